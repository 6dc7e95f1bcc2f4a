"""Reading a checkpoint folder's model config, shared by every service (the stages, the gateway, the tools).

Usage::

    config = read_config("ckpt/transformer")   # WanTransformer3DModel keyword arguments (diffusers or Wan-AI)
    vae = read_vae_config("ckpt/vae")          # AutoencoderKLWan keyword arguments

Every problem raises ``CheckpointError`` naming the file (and the key where there is one).
"""

from __future__ import annotations

import json
from pathlib import Path

from stagecast.model import wan_keys

CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot provide a stage's slice; ``file`` and ``key`` say where."""

    def __init__(self, file: str | Path, key: str | None, message: str):
        self.file = str(file)
        self.key = key
        where = self.file if key is None else f"{self.file}: key {key!r}"
        super().__init__(f"{where}: {message}")


# --- config -------------------------------------------------------------------------------------------------


def read_config(folder: str | Path) -> dict:
    """Read ``folder/config.json`` as ``WanTransformer3DModel`` keyword arguments.

    Metadata keys (``_class_name``, ``_diffusers_version``, ...) are dropped so both
    ``WanTransformer3DModel(**config)`` and ``from_config(config)`` work; a Wan-AI ``WanModel`` config is
    converted.  ``patch_size`` comes back as a tuple, as in ``stagecast.model.dit_configs``.
    """
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(path, None, f"missing {CONFIG_NAME}: a checkpoint folder needs the model config")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(path, None, f"unreadable config: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(path, None, "config is not a JSON object")
    if wan_keys.is_original_config(raw):
        try:
            return wan_keys.original_config_to_diffusers(raw)
        except ValueError as e:
            raise CheckpointError(path, None, str(e)) from e
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    if "num_layers" not in config or "num_attention_heads" not in config:
        raise CheckpointError(
            path, "num_layers", "not a WanTransformer3DModel config (no num_layers/num_attention_heads)"
        )
    if isinstance(config.get("patch_size"), list):
        # JSON has no tuples; match stagecast.model.dit_configs so a written and re-read config compares equal.
        config["patch_size"] = tuple(config["patch_size"])
    return config


def read_vae_config(folder: str | Path) -> dict:
    """Read ``folder/config.json`` as ``AutoencoderKLWan`` keyword arguments, with diffusers' own defaults.

    Configs written by older diffusers lack newer keys (``patch_size``, ``decoder_base_dim``, ...); the model
    fills them from its ``__init__`` defaults, so this reader does the same and callers may index any key.
    """
    import inspect

    from diffusers import AutoencoderKLWan

    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(path, None, f"missing {CONFIG_NAME}: a VAE folder needs its config")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(path, None, f"unreadable config: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(path, None, "config is not a JSON object")
    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    config = {
        name: p.default for name, p in params.items() if name != "self" and p.default is not inspect.Parameter.empty
    }
    config.update({k: v for k, v in raw.items() if not k.startswith("_")})
    for key in ("z_dim", "dim_mult", "temperal_downsample"):
        if config.get(key) is None:
            raise CheckpointError(path, key, "not an AutoencoderKLWan config")
    return config

"""Reading a checkpoint folder's model config, shared by every service (the stages, the gateway, the tools).

Usage::

    config = read_config("ckpt/transformer")   # WanTransformer3DModel keyword arguments (diffusers or Wan-AI)
    vae = read_vae_config("ckpt/vae")          # AutoencoderKLWan keyword arguments
    config = checkpoint_config("random:wan2.1-1.3b")   # a stage's --checkpoint: a folder, or random weights of a
    checkpoint_folder("random:/ckpt/transformer")      # named architecture or of a folder's config (benchmarks)

Every problem raises ``CheckpointError`` naming the file (and the key where there is one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stagecast.microstep import StreamSpec
from stagecast.model import wan_keys
from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN, model_config

CONFIG_NAME = "config.json"
# A stage's ``--checkpoint random:NAME`` (a named architecture of ``stagecast.model.dit_configs``) or
# ``random:FOLDER`` (the config.json of a transformer folder, with its checkpoint root's stagecast.json and vae/ beside
# it): the real architecture with random weights, which the stage draws on its device (benchmarks: nothing to read).
RANDOM_PREFIX = "random:"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot provide a stage's slice; ``file`` and ``key`` say where."""

    def __init__(self, file: str | Path, key: str | None, message: str):
        self.file = str(file)
        self.key = key
        where = self.file if key is None else f"{self.file}: key {key!r}"
        super().__init__(f"{where}: {message}")


# --- config -------------------------------------------------------------------------------------------------


def checkpoint_folder(checkpoint: str) -> Path | None:
    """The transformer folder a ``--checkpoint`` names (``random:FOLDER`` too); None for ``random:NAME``."""
    if checkpoint.startswith(RANDOM_PREFIX):
        rest = checkpoint[len(RANDOM_PREFIX) :]
        return Path(rest) if (Path(rest) / CONFIG_NAME).is_file() else None
    return Path(checkpoint) if checkpoint else None


def checkpoint_config(checkpoint: str) -> dict:
    """The transformer config of a ``--checkpoint``: its folder's config.json (``random:FOLDER`` too), or the named
    architecture of ``random:NAME`` (``KeyError``/``ValueError`` names an unknown one)."""
    folder = checkpoint_folder(checkpoint)
    if folder is not None:
        return read_config(folder)
    return model_config(checkpoint[len(RANDOM_PREFIX) :])


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


@dataclass(frozen=True)
class DiTConfig:
    """The typed facts of a Wan transformer config that the services check streams against.

    ``kwargs`` keeps the full ``WanTransformer3DModel`` keyword arguments (what ``read_config`` returns) for
    building the model; everything the services reason about is a typed field::

        model = DiTConfig.from_kwargs(read_config(folder))
        model.in_channels, model.patch_hw, model.text_dim
    """

    in_channels: int
    patch_size: tuple[int, int, int]
    text_dim: int
    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    rope_max_seq_len: int
    kwargs: dict = field(compare=False, repr=False, default_factory=dict)

    @classmethod
    def from_kwargs(cls, config: Mapping) -> DiTConfig:
        missing = [k for k in ("in_channels", "patch_size", "text_dim", "num_layers") if k not in config]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
        return cls(
            in_channels=int(config["in_channels"]),
            patch_size=tuple(int(p) for p in config["patch_size"]),
            text_dim=int(config["text_dim"]),
            num_layers=int(config["num_layers"]),
            num_attention_heads=int(config.get("num_attention_heads", 0)),
            attention_head_dim=int(config.get("attention_head_dim", 0)),
            rope_max_seq_len=int(config.get("rope_max_seq_len", WAN_ROPE_MAX_SEQ_LEN)),
            kwargs=dict(config),
        )

    @property
    def patch_hw(self) -> tuple[int, int]:
        return self.patch_size[1], self.patch_size[2]


def check_image(spec: StreamSpec, image_shape: tuple[int, ...] | None, *, per_token: bool) -> None:
    """An image-to-video stream (``spec.image_latents``) needs a per-token-timestep model (its image frame runs at
    timestep 0 beside noisy frames: Wan2.2-TI2V) and one image latent frame at the stream's latent size; other
    streams take no image.  Raises ``ValueError`` starting with ``image:``."""
    if not spec.image_latents:
        if image_shape is not None:
            raise ValueError(f"image: stream {spec.stream_id} takes no image (spec.image_latents is not set)")
        return
    if not per_token:
        raise ValueError(
            "image: this model cannot condition on an image: its first frame would need timestep 0 beside noisy "
            "frames, and it takes one timestep per item (Wan2.2-TI2V takes one per token)"
        )
    want = (1, spec.latent_channels, 1, spec.latent_height, spec.latent_width)
    if image_shape is None or tuple(image_shape) != want:
        got = None if image_shape is None else tuple(image_shape)
        raise ValueError(f"image: the image latent must have shape {want}, got {got}")


def check_spec(spec: StreamSpec, model: DiTConfig, text_shape: tuple[int, ...] | None = None) -> None:
    """The one check of a stream against a model: the coordinator admits by it, every stage opens by it.

    Raises ``ValueError`` naming the field.  ``text_shape``, when given, is the prompt embedding's shape.
    """
    if spec.latent_channels != model.in_channels:
        raise ValueError(f"spec.latent_channels={spec.latent_channels} but the model takes {model.in_channels}")
    p_h, p_w = model.patch_hw
    h, w = spec.latent_height, spec.latent_width
    if h <= 0 or w <= 0 or h % p_h or w % p_w:
        raise ValueError(
            f"spec.latent_height x spec.latent_width = {h}x{w} must be positive and divisible by the patch {p_h}x{p_w}"
        )
    if spec.epoch_frames(model.rope_max_seq_len) > model.rope_max_seq_len:
        raise ValueError(f"spec.reset_frames={spec.reset_frames} exceeds rope_max_seq_len={model.rope_max_seq_len}")
    expected = (1, spec.text_len, model.text_dim)
    if text_shape is not None and tuple(text_shape) != expected:
        raise ValueError(f"text embeddings have shape {tuple(text_shape)}, expected {expected} (spec.text_len)")

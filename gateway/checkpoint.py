"""What the gateway needs to know about a checkpoint folder before it can turn a request into a stream.

Usage::

    model = ModelInfo.from_checkpoint("/models/Wan2.1-T2V-1.3B-Diffusers")
    model.latent_channels, model.width_multiple         # 16, 16 (VAE 8x spatial x patch 2)
    defaults = ServingDefaults.load("/models/Wan2.1-T2V-1.3B-Diffusers")
    defaults.text_len, defaults.width, defaults.height  # 512, 832, 480 unless stagecast.json says otherwise

    defaults.sampler.ladder_for(defaults.steps)         # the checkpoint's timestep ladder (stagecast.sampling)

    tiny_decoder_file(root, flag=None)                  # the tiny decoder's weights: --tiny-decoder, else
                                                        # tiny_decoder/ in the checkpoint, else None

The folder holds ``transformer/``, ``vae/``, ``text_encoder/`` and ``tokenizer/`` (diffusers layout), and optionally
``tiny_decoder/`` with one weights file of a tiny streaming decoder (``gateway.decode.tiny_decoder``).  An optional
``stagecast.json`` beside them overrides the serving defaults and names the checkpoint's sampler (its ``sampler``
section, see ``stagecast.sampling`` and docs/checkpoints.md); ``stagecast demo-checkpoint`` writes one so the
tiny model runs with a short text length and small frames.  An unknown key, or a value the sampler cannot use, is
an error that names the key.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from stagecast.api import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_FPS,
    DEFAULT_HEIGHT,
    DEFAULT_STEPS,
    DEFAULT_TEXT_LEN,
    DEFAULT_WIDTH,
    MAX_PROMPT_CHARS,
)
from stagecast.model import vae_configs
from stagecast.model.config import read_config, read_vae_config
from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN, expands_timesteps
from stagecast.sampling import SamplerConfig, SamplerError

logger = logging.getLogger(__name__)

SERVING_DEFAULTS_FILE = "stagecast.json"
TINY_DECODER_DIR = "tiny_decoder"
TINY_DECODER_SUFFIXES = (".pth", ".safetensors")
MAX_WINDOW = WAN_ROPE_MAX_SEQ_LEN  # latent frames: the Wan models' RoPE covers no more; a longer window is never filled
MAX_NEGATIVE_PROMPT_CHARS = MAX_PROMPT_CHARS  # the public API's prompt limit (stagecast.api)


@dataclass(frozen=True)
class ServingDefaults:
    """Values the gateway uses for fields a request leaves out, and the text length every stream is encoded with.

    ``text_len`` is the text encoder's ``max_len`` and the DiT stream's ``text_len``: the Wan models were trained with
    512 text tokens, so only tiny test models should use anything else.
    """

    text_len: int = DEFAULT_TEXT_LEN
    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    fps: float = DEFAULT_FPS
    steps: int = DEFAULT_STEPS
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    # The per-stream cost budget (gateway.edge.admission); 0 derives it from the serving size, rate and steps above and
    # the gateway's device.
    max_frame_pixels: int = 0
    max_stream_cost: float = 0
    # The KV window (latent frames) and its sink frames of a stream whose request leaves ``window`` out; 0: unbounded
    # (its context then grows to the RoPE limit, MAX_WINDOW latent frames, which a real model's KV cache cannot hold on
    # one GPU, so a checkpoint served live should set a window here).
    window: int = 0
    sink: int = 0
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # the ``sampler`` section
    # Classifier-free guidance: the negative prompt a guided stream runs when its request names none, and whether
    # the checkpoint is guidance-distilled (CausVid, Self-Forcing, StreamDiffusionV2: only guidance 1.0).
    negative_prompt: str = ""
    guidance_distilled: bool = False

    def __post_init__(self):
        if not isinstance(self.negative_prompt, str) or len(self.negative_prompt) > MAX_NEGATIVE_PROMPT_CHARS:
            raise ValueError(f"negative_prompt: must be a string of at most {MAX_NEGATIVE_PROMPT_CHARS} characters")
        if not isinstance(self.guidance_distilled, bool):
            raise ValueError(f"guidance_distilled: must be true or false, got {self.guidance_distilled!r}")
        for name, value, top in (("window", self.window, MAX_WINDOW), ("sink", self.sink, self.window or MAX_WINDOW)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                raise ValueError(f"{name}: must be an integer in [0, {top}] latent frames, got {value!r}")
        offered = self.sampler.supported_steps()
        if self.steps not in offered:
            raise SamplerError(
                "steps", f"the default step count {self.steps} has no ladder (the sampler offers {list(offered)})"
            )

    @classmethod
    def load(cls, checkpoint: str | os.PathLike) -> ServingDefaults:
        path = Path(checkpoint) / SERVING_DEFAULTS_FILE
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: must hold a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown key {unknown[0]!r} (unknown: {unknown}); known: {sorted(known)}")
        try:
            if "sampler" in data:
                data["sampler"] = SamplerConfig.from_json(data["sampler"])
            defaults = cls(**data)
        except (SamplerError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        logger.info("serving defaults from %s: %s", path, defaults)
        return defaults


@dataclass(frozen=True)
class ModelInfo:
    """Shapes that link pixels, latents and tokens for one DiT + VAE pair."""

    latent_channels: int
    patch_hw: tuple[int, int]
    spatial_factor: int  # video pixels per latent pixel
    temporal_factor: int  # video frames per latent frame after the first
    per_token_timesteps: bool = False  # Wan2.2-TI2V: can condition on a first-frame image (StreamConfig.image)

    @property
    def height_multiple(self) -> int:
        """Pixel heights must be multiples of this, so that latent pixels and DiT patches are whole."""
        return self.spatial_factor * self.patch_hw[0]

    @property
    def width_multiple(self) -> int:
        return self.spatial_factor * self.patch_hw[1]

    @classmethod
    def from_checkpoint(cls, checkpoint: str | os.PathLike) -> ModelInfo:
        root = Path(checkpoint)
        # The shared readers: a transformer config in the original Wan layout, or an older diffusers VAE config,
        # reads here exactly as the stages read it.
        dit = read_config(root / "transformer")
        vae = read_vae_config(root / "vae")
        if vae["z_dim"] != dit["in_channels"]:
            raise ValueError(f"{root}: the VAE has {vae['z_dim']} latent channels, the DiT {dit['in_channels']}")
        _, p_h, p_w = dit["patch_size"]
        return cls(
            latent_channels=dit["in_channels"],
            patch_hw=(p_h, p_w),
            spatial_factor=vae_configs.spatial_factor(vae),
            temporal_factor=vae_configs.temporal_factor(vae),
            per_token_timesteps=expands_timesteps(dit),
        )


def tiny_decoder_file(checkpoint: str | os.PathLike, flag: str | os.PathLike | None = None) -> Path | None:
    """The tiny decoder's weights file this deployment serves: ``flag`` (``--tiny-decoder``) when given, else the one
    ``.pth`` or ``.safetensors`` file in the checkpoint's ``tiny_decoder/``, else None (no tiny decoder).  A flag that
    names no such file, or a ``tiny_decoder/`` without exactly one weights file, raises ``ValueError`` naming it."""
    if flag:
        path = Path(flag)
        if not path.is_file():
            raise ValueError(f"--tiny-decoder {path}: no such file")
        if path.suffix not in TINY_DECODER_SUFFIXES:
            raise ValueError(f"--tiny-decoder {path}: must be a {' or '.join(TINY_DECODER_SUFFIXES)} weights file")
        return path
    folder = Path(checkpoint) / TINY_DECODER_DIR
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in TINY_DECODER_SUFFIXES)
    if len(files) != 1:
        found = ", ".join(p.name for p in files) or "none"
        raise ValueError(
            f"{folder}: must hold exactly one {' or '.join(TINY_DECODER_SUFFIXES)} weights file, found {found}"
        )
    return files[0]

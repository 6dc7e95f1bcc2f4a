"""Named Wan VAE configs (diffusers ``AutoencoderKLWan`` keyword arguments).

Use ``AutoencoderKLWan(**vae_config("wan2.2"))`` for the real architectures (benchmarks run them with random
weights; production loads a diffusers folder instead) and the ``tiny-*`` presets for tests and the CPU demo::

    from diffusers import AutoencoderKLWan
    from stagecast.model.vae_configs import vae_config, spatial_factor, temporal_factor

    cfg = vae_config("tiny-wan2.2")
    vae = AutoencoderKLWan(**cfg)
    spatial_factor(cfg), temporal_factor(cfg)   # (16, 4): latent 16x16 -> video 256x256

Tiny decode cost (one CPU thread, one steady-state latent frame = 4 video frames): about 35 ms (2.1) / 45 ms (2.2)
at a 4x6 latent, but 0.5 s / 0.7 s at 16x16, because the last blocks run at (nearly) the output resolution of
128x128 / 256x256 even when narrow; tests therefore use 4x6 latents.

Every preset lists all sixteen ``AutoencoderKLWan.__init__`` arguments, so an override of a key the model does
not take is caught here rather than deep inside diffusers.

``latents_mean``/``latents_std`` are the real per-channel statistics in every preset, tiny ones included: the tiny
VAEs keep the real ``z_dim`` so they accept the latents of the matching tiny DiTs in ``stagecast/model/dit_configs.py``
(16 channels for Wan2.1, 48 for Wan2.2), and de-normalisation is then exercised with realistic numbers.

- Wan2.1: diffusers' own ``AutoencoderKLWan`` defaults (the Wan2.1 VAE).
- Wan2.2: the installed diffusers package ships no Wan2.2 VAE config, so the 48 values are copied from
  ``vae22_diffusers_config`` in diffusers' ``scripts/convert_wan_to_diffusers.py``, which are the constants
  hardcoded in the official ``Wan2_2_VAE`` (Wan2.2 repo, ``wan/modules/vae2_2.py``) and written to
  ``Wan-AI/Wan2.2-TI2V-5B-Diffusers/vae/config.json``.
"""

from __future__ import annotations

from stagecast.model.presets import named_config

# fmt: off
_WAN21_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]
_WAN21_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]
_WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
_WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]
# fmt: on

# Exactly the defaults of AutoencoderKLWan.__init__ in diffusers 0.42.1 (a test pins this).
_WAN21 = dict(
    base_dim=96,
    decoder_base_dim=None,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=_WAN21_LATENTS_MEAN,
    latents_std=_WAN21_LATENTS_STD,
    is_residual=False,
    in_channels=3,
    out_channels=3,
    patch_size=None,
    scale_factor_temporal=4,
    scale_factor_spatial=8,
)

# RGB is patchified 2x2 into 12 channels around the encoder/decoder, hence 16x spatial in total.
_WAN22 = dict(
    _WAN21,
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    latents_mean=_WAN22_LATENTS_MEAN,
    latents_std=_WAN22_LATENTS_STD,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
)

CONFIGS: dict[str, dict] = {
    "wan2.1": _WAN21,
    "wan2.2": _WAN22,
    # Tiny widths keep the real block structure (3 spatial and 2 temporal upsamples, residual DupUp3D shortcuts
    # for 2.2, the "Rep" first-frame path) so chunked-decode behaviour is the same, at millisecond cost on CPU.
    "tiny-wan2.1": dict(_WAN21, base_dim=8),
    # Encoder and decoder widths differ, as in the real model, so decoder_base_dim is exercised. The decoder is the
    # narrower one here because only decode is on the streaming path.
    "tiny-wan2.2": dict(_WAN22, base_dim=12, decoder_base_dim=8),
}


def vae_config(name: str, **overrides) -> dict:
    """Return a fresh copy of a named config, with keyword overrides applied."""
    return named_config(CONFIGS, name, "VAE", **overrides)


def spatial_factor(cfg) -> int:
    """Video pixels per latent pixel along H and W.

    Derived from the architecture (one 2x spatial upsample per ``dim_mult`` step, times the RGB patch size) rather
    than read from ``scale_factor_spatial``, which is metadata the model does not use. ``cfg`` is a config dict
    or a diffusers ``FrozenDict`` (``vae.config``).
    """
    return 2 ** (len(cfg["dim_mult"]) - 1) * (cfg["patch_size"] or 1)


def temporal_factor(cfg) -> int:
    """Video frames per latent frame after the first (which always gives one frame)."""
    return 2 ** sum(bool(t) for t in cfg["temperal_downsample"])

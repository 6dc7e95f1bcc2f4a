"""Named Wan transformer configs (diffusers ``WanTransformer3DModel`` keyword arguments).

Use ``model_config("wan2.1-1.3b")`` for the real architectures (benchmarks run them with random
weights) and the ``tiny-*`` presets for tests and the CPU demo.  ``expand_timesteps`` marks models
that take per-token timesteps of shape ``(B, L)`` (Wan2.2-TI2V); it is a pipeline choice, not a
transformer config key, so it is kept beside the config rather than inside it.
"""

from __future__ import annotations

from stagecast.model.presets import named_config

# Latent frames the Wan models' RoPE table covers (``rope_max_seq_len``, diffusers' ``WanTransformer3DModel``
# default): the limit every floor uses when a config leaves it out.  The one home of the number.
WAN_ROPE_MAX_SEQ_LEN = 1024

_WAN21_BASE = dict(
    patch_size=(1, 2, 2),
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=WAN_ROPE_MAX_SEQ_LEN,
    pos_embed_seq_len=None,
)

CONFIGS: dict[str, dict] = {
    "wan2.1-1.3b": dict(_WAN21_BASE, num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "wan2.1-14b": dict(_WAN21_BASE, num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "wan2.2-ti2v-5b": dict(
        _WAN21_BASE, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48
    ),
    # Tiny shapes for CPU tests: head_dim 12 keeps the t/h/w RoPE split non-trivial (4/4/4).
    "tiny-wan2.1": dict(
        _WAN21_BASE, num_attention_heads=2, attention_head_dim=12, ffn_dim=48, num_layers=4, text_dim=32, freq_dim=16
    ),
    "tiny-wan2.2-ti2v": dict(
        _WAN21_BASE,
        num_attention_heads=2,
        attention_head_dim=12,
        ffn_dim=48,
        num_layers=4,
        text_dim=32,
        freq_dim=16,
        in_channels=48,
        out_channels=48,
    ),
}


def model_config(name: str, **overrides) -> dict:
    """Return a fresh copy of a named config, with keyword overrides applied."""
    return named_config(CONFIGS, name, "model", **overrides)


def expands_timesteps(config: dict) -> bool:
    """Wan2.2-TI2V (48 latent channels) is driven with per-token timesteps ``(B, L)``."""
    return config.get("in_channels") == 48

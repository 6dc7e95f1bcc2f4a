"""Helpers for tests of a gateway's stream parts without a gateway: a StreamHost of stubs and a resolved config."""

from types import SimpleNamespace

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.edge.config import Decoders, resolve_config
from gateway.stream.run import StreamHost, StreamLimits
from stagecast.client import stream_config

WAN21 = ModelInfo(latent_channels=16, patch_hw=(2, 2), spatial_factor=8, temporal_factor=4)
DEFAULTS = ServingDefaults(text_len=32, width=64, height=48)
BOTH_DECODERS = Decoders(tiny=True, default="full")


def stub_stream_host(coordinator, kinds=("full", "tiny"), **fields) -> StreamHost:
    """A StreamHost on ``coordinator`` (a stub, or a real CoordinatorServiceStub) whose decoders only report a depth;
    ``fields`` replace any other part."""
    parts = dict(
        coordinator=coordinator,
        coordinator_target="test",
        decoders={kind: SimpleNamespace(depth=lambda capacity: 2) for kind in kinds},
        metrics=None,
        timers=None,
        limits=StreamLimits(4, 8, 1.0, 1.0, 1.0),
        latent_channels=WAN21.latent_channels,
        text_len=DEFAULTS.text_len,
        model_name="test",
        encode_prompt=None,
        input_encoder=None,
        temporal_factor=WAN21.temporal_factor,
        touch=lambda: None,
        forget=lambda run: None,
    )
    return StreamHost(**{**parts, **fields})


def resolve(prompt="a cat", decoders=BOTH_DECODERS, **kw):
    """A stream's EffectiveConfig at DEFAULTS on WAN21, as the gateway resolves a client's StreamConfig."""
    return resolve_config(stream_config(prompt, **kw), defaults=DEFAULTS, model=WAN21, decoders=decoders)

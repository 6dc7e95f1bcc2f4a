"""A coordinator engine driven by hand, in process: no stages, the plan loop ticked by the test.

The engine's generation is marked formed and given a scheduler, so streams open and plan as they would against
real stages; nothing is sent anywhere.
"""

from __future__ import annotations

import torch

from coordinator.engine import PipelineEngine
from coordinator.options import CoordinatorOptions
from coordinator.registry import StageRegistry
from coordinator.requests import OpenRequest
from coordinator.scheduler import StreamBatchScheduler
from stagecast.microstep import StreamSpec
from stagecast.model.dit_configs import model_config

TEXT = torch.zeros(1, 8, model_config("tiny-wan2.1")["text_dim"])  # a prompt's embedding for the tiny model


ENGINE_KEYWORDS = {"clock", "form_timeout", "max_ahead", "slo_interval_s", "stream_defaults"}


def engine_options(stages: int, **kw) -> CoordinatorOptions:
    """``CoordinatorOptions`` of ``stages`` stages; ``vae_ms_per_chunk`` may be one number (the full VAE's)."""
    vae = kw.get("vae_ms_per_chunk")
    if vae is not None and not isinstance(vae, dict):
        kw["vae_ms_per_chunk"] = {"full": float(vae)}
    lookahead = kw.pop("lookahead", None)
    options = CoordinatorOptions(stages=stages, backend="gloo", **kw)
    # A plan loop ticked by hand may run unbounded (lookahead=10**6), past what the flag accepts (1..64).
    options.lookahead = lookahead
    return options


def hand_driven_engine(stages: int = 2, *, max_batch: int = 4, **kw) -> PipelineEngine:
    """A ``PipelineEngine`` of ``stages`` stages (keywords: its options, or the engine's own ``ENGINE_KEYWORDS``),
    formed around a scheduler of ``max_batch``, with no stage process."""
    engine_kw = {k: v for k, v in kw.items() if k in ENGINE_KEYWORDS}
    options = engine_options(stages, **{k: v for k, v in kw.items() if k not in ENGINE_KEYWORDS})
    eng = PipelineEngine(StageRegistry(stages), options, **engine_kw)
    eng.generations.adopt(StreamBatchScheduler(num_stages=stages, max_batch=max_batch))
    return eng


def small_spec(**kw) -> StreamSpec:
    """A 4x6-latent, one-frame-per-chunk stream of the tiny model (keywords: any ``StreamSpec`` field)."""
    fields = dict(stream_id=0, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, text_len=8)
    return StreamSpec(**(fields | kw))


def stream_opener(eng: PipelineEngine, *, chunk_rate: float, ladders, running: bool = False):
    """``open_stream(**kw)``: a paced, acknowledging stream on ``ladders`` (starting on the last), each call a new
    one.  ``running``: its chunk 0 counts as consumed once it opens, so admission prices the next stream beside it at
    its steady rate, not its start (``coordinator.slo.SloController.startup_utilization``)."""

    def open_stream(num_chunks=None, **kw):
        spec = small_spec(timesteps=tuple(ladders[-1]), num_chunks=num_chunks)
        stream = eng.open(
            OpenRequest(spec, TEXT, acknowledges=True, consumer_depth=8, chunk_rate=chunk_rate, ladders=ladders, **kw)
        )
        if running:
            consume_first(eng, stream)
        return stream

    return open_stream


class Clock:
    """A clock the test sets by hand (``clock.t``), for the engine's ``clock``."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def consume_first(eng: PipelineEngine, stream) -> None:
    """Its chunk 0 came back from the stages (no stage runs here) and its consumer acknowledged it."""
    session = eng.sessions[stream.id]
    session.received = max(session.received, 1)
    eng.consumed(stream.id, 1)

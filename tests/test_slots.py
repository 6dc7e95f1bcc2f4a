"""Free slots (``PipelineEngine.slots``, ``ClusterStatus.slots_free`` / ``slots_total``): a dry run of the admission
that refuses, so that "k free" means k more default streams are admitted and the next one is refused.

The default stream here is the one the gateway sends for a request that sets nothing, over the demo checkpoint's serving
defaults (``launcher.demo_checkpoint.DEMO_SERVING``, its model ``tiny-wan2.1``): resolved by ``gateway.edge.config`` and
opened with the fields ``gateway.stream.run.StreamRun.open_pipeline`` sends.
"""

import json

import grpc
import pytest
import torch

from coordinator.errors import AdmissionError
from coordinator.requests import OpenRequest
from coordinator.slots import Slots, StreamDefaults
from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.edge.config import resolve_config
from launcher.demo_checkpoint import DEMO_MODEL, DEMO_SERVING
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.kv_memory import stream_kv_bytes
from stagecast.model.config import DiTConfig
from stagecast.model.dit_configs import model_config
from stagecast.v1 import stream_pb2 as pb
from tests.engine_helpers import hand_driven_engine

pytestmark = pytest.mark.unit

MODEL = model_config(DEMO_MODEL)
SERVING = ServingDefaults(**DEMO_SERVING)
INFO = ModelInfo(
    latent_channels=MODEL["in_channels"], patch_hw=tuple(MODEL["patch_size"][1:]), spatial_factor=8, temporal_factor=4
)
DEFAULTS = StreamDefaults(
    width=SERVING.width,
    height=SERVING.height,
    chunk_frames=SERVING.chunk_frames,
    text_len=SERVING.text_len,
    steps=SERVING.steps,
    fps=SERVING.fps,
    window=SERVING.window,
    sink=SERVING.sink,
    sampler=SERVING.sampler,
)
STAGES = 2


def _engine(**kw):
    eng = hand_driven_engine(STAGES, lookahead=10**6, clock=lambda: 0.0, stream_defaults=DEFAULTS, **kw)
    for index in range(STAGES):  # the stages' model, as their registration gives it
        eng.registry.register(
            index=index,
            address=f"127.0.0.1:{6000 + index}",
            config_json=json.dumps(MODEL),
            expected_world_size=STAGES,
            device="cpu",
        )
    return eng


def _open_default(eng):
    """A stream of a request that sets nothing, as the gateway opens it."""
    cfg = resolve_config(pb.StreamConfig(prompt="a cat"), defaults=SERVING, model=INFO)
    spec = cfg.stream_spec(latent_channels=INFO.latent_channels, text_len=SERVING.text_len)
    return eng.open(
        OpenRequest(
            spec,
            torch.zeros(1, SERVING.text_len, MODEL["text_dim"]),
            acknowledges=True,
            consumer_depth=2,
            chunk_rate=cfg.chunk_rate,
            pace_offset_s=cfg.pace_offset_s,
            ladders=list(cfg.ladders),
            latency_first=cfg.steps_preference == "latency_first",
            decoder=cfg.decoder,
        )
    )


def _admitted_until_refused(eng, limit=40) -> tuple[int, AdmissionError]:
    for n in range(limit):
        try:
            _open_default(eng)
        except AdmissionError as exc:
            return n, exc
    raise AssertionError(f"{limit} default streams admitted")


def test_the_default_stream_is_the_one_the_gateway_sends_for_a_request_that_sets_nothing():
    cfg = resolve_config(pb.StreamConfig(prompt="a cat"), defaults=SERVING, model=INFO)
    gateway_spec = cfg.stream_spec(latent_channels=INFO.latent_channels, text_len=SERVING.text_len)
    ours = DEFAULTS.spec(MODEL)
    assert ours == gateway_spec.__class__(**{**gateway_spec.__dict__, "seed": ours.seed})  # the seed is random
    assert DEFAULTS.chunk_rate == cfg.chunk_rate and (DEFAULTS.steps,) == tuple(len(lad) for lad in cfg.ladders)
    assert DEFAULTS.decoder == cfg.decoder


@pytest.mark.parametrize("stage_ms", [[40.0, 40.0], [90.0, 60.0]])
def test_k_free_slots_mean_k_more_default_streams_are_admitted_and_the_next_is_refused_for_capacity(stage_ms):
    eng = _engine(stage_ms=stage_ms, vae_ms_per_chunk=20.0, max_streams=64)
    before = eng.slots()
    assert before.free > 0 and before == Slots(before.free, before.free)
    _open_default(eng)  # one open stream: the count goes down by one, the total stays
    after_one = eng.slots()
    assert after_one == Slots(before.free - 1, before.free)
    admitted, refusal = _admitted_until_refused(eng)
    assert admitted == after_one.free
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.limit == "capacity"
    assert eng.slots() == Slots(0, before.free)


def test_the_stream_cap_bounds_the_free_slots_when_nothing_else_does():
    eng = _engine(max_streams=3)  # no stage times: capacity is not checked; no KV budget
    assert eng.slots() == Slots(3, 3)
    admitted, refusal = _admitted_until_refused(eng)
    assert admitted == 3 and refusal.limit == "streams"
    assert eng.slots() == Slots(0, 3)


def test_kv_memory_bounds_the_free_slots_on_a_stage_with_a_budget():
    eng = _engine(max_streams=64)
    spec = DEFAULTS.spec(MODEL)
    layers = {r.index: len(r.layers) for r in eng.registry.records()}
    need = {
        i: stream_kv_bytes(spec, DiTConfig.from_kwargs(MODEL), layers=n, element_bytes=4, max_steps=spec.steps)
        for i, n in layers.items()
    }
    # Stage 1 holds two and a half default streams' KV; stage 0 has no limit.
    eng.admission.on_formed(
        {0: ipb.FormReply(), 1: ipb.FormReply(kv_budget_bytes=int(2.5 * need[1]), kv_element_bytes=4)}
    )
    assert eng.slots() == Slots(2, 2)
    admitted, refusal = _admitted_until_refused(eng)
    assert admitted == 2 and refusal.limit == "kv_memory"


def test_a_pipeline_that_is_not_formed_has_no_free_slot_and_status_carries_the_count():
    eng = _engine(max_streams=5)
    _open_default(eng)
    assert eng.status().slots_free == 4 and eng.status().slots_total == 5
    eng.generations.adopt(None)  # the generation ended
    assert eng.slots() == Slots(0, 1)
    status = eng.status()
    assert (status.slots_free, status.slots_total) == (0, 1)


def test_a_dry_run_reserves_nothing():
    eng = _engine(stage_ms=[40.0, 40.0], vae_ms_per_chunk=20.0, max_streams=64)
    first = eng.slots()
    assert eng.slots() == first and not eng.sessions and not eng.streams.pending_opens

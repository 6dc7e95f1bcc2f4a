"""The public streaming API end to end: real processes (coordinator, 2 stages, 2 gateways) on loopback, driven
through the client SDK (and, for malformed call shapes, the generated gRPC stub).

The module runs on the session's shared system (tests/shared_system.py).  Gateway ``main`` is the shared one: generous
limits, decoding in-process; gateway ``tight``, this module's own, allows 2 streams, buffers almost nothing (so the
stream limit and the slow-client policy are cheap to reach) and decodes through a chain of two VAE stage processes.
The coordinator admits 4 streams and records its plan, which lets the reference executor replay exactly what the
pipeline ran.  Every test leaves the system idle (no streams anywhere) so the next one's plan replays in isolation."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import stagecast
import stagecast.client
from gateway.decode.stream_vae import StreamVAE, to_uint8_frames
from gateway.text_encoder import TextEncoder
from launcher.demo_checkpoint import DEMO_SERVING
from launcher.process import Launcher
from launcher.reference import ReferenceExecutor
from launcher.selftest import plan_from_proto
from stage_service.checkpoint import load_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from stagecast.internal.v1 import vae_pb2_grpc as vpb_grpc
from stagecast.media import read_mp4_frames
from stagecast.model.config import read_config
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc
from tests.shared_system import MAX_STREAMS as COORDINATOR_MAX_STREAMS

pytestmark = pytest.mark.multiprocess

PROMPT = "a red fox running through snow"
OTHER_PROMPT = "a blue bird flying over the ocean"
W, H = 48, 32  # non-square, so a width/height mix-up shows; latents 6x4
TIGHT_MAX_STREAMS = 2
TIMEOUT = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    root: object
    coordinator: str
    main: str
    tight: str
    metrics_port: int
    stage_addresses: list[str]
    vae_stage_addresses: list[str]
    launcher: Launcher  # holds the operator's certificate for the internal services


@pytest.fixture(scope="module")
def cluster(system_session):
    """The session's shared system (its coordinator admits COORDINATOR_MAX_STREAMS) with its gateway as ``main``, and a
    ``tight`` gateway of this module's own in front of a chain of two VAE stage processes."""
    s = system_session
    metrics_port = _free_port()
    tight = ["gateway", "--coordinator", s.coordinator, "--checkpoint", str(s.root), "--port", "0"]
    tight += ["--max-streams", str(TIGHT_MAX_STREAMS), "--buffer-chunks", "1", "--buffer-messages", "2"]
    tight += ["--slow-client-timeout", "2", "--metrics-port", str(metrics_port)]
    # The VAE chain is started from its end: each stage needs the next one's address.
    vae = ["vae-stage", "--checkpoint", str(s.root), "--num-slices", "2", "--port", "0"]
    vae += ["--cuda-graphs", f"{H}x{W}", "--graph-slots", "2"]  # on CPU a replay re-runs the slice (exactness)
    with s.spawned("gateway-vae-1", vae + ["--index", "1"]) as vae_last:
        with s.spawned("gateway-vae-0", vae + ["--index", "0", "--next", vae_last.info["address"]]) as vae_first:
            with s.spawned("tight", tight + ["--vae-stage", vae_first.info["address"]]) as tight_child:
                yield Cluster(
                    root=s.root,
                    coordinator=s.coordinator,
                    main=s.gateway,
                    tight=tight_child.info["address"],
                    metrics_port=metrics_port,
                    stage_addresses=[c.info["address"] for n, c in s.children.items() if n.startswith("stage-")],
                    vae_stage_addresses=[vae_first.info["address"], vae_last.info["address"]],
                    launcher=s.launcher,
                )
    s.assert_idle()


@pytest.fixture(scope="module")
def reference(cluster):
    """Replays a stream of the recorded plan with the reference executor and decodes it with a fresh StreamVAE."""
    return Reference(cluster)


class Reference:
    def __init__(self, cluster: Cluster):
        transformer = str(cluster.root / "transformer")
        n = read_config(transformer)["num_layers"]
        config, sd = load_slice_state_dict(transformer, layers=range(n), first=True, last=True, dtype=torch.float32)
        self.dit = DiTSlice.from_state_dict(config, sd, layers=range(n), first=True, last=True, device="cpu")
        self.encoder = TextEncoder(cluster.root, max_len=DEMO_SERVING["text_len"])
        self.vae_folder = cluster.root / "vae"
        self.coordinator = cluster.coordinator
        self.launcher = cluster.launcher

    def plan_of(self, pipeline_stream_id: int):
        """The recorded plan events of one stream; it must have run alone, so its batches replay in isolation."""
        with self.launcher.channel(self.coordinator, "coordinator") as ch:
            dump = ipb_grpc.CoordinatorServiceStub(ch).GetPlan(ipb.PlanRequest(), timeout=30)
        events = []
        for ev in plan_from_proto(list(dump.events)):
            if ev.kind == "open" and ev.spec.stream_id == pipeline_stream_id:
                events.append(ev)
            elif ev.kind == "batch" and any(s.stream == pipeline_stream_id for s in ev.steps):
                assert all(s.stream == pipeline_stream_id for s in ev.steps), "stream shared a batch; not isolated"
                events.append(ev)
            elif ev.kind in ("close", "prompt") and ev.stream_id == pipeline_stream_id:
                events.append(ev)
        return events

    def latents(
        self, events, sid: int, prompt: str, updates: dict[int, str] | None = None, negative: str | None = None
    ) -> list[torch.Tensor]:
        texts = {sid: self.encoder.encode(prompt)}
        prompt_texts = {(sid, c): self.encoder.encode(p) for c, p in (updates or {}).items()}
        negative_texts = None
        if negative is not None:
            negative_texts = {sid: self.encoder.encode_cached(negative, allow_empty=True)[0]}
        return ReferenceExecutor(self.dit).replay(events, texts, prompt_texts, negative_texts=negative_texts)[sid]

    def frames(self, chunks: list[torch.Tensor]) -> list[np.ndarray]:
        """Per chunk, the uint8 frames a fresh StreamVAE decodes (the stream's VAE cache carried across chunks)."""
        vae = StreamVAE.from_folder(self.vae_folder)
        state = vae.new_state()
        return [to_uint8_frames(vae.decode_chunk(state, c)).numpy() for c in chunks]


def _raw(frames: list[stagecast.Frame]) -> np.ndarray:
    return np.stack([f.to_array() for f in frames])


def wait_idle(cluster: Cluster) -> None:
    """Every stream gone everywhere: both gateways (event-driven watch) and then the coordinator."""
    for target in (cluster.main, cluster.tight):
        with stagecast.Client(target) as client:
            client.wait_for_status(lambda s: s.active_streams == 0 and s.vae_state_bytes == 0, timeout=TIMEOUT)
    with cluster.launcher.channel(cluster.coordinator, "coordinator") as ch:
        assert ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10).active_streams == 0


@pytest.fixture
def main(cluster):
    with stagecast.Client(cluster.main) as client:
        yield client
    wait_idle(cluster)


def test_raw_frames_equal_vae_decode_of_the_reference_executors_latents_bit_for_bit(main, reference):
    gen = main.generate(PROMPT, width=W, height=H, seconds=1, codec="raw", seed=7, timeout=TIMEOUT)
    frames = gen.collect()
    info = gen.info
    # 1 s at 16 fps = 16 frames; 5 one-latent-frame chunks give 1 + 4*4 = 17, so the last frame is dropped.
    assert (info.total_frames, info.num_chunks, info.latent_width, info.latent_height) == (16, 5, 6, 4)
    assert gen.end.reason == "completed" and gen.end.frames == 16
    assert [f.index for f in frames] == list(range(16))
    assert [f.pts for f in frames] == [i / 16 for i in range(16)]
    assert [f.chunk for f in frames] == [0] + [c for c in range(1, 5) for _ in range(4)][:15]

    sid = info.pipeline_stream_id
    events = reference.plan_of(sid)
    want = np.concatenate(reference.frames(reference.latents(events, sid, PROMPT)))[:16]
    got = _raw(frames)
    assert got.shape == want.shape == (16, H, W, 3)
    assert got.tobytes() == want.tobytes()


def test_a_streams_own_ladder_reaches_every_stage_and_started_echoes_it(main, cluster, reference):
    kwargs = dict(width=W, height=H, seconds=0.3, codec="raw", seed=5, timeout=TIMEOUT)
    default = main.generate(PROMPT, **kwargs)
    default_frames = default.collect()
    # The demo checkpoint's stagecast.json has no sampler section: 2 steps evenly from 1000, shift 1.
    assert (default.info.timesteps, default.info.shift, default.info.config.steps) == ((1000.0, 500.0), 1.0, 2)
    wait_idle(cluster)

    gen = main.generate(PROMPT, timesteps=[700, 500, 200], **kwargs)
    frames = gen.collect()
    assert (gen.info.timesteps, gen.info.shift, gen.info.config.steps) == ((700.0, 500.0, 200.0), 1.0, 3)
    sid = gen.info.pipeline_stream_id
    events = reference.plan_of(sid)
    opened = events[0].spec
    assert (opened.timesteps, opened.shift, opened.sampler) == ((700.0, 500.0, 200.0), 1.0, "x0")
    want = np.concatenate(reference.frames(reference.latents(events, sid, PROMPT)))[: len(frames)]
    assert _raw(frames).tobytes() == want.tobytes()
    assert _raw(frames).tobytes() != _raw(default_frames).tobytes()


def test_guidance_with_a_negative_prompt_equals_the_reference_and_started_echoes_it(main, cluster, reference):
    """guidance_scale 5 runs a conditional and an unconditional branch per step (the negative prompt, empty when the
    request sends none and the checkpoint has no default); the frames are the reference's, bit for bit."""
    kwargs = dict(width=W, height=H, seconds=0.3, codec="raw", seed=5, timeout=TIMEOUT)
    for negative in ("", OTHER_PROMPT):
        gen = main.generate(PROMPT, guidance_scale=5.0, negative_prompt=negative or None, **kwargs)
        frames = gen.collect()
        assert (gen.info.config.guidance_scale, gen.info.config.negative_prompt) == (5.0, negative)
        sid = gen.info.pipeline_stream_id
        events = reference.plan_of(sid)
        assert events[0].spec.guidance_scale == 5.0
        want = np.concatenate(reference.frames(reference.latents(events, sid, PROMPT, negative=negative)))
        assert _raw(frames).tobytes() == want[: len(frames)].tobytes()
        wait_idle(cluster)


def _vae_stage_streams(cluster: Cluster, address: str) -> tuple[int, int]:
    with cluster.launcher.channel(address, "vae-stage") as ch:
        d = vpb_grpc.VAEStageServiceStub(ch).Describe(ipb.Empty(), timeout=10)
    return d.open_streams, d.state_bytes


def test_vae_stage_processes_decode_exactly_what_the_in_process_vae_decodes(cluster, reference):
    kwargs = dict(width=W, height=H, seconds=1, codec="raw", seed=7, timeout=TIMEOUT)
    # Against the replay of its own recorded plan, decoded by an in-process StreamVAE: two live streams may form
    # different batches (the plan follows timing), and a batch's size changes CPU numerics; the decoder must not.
    wait_idle(cluster)
    with stagecast.Client(cluster.tight) as client:
        remote = client.generate(PROMPT, **kwargs)
        frames = remote.collect()
    assert remote.end.reason == "completed" and len(frames) == 16
    sid = remote.info.pipeline_stream_id
    want = np.concatenate(reference.frames(reference.latents(reference.plan_of(sid), sid, PROMPT)))[:16]
    assert _raw(frames).tobytes() == want.tobytes()
    # The call to the VAE chain ends only after every stage released the stream's cache.
    assert [_vae_stage_streams(cluster, a) for a in cluster.vae_stage_addresses] == [(0, 0), (0, 0)]


@pytest.mark.parametrize("codec", ["h264", "jpeg"])
def test_sdk_mp4_has_exactly_the_requested_frames_at_the_requested_size(main, codec, tmp_path):
    gen = main.generate(PROMPT, width=W, height=H, seconds=0.5, codec=codec, seed=1, timeout=TIMEOUT)
    written = gen.write_mp4(tmp_path / "clip.mp4")
    # 0.5 s at 16 fps = 8 frames: 3 chunks decode to 9, trimmed to 8.
    assert written == 8 and gen.info.num_chunks == 3
    frames = read_mp4_frames(tmp_path / "clip.mp4")
    assert len(frames) == 8
    assert all(f.shape == (H, W, 3) for f in frames)


def test_async_client_streams_the_same_frames_as_the_sync_client(main, cluster):
    kwargs = dict(width=W, height=H, seconds=0.3, codec="raw", seed=3, timeout=TIMEOUT)
    sync_frames = main.generate(PROMPT, **kwargs).collect()

    async def run():
        async with stagecast.AsyncClient(cluster.main) as client:
            gen = client.generate(PROMPT, **kwargs)
            info = await gen.wait_started()
            frames = await gen.collect()
            return info, frames, gen.end

    info, async_frames, end = asyncio.run(run())
    assert info.total_frames == 5 and end.reason == "completed"
    assert [f.data for f in async_frames] == [f.data for f in sync_frames]


def test_prompt_update_takes_effect_at_the_next_chunk_boundary_and_nowhere_else(main, reference):
    gen = main.generate(PROMPT, width=W, height=H, codec="raw", seed=11, timeout=TIMEOUT)  # until stopped
    sid = gen.info.pipeline_stream_id
    frames, boundary = [], None
    for frame in gen:
        frames.append(frame)
        if frame.index == 1:  # chunk 1's first frame: chunks 0 and 1 have started, so the boundary is >= 2
            gen.update_prompt(OTHER_PROMPT)
        if gen.prompt_updates and boundary is None and frame.index % 4 == 0:
            # The coordinator picks the boundary (the next chunk it has not started); read it from its recorded plan.
            boundary = next((ev.from_chunk for ev in reference.plan_of(sid) if ev.kind == "prompt"), None)
        if boundary is not None and frame.chunk > boundary:
            break
    # The pipeline is not paced by this client and may have run far ahead; what it ran is in the plan either way.
    gen.cancel()
    assert gen.prompt_updates == [OTHER_PROMPT] and boundary >= 2

    events = reference.plan_of(sid)
    assert [ev.from_chunk for ev in events if ev.kind == "prompt"] == [boundary]
    with_update = reference.latents(events, sid, PROMPT, {boundary: OTHER_PROMPT})
    without = reference.latents([ev for ev in events if ev.kind != "prompt"], sid, PROMPT)
    assert len(with_update) == len(without) > boundary + 1
    for c in range(boundary + 2):
        assert torch.equal(with_update[c], without[c]) == (c < boundary), f"chunk {c}, boundary {boundary}"

    got = _raw(frames)
    want = np.concatenate(reference.frames(with_update[: boundary + 2]))[: len(got)]
    assert got.tobytes() == want.tobytes()
    # In pixels: every frame before the boundary chunk is the no-update video's; the boundary chunk's are not.
    old = reference.frames(without[: boundary + 1])
    first_changed = sum(len(f) for f in old[:boundary])
    old = np.concatenate(old)
    assert got[:first_changed].tobytes() == old[:first_changed].tobytes()
    for i in range(first_changed, len(old)):
        assert not np.array_equal(got[i], old[i]), f"frame {i} of chunk {boundary} ignores the new prompt"


def test_stop_ends_the_stream_gracefully_after_whole_chunks(main):
    gen = main.generate(PROMPT, width=W, height=H, codec="jpeg", timeout=TIMEOUT)  # until stopped
    gen.wait_started()
    gen.stop()
    frames = gen.collect()
    assert gen.end.reason == "stopped" and gen.end.frames == len(frames) > 0
    chunks = frames[-1].chunk + 1
    assert len(frames) == 1 + 4 * (chunks - 1)  # no chunk cut short
    assert [f.index for f in frames] == list(range(len(frames)))


BAD_CONFIGS = [
    ("width", dict(width=50)),
    ("height", dict(height=40)),
    ("seconds", dict(seconds=0)),
    ("seconds", dict(seconds=-2)),
    ("steps", dict(steps=0)),
    ("steps", dict(steps=-1)),
    ("prompt", dict(prompt="")),
    ("prompt", dict(prompt="   ")),
    ("prompt", dict(prompt="snow " * 40)),  # 41 tokens; the demo encoder takes 32
    ("codec", dict(codec=99)),  # an enum number this gateway does not know
    ("guidance_scale", dict(guidance_scale=0.5)),
    ("negative_prompt", dict(negative_prompt="blurry")),  # no guidance: it would do nothing
    ("negative_prompt", dict(guidance_scale=5.0, negative_prompt="snow " * 40)),  # 41 tokens; the encoder takes 32
    ("chunk_frames", dict(chunk_frames=0)),
    ("timesteps", dict(timesteps=[400, 700])),  # not descending
    ("timesteps", dict(timesteps=[1500, 700])),  # out of range
    ("timesteps", dict(steps=2, timesteps=[700, 500, 300])),  # wrong length for the step count
    ("shift", dict(shift=5.0)),  # the demo checkpoint's sampler runs at shift 1
]


def _raw_call(target: str, messages: list[pb.ClientMessage]) -> grpc.RpcError:
    """Drive Generate with an exact message sequence (the SDK never sends malformed ones) and return its error."""
    with grpc.insecure_channel(target) as ch:
        call = pb_grpc.StreamServiceStub(ch).Generate(iter(messages), timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        return err.value


def test_bad_requests_get_invalid_argument_naming_the_field_while_a_good_stream_completes(main, cluster):
    good = main.generate(PROMPT, width=W, height=H, seconds=1, codec="jpeg", seed=2, timeout=TIMEOUT)
    good.wait_started()
    collected: list = []
    reader = threading.Thread(target=lambda: collected.extend(good))
    reader.start()

    for field, overrides in BAD_CONFIGS:
        kwargs = dict(prompt=PROMPT, width=W, height=H, seconds=1)
        kwargs.update(overrides)
        with pytest.raises(stagecast.InvalidArgumentError) as err:
            main.generate(kwargs.pop("prompt"), timeout=TIMEOUT, **kwargs).wait_started()
        assert err.value.details.startswith(f"{field}:"), err.value.details

    config = pb.ClientMessage(config=stagecast.client.stream_config(PROMPT, width=W, height=H))
    prompt_first = pb.ClientMessage(prompt=pb.PromptUpdate(prompt=PROMPT))
    for messages in ([prompt_first, config], [config, config], []):
        err = _raw_call(cluster.main, messages)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("config:"), err.details()

    # A bad prompt update ends its stream (the call's status is the only error channel), and only that stream.
    updated = main.generate(PROMPT, width=W, height=H, codec="raw", timeout=TIMEOUT)  # until stopped
    updated.wait_started()
    updated.update_prompt("snow " * 40)
    with pytest.raises(stagecast.InvalidArgumentError, match="INVALID_ARGUMENT: prompt update: prompt: is too long"):
        updated.collect()

    reader.join(TIMEOUT)
    assert good.end.reason == "completed" and len(collected) == 16


def test_too_many_streams_on_a_gateway_is_resource_exhausted(cluster):
    # One client fills the gateway: its quota (by default the gateway's whole bound) is reached too, and the refusal
    # says the gateway is full.
    with stagecast.Client(cluster.tight) as client:
        streams = [client.generate(PROMPT, width=W, height=H, codec="raw", timeout=TIMEOUT) for _ in range(2)]
        for gen in streams:
            gen.wait_started()
        with pytest.raises(stagecast.ResourceExhaustedError, match="too many streams.*--max-streams"):
            client.generate(PROMPT, width=W, height=H, timeout=TIMEOUT).wait_started()
        for gen in streams:
            gen.cancel()
    wait_idle(cluster)


def test_the_coordinators_stream_limit_passes_through_as_resource_exhausted(main, cluster):
    streams = [
        main.generate(PROMPT, width=W, height=H, codec="raw", timeout=TIMEOUT) for _ in range(COORDINATOR_MAX_STREAMS)
    ]
    for gen in streams:
        gen.wait_started()
    with pytest.raises(stagecast.ResourceExhaustedError, match="pipeline.*too many streams"):
        main.generate(PROMPT, width=W, height=H, timeout=TIMEOUT).wait_started()
    for gen in streams:
        gen.cancel()


def _stage_state(cluster: Cluster, address: str) -> tuple[int, int]:
    with cluster.launcher.channel(address, "stage") as ch:
        d = ipb_grpc.StageServiceStub(ch).Describe(ipb.Empty(), timeout=10)
    return d.open_streams, d.kv_bytes


def test_cancel_stops_the_pipeline_stream_and_frees_kv_and_vae_state(main, cluster):
    gen = main.generate(PROMPT, width=W, height=H, codec="raw", timeout=TIMEOUT)  # until stopped
    next(gen)  # chunk 0 is decoded: the stream's VAE cache is filled
    seen = main.status()
    assert seen.active_streams == 1 and seen.streams[0].vae_state_bytes > 0 and seen.vae_state_bytes > 0
    assert any(_stage_state(cluster, a)[1] > 0 for a in cluster.stage_addresses)  # the stages hold its KV cache
    cancelled = seen.ended_by_reason["cancelled"]

    gen.cancel()
    assert list(gen) == []  # iteration ends quietly after cancel()
    done = main.wait_for_status(lambda s: s.active_streams == 0, timeout=TIMEOUT)
    assert done.vae_state_bytes == 0 and done.ended_by_reason["cancelled"] == cancelled + 1
    with cluster.launcher.channel(cluster.coordinator, "coordinator") as ch:
        assert ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10).active_streams == 0
    # The coordinator ended the stream after its last chunk; the stages run the close event right after it, so
    # allow them a moment (bounded) to get there.
    deadline = time.monotonic() + 10
    while any(_stage_state(cluster, a) != (0, 0) for a in cluster.stage_addresses) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert [_stage_state(cluster, a) for a in cluster.stage_addresses] == [(0, 0)] * len(cluster.stage_addresses)


def test_a_client_that_stops_reading_gets_resource_exhausted_and_its_stream_is_freed(cluster):
    # Without BDP probing the client's flow-control window stays at 64 KiB, so the gateway's buffers fill quickly.
    with (
        stagecast.Client(cluster.tight, options=[("grpc.http2.bdp_probe", 0)]) as slow,
        stagecast.Client(cluster.tight) as observer,
    ):
        before = observer.status().ended_by_reason["client_too_slow"]
        gen = slow.generate(PROMPT, width=64, height=64, codec="raw", timeout=TIMEOUT)  # 12 KiB frames, unbounded
        next(iter(gen))
        # Read nothing more until the gateway has given up on this client and released everything it held.
        status = observer.wait_for_status(
            lambda s: s.ended_by_reason["client_too_slow"] == before + 1 and s.active_streams == 0, timeout=TIMEOUT
        )
        assert status.vae_state_bytes == 0
        assert [_vae_stage_streams(cluster, a) for a in cluster.vae_stage_addresses] == [(0, 0), (0, 0)]
        with pytest.raises(stagecast.ResourceExhaustedError, match="client too slow"):
            for _ in gen:
                pass
    wait_idle(cluster)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).read().decode()
    assert 'stagecast_gateway_streams_ended_total{reason="client_too_slow"}' in metrics
    assert "stagecast_gateway_active_streams 0.0" in metrics


def test_gateway_serves_grpc_health_and_reflection(cluster):
    with grpc.insecure_channel(cluster.main) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "stagecast.v1.StreamService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert "stagecast.v1.StreamService" in services and "grpc.health.v1.Health" in services


def test_generate_cli_writes_the_clip_and_prints_ttff_and_fps(cluster, tmp_path):
    out = tmp_path / "cli.mp4"
    args = ["generate", "--target", cluster.main, "--prompt", PROMPT, "--seconds", "0.5", "--out", str(out)]
    args += ["--width", str(W), "--height", str(H), "--seed", "5", "--timesteps", "900,300"]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFF" in proc.stdout and "FPS" in proc.stdout and "8 frames" in proc.stdout
    assert "timesteps [900, 300] shift 1" in proc.stdout
    assert len(read_mp4_frames(out)) == 8
    wait_idle(cluster)
    bad = subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args[:-1], "300,900"], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert bad.returncode == 1 and "timesteps: must be strictly descending" in bad.stderr, bad.stderr


@pytest.mark.multiprocess
def test_unpaced_streams_are_capped_per_client_and_never_ahead_of_a_paced_stream_in_a_batch(cluster, main):
    """One client asks for 8 unpaced streams: it gets its quota (2) and RESOURCE_EXHAUSTED naming it for the rest; a
    paced stream of another client is admitted beside them, and in the recorded plan no batch lists an unpaced
    stream's micro-step before one of the paced stream's."""
    kwargs = dict(width=W, height=H, codec="jpeg", timeout=TIMEOUT)
    with stagecast.Client(cluster.main) as greedy:
        asked = [greedy.generate(PROMPT, pace=False, **kwargs) for _ in range(8)]  # unbounded, as fast as possible
        unpaced, refusals = [], []
        for gen in asked:
            try:
                gen.wait_started()
                unpaced.append(gen)
            except stagecast.ResourceExhaustedError as exc:
                refusals.append(exc.details)
        assert len(unpaced) == 2 and len(refusals) == 6
        assert all("quota" in r and "--max-unpaced-per-client 2" in r for r in refusals), refusals
        readers = [threading.Thread(target=lambda g=g: [None for _ in g]) for g in unpaced]
        for reader in readers:
            reader.start()
        paced = main.generate(PROMPT, seconds=1, seed=4, **kwargs)  # another client (connection), paced
        paced.wait_started()
        status = main.status()
        assert (status.paced_streams, status.unpaced_streams) == (1, 2)
        assert sorted(s.paced for s in status.streams) == [False, False, True]
        frames = paced.collect()
        assert paced.end.reason == "completed" and len(frames) == 16
        for gen in unpaced:
            gen.cancel()
        for reader in readers:
            reader.join(TIMEOUT)
    wait_idle(cluster)

    ids = {gen.info.pipeline_stream_id for gen in unpaced}
    pid = paced.info.pipeline_stream_id
    with cluster.launcher.channel(cluster.coordinator, "coordinator") as ch:
        plan = plan_from_proto(list(ipb_grpc.CoordinatorServiceStub(ch).GetPlan(ipb.PlanRequest(), timeout=30).events))
    batches = [[s.stream for s in ev.steps] for ev in plan if ev.kind == "batch"]
    batches = [b for b in batches if pid in b]
    assert sum(1 for b in batches for s in b if s == pid) == 5 * 2  # 5 chunks x 2 steps, all planned
    shared = [b for b in batches if ids & set(b)]
    assert shared, "the paced stream never shared a batch with an unpaced one: the test shows nothing"
    for batch in shared:
        assert batch == sorted(batch, key=lambda s: s != pid), f"an unpaced micro-step ahead of the paced one: {batch}"

"""Video-to-video through the public API end to end: real processes (coordinator, 2 stages, a gateway) on loopback.

The oracle for a restyled stream is built the slow way in this process: the input frames through a fresh streaming
VAE encoder (pinned to the one-shot ``vae.encode`` by tests/test_stream_vae_encode.py), noised to the strength with
the stream's noise, the recorded plan replayed by the reference executor with those latents, and the chunks decoded
by a fresh StreamVAE.  The gateway's raw frames must equal it bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import torch

import stagecast
from gateway.decode.stream_vae import StreamVAE, StreamVAEEncoder, to_uint8_frames
from gateway.stream.video_input import input_noise, noise_to
from gateway.text_encoder import TextEncoder
from launcher.demo_checkpoint import DEMO_SERVING, write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from launcher.reference import ReferenceExecutor
from launcher.selftest import plan_from_proto
from stage_service.checkpoint import load_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stagecast.client import stream_config
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from stagecast.media import read_mp4_frames, write_mp4
from stagecast.model.config import read_config
from stagecast.sampling import sigmas
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc

pytestmark = pytest.mark.multiprocess

PROMPT = "a watercolor painting of a harbour"
W, H = 48, 32
TIMEOUT = 120
LADDER = (1000.0, 500.0)  # the demo checkpoint's 2 steps


@pytest.fixture(scope="module")
def cluster(system_session):
    """The session's shared system (2 stages recording their plan, a gateway with default flags)."""
    s = system_session
    return dict(root=s.root, coordinator=s.coordinator, gateway=s.gateway, launcher=s.launcher)


@pytest.fixture
def client(cluster):
    with stagecast.Client(cluster["gateway"]) as c:
        yield c
        c.wait_for_status(lambda s: s.active_streams == 0 and s.vae_state_bytes == 0, timeout=TIMEOUT)


def video(n, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    return [np.roll(base, 3 * i, axis=1) for i in range(n)]  # a moving picture


def oracle(cluster, pipeline_id, frames, *, seed, strength):
    """The restyled frames built the slow way (see the module docstring)."""
    root = cluster["root"]
    with cluster["launcher"].channel(cluster["coordinator"], "coordinator") as ch:
        dump = ipb_grpc.CoordinatorServiceStub(ch).GetPlan(ipb.PlanRequest(), timeout=30)
    events = []
    for ev in plan_from_proto(list(dump.events)):
        mine = ev.spec.stream_id == pipeline_id if ev.kind == "open" else ev.stream_id == pipeline_id
        if ev.kind == "batch":
            mine = any(s.stream == pipeline_id for s in ev.steps)
            assert not mine or all(s.stream == pipeline_id for s in ev.steps), "the stream shared a batch"
        if mine:
            events.append(ev)
    vae = StreamVAE.from_folder(root / "vae")
    enc = StreamVAEEncoder(vae.vae)
    x = torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2)[None].float() / 255.0 * 2.0 - 1.0
    z = enc.encode_frames(enc.new_state(), x)
    sigma = sigmas(LADDER[LADDER.index(strength) :], 1.0)[0]
    inputs = {}
    for c in range(z.shape[2]):
        clean = z[:, :, c : c + 1]
        inputs[(pipeline_id, c)] = noise_to(clean, sigma, input_noise(seed, c, tuple(clean.shape)))
    transformer = str(root / "transformer")
    n = read_config(transformer)["num_layers"]
    config, sd = load_slice_state_dict(transformer, layers=range(n), first=True, last=True, dtype=torch.float32)
    dit = DiTSlice.from_state_dict(config, sd, layers=range(n), first=True, last=True, device="cpu")
    text = TextEncoder(root, max_len=DEMO_SERVING["text_len"]).encode(PROMPT)
    chunks = ReferenceExecutor(dit).replay(events, {pipeline_id: text}, inputs=inputs)[pipeline_id]
    state = vae.new_state()
    return np.concatenate([to_uint8_frames(vae.decode_chunk(state, c)).numpy() for c in chunks])


def restyle(client, frames, pts, *, seed):
    """Raw frames through ``client.transform`` at strength 500, nothing dropped: (the call, its output frames)."""
    tr = client.transform(
        list(zip(frames, pts)),
        PROMPT,
        strength=500,
        width=W,
        height=H,
        seed=seed,
        codec="raw",
        input_format="raw",
        input_pacing="backpressure",
        timeout=TIMEOUT,
    )
    return tr, tr.collect()


def test_restyled_frames_equal_the_reference_fed_the_same_latents_bit_for_bit(client, cluster):
    frames = video(9)
    pts = [0.25 + 0.07 * i for i in range(9)]  # the input's own clock, not index / fps
    tr, out = restyle(client, frames, pts, seed=11)
    info = tr.info
    assert (info.config.strength, info.config.input_pacing) == (500.0, pb.INPUT_PACING_BACKPRESSURE)
    assert info.timesteps == LADDER and info.total_frames is None
    assert tr.end.reason == "stopped" and tr.frames_sent == 9 and len(out) == 9
    assert [f.pts for f in out] == pts and [f.index for f in out] == list(range(9))
    assert [f.chunk for f in out] == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    want = oracle(cluster, info.pipeline_stream_id, frames, seed=11, strength=500.0)
    got = np.stack([f.to_array() for f in out])
    assert got.shape == want.shape == (9, H, W, 3)
    assert got.tobytes() == want.tobytes()


def test_input_that_ends_inside_a_chunk_is_completed_by_its_last_frame_and_every_frame_comes_back(client, cluster):
    frames = video(7, seed=3)  # frame 0, then 1-4, then 5-6: the last chunk lacks two frames
    pts = [0.1 * i for i in range(7)]
    tr, out = restyle(client, frames, pts, seed=5)
    assert tr.end.reason == "stopped" and tr.frames_sent == 7 and len(out) == 7
    assert [f.pts for f in out] == pts and [f.chunk for f in out] == [0, 1, 1, 1, 1, 2, 2]
    # The oracle: the input with its last frame repeated twice, restyled; the first 7 frames go out.
    want = oracle(cluster, tr.info.pipeline_stream_id, [*frames, frames[6], frames[6]], seed=5, strength=500.0)
    got = np.stack([f.to_array() for f in out])
    assert want.shape == (9, H, W, 3) and got.tobytes() == want[:7].tobytes()


def _raw_call(target, messages):
    with grpc.insecure_channel(target) as ch:
        call = pb_grpc.StreamServiceStub(ch).Generate(iter(messages), timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        return err.value


def test_bad_inputs_get_invalid_argument_naming_the_field_and_other_streams_are_unaffected(client, cluster):
    good = client.transform(video(9), PROMPT, strength=1000, width=W, height=H, seed=1, timeout=TIMEOUT)
    good.wait_started()
    collected: list = []
    reader = threading.Thread(target=lambda: collected.extend(good))
    reader.start()

    v2v = pb.ClientMessage(config=stream_config(PROMPT, width=W, height=H, strength=1000))
    text = pb.ClientMessage(config=stream_config(PROMPT, width=W, height=H))
    frame = video(1)[0]
    raw = pb.ClientMessage(frame=pb.InputFrame(data=frame.tobytes(), format=pb.INPUT_FORMAT_RAW, pts=0))
    cases = [
        ([raw, v2v], "config:"),  # frames before the config
        ([pb.ClientMessage(config=stream_config(PROMPT, width=W, height=H, strength=600))], "strength:"),
        ([v2v, pb.ClientMessage(frame=pb.InputFrame(data=frame[:16].tobytes(), format=2, pts=0))], "frame.data:"),
        ([v2v, pb.ClientMessage(frame=pb.InputFrame(data=b"\xff\xd8\xff not a jpeg", format=1, pts=0))], "frame.data:"),
        ([v2v, pb.ClientMessage(frame=pb.InputFrame(data=frame.tobytes(), pts=0))], "frame.format:"),
        ([v2v, raw, raw], "frame.pts:"),
        ([text, raw], "frame:"),
    ]
    for messages, field in cases:
        err = _raw_call(cluster["gateway"], messages)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.code(), err.details())
        assert err.details().startswith(field), err.details()

    reader.join(TIMEOUT)
    assert good.end.reason == "stopped" and len(collected) == 9


def test_a_stalled_input_ends_the_stream_cleanly_after_input_timeout(client):
    released = threading.Event()

    def frames():
        yield from video(5)
        released.wait(TIMEOUT)  # the input stalls with the call still open

    tr = client.transform(
        frames(), PROMPT, strength=1000, width=W, height=H, input_timeout=1.0, codec="raw", timeout=TIMEOUT
    )
    out = tr.collect()
    released.set()
    assert tr.end.reason == "input_stalled" and len(out) == 5 and tr.end.frames == 5


def test_transform_cli_restyles_a_file_with_progress_ttff_and_fps(cluster, tmp_path):
    source, out = tmp_path / "in.mp4", tmp_path / "out.mp4"
    write_mp4(source, video(17), fps=16)
    args = ["transform", "--target", cluster["gateway"], "--input", str(source), "--prompt", PROMPT]
    args += ["--out", str(out), "--seed", "3"]
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "17 of 17 input frames restyled" in proc.stdout and "TTFF" in proc.stdout and "FPS" in proc.stdout
    # The default strength keeps the input (the demo's ladder [1000, 500]: 500), and the summary says what ran.
    assert "seed 3, strength 500 on timesteps [1000, 500], to the input's end" in proc.stdout, proc.stdout
    assert [f.shape for f in read_mp4_frames(out)] == [(H, W, 3)] * 17
    bad = subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args, "--strength", "600"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1 and "strength: must be one of" in bad.stderr, bad.stderr


# ---- image-to-video ---------------------------------------------------------------------------------------------


def test_an_image_on_a_checkpoint_that_cannot_condition_on_one_is_invalid_argument(client):
    (frame,) = video(1)
    with pytest.raises(stagecast.InvalidArgumentError, match="image: this checkpoint cannot condition on an image"):
        client.generate(PROMPT, width=W, height=H, seconds=0.5, image=frame, timeout=TIMEOUT).wait_started()


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    """A Wan2.2-TI2V-style tiny checkpoint (48 latent channels, per-token timesteps, the 16x Wan2.2 VAE)."""
    import shutil

    from launcher.demo_checkpoint import write_tiny_vae, write_transformer

    root = write_demo_checkpoint(tmp_path_factory.mktemp("ti2v"))
    shutil.rmtree(root / "transformer")
    shutil.rmtree(root / "vae")
    write_transformer(root / "transformer", seed=0, name="tiny-wan2.2-ti2v")
    write_tiny_vae(root / "vae", name="tiny-wan2.2")
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=str(root / "transformer"), stages=2, record_plan=True)
        gateway = launcher.spawn(
            "gateway", ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        )
        yield dict(root=root, coordinator=pipe.coordinator, gateway=gateway.info["address"], launcher=launcher)


def test_image_to_video_first_frame_equals_the_reference_bit_for_bit(ti2v):
    from gateway.stream.video_input import encode_image

    side = 64  # the tiny Wan2.2 VAE is 16x: 4x4 latents
    rgb = np.random.default_rng(9).integers(0, 256, (side, side, 3), dtype=np.uint8)
    with stagecast.Client(ti2v["gateway"]) as client:
        with pytest.raises(stagecast.InvalidArgumentError, match="^INVALID_ARGUMENT: image: is 64x32"):
            bad = client.generate(PROMPT, width=side, height=side, seconds=0.5, image=rgb[:32], timeout=TIMEOUT)
            bad.wait_started()
        gen = client.generate(PROMPT, width=side, height=side, seconds=0.5, image=rgb, codec="raw", seed=4)
        frames = gen.collect()
        info = gen.info
    assert gen.end.reason == "completed" and len(frames) == 8  # 0.5 s at 16 fps: chunks of 1 + 4 + 4 frames
    root = ti2v["root"]
    with ti2v["launcher"].channel(ti2v["coordinator"], "coordinator") as ch:
        dump = ipb_grpc.CoordinatorServiceStub(ch).GetPlan(ipb.PlanRequest(), timeout=30)
    plan = plan_from_proto(list(dump.events))
    sid = info.pipeline_stream_id
    assert any(ev.kind == "open" and ev.spec.stream_id == sid and ev.spec.image_latents for ev in plan)
    vae = StreamVAE.from_folder(root / "vae")
    latent = encode_image(StreamVAEEncoder(vae.vae), rgb)
    transformer = str(root / "transformer")
    n = read_config(transformer)["num_layers"]
    config, sd = load_slice_state_dict(transformer, layers=range(n), first=True, last=True, dtype=torch.float32)
    dit = DiTSlice.from_state_dict(config, sd, layers=range(n), first=True, last=True, device="cpu")
    text = TextEncoder(root, max_len=DEMO_SERVING["text_len"]).encode(PROMPT)
    chunks = ReferenceExecutor(dit).replay(plan, {sid: text}, images={sid: latent})[sid]
    assert torch.equal(chunks[0], latent)  # latent frame 0 is the image's, held clean
    state = vae.new_state()
    want = np.concatenate([to_uint8_frames(vae.decode_chunk(state, c)).numpy() for c in chunks])[:8]
    got = np.stack([f.to_array() for f in frames])
    assert got.tobytes() == want.tobytes()


def test_the_async_client_restyles_the_same_frames_as_the_sync_client(client, cluster):
    import asyncio

    frames = video(5)
    kwargs = dict(strength=1000, width=W, height=H, seed=21, codec="raw", input_format="raw", timeout=TIMEOUT)
    sync = [f.to_array() for f in client.transform(frames, PROMPT, input_pacing="backpressure", **kwargs)]
    client.wait_for_status(lambda s: s.active_streams == 0, timeout=TIMEOUT)

    async def source():
        for rgb in frames:
            yield rgb

    async def run():
        async with stagecast.AsyncClient(cluster["gateway"]) as aclient:
            tr = aclient.transform(source(), PROMPT, input_pacing="backpressure", **kwargs)
            out = await tr.collect()
            return tr, [f.to_array() for f in out]

    tr, got = asyncio.run(run())
    assert tr.end.reason == "stopped" and tr.frames_sent == 5 and len(got) == len(sync) == 5
    assert all(np.array_equal(a, b) for a, b in zip(got, sync))


# ---- prompt transitions -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["per_level", "clean"])
def test_a_recache_prompt_update_equals_the_reference_bit_for_bit(client, cluster, policy):
    """The stages rebuild the KV window under the new prompt before the next chunk, exactly as the reference does
    from its own clean latents (the recorded plan keeps the event, not the latents)."""
    other = "a pencil sketch of a harbour"
    kwargs = dict(width=W, height=H, codec="raw", seed=8, window=2, sink=1, policy=policy, timeout=TIMEOUT)
    gen = client.generate(PROMPT, **kwargs)
    frames = []
    for frame in gen:
        frames.append(frame)
        if frame.index == 4:
            gen.update_prompt(other, transition="recache")
        if frame.index == 16:
            gen.stop()
    assert gen.end.reason == "stopped" and gen.prompt_updates == [other]
    sid = gen.info.pipeline_stream_id
    with cluster["launcher"].channel(cluster["coordinator"], "coordinator") as ch:
        dump = ipb_grpc.CoordinatorServiceStub(ch).GetPlan(ipb.PlanRequest(), timeout=30)
    events = [
        ev
        for ev in plan_from_proto(list(dump.events))
        if (ev.kind == "open" and ev.spec.stream_id == sid)
        or (ev.kind == "batch" and any(s.stream == sid for s in ev.steps))
        or (ev.kind in ("prompt", "close") and ev.stream_id == sid)
    ]
    (update,) = [ev for ev in events if ev.kind == "prompt"]
    assert update.recache and update.from_chunk >= 2 and [c for c, _ in update.window] == [0, update.from_chunk - 1]
    root = cluster["root"]
    transformer = str(root / "transformer")
    n = read_config(transformer)["num_layers"]
    config, sd = load_slice_state_dict(transformer, layers=range(n), first=True, last=True, dtype=torch.float32)
    dit = DiTSlice.from_state_dict(config, sd, layers=range(n), first=True, last=True, device="cpu")
    encoder = TextEncoder(root, max_len=DEMO_SERVING["text_len"])
    texts, updates = {sid: encoder.encode(PROMPT)}, {(sid, update.from_chunk): encoder.encode(other)}
    chunks = ReferenceExecutor(dit).replay(events, texts, updates)[sid]
    vae = StreamVAE.from_folder(root / "vae")
    state = vae.new_state()
    want = np.concatenate([to_uint8_frames(vae.decode_chunk(state, c)).numpy() for c in chunks])
    got = np.stack([f.to_array() for f in frames])
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


def test_a_recache_needs_a_bounded_window_and_a_known_transition(client):
    gen = client.generate(PROMPT, width=W, height=H, codec="raw", timeout=TIMEOUT)  # unbounded window
    gen.wait_started()
    gen.update_prompt("a pencil sketch", transition="recache")
    with pytest.raises(stagecast.InvalidArgumentError, match="prompt update: transition: RECACHE rebuilds"):
        gen.collect()
    with pytest.raises(ValueError, match="transition: must be one of"):
        gen.update_prompt("x", transition="blend")  # refused by the SDK before it is sent

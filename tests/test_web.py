"""The web process against a demo-sized system, driven by an aiortc peer and a WebSocket client speaking the page's
protocol: frames over WebRTC and over the fMP4 fallback, live prompt switches, and the edge's refusals (garbage and
oversized SDP, data-channel junk, too many peers, a peer that vanishes) while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse

import aiohttp
import pytest

import stagecast
from launcher.demo_checkpoint import DEMO_SERVING
from stagecast.media import read_mp4_frames
from tests.web_cluster import MAX_PEERS, PEER_TIMEOUT, web_cluster
from web.rtc import MAX_SDP_BYTES, use_ice_hosts
from web.session import MAX_MESSAGES_PER_S
from web.viewer import OfferRefused, PatternCamera, RtcViewer, post_offer

pytestmark = pytest.mark.multiprocess

PROMPT = "a red fox running through snow"
OTHER = "a blue bird flying over the ocean"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    use_ice_hosts(["127.0.0.1"])  # this test process's own peers offer loopback only
    with web_cluster(tmp_path_factory.mktemp("ckpt")) as cluster:
        yield cluster


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


def active_streams(system) -> int:
    with stagecast.Client(system.gateway) as client:
        return client.status().active_streams


def wait_streams(system, predicate, timeout=60.0) -> float:
    """Seconds until the gateway's stream count satisfies ``predicate`` (event-driven: WatchStatus)."""
    t0 = time.monotonic()
    with stagecast.Client(system.gateway) as client:
        client.wait_for_status(lambda s: predicate(s.active_streams), timeout=timeout)
    return time.monotonic() - t0


def test_webrtc_peer_gets_paced_frames_and_a_live_prompt_switch(system):
    async def scenario():
        async with RtcViewer(system.url) as viewer:
            viewer.send({"type": "config", "prompt": PROMPT, "seconds": 3, "seed": 1})
            started = await viewer.wait_for("started")
            assert started["config"]["width"] == DEMO_SERVING["width"]
            first = await viewer.next_frame()
            assert (first.width, first.height) == (DEMO_SERVING["width"], DEMO_SERVING["height"])
            viewer.send({"type": "prompt", "prompt": OTHER})
            updated = await viewer.wait_for("prompt_updated")
            assert updated["prompt"] == OTHER
            end = await viewer.wait_for("end")
            stats = [m for m in viewer.log if m["type"] == "frame"]
            return end, stats

    end, stats = run(scenario())
    assert end["reason"] == "completed" and end["frames"] == 48  # 3 s at 16 fps
    assert [m["index"] for m in stats] == list(range(48))  # every frame was sent, in order
    # Paced at target_fps: frame i leaves no earlier than first + i/16 s.
    sent = [m["sent_s"] for m in stats]
    for i, t in enumerate(sent):
        assert t >= sent[0] + i / 16.0 - 0.005, (i, t, sent[0])


async def _socket_stream(url: str, messages: list[dict], switch: str | None = None) -> tuple[list[dict], bytes]:
    """Run one WebSocket session: send ``messages``, switch the prompt after the first frame; until ``end``."""
    texts: list[dict] = []
    media = bytearray()
    ws_url = urllib.parse.urljoin(url.replace("http", "ws", 1), "api/ws")
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url) as ws:
        for msg in messages:
            await ws.send_str(msg if isinstance(msg, str) else json.dumps(msg))
        async for raw in ws:
            if raw.type == aiohttp.WSMsgType.BINARY:
                media += raw.data
                continue
            if raw.type != aiohttp.WSMsgType.TEXT:
                break
            msg = json.loads(raw.data)
            texts.append(msg)
            if msg["type"] == "frame" and switch and msg["index"] == 0:
                await ws.send_str(json.dumps({"type": "prompt", "prompt": switch}))
            if msg["type"] == "end" or (msg["type"] == "error" and msg["code"] == "UNAUTHENTICATED"):
                break
    return texts, bytes(media)


def test_websocket_fallback_streams_fmp4_that_plays_and_switches_prompts(system):
    texts, media = run(_socket_stream(system.url, [{"type": "config", "prompt": PROMPT, "seconds": 2}], switch=OTHER))
    kinds = [m["type"] for m in texts]
    assert kinds[0] == "started" and kinds[-1] == "end", kinds
    init = next(m for m in texts if m["type"] == "init")
    assert init["mime"].startswith('video/mp4; codecs="avc1.')
    assert [m["prompt"] for m in texts if m["type"] == "prompt_updated"] == [OTHER]
    frames = read_mp4_frames(media)  # the binary messages, concatenated, are one playable MP4
    assert len(frames) == 32 and frames[0].shape == (DEMO_SERVING["height"], DEMO_SERVING["width"], 3)
    assert texts[-1] == {"type": "end", "reason": "completed", "frames": 32}


def test_garbage_oversized_and_non_offer_bodies_are_refused_naming_the_field(system):
    async def refusals():
        out = []
        for body, raw in (
            ({"sdp": "hello", "type": "offer"}, None),
            ({"sdp": "v=0\r\nm=nonsense 9 X 0\r\n", "type": "offer"}, None),
            ({"sdp": 5, "type": "offer"}, None),
            ({"sdp": "v=0", "type": "answer"}, None),
            (None, b"\xff\x00 not json"),
            (None, json.dumps({"sdp": "v=0\r\n" + "a=x\r\n" * MAX_SDP_BYTES, "type": "offer"}).encode()),
        ):
            try:
                await post_offer(system.url, body, raw=raw)
            except OfferRefused as exc:
                out.append((exc.status, exc.error))
        return out

    refused = run(refusals())
    assert [status for status, _ in refused] == [400, 400, 400, 400, 400, 413], refused
    assert [error.split(":")[0] for _, error in refused] == ["sdp", "sdp", "sdp", "type", "body", "sdp"], refused
    assert "cannot be used" in refused[1][1]


def test_data_channel_junk_is_answered_with_errors_and_the_peer_still_streams(system):
    junk = [
        "not json",
        b"\xff\xfe\x00",
        json.dumps([1, 2]),
        json.dumps({"type": "launch"}),
        json.dumps({"type": "config", "prompt": 5}),
        json.dumps({"type": "config", "prompt": PROMPT, "width": "wide"}),
        json.dumps({"type": "config", "prompt": PROMPT, "bogus": 1}),
        json.dumps({"type": "prompt", "prompt": OTHER}),  # no stream yet
        "x" * (100 * 1024),
    ]

    async def scenario():
        async with RtcViewer(system.url) as viewer:
            for item in junk:
                viewer.send(item)
            errors = [await viewer.wait_for("error") for _ in junk]
            viewer.send({"type": "config", "prompt": PROMPT, "width": 50})  # the gateway's own check
            errors.append(await viewer.wait_for("error"))
            viewer.send({"type": "config", "prompt": PROMPT, "seconds": 1})
            await viewer.wait_for("started")
            end = await viewer.wait_for("end")
            return errors, end

    errors, end = run(scenario())
    fields = [e["message"].split(":")[0] for e in errors]
    assert fields == ["message", "message", "message", "type", "prompt", "width", "bogus", "prompt", "message", "width"]
    assert errors[-1]["code"] == "INVALID_ARGUMENT"
    assert end == {"type": "end", "reason": "completed", "frames": 16}


def test_too_many_peers_get_503_and_a_closed_peer_frees_its_slot(system):
    async def scenario():
        viewers = [RtcViewer(system.url) for _ in range(MAX_PEERS)]
        for viewer in viewers:
            await viewer.connect()
        with pytest.raises(OfferRefused) as refused:
            await RtcViewer(system.url).connect()
        await viewers[0].close()  # a goodbye: DTLS close and SCTP abort reach the server at once
        health = urllib.parse.urljoin(system.url, "healthz")
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 10
            while (await (await http.get(health)).json())["peers"] >= MAX_PEERS:
                assert time.monotonic() < deadline, "the closed peer kept its slot"
                await asyncio.sleep(0.05)
        async with RtcViewer(system.url) as again:
            again.send({"type": "config", "prompt": PROMPT, "seconds": 0.5})
            await again.wait_for("end")
        for viewer in viewers[1:]:
            await viewer.close()
        return refused.value

    refused = run(scenario())
    assert refused.status == 503 and f"the limit is {MAX_PEERS}" in refused.error


VANISHING_PEER = """
import asyncio, sys
from web.rtc import use_ice_hosts
from web.viewer import RtcViewer
use_ice_hosts(["127.0.0.1"])
async def main():
    viewer = RtcViewer(sys.argv[1])
    await viewer.connect()
    viewer.send({"type": "config", "prompt": "a fox"})
    await viewer.next_frame()
    print("FRAME", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_a_peer_that_vanishes_without_goodbye_has_its_stream_freed_within_seconds(system):
    wait_streams(system, lambda n: n == 0)  # what earlier tests cancelled may still be winding down
    proc = subprocess.Popen(
        [sys.executable, "-c", VANISHING_PEER, system.url], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert proc.stdout.readline().strip() == "FRAME"
        assert active_streams(system) == 1
        t_kill = time.monotonic()
        proc.send_signal(signal.SIGKILL)  # no DTLS close, no SCTP abort: the peer just goes silent
        proc.wait()
        wait_streams(system, lambda n: n == 0, timeout=30)
        freed = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"vanished peer's stream freed {freed:.2f} s after the kill (peer timeout {PEER_TIMEOUT} s)")
    assert freed < PEER_TIMEOUT + 3.0


def test_a_camera_track_is_restyled_through_video_to_video_and_comes_back_with_its_pts(system):
    async def scenario():
        camera = PatternCamera(DEMO_SERVING["width"], DEMO_SERVING["height"], fps=16)  # a track binds to its loop
        async with RtcViewer(system.url, camera=camera) as viewer:
            viewer.send({"type": "config", "prompt": PROMPT, "strength": 500, "steps": 2})
            started = await viewer.wait_for("started")
            frames = [await viewer.next_frame() for _ in range(8)]
            viewer.send({"type": "stop"})
            end = await viewer.wait_for("end")
            stats = [m for m in viewer.log if m["type"] == "frame"]
            return camera, started, frames, end, stats

    camera, started, frames, end, stats = run(scenario())
    assert started["config"]["strength"] == 500
    assert all((f.width, f.height) == (DEMO_SERVING["width"], DEMO_SERVING["height"]) for f in frames)
    assert end["reason"] == "stopped" and end["frames"] == len(stats) >= 8, (end, system.web.log[-20:])
    # Output frame i carries the pts of the camera frame it was made from, on the camera's own clock.
    pts = [m["pts"] for m in stats]
    assert pts == sorted(set(pts)) and set(pts) <= set(camera.sent_at), (pts, sorted(camera.sent_at)[:20])


ALICE = "alice-token-0123456789abcdef"
WATCHER = "status-token-0123456789abcdef"


def test_with_tokens_the_web_edge_refuses_strangers_before_any_webrtc_work(system, tmp_path):
    """The gateway's token file and wording: no token or a wrong one is 401, a status token may not generate (403),
    on the offer and on the WebSocket's config; a valid token streams (and is what the gateway sees)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALICE} alice\n{WATCHER} ops status\n")
    args = ["web", "--gateway", system.gateway, "--port", "0", "--ice-host", "127.0.0.1", "--tokens", str(tokens)]
    url = system.launcher.spawn("web-tokens", args).info["url"]

    async def scenario():
        refused = []
        for token in (None, "not-a-token-at-all-0000", WATCHER):
            try:
                await post_offer(url, {"sdp": "v=0\r\nm=video 9 X 0\r\n", "type": "offer"}, token=token)
            except OfferRefused as exc:
                refused.append((exc.status, exc.error))
        async with RtcViewer(url, token=ALICE) as viewer:
            viewer.send({"type": "config", "prompt": PROMPT, "seconds": 0.5})
            end = await viewer.wait_for("end")
        socket, _ = await _socket_stream(url, [{"type": "config", "prompt": PROMPT, "seconds": 0.5}])
        return refused, end, socket

    refused, end, socket = run(scenario())
    assert [status for status, _ in refused] == [401, 401, 403], refused
    assert "a valid bearer token is required" in refused[0][1] and "'ops' may not generate" in refused[2][1]
    assert end["reason"] == "completed" and end["frames"] == 8
    assert socket == [{"type": "error", "code": "UNAUTHENTICATED", "message": refused[0][1]}]


def test_a_flood_of_control_messages_is_refused_past_the_rate_and_the_peer_goes_on(system):
    config = {"type": "config", "prompt": PROMPT, "seconds": 0.5}

    async def scenario():
        async with RtcViewer(system.url, ping=False) as viewer:
            for _ in range(MAX_MESSAGES_PER_S + 10):
                viewer.send({"type": "ping"})
            seen = [await viewer.wait_for("error")]
            # The rate is per second: the config goes once the burst's second is over (this waits out the rate's
            # window, not an event), so it is not refused with the burst's tail, and a stream starts once.  (Sent on
            # each of the tail's refusals, it replaced its own stream up to ten times, which a loaded host did not
            # finish within the test's bound.)
            await asyncio.sleep(1.0)
            viewer.send(config)
            while not (seen[-1]["type"] == "end" and seen[-1]["reason"] == "completed"):
                seen.append(await asyncio.wait_for(viewer.messages.get(), 120))
            return seen

    seen = run(scenario())
    errors = [m["message"] for m in seen if m["type"] == "error"]
    assert set(errors) == {f"message: more than {MAX_MESSAGES_PER_S} control messages a second"}
    assert seen[-1]["reason"] == "completed" and [m["type"] for m in seen].count("started") == 1


def test_a_websocket_peer_that_stops_answering_pings_has_its_stream_freed_within_seconds(system):
    wait_streams(system, lambda n: n == 0)  # what earlier tests cancelled may still be winding down

    async def scenario():
        ws_url = urllib.parse.urljoin(system.url.replace("http", "ws", 1), "api/ws")
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(ws_url, autoping=False)  # a peer gone silent: no pongs from here on
            await ws.send_str(json.dumps({"type": "config", "prompt": PROMPT}))
            while (await ws.receive()).type != aiohttp.WSMsgType.BINARY:  # until media flows
                pass
            assert await asyncio.to_thread(active_streams, system) == 1
            t0 = time.monotonic()
            await asyncio.to_thread(wait_streams, system, lambda n: n == 0, 30)
            freed = time.monotonic() - t0
            await ws.close()
            return freed

    freed = run(scenario())
    print(f"silent WebSocket's stream freed {freed:.2f} s after its media began (peer timeout {PEER_TIMEOUT} s)")
    assert freed < PEER_TIMEOUT + 3.0


BOB = "bob-token-0123456789abcdef"


@pytest.mark.multiprocess
def test_tokenless_websockets_wait_in_a_pool_of_their_own_and_valid_tenants_still_start(system, tmp_path):
    """Four tokenless WebSockets held open (each reopened as the edge closes it, 1 s after it opened) on an edge of 4
    peers: a valid tenant's WebSocket (token in the first message, or in Sec-WebSocket-Protocol) and WebRTC sessions
    start; a tenant holds at most its share of the peers."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
    args = ["web", "--gateway", system.gateway, "--port", "0", "--ice-host", "127.0.0.1", "--tokens", str(tokens)]
    args += ["--max-peers", "4"]  # 2 per tenant
    url = system.launcher.spawn("web-preauth", args).info["url"]
    ws_url = urllib.parse.urljoin(url.replace("http", "ws", 1), "api/ws")
    config = {"type": "config", "prompt": PROMPT, "seconds": 0.5}

    async def squat(http, closes: list, closed: asyncio.Event, stop: asyncio.Event) -> None:
        """Hold a tokenless socket open, reopening it whenever the edge closes it."""
        while not stop.is_set():
            async with http.ws_connect(ws_url) as ws:
                msg = await ws.receive()
                if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                    closes.append(msg.extra or ws.close_code)
                    if len(closes) >= 4:
                        closed.set()

    async def scenario():
        closes: list = []
        closed, stop = asyncio.Event(), asyncio.Event()
        async with aiohttp.ClientSession() as http:
            squatters = [asyncio.create_task(squat(http, closes, closed, stop)) for _ in range(4)]
            try:
                in_message, _ = await _socket_stream(url, [{**config, "token": ALICE}])
                async with http.ws_connect(ws_url, protocols=("stagecast", f"bearer.{ALICE}")) as ws:
                    protocol = ws.protocol
                    await ws.send_str(json.dumps(config))
                    in_header = []
                    async for raw in ws:
                        if raw.type == aiohttp.WSMsgType.TEXT:
                            in_header.append(json.loads(raw.data))
                            if in_header[-1]["type"] in ("end", "error"):
                                break
                async with RtcViewer(url, token=ALICE) as viewer:
                    viewer.send(config)
                    rtc_end = await viewer.wait_for("end")
                    async with RtcViewer(url, token=ALICE):  # alice's second peer: her share of 4
                        with pytest.raises(OfferRefused) as third:
                            await RtcViewer(url, token=ALICE).connect()
                        async with RtcViewer(url, token=BOB) as bob:  # another tenant still gets in
                            bob.send(config)
                            bob_end = await bob.wait_for("end")
                # The squatters' sockets were closed for want of a token, and none of them ever held a peer slot.
                await closed.wait()
            finally:
                stop.set()
                for task in squatters:
                    task.cancel()
                await asyncio.gather(*squatters, return_exceptions=True)
            health = await (await http.get(urllib.parse.urljoin(url, "healthz"))).json()
        return in_message, protocol, in_header, rtc_end, third.value, bob_end, closes, health

    in_message, protocol, in_header, rtc_end, third, bob_end, closes, health = run(scenario())
    assert in_message[0]["type"] == "started" and in_message[-1] == {"type": "end", "reason": "completed", "frames": 8}
    assert protocol == "stagecast"  # the token is never echoed back
    assert in_header[0]["type"] == "started" and in_header[-1]["type"] == "end", in_header
    assert rtc_end["reason"] == "completed" and bob_end["reason"] == "completed"
    assert third.status == 503 and "tenant 'alice'" in third.error and "--max-peers-per-tenant" in third.error
    assert all(c == "no token within 1 s" for c in closes), closes
    assert health["ws"] == 2 and health["rtc"] == 3  # the squatters were never counted as peers

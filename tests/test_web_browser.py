"""The live page in a real browser: Debian's headless chromium, driven through /usr/bin/chromedriver (Selenium never
downloads a driver), against a demo-sized system with the web process in front.  Over WebRTC and over the WebSocket
fallback, the page receives frames it can draw, switches the prompt live and sees ``prompt_updated``, and a
screenshot is taken with the video playing.  It recovers by itself: from a network namespace whose UDP cannot reach
the media address it falls back to the WebSocket, without WebRTC it uses the WebSocket, a server error shows in its
status line and Start retries; its size list holds only what the gateway's cost budget admits.

Traffic stays on loopback: the web process offers 127.0.0.1 only, the browser may use loopback candidates
(``--allow-loopback-in-peer-connection``, mDNS hiding off), resolves no host name but 127.0.0.1, and its background
services (updates, sync, safe browsing) are off.  ``.ci/run`` installs ``chromium`` and ``chromium-driver``; the tests
skip only where they are not installed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid

import aiohttp
import av
import numpy as np
import pytest
from PIL import Image

import stagecast
from launcher.demo_checkpoint import DEMO_SERVING
from tests.web_cluster import web_cluster

pytestmark = pytest.mark.multiprocess

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
OTHER = "a blue bird flying over the ocean"
TIMEOUT = 180

if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(
        f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium"
        " chromium-driver (.ci/run does)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

BROWSER_FLAGS = [
    "--headless=new",
    "--no-sandbox",  # CI runs as root
    "--disable-dev-shm-usage",
    "--window-size=1100,800",
    "--allow-loopback-in-peer-connection",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    # Nothing leaves the machine: no name resolves except to loopback, no background traffic.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-domain-reliability",
    "--safebrowsing-disable-auto-update",
]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with web_cluster(tmp_path_factory.mktemp("ckpt")) as cluster:
        yield cluster


def _chromium(tmp_path, extra_flags=()):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*BROWSER_FLAGS, *extra_flags, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_script_timeout(30)
    return driver


@pytest.fixture
def browser(tmp_path):
    driver = _chromium(tmp_path)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "profile", ignore_errors=True)


UDP_NET = "10.231.88"  # the browser's network namespace (.2) and the web process's side of it (.1)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def browser_without_udp(system, tmp_path):
    """Chromium in a network namespace of its own, joined to this one by a veth pair: it reaches the page and the
    WebSocket over TCP (a second web process serves them on the veth address), but no UDP packet gets between it and
    the web process's WebRTC media address (loopback here, which that namespace cannot reach), as behind a network
    that carries only the page.  Needs root and iproute2; skips and says why elsewhere."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2 (`ip`)")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"sc-udp-{tag}", f"vhu{tag}", f"vnu{tag}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    driver = chromedriver = web = None
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{UDP_NET}.1/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{UDP_NET}.2/30", "dev", ns_if)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        args = ["web", "--gateway", system.gateway, "--host", f"{UDP_NET}.1", "--port", "0", "--ice-host", "127.0.0.1"]
        args.append("--allow-anonymous")  # the veth reaches only the test's own namespace
        web = system.launcher.spawn(f"web-{tag}", args)
        chromedriver = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                CHROMEDRIVER,
                "--port=9515",
                f"--allowed-ips={UDP_NET}.1",
                "--allowed-origins=*",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in chromedriver.stdout:  # it says when it listens
            if "started successfully" in line:
                break
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in [*BROWSER_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
            if flag.startswith("--host-resolver-rules="):  # the page's address is the veth's, not loopback
                flag += f", EXCLUDE {UDP_NET}.1"
            options.add_argument(flag)
        driver = webdriver.Remote(command_executor=f"http://{UDP_NET}.2:9515", options=options)
        driver.set_script_timeout(30)
        driver.page_url = web.info["url"]
        yield driver
    finally:
        if driver is not None:
            driver.quit()
        if chromedriver is not None:
            chromedriver.kill()
            chromedriver.wait(timeout=30)
        if web is not None:
            system.launcher.stop(web)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # takes the veth pair with it
        shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def until(driver, script: str, timeout: float = TIMEOUT):
    """Wait until the page's ``script`` (an expression over ``window.stagecast``) is truthy; returns its value."""
    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(
        lambda d: d.execute_script(f"return {script};"),
        message=lambda d: f"{script} never held; page events: {d.execute_script('return window.stagecast.events;')}",
    )


# The video element's current picture, drawn into a canvas: (H, W, 3) pixels the browser decoded.
PIXELS = """
const v = document.getElementById('video');
const c = document.createElement('canvas'); c.width = v.videoWidth; c.height = v.videoHeight;
const g = c.getContext('2d'); g.drawImage(v, 0, 0);
return Array.from(g.getImageData(0, 0, c.width, c.height).data);
"""


def decoded_picture(driver) -> np.ndarray:
    w, h = driver.execute_script("const v = document.getElementById('video'); return [v.videoWidth, v.videoHeight];")
    rgba = np.array(driver.execute_script(PIXELS), dtype=np.uint8).reshape(h, w, 4)
    return rgba[..., :3]


def run_page(driver, url: str, transport: str, shot) -> dict:
    driver.get(url)
    until(driver, "window.stagecast && window.stagecast.ready")
    driver.find_element(By.CSS_SELECTOR, f"input[name=transport][value={transport}]").click()
    driver.find_element(By.ID, "start").click()  # no seconds: streams until stopped
    until(driver, "window.stagecast.frames >= 8")
    # The browser decodes and plays the stream: the picture has the stream's size and advances.
    until(driver, "document.getElementById('video').videoWidth > 0")
    played = driver.execute_script("return document.getElementById('video').currentTime;")
    until(driver, f"document.getElementById('video').currentTime > {played}")
    picture = decoded_picture(driver)
    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(OTHER)
    driver.find_element(By.ID, "update").click()
    until(driver, f"window.stagecast.promptUpdates.includes({OTHER!r})")
    frames_before = driver.execute_script("return window.stagecast.frames;")
    until(driver, f"window.stagecast.frames >= {frames_before + 8}")  # still streaming after the switch
    until(driver, "document.getElementById('ttff').textContent.endsWith(' s')")
    png = driver.get_screenshot_as_png()
    shot.write_bytes(png)
    driver.find_element(By.ID, "stop").click()
    end = until(driver, "window.stagecast.ends.length && window.stagecast.ends[0]")
    state = driver.execute_script("return window.stagecast;")
    return {"picture": picture, "png": png, "end": end, "state": state}


def check_run(result: dict) -> None:
    picture = result["picture"]
    assert picture.shape == (DEMO_SERVING["height"], DEMO_SERVING["width"], 3)
    assert picture.std() > 5.0  # generated content, not a blank or black frame
    assert result["end"]["reason"] == "stopped"
    assert result["state"]["errors"] == []
    screenshot = np.asarray(Image.open(io.BytesIO(result["png"])).convert("RGB"))
    assert screenshot.shape[0] > 300 and screenshot.std() > 5.0


def test_the_page_plays_webrtc_frames_switches_the_prompt_and_is_screenshotted(system, browser, tmp_path):
    result = run_page(browser, system.url, "webrtc", tmp_path / "webrtc.png")
    check_run(result)
    assert result["state"]["transport"] == "webrtc"


def test_the_page_plays_the_websocket_fallback_through_media_source(system, browser, tmp_path):
    result = run_page(browser, system.url, "ws", tmp_path / "websocket.png")
    check_run(result)
    assert result["state"]["transport"] == "ws"


def test_the_fake_webcam_is_restyled_through_video_to_video_and_played(system, browser, tmp_path):
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready")
    browser.find_element(By.ID, "webcam").click()  # chromium's fake camera (--use-fake-device-for-media-stream)
    browser.find_element(By.ID, "steps").send_keys("2")
    browser.find_element(By.ID, "strength").send_keys("500")  # the demo's 2-step ladder is [1000, 500]
    browser.find_element(By.ID, "record-input").click()  # record the output and the webcam's own video
    browser.find_element(By.ID, "record").click()
    browser.find_element(By.ID, "start").click()
    started = until(browser, "window.stagecast.started")
    assert started["config"]["strength"] == 500 and "seconds" not in started["config"]
    until(browser, "window.stagecast.frames >= 8")
    until(browser, "document.getElementById('camera').videoWidth > 0")  # the local preview of what is sent
    until(browser, "document.getElementById('video').videoWidth > 0")
    played = browser.execute_script("return document.getElementById('video').currentTime;")
    until(browser, f"document.getElementById('video').currentTime > {played}")
    picture = decoded_picture(browser)
    (tmp_path / "webcam.png").write_bytes(browser.get_screenshot_as_png())
    browser.find_element(By.ID, "stop").click()
    end = until(browser, "window.stagecast.ends.length && window.stagecast.ends[0]")
    assert picture.shape == (DEMO_SERVING["height"], DEMO_SERVING["width"], 3) and picture.std() > 5.0
    assert end["reason"] == "stopped" and end["frames"] >= 8
    assert browser.execute_script("return window.stagecast.errors;") == []
    # The recording holds both videos, each a file PyAV opens, the sidecar naming the input's.
    saved = until(browser, "window.stagecast.recordings.length && window.stagecast.recordings[0]")
    files = {f["kind"]: f for f in saved["files"]}
    assert set(files) == {"output", "input", "sidecar"} and saved["sidecar"]["input_file"] == files["input"]["name"]
    for kind in ("output", "input"):
        path = tmp_path / files[kind]["name"]
        _saved(browser, files[kind]["url"], path)
        duration, frames = _duration_s(path)
        assert frames >= 2 and duration > 0.2, (kind, duration, frames)


def _status(driver) -> tuple[str, str]:
    return tuple(
        driver.execute_script("const s = document.getElementById('status'); return [s.textContent, s.className];")
    )


@pytest.mark.multiprocess
def test_with_udp_blocked_the_page_falls_back_to_the_websocket_by_itself(system, browser_without_udp):
    driver = browser_without_udp
    driver.get(driver.page_url)
    until(driver, "window.stagecast && window.stagecast.ready")
    assert driver.find_element(By.CSS_SELECTOR, "input[name=transport][value=webrtc]").is_selected()
    driver.find_element(By.ID, "start").click()  # WebRTC chosen; nothing else pressed
    until(driver, "window.stagecast.frames >= 4")
    state = driver.execute_script("return window.stagecast;")
    assert state["transport"] == "ws" and state["fallbacks"] == 1 and state["errors"] == []
    assert any(
        "did not connect within 5 s" in e["text"] and "using the WebSocket" in e["text"] for e in state["events"]
    )
    text, kind = _status(driver)
    assert text.startswith("streaming (ws)") and kind == ""  # it says which transport it uses
    driver.find_element(By.ID, "stop").click()
    assert until(driver, "window.stagecast.ends.length && window.stagecast.ends[0]")["reason"] == "stopped"


@pytest.mark.multiprocess
def test_a_server_error_shows_in_the_status_and_start_retries(system, browser):
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready")
    browser.find_element(By.CSS_SELECTOR, "input[name=transport][value=ws]").click()
    browser.find_element(By.ID, "steps").send_keys("60")  # over the 50 a stream may run: the gateway refuses
    browser.find_element(By.ID, "start").click()
    until(browser, "window.stagecast.errors.length")
    text, kind = _status(browser)
    assert kind == "error" and text.startswith("idle: INVALID_ARGUMENT: steps") and "press Start to retry" in text
    assert browser.find_element(By.ID, "stop").get_attribute("disabled")
    browser.find_element(By.ID, "steps").clear()
    browser.find_element(By.ID, "start").click()  # the retry path: the same page streams
    until(browser, "window.stagecast.frames >= 4")
    assert _status(browser)[1] == ""
    browser.find_element(By.ID, "stop").click()
    until(browser, "window.stagecast.ends.length")


@pytest.mark.multiprocess
def test_the_size_list_offers_only_sizes_the_gateways_budget_admits_and_no_hidden_camera_shows(system, browser):
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready && window.stagecast.budget")
    budget = browser.execute_script("return window.stagecast.budget;")
    with stagecast.Client(system.gateway) as client:
        expected = client.status().cost_budget
    assert budget["max_frame_pixels"] == expected.max_frame_pixels > 0
    passes = expected.default_passes
    fps = max(expected.default_fps, expected.min_fps)
    shipped = ["64x64", "256x256", "512x512", "832x480", "1280x704"]
    admitted = [
        s
        for s in shipped
        if (px := int(s.split("x")[0]) * int(s.split("x")[1])) <= expected.max_frame_pixels
        and px * fps * passes <= expected.max_stream_cost
    ]
    offered = browser.execute_script("return [...document.getElementById('size').options].map(o => o.value);")
    assert offered == ["", *admitted]
    assert "256x256" not in offered  # the demo checkpoint admits its own 64x64 only
    label = browser.execute_script("return document.getElementById('size').options[0].textContent;")
    assert label == f"default ({DEMO_SERVING['width']}×{DEMO_SERVING['height']})"
    # The camera preview is hidden while the webcam is off: no black box.
    box = browser.execute_script("return document.getElementById('camera').getBoundingClientRect().height;")
    assert box == 0


@pytest.mark.multiprocess
def test_a_browser_without_webrtc_streams_over_the_websocket_with_a_message(system, browser):
    browser.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument",
        {
            "source": "delete window.RTCPeerConnection; delete window.webkitRTCPeerConnection;"
            "window.scriptErrors = []; addEventListener('error', (e) => window.scriptErrors.push(String(e.message)));"
        },
    )
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready")
    assert browser.execute_script("return typeof RTCPeerConnection;") == "undefined"
    assert browser.find_element(By.CSS_SELECTOR, "input[name=transport][value=webrtc]").get_attribute("disabled")
    browser.find_element(By.ID, "start").click()
    until(browser, "window.stagecast.frames >= 4")
    state = browser.execute_script("return window.stagecast;")
    assert state["transport"] == "ws" and state["errors"] == []
    assert any("this browser has no WebRTC" in e["text"] for e in state["events"])
    assert browser.execute_script("return window.scriptErrors;") == []  # no script error on the way
    browser.find_element(By.ID, "stop").click()
    until(browser, "window.stagecast.ends.length")


# The page's own playout clock, fed frames of a 16 fps stream in chunks of 4 (the first frame alone, as a stream
# starts) at the times given: what it says at each second, and how long its player waited for each frame.
PLAYOUT = """
const [chunkMs, firstChunkMs, chunks, heldMs, lateMs] = arguments;
const s = window.stagecast; s.running = true; s.frames = 1; s.started = {config: {target_fps: 16}};
playout = newPlayout(16); windowFrames = [];
const t0 = 1e6, said = [], waited = [];
const say = (at) => { windowFrames = windowFrames.filter((f) => at - f.at < 1000); return lateReason(at); };
const arrive = (i, at) => {
  const w = playoutFrame(playout, i / 16, at);
  windowFrames.push({at, late: lateMs, held: heldMs, waited: w}); waited.push(w);
};
arrive(0, t0);
let next = 1000, at = t0;
for (let k = 1; k <= chunks; k++) {
  at = t0 + firstChunkMs + (k - 1) * chunkMs;
  while (t0 + next <= at) { said.push(say(t0 + next)); next += 1000; }  // once a second, as the page does
  for (let j = 4 * k - 3; j <= 4 * k; j++) arrive(j, at);
}
return {said, waited, after: say(at + 1500), started: playout.startAt !== null};
"""


def _playout(driver, chunk_ms, first_chunk_ms, chunks=16, held_ms=2, late_ms=5) -> dict:
    return driver.execute_script(PLAYOUT, chunk_ms, first_chunk_ms, chunks, held_ms, late_ms)


@pytest.mark.multiprocess
def test_the_page_judges_lateness_on_its_playout_clock_once_its_buffer_is_full(system, browser):
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready")
    # A stream's start: the first frame alone, the next chunk a chunk later (and a slow first one, 400 ms): frames
    # late by the first frame's clock (the server's late_ms) but not on a player's, which fills its buffer first.
    for first_ms in (250, 400):
        start = _playout(browser, 250, first_ms, late_ms=180)
        assert start["said"] == [""] * len(start["said"]) and start["started"], start
        assert start["waited"][:5] == [None] * 5 and set(start["waited"][8:]) == {0}, start["waited"]
    # A server at half the real-time rate: the player waits for every chunk, 250 ms of each 500.
    half = _playout(browser, 500, 500, late_ms=400)
    assert all(r.startswith("frames arrive late: playback waited 500 ms in the last second") for r in half["said"][2:])
    assert "fewer than 16 fps" in half["said"][-1], half["said"]
    encoder = _playout(browser, 500, 500, held_ms=250, late_ms=400)  # late frames held in the web process
    assert encoder["said"][-1] == "frames wait 250 ms in the web process's encoder (CPU)", encoder["said"]
    stalled = _playout(browser, 250, 250, chunks=3)  # then nothing more comes
    assert stalled["after"].startswith("no frames this second: the server is behind"), stalled
    # A real stream: the first frames fill the buffer (not judged), the rest are judged on its clock.
    browser.execute_script("window.stagecast.running = false;")
    browser.find_element(By.ID, "seconds").send_keys("2")
    browser.find_element(By.ID, "start").click()
    until(browser, "window.stagecast.ends.length")
    state = browser.execute_script("return {p: playout, s: window.stagecast};")
    assert state["p"]["startAt"] is not None and state["p"]["firstPts"] == 0, state["p"]
    assert state["s"]["errors"] == [] and state["s"]["ends"][0]["reason"] == "completed"


@pytest.mark.multiprocess
def test_a_lost_gateway_is_said_in_plain_words_and_the_stats_are_reset(system, browser):
    """The gateway dies under a running stream (SIGKILL): the page says the connection was lost, not gRPC's raw
    text (that goes to its event log), and shows no stats of the dead stream."""
    tag = uuid.uuid4().hex[:6]
    args = ["gateway", "--coordinator", system.coordinator, "--checkpoint", system.checkpoint, "--port", "0"]
    gateway = system.launcher.spawn(f"gateway-{tag}", args)
    args = ["web", "--gateway", gateway.info["address"], "--port", "0", "--ice-host", "127.0.0.1"]
    web = system.launcher.spawn(f"web-{tag}", args)
    try:
        browser.get(web.info["url"])
        until(browser, "window.stagecast && window.stagecast.ready")
        browser.find_element(By.CSS_SELECTOR, "input[name=transport][value=ws]").click()
        browser.find_element(By.ID, "start").click()  # until stopped
        until(browser, "window.stagecast.frames >= 8")
        until(browser, "document.getElementById('fps').textContent !== '–'")
        assert browser.find_element(By.ID, "ttff").text.endswith(" s")
        gateway.proc.kill()
        gateway.proc.wait(timeout=30)
        error = until(browser, "window.stagecast.errors.length && window.stagecast.errors[0]")
        text, kind = _status(browser)
        stats = [browser.find_element(By.ID, i).text for i in ("ttff", "fps", "ontime", "frames")]
        events = browser.execute_script("return window.stagecast.events;")
    finally:
        system.launcher.stop(web)
        system.launcher.stop(gateway)
    print(f"the gateway's loss reached the page as {error}; the status line: {text!r}")
    assert error["code"] in ("UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL"), error
    assert kind == "error" and text.startswith("idle: the connection to the gateway was lost"), text
    assert "Stream removed" not in text and "Socket closed" not in text and "press Start to retry" in text
    assert stats == ["–", "–", "–", "0"], stats
    assert {"kind": "grpc", "text": f"{error['code']}: {error['message']}"} in events  # gRPC's words, for the log
    assert browser.find_element(By.ID, "late-reason").get_attribute("hidden")


@pytest.mark.multiprocess
def test_a_default_size_the_budget_refuses_is_not_offered_and_the_size_offered_streams(system, browser):
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready && window.stagecast.budget")
    # The demo gateway admits its own 64x64 only; were its default 256x256, "default" would be refused: not offered.
    offered = browser.execute_script(
        "budget = {...window.stagecast.budget, default_width: 256, default_height: 256}; offerSizes();"
        "const s = document.getElementById('size'); return [[...s.options].map((o) => o.value), s.value];"
    )
    assert offered == [["64x64"], "64x64"], offered
    browser.find_element(By.CSS_SELECTOR, "input[name=transport][value=ws]").click()
    browser.find_element(By.ID, "seconds").send_keys("1")
    browser.find_element(By.ID, "start").click()
    end = until(browser, "window.stagecast.ends.length && window.stagecast.ends[0]")
    state = browser.execute_script("return window.stagecast;")
    assert end["reason"] == "completed" and state["errors"] == [], state["events"]
    assert (state["started"]["config"]["width"], state["started"]["config"]["height"]) == (64, 64)
    # At steps the budget admits no size for, the list says so instead of offering one the server refuses.
    none = browser.execute_script(
        "budget = {...window.stagecast.budget, max_stream_cost: 1}; offerSizes();"
        "return [...document.getElementById('size').options].map((o) => o.textContent);"
    )
    assert none == ["none fits the server's budget at these steps (fewer steps)"], none


# ---- the page's own handshake past the pre-auth pool (issue 50) ---------------------------------------------------

ALICE = "alice-token-0123456789abcdef"
SQUAT_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # three peers of their own: any 127/8 address is local
SQUATS_PER_ADDRESS = 8  # the edge's --max-preauth-per-address: 24 sockets for its 16 places (--max-preauth)


class Squatters:
    """Tokenless WebSockets held open from several loopback addresses, each reopened as soon as the edge closes it
    (it does 1 s after opening, or when a newcomer evicts it): threads with raw sockets, so each can bind its own
    source address.  Counts the handshakes answered 101 (a place in the pre-auth pool) and refused (503)."""

    def __init__(self, host: str, port: int, addresses, per_address: int):
        self.target = (host, port)
        self.stop = threading.Event()
        self.upgraded = self.refused = 0
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._squat, args=(address,), daemon=True)
            for address in addresses
            for _ in range(per_address)
        ]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _squat(self, address: str) -> None:
        request = (
            f"GET /api/ws HTTP/1.1\r\nHost: {self.target[0]}:{self.target[1]}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n\r\n"
        ).encode()
        while not self.stop.is_set():
            with socket.socket() as s:
                s.settimeout(0.5)
                s.bind((address, 0))
                try:
                    s.connect(self.target)
                    s.sendall(request)
                    head = b""
                    while b"\r\n" not in head and not self.stop.is_set():
                        try:
                            data = s.recv(4096)
                        except TimeoutError:
                            continue
                        if not data:
                            break
                        head += data
                    with self.lock:
                        if head.startswith(b"HTTP/1.1 101"):
                            self.upgraded += 1
                        else:
                            self.refused += 1
                    while not self.stop.is_set():  # hold it until the edge closes it
                        try:
                            if not s.recv(4096):
                                break
                        except TimeoutError:
                            continue
                except OSError:
                    pass


def _health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(urllib.parse.urljoin(url, "healthz"), timeout=10).read())


@pytest.fixture
def token_web(system, tmp_path):
    """A second web edge in front of the same gateway, asking for tokens."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALICE} alice\n")
    args = ["web", "--gateway", system.gateway, "--port", "0", "--ice-host", "127.0.0.1", "--tokens", str(tokens)]
    child = system.launcher.spawn(f"web-tokens-{uuid.uuid4().hex[:6]}", args)
    try:
        yield child.info["url"]
    finally:
        system.launcher.stop(child)


def _first_message_stream(url: str, address: str, token: str) -> list[dict]:
    """A client that cannot set the subprotocol: a WebSocket from ``address`` with its token in its first message,
    through a 1 s stream; the messages it got."""

    async def scenario():
        ws_url = urllib.parse.urljoin(url.replace("http", "ws", 1), "api/ws")
        connector = aiohttp.TCPConnector(local_addr=(address, 0))
        async with aiohttp.ClientSession(connector=connector) as http, http.ws_connect(ws_url) as ws:
            await ws.send_str(json.dumps({"type": "config", "prompt": "a fox", "seconds": 1, "token": token}))
            seen = []
            async for raw in ws:
                if raw.type == aiohttp.WSMsgType.TEXT:
                    seen.append(json.loads(raw.data))
                    if seen[-1]["type"] in ("end", "error"):
                        break
            return seen

    return asyncio.run(scenario())


@pytest.mark.multiprocess
def test_24_tokenless_sockets_from_3_addresses_do_not_stop_a_tenant_streaming_through_the_page(token_web, browser):
    host, port = urllib.parse.urlsplit(token_web).hostname, urllib.parse.urlsplit(token_web).port
    with Squatters(host, port, SQUAT_ADDRESSES, SQUATS_PER_ADDRESS) as squat:
        # The pool is full of them (16 places), and the rest of the 24 are refused or evict each other.
        deadline = time.monotonic() + 60
        while _health(token_web)["preauth"] < 16:
            assert time.monotonic() < deadline, f"the squatters never filled the pre-auth pool: {_health(token_web)}"
            time.sleep(0.05)
        browser.get(f"{token_web}#token={ALICE}")
        until(browser, "window.stagecast && window.stagecast.ready")
        browser.find_element(By.CSS_SELECTOR, "input[name=transport][value=ws]").click()
        browser.find_element(By.ID, "seconds").send_keys("1")
        browser.find_element(By.ID, "start").click()
        end = until(browser, "window.stagecast.ends.length && window.stagecast.ends[0]")
        state = browser.execute_script("return window.stagecast;")
        during = _health(token_web)
        # A client that can only send its token in its first message shares the pool; from an address below its
        # fair share, it evicts the oldest socket of the address holding the most, and streams.
        late = _first_message_stream(token_web, "127.0.0.5", ALICE)
        after = _health(token_web)
    assert end == {"type": "end", "reason": "completed", "frames": 16}, state["events"]
    assert state["errors"] == [] and state["transport"] == "ws" and state["tokenInHeader"] is True
    assert squat.upgraded >= 24 and during["preauth"] >= 8, (squat.upgraded, during)  # the squatting went on
    assert late[0]["type"] == "started" and late[-1] == {"type": "end", "reason": "completed", "frames": 16}, late
    # The page and the late client were the only peers, the page's token in its handshake, past the pool.
    assert after["ws"] == 2 and after["ws_token_in_header"] == 1 and after["evicted"] >= 1, after


# ---- recording on the page (issue 51) -------------------------------------------------------------------------------

READ_BLOB = """
const done = arguments[arguments.length - 1];
window.stagecastFiles.get(arguments[0]).arrayBuffer().then((buf) => {
  let s = ""; const bytes = new Uint8Array(buf);
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  done(btoa(s));
}).catch((e) => done("error: " + e));
"""


def _saved(driver, url: str, path) -> None:
    data = driver.execute_async_script(READ_BLOB, url)
    assert not data.startswith("error"), data
    path.write_bytes(base64.b64decode(data))


def _duration_s(path) -> tuple[float, int]:
    """A recording's duration as PyAV reads it (from its frames' times: MediaRecorder's WebM has no duration in
    its header) and its frame count."""
    with av.open(str(path)) as container:
        times = [float(f.time) for f in container.decode(video=0) if f.time is not None]
    assert len(times) >= 2, f"{path} holds {len(times)} frames"
    step = float(np.median(np.diff(sorted(times))))
    return max(times) - min(times) + step, len(times)


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["webrtc", "ws"])
def test_the_page_records_a_stream_with_a_prompt_switch_into_a_file_and_a_sidecar(system, browser, tmp_path, transport):
    seconds = 3
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready")
    browser.find_element(By.CSS_SELECTOR, f"input[name=transport][value={transport}]").click()
    browser.find_element(By.ID, "seconds").send_keys(str(seconds))
    browser.find_element(By.ID, "record").click()  # armed: it starts at the stream's first shown frame
    assert browser.find_element(By.ID, "record").text.startswith("Record (armed")
    browser.find_element(By.ID, "start").click()
    until(browser, "window.stagecast.recording && !window.stagecast.recording.armed")
    until(browser, "window.stagecast.frames >= 12 && window.stagecast.recording.shown >= 4")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(OTHER)
    browser.find_element(By.ID, "update").click()
    until(browser, f"window.stagecast.promptUpdates.includes({OTHER!r})")
    told_s = browser.execute_script("return window.stagecast.lastPts;")  # told of the switch by this frame
    end = until(browser, "window.stagecast.ends.length && window.stagecast.ends[0]")
    saved = until(browser, "window.stagecast.recordings.length && window.stagecast.recordings[0]")
    state = browser.execute_script("return window.stagecast;")
    assert end["reason"] == "completed" and state["errors"] == [], state["events"]
    assert state["recording"] is None and browser.find_element(By.ID, "record").text == "Record"
    kinds = {f["kind"]: f for f in saved["files"]}
    assert set(kinds) == {"output", "sidecar"}
    video = kinds["output"]
    ext = "mp4" if video["type"].startswith("video/mp4") else "webm"
    assert video["type"].startswith(("video/mp4", "video/webm")) and video["name"].endswith(f".{ext}")
    # The page lists them as downloads, named alike.
    links = [a.get_attribute("download") for a in browser.find_elements(By.CSS_SELECTOR, "#recordings a")]
    assert links == [video["name"], kinds["sidecar"]["name"]]
    path = tmp_path / video["name"]
    _saved(browser, video["url"], path)
    duration, frames = _duration_s(path)
    config = state["started"]["config"]
    fps = config["target_fps"]
    chunk_s = config.get("chunk_frames", 1) * 4 / fps  # one latent frame is 4 video frames
    sidecar = saved["sidecar"]
    stream_s = seconds - sidecar["first_pts_s"]  # the stream from its first picture recorded
    print(
        f"{transport}: {video['type']} recording of {duration:.3f} s, {frames} frames ({sidecar['frames']} drawn); "
        f"the {seconds} s stream from pts {sidecar['first_pts_s']} is {stream_s:.3f} s; the screen showed "
        f"{sidecar['shown_frames']} pictures over {sidecar['shown_s']} s; {sidecar['pauses']} stalls left out, "
        f"{sidecar['paused_s']} s of {sidecar['wall_s']} s"
    )
    # The file plays the stream at its rate: its duration is the stream's, from its first picture recorded, within
    # one chunk either way, however late the pictures reached the screen (the stalls are left out: paused_s).
    assert abs(duration - stream_s) <= chunk_s, (duration, stream_s, chunk_s, sidecar)
    assert abs(duration - sidecar["duration_s"]) <= chunk_s, (duration, sidecar)
    # What was left out adds up: the recording's clock plus the stalls is the wall clock from the first picture, and
    # the screen took at least the file's span to show it (a loaded browser's compositor skips some pictures: 34 of
    # 48 seen, so at least half of the stream's).
    assert sidecar["paused_s"] >= 0 and (sidecar["pauses"] > 0 or sidecar["paused_s"] == 0), sidecar
    assert abs(sidecar["duration_s"] + sidecar["paused_s"] - sidecar["wall_s"]) <= 0.01, sidecar
    assert sidecar["shown_s"] >= duration - chunk_s, (duration, sidecar)
    assert sidecar["shown_frames"] >= 0.5 * stream_s * fps and sidecar["frames"] >= 0.5 * stream_s * fps, sidecar
    # The sidecar: the stream, its first prompt, and the switch at its time on the recording's clock.
    assert sidecar["file"] == video["name"] and sidecar["stream_id"] == state["started"]["stream_id"]
    assert sidecar["prompt"] == config["prompt"]
    (switch,) = sidecar["prompt_switches"]
    assert switch["prompt"] == OTHER and 0 < switch["at_s"] < duration
    # Told of the switch after at least 4 pictures were shown since the recording started, and before the frame of
    # pts told_s was told of: the picture on the screen then is between the two, and the switch's time in the file
    # is that picture's from the first recorded (within a frame: the MSE player's clock is read a moment later).
    since_first = switch["stream_s"] - sidecar["first_pts_s"]
    assert 3 / fps <= since_first and switch["stream_s"] <= told_s + 1 / fps, (switch, sidecar["first_pts_s"], told_s)
    assert abs(switch["at_s"] - since_first) <= 1 / fps + 0.002, (switch, sidecar)
    side_path = tmp_path / kinds["sidecar"]["name"]
    _saved(browser, kinds["sidecar"]["url"], side_path)
    assert json.loads(side_path.read_text()) == sidecar

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

import io
import os
import shutil
import subprocess
import uuid

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


@pytest.mark.multiprocess
def test_the_page_says_why_frames_are_late(system, browser):
    browser.get(system.url)
    until(browser, "window.stagecast && window.stagecast.ready")
    # The page's own reasoning over the frame stats it keeps (late_ms from the server, held_ms in the web process).
    reason = """
      const s = window.stagecast; s.running = true; s.frames = 3; s.started = {config: {target_fps: 16}};
      const now = performance.now();
      windowFrames = arguments[0].map((f) => ({at: now, late: f[0], held: f[1]}));
      return lateReason(arguments[1], arguments[2]);
    """
    behind = browser.execute_script(reason, [[400, 2], [420, 3]], 2, 0.0)
    assert behind.startswith("frames arrive 410 ms late: the server makes fewer than 16 fps"), behind
    encoder = browser.execute_script(reason, [[300, 250], [300, 250]], 2, 0.0)
    assert encoder == "frames wait 250 ms in the web process's encoder (CPU)"
    assert browser.execute_script(reason, [], 0, None).startswith("no frames this second: the server is behind")
    assert browser.execute_script(reason, [[5, 1], [6, 1]], 2, 1.0) == ""  # on time: nothing to explain

"""``stagecast demo`` is one command that works: checkpoint, processes, real gRPC API, an MP4 with the right frames,
and no process left behind."""

import os
import subprocess
import sys

import pytest

from launcher.demo_checkpoint import DEMO_SERVING, write_demo_checkpoint
from stagecast.media import read_mp4_frames

pytestmark = pytest.mark.multiprocess


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (the demo's stages and gateway name its cache dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it exited while we looked
        if text in cmdline:
            found.append(cmdline)
    return found


def test_demo_writes_a_one_second_mp4_and_stops_every_process(tmp_path):
    out = tmp_path / "demo.mp4"
    env = {**os.environ, "STAGECAST_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "demo", "--seconds", "1", "--out", str(out), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log
    assert "TTFF" in log and "FPS" in log, log
    assert "live page: http://127.0.0.1:" in log, log  # the browser page's URL
    # ... with how long it lives: without --serve it goes with the demo, and the demo says how to keep it
    assert "(while the clip streams (--serve keeps it up after))" in log and "stagecast demo --serve" in log, log
    assert f"a {DEMO_SERVING['width']}x{DEMO_SERVING['height']}, 1 s clip" in log, log
    frames = read_mp4_frames(out)
    # 1 s at the demo's 16 fps is exactly 16 frames, at the demo checkpoint's default size.
    assert len(frames) == 16
    assert frames[0].shape == (DEMO_SERVING["height"], DEMO_SERVING["width"], 3)
    assert _processes_mentioning(str(tmp_path / "cache")) == []  # no stage or gateway outlived the demo
    assert (tmp_path / "cache" / "demo" / "vae" / "config.json").exists()


def test_demo_checkpoint_completes_a_folder_written_before_it_had_a_vae(tmp_path):
    root = write_demo_checkpoint(tmp_path / "ckpt")
    for part in ("transformer", "text_encoder", "tokenizer", "vae"):
        assert (root / part).is_dir()
    assert (root / "stagecast.json").exists()
    vae_config = (root / "vae" / "config.json").read_text()
    subprocess.run(["rm", "-r", str(root / "vae")], check=True)
    write_demo_checkpoint(root)
    assert (root / "vae" / "config.json").read_text() == vae_config

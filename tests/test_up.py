"""``stagecast up`` starts coordinator, stages and gateway; SIGTERM stops all of them, leaving no orphans."""

import os
import shutil
import signal
import tempfile
from pathlib import Path

import stagecast
from launcher.demo_checkpoint import write_demo_checkpoint, write_transformer
from launcher.process import Launcher
from stagecast.internal.v1 import pipeline_pb2 as pb
from tests.pipeline_helpers import coordinator_stub, run_stream, tiny_spec


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            kids = (task / "children").read_text().split() if (task / "children").exists() else []
            out += [int(k) for k in kids]
            todo += [int(k) for k in kids]
    return out


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_and_sigterm_stops_every_process():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--port", "0", "--gateway-port", "0"]
        up = launcher.spawn("up", [*args, "--vae-devices", "cpu,cpu"])  # the gateway's VAE cut in two parts
        channel, stub = coordinator_stub(up.info["coordinator"])
        assert stub.Status(pb.Empty()).ready
        chunks, reason = run_stream(stub, tiny_spec(num_chunks=2))
        assert reason == "completed" and len(chunks) == 2
        channel.close()
        with stagecast.Client(up.info["gateway"]) as client:
            frames = client.generate(prompt="a red fox", seconds=0.5, codec="raw").collect()
        assert len(frames) == 8
        children = descendants(up.pid)
        assert len(children) >= 4  # coordinator + 2 stages + gateway
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        assert not [pid for pid in children if alive(pid)]


def test_up_serves_a_checkpoint_whose_transformer_has_original_wan_keys_and_config(tmp_path):
    """Stages and gateway read the same config: a Wan-AI ``WanModel`` config.json (``dim``, ``num_heads``, no
    ``in_channels``) with original key names starts the whole system and streams."""
    root = write_demo_checkpoint(tmp_path / "ckpt")
    shutil.rmtree(root / "transformer")
    write_transformer(root / "transformer", seed=0, layout="original")
    config = (root / "transformer" / "config.json").read_text()
    assert '"dim"' in config and "in_channels" not in config
    with Launcher() as launcher:
        args = ["up", "--checkpoint", str(root), "--stages", "2", "--port", "0", "--gateway-port", "0"]
        up = launcher.spawn("up", args)
        with stagecast.Client(up.info["gateway"]) as client:
            frames = client.generate(prompt="a red fox", seconds=0.5, codec="raw").collect()
        assert len(frames) == 8

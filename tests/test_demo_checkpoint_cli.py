"""``stagecast demo-checkpoint`` (the Helm CPU values' initContainer) writes a complete, loadable folder."""

import json
import subprocess
import sys

import pytest

from stage_service.checkpoint import load_slice_state_dict
from stagecast.model.config import read_config

pytestmark = pytest.mark.multiprocess


def test_demo_checkpoint_command_writes_every_component(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "demo-checkpoint", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        assert (out / sub).is_dir(), sub
    cfg = read_config(out / "transformer")
    _, sd = load_slice_state_dict(out / "transformer", layers=range(cfg["num_layers"]), first=True, last=True)
    assert any(k.startswith("blocks.") for k in sd)
    assert json.loads((out / "vae" / "config.json").read_text())["z_dim"] == cfg["in_channels"]

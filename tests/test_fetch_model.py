"""The chart's model Job (``python -m launcher.fetch_model fill``) fills a volume once and atomically, and its pods'
initContainer (``wait``) waits for the marker it writes last.  Offline: the copy path (downloads are
huggingface_hub's)."""

from __future__ import annotations

import threading

import pytest

from launcher.fetch_model import READY, build_parser, fill, main, wait


def _seed(tmp_path):
    seed = tmp_path / "seed" / "wan"
    (seed / "vae").mkdir(parents=True)
    (seed / "vae" / "config.json").write_text("{}")
    (seed / "model_index.json").write_text("{}")
    return seed


@pytest.mark.unit
def test_a_copy_fills_the_folder_and_marks_it_ready_last(tmp_path):
    seed = _seed(tmp_path)
    out = tmp_path / "models" / "wan"
    out.parent.mkdir()
    assert main(["fill", "--out", str(out), "--copy-from", str(seed)]) == 0
    assert (out / "vae" / "config.json").read_text() == "{}" and (out / READY).is_file()
    assert not (out.parent / "wan.partial").exists()


@pytest.mark.unit
def test_a_filled_volume_is_left_alone_so_the_job_can_run_again(tmp_path):
    seed = _seed(tmp_path)
    out = tmp_path / "wan"
    args = build_parser().parse_args(["fill", "--out", str(out), "--copy-from", str(seed)])
    fill(args)
    (out / "vae" / "config.json").write_text("kept")
    fill(args)  # a second run (helm upgrade) does not copy again
    assert (out / "vae" / "config.json").read_text() == "kept"


@pytest.mark.unit
def test_an_unfinished_earlier_fill_is_refused_and_a_stale_partial_is_redone(tmp_path, capsys):
    seed = _seed(tmp_path)
    out = tmp_path / "wan"
    (tmp_path / "wan.partial" / "junk").mkdir(parents=True)  # a Job killed mid-copy
    assert main(["fill", "--out", str(out), "--copy-from", str(seed)]) == 0
    assert not (out / "junk").exists()
    half = tmp_path / "half"
    half.mkdir()
    assert main(["fill", "--out", str(half), "--copy-from", str(seed)]) == 2
    assert f"--out {half}: exists without {READY}" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "exactly one of --repo (Hugging Face) and --copy-from"),
        (["--repo", "a/b", "--copy-from", "."], "exactly one of --repo"),
        (["--repo", "not a repo"], "--repo 'not a repo': a Hugging Face repository id"),
        (["--repo", "a/b", "--convert-repo", "c/d"], "--convert-repo, --convert-file and --convert-source go together"),
        (
            ["--repo", "a/b", "--convert-repo", "c/d", "--convert-file", "../x.pt", "--convert-source", "causvid"],
            "--convert-file '../x.pt': a file path inside --convert-repo",
        ),
        (["--copy-from", "/nonexistent/stagecast"], "--copy-from /nonexistent/stagecast: not a folder"),
        (["--repo", "a/b", "--tiny-decoder-repo", "c/d"], "--tiny-decoder-repo and --tiny-decoder-file go together"),
        (
            ["--repo", "a/b", "--tiny-decoder-repo", "c/d", "--tiny-decoder-file", "taew2_1.txt"],
            "--tiny-decoder-file 'taew2_1.txt': a .pth or .safetensors path",
        ),
    ],
)
def test_bad_fill_arguments_exit_2_naming_the_flag(tmp_path, capsys, argv, message):
    assert main(["fill", "--out", str(tmp_path / "m"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.unit
def test_wait_returns_when_the_marker_appears_and_gives_up_after_its_timeout(tmp_path, capsys):
    out = tmp_path / "wan"
    out.mkdir()
    assert wait(out, timeout=0.05, poll=0.01) is False
    assert main(["wait", "--out", str(out), "--timeout", "0.05"]) == 1
    assert "is not complete after 0.05 s" in capsys.readouterr().err
    written = threading.Event()

    def write():
        (out / READY).write_text("complete\n")
        written.set()

    threading.Thread(target=write).start()
    assert written.wait(10)
    assert wait(out, timeout=10, poll=0.01) is True
    assert main(["wait", "--out", str(out), "--timeout", "0"]) == 2


@pytest.mark.unit
def test_a_fill_places_the_tiny_decoder_as_the_checkpoints_tiny_decoder_folder(tmp_path, monkeypatch):
    import huggingface_hub

    from gateway.checkpoint import tiny_decoder_file

    asked = []

    def fake_download(repo, filename, local_dir, **_):  # huggingface_hub's call, offline
        asked.append((repo, filename))
        path = tmp_path / "hub" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"weights")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    out = tmp_path / "models" / "wan"
    out.parent.mkdir()
    argv = ["fill", "--out", str(out), "--copy-from", str(_seed(tmp_path))]
    assert main([*argv, "--tiny-decoder-repo", "madebyollin/taehv", "--tiny-decoder-file", "taew2_1.pth"]) == 0
    assert asked == [("madebyollin/taehv", "taew2_1.pth")]
    placed = out / "tiny_decoder" / "taew2_1.pth"
    assert placed.read_bytes() == b"weights" and (out / READY).is_file()
    assert tiny_decoder_file(out) == placed  # the file the gateway serves DECODER_TINY from


@pytest.mark.multiprocess
def test_a_fill_that_cannot_reach_the_hub_is_one_line_naming_copy_from(tmp_path):
    """A real download against a Hub endpoint where nothing listens: one error line, no traceback, exit 2."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2", "HF_TOKEN": ""}
    done = subprocess.run(
        [sys.executable, "-m", "launcher.fetch_model", "fill", "--out", str(tmp_path / "m"), "--repo", "a/b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--repo a/b" in errors[0] and "model.fill.copyFrom" in errors[0], done.stderr
    assert not (tmp_path / "m").exists()

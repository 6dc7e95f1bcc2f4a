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

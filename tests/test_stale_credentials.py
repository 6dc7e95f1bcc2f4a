"""The throwaway credentials of a launcher killed with SIGKILL do not stay behind: each folder names its owner
(``owner.json``), and ``stagecast up`` deletes at start the folders whose owner is dead (``launcher.process``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launcher.process import CREDENTIALS_PREFIX, OWNER_FILE, Launcher, remove_stale_credentials
from tests.cli_run import run_cli


def _pid_max() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text())  # pids are below it: never a live process


def _folder(tmp: Path, name: str, owner: dict | None) -> Path:
    folder = tmp / f"{CREDENTIALS_PREFIX}{name}"
    folder.mkdir(mode=0o700)
    (folder / "ca.crt").write_text("x")
    if owner is not None:
        (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


@pytest.mark.unit
def test_only_folders_whose_owner_is_known_and_dead_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    launcher = Launcher()
    live = Path(launcher.credentials)  # this process's, with its owner file
    me = json.loads((live / OWNER_FILE).read_text())
    assert me["pid"] == os.getpid() and me["start"] and me["pidns"]
    dead = _folder(tmp_path, "dead", {**me, "pid": _pid_max()})
    reused = _folder(tmp_path, "reused", {**me, "start": "1"})  # our pid, another process's start: the pid was reused
    foreign = _folder(tmp_path, "foreign", {**me, "pid": _pid_max(), "pidns": "pid:[1]"})  # another pid namespace
    unowned = _folder(tmp_path, "unowned", None)  # made before owner files, or by something else
    garbled = _folder(tmp_path, "garbled", None)
    (garbled / OWNER_FILE).write_text("{not json")
    other = tmp_path / "unrelated"
    other.mkdir()

    assert remove_stale_credentials() == [dead, reused]
    assert [p.exists() for p in (live, dead, reused, foreign, unowned, garbled, other)] == [
        True,
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    launcher.__exit__(None, None, None)  # a launcher that exits deletes its own folder, as before
    assert not live.exists()


@pytest.mark.unit
def test_up_removes_a_dead_runs_folder_first_whatever_it_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = _folder(tmp_path, "stale", {"pid": _pid_max(), "start": "1", "pidns": os.readlink("/proc/self/ns/pid")})
    result = run_cli("up", "--checkpoint", str(tmp_path), "--stage-hang-s", "0")  # refused at once, nothing started
    assert result.returncode == 2 and "--stage-hang-s" in result.stderr
    assert not stale.exists() and f"removed {stale}" in result.stderr


@pytest.mark.multiprocess
def test_the_folder_of_a_launcher_killed_with_sigkill_is_found_and_removed(tmp_path):
    code = "from launcher.process import Launcher; print(Launcher().credentials, flush=True); input()"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        folder = Path(proc.stdout.readline().decode().strip())
        assert folder.parent == tmp_path and (folder / "ca.crt").exists()
        assert remove_stale_credentials(tmp_path) == []  # its launcher lives: kept
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        assert folder.exists()  # SIGKILL: nothing could delete it
        assert remove_stale_credentials(tmp_path) == [folder]
        assert not folder.exists()
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdin.close()
        proc.stdout.close()

"""Start-up progress in one process: the steps a service prints and keeps (``stagecast.startup``), how a launcher shows
them (``launcher.startup_view``), what the calibration reports as it goes, and what ``up`` says once it is up."""

from __future__ import annotations

import argparse
import io

import pytest

from launcher.startup_view import StartupView
from launcher.up import summary
from stage_service.calibration import calibrate
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.startup import STARTUP_PREFIX, Startup, StartupStep, parse_line
from stagecast.v1 import stream_pb2 as pb
from tests.test_calibration import SHAPE, make_slice

pytestmark = pytest.mark.unit


def test_a_step_is_one_line_that_reads_back_as_the_same_step():
    step = StartupStep("calibration", 2, 4, 3.125, "at 64x64")
    line = step.line()
    assert line == f"{STARTUP_PREFIX} calibration 2/4 3.12s at 64x64"
    assert parse_line(line) == StartupStep("calibration", 2, 4, 3.12, "at 64x64")
    assert parse_line(f"{STARTUP_PREFIX} weights 1/1 0.50s") == StartupStep("weights", 1, 1, 0.5, "")
    for other in ("INFO stage 0 loaded", f"{STARTUP_PREFIX} weights", f"{STARTUP_PREFIX} weights x/1 0.5s"):
        assert parse_line(other) is None


def test_startup_keeps_each_step_once_with_its_latest_count_and_reports_every_step(capsys):
    clock = iter([0.5, 1.0, 2.0, 3.5]).__next__
    reports = []
    startup = Startup("stage 1", report=lambda s: reports.append(s.to_proto(ipb.StartupProgress, index=1)), clock=clock)
    startup.step("weights", detail="layers 2:4")
    startup.step("calibration", 1, 2)
    startup.step("calibration", 2, 2)
    assert not startup.is_ready
    startup.ready()
    printed = capsys.readouterr().out.splitlines()
    assert [parse_line(line).name for line in printed] == ["weights", "calibration", "calibration", "ready"]
    last = reports[-1]
    assert len(reports) == 4 and last.index == 1 and last.process == "stage 1"
    assert [(s.name, s.done, s.total, s.at_s) for s in last.steps] == [
        ("weights", 1, 1, 0.5),
        ("calibration", 2, 2, 2.0),
        ("ready", 1, 1, 3.5),
    ]
    assert last.ready and last.ready_s == 3.5
    public = startup.to_proto(pb.StartupProgress)  # the public message has the same fields
    assert public.ready and [s.name for s in public.steps] == ["weights", "calibration", "ready"]


def test_a_launcher_not_on_a_terminal_prints_every_step_and_the_ready_time():
    out = io.StringIO()
    view = StartupView(out)
    assert not view.tty
    view.step("stage-0", StartupStep("weights", 1, 1, 0.41, "layers 0:2"))
    view.step("stage-0", StartupStep("calibration", 1, 2, 1.0))
    view.step("stage-0", StartupStep("calibration", 2, 2, 1.5))
    view.step("stage-0", StartupStep("ready", 1, 1, 1.6))  # said by its READY line
    view.ready("stage-0", 1.6)
    assert out.getvalue().splitlines() == [
        "[stage-0] start-up: weights at 0.41 s (layers 0:2)",
        "[stage-0] start-up: calibration 1/2 at 1.00 s",
        "[stage-0] start-up: calibration 2/2 at 1.50 s",
        "[stage-0] READY in 1.60 s",
    ]


def test_on_a_terminal_a_counted_step_is_a_bar_that_fills():
    out = io.StringIO()
    view = StartupView(out, tty=True)
    view.step("stage-0", StartupStep("graphs", 1, 4, 2.0))
    assert ("stage-0", "graphs") in view._bars and "[stage-0] graphs" in out.getvalue()
    view.step("stage-0", StartupStep("graphs", 4, 4, 3.0))
    assert not view._bars  # full: closed
    assert "4/4" in out.getvalue() and "start-up: graphs" not in out.getvalue()


def test_the_calibration_reports_each_batch_size_as_it_is_timed():
    seen = []
    cal = calibrate(
        make_slice(True, True), 3, SHAPE, window=2, sink=1, budget_s=600, on_batch=lambda b, n: seen.append((b, n))
    )
    assert not cal.error and seen == [(1, 3), (2, 3), (3, 3)]


def _args(**over) -> argparse.Namespace:
    base = dict(host="127.0.0.1", health_port=-1, tls_cert=None, tokens=None)
    return argparse.Namespace(**{**base, **over})


def test_ups_summary_says_what_answers_where_and_what_a_client_needs():
    ready = {"coordinator": "127.0.0.1:50050", "gateway": "127.0.0.1:50051", "web": "http://127.0.0.1:8080/"}
    lines = summary(_args(), ready, "1 stage", took=31.25)
    assert lines[0] == "stagecast is up in 31.2 s: 1 stage"
    assert "public API (gRPC): 127.0.0.1:50051, plaintext" in lines
    assert "watch and steer it in a browser: http://127.0.0.1:8080/" in lines
    secure = summary(_args(tls_cert="gw.crt", tokens="tokens.txt"), ready, "2 stages")
    api = next(line for line in secure if line.startswith("public API"))
    assert "TLS (a client trusts gw.crt" in api and "bearer token from tokens.txt" in api


def test_under_a_wildcard_host_the_summary_gives_addresses_that_answer():
    ready = {"coordinator": "0.0.0.0:50050", "gateway": "0.0.0.0:50051", "web": "http://0.0.0.0:8080/"}
    lines = summary(_args(host="0.0.0.0", health_port=50052), ready, "1 stage")
    text = "\n".join(lines)
    assert "0.0.0.0:" not in text.replace("--host 0.0.0.0", "")
    assert "public API (gRPC): 127.0.0.1:50051" in text and "http://127.0.0.1:8080/" in text
    assert "health (plaintext grpc.health.v1): 127.0.0.1:50052" in text
    assert "every interface listens" in lines[-1]

"""The gateway's fleet side in process: what its agent tells HAProxy from its coordinator's slots, the agent's
line protocol on a real socket, the refusal while draining, and the door's template and its refusals at start."""

import argparse
import socket
import threading

import grpc
import pytest

from gateway.edge.admission import Refused
from gateway.edge.agent import Fleet, FleetOptions, PipelineSlots, agent_reply
from launcher import door
from launcher.fleet import check_fleet_flags
from stagecast.internal.v1 import pipeline_pb2 as ipb

pytestmark = pytest.mark.unit


def test_capped_backend_weighs_free_slots_and_caps_at_held_plus_free():
    slots = PipelineSlots(ready=True, free=3, total=7)
    assert agent_reply(slots, draining=False, streams=4, backend="grpc") == "up ready 43% maxconn:7"
    one = PipelineSlots(ready=True, free=1, total=200)  # a free slot never rounds to weight 0
    assert agent_reply(one, draining=False, streams=0, backend="grpc") == "up ready 1% maxconn:1"


def test_a_full_pipeline_is_capped_at_the_doors_streams_and_never_at_maxconn_zero():
    # HAProxy reads maxconn 0 as "no limit": a full pipeline with no stream of the door's gets weight 0 and a cap of 1
    full = PipelineSlots(ready=True, free=0, total=4)
    assert agent_reply(full, draining=False, streams=0, backend="grpc") == "up ready 0% maxconn:1"
    # With the door's own streams there, the cap holds new ones out by itself, and weight 1% leaves the pipeline in
    # the door's choice: the connection one of them frees is usable before the next check.
    assert agent_reply(full, draining=False, streams=3, backend="grpc") == "up ready 1% maxconn:3"
    assert agent_reply(full, draining=False, streams=4, backend="grpc") == "up ready 1% maxconn:4"


class _Call:
    """A gRPC server context as ``ClientIdentity`` reads it: the peer and the metadata."""

    def __init__(self, peer: str, *metadata: tuple[str, str]):
        self._peer, self._metadata = peer, metadata

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self):
        return self._metadata


def test_the_agents_cap_counts_only_the_streams_the_door_sent_on():
    from types import SimpleNamespace

    from gateway.edge.admission import CostBudget, DecoderMemory
    from gateway.edge.client_identity import ClientIdentity
    from gateway.edge.quotas import QuotaOptions, Quotas
    from gateway.edge.stream_table import StreamTable
    from gateway.metrics import GatewayMetrics

    identity = ClientIdentity(None, ["10.0.0.5"])
    forwarded = ("x-forwarded-for", "203.0.113.9")
    door_call = _Call("ipv4:10.0.0.5:4000", forwarded)
    assert identity.via_proxy(door_call) and identity.of(door_call) == "address 203.0.113.9"
    assert not identity.via_proxy(_Call("ipv4:10.0.0.5:4000"))  # the door's own call (no viewer named)
    assert not identity.via_proxy(_Call("ipv4:198.51.100.4:1", forwarded))  # the header from anyone else
    # No --trusted-proxy (the chart's default): the header still marks the door's streams for the cap, not identity.
    untrusting = ClientIdentity(None, None)
    assert untrusting.via_proxy(door_call) and untrusting.of(door_call) == "address 10.0.0.5"
    assert not untrusting.via_proxy(_Call("ipv4:10.0.0.5:4000"))

    table = StreamTable(
        max_streams=8,
        max_pending=8,
        budget=CostBudget(max_frame_pixels=64 * 64, max_stream_cost=1e12, floor_fps=16.0),
        decoder_memory=DecoderMemory.derive("cpu", {"full": 0}, (64, 64)),
        quotas=Quotas(QuotaOptions(), max_streams=8),
        metrics=GatewayMetrics(active=lambda: 0, vae_bytes=lambda: 0),
    )
    runs = [
        SimpleNamespace(id=str(i), via_door=via, outcome="completed", frames_emitted=0)
        for i, via in enumerate((True, False, True))
    ]
    for run in runs:
        table.register(run, lambda: None)
    assert table.door_streams() == 2
    table.forget(runs[0])
    assert table.door_streams() == 1 and len(table.streams) == 2


def test_overflow_backend_is_uncapped_but_still_drains_and_goes_down():
    full = PipelineSlots(ready=True, free=0, total=4)
    assert agent_reply(full, draining=False, streams=4, backend="overflow") == "up ready 100%"
    assert agent_reply(full, draining=True, streams=4, backend="overflow") == "drain"
    assert agent_reply(PipelineSlots(), draining=False, streams=0, backend="overflow") == "down"


def test_not_ready_is_down_and_draining_wins():
    assert agent_reply(PipelineSlots(ready=False, free=5, total=5), draining=False, streams=0, backend="grpc") == "down"
    slots = PipelineSlots(ready=True, free=5, total=5)
    assert agent_reply(slots, draining=True, streams=0, backend="grpc") == "drain"


class _Coordinator:
    """The coordinator's Status as the fleet reads it (``ClusterStatus``), or UNAVAILABLE."""

    def __init__(self):
        self.status = ipb.ClusterStatus(ready=True, slots_free=2, slots_total=5)
        self.read = threading.Event()

    def Status(self, request, timeout=None):
        self.read.set()
        if self.status is None:
            raise _Unavailable()
        return self.status


class _Unavailable(grpc.RpcError):
    pass


def _ask(address: str, line: bytes) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(line)
        out = b""
        while chunk := sock.recv(64):
            out += chunk
    return out.decode()


def test_agent_port_answers_each_backend_one_line_from_the_coordinators_slots():
    coordinator = _Coordinator()
    fleet = Fleet(FleetOptions(pipeline_name="p7", agent_port=0), coordinator, host="127.0.0.1", streams=lambda: 3)
    try:
        assert fleet.agent_address.startswith("127.0.0.1:")  # binds where it is told
        fleet._slots = fleet._read_slots()
        fleet.start()
        assert _ask(fleet.agent_address, b"grpc\n") == "up ready 40% maxconn:5\n"
        assert _ask(fleet.agent_address, b"overflow\n") == "up ready 100%\n"
        coordinator.status = None  # the coordinator cannot be reached: the pipeline is down
        assert fleet._read_slots() == PipelineSlots()
    finally:
        fleet.stop()


def test_draining_refuses_new_streams_with_unavailable_naming_the_pipeline():
    fleet = Fleet(FleetOptions(pipeline_name="p1"), _Coordinator(), host="127.0.0.1", streams=lambda: 0)
    assert fleet.agent_address is None  # no --agent-port: no socket
    assert fleet.refuse_while_draining(None) is None
    fleet.draining.set()
    with pytest.raises(Refused) as refused:
        fleet.refuse_while_draining(None)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "pipeline p1 is draining" in refused.value.message and "reconnect" in refused.value.message
    assert fleet.reply("grpc") == "drain"


@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_drain_s_must_be_a_duration(value):
    with pytest.raises(ValueError, match="--drain-s"):
        Fleet(FleetOptions(drain_s=value), _Coordinator(), host="127.0.0.1", streams=lambda: 0)


def test_launcher_finds_the_charts_template():
    found = door.template_path()
    chart = door.Path(door.__file__).resolve().parent.parent / "helm" / "stagecast" / "files" / "haproxy.cfg.tmpl"
    assert found.read_text() == chart.read_text()  # one file: the launcher's is the chart's


def test_rendered_door_lists_every_pipeline_in_both_backends():
    servers = [door.Server("p0", "127.0.0.1:7001", 7101), door.Server("p1", "127.0.0.1:7002", 7102)]
    text = door.render(bind="127.0.0.1:7000", servers=servers, web="127.0.0.1:7003")
    assert text.count("server p0 127.0.0.1:7001 agent-port 7101") == 2  # grpc and overflow
    assert "bind 127.0.0.1:7000\n" in text and "server web 127.0.0.1:7003" in text
    assert "option forwardfor" in text and "${" not in text
    tls = door.render(bind="0.0.0.0:443", servers=servers[:1], tls_pem="/run/door.pem")
    assert "bind 0.0.0.0:443 ssl crt /run/door.pem alpn h2,http/1.1" in tls


def test_missing_haproxy_fails_at_once_naming_the_package(monkeypatch):
    monkeypatch.setattr(door.shutil, "which", lambda name: None)
    monkeypatch.setattr(door.os, "access", lambda path, mode: False)
    with pytest.raises(door.DoorError, match="apt-get install haproxy"):
        door.find_haproxy()
    args = argparse.Namespace(gateway_port=0, checkpoint="ckpt", cfg_parallel=1, fleet_drain_s=30.0, device="cpu")
    monkeypatch.setattr("launcher.fleet.has_gateway", lambda args: True)
    assert "apt-get install haproxy" in check_fleet_flags(args)

"""The gateway's global unpaced cap (``--max-unpaced``): best-effort streams of all clients together, beside each
client's own quota (``--max-unpaced-per-client``), refused with RESOURCE_EXHAUSTED naming the flag."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from gateway.edge.admission import CostBudget, DecoderMemory, Refused
from gateway.edge.quotas import QuotaOptions, Quotas
from gateway.edge.stream_table import StreamTable
from gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.unit


def table(max_unpaced: int, per_client: int = 2) -> StreamTable:
    return StreamTable(
        max_streams=16,
        max_pending=8,
        max_unpaced=max_unpaced,
        budget=CostBudget(max_frame_pixels=64 * 64, max_stream_cost=1e12, floor_fps=16.0),
        decoder_memory=DecoderMemory.derive("cpu", {"full": 0}, (64, 64)),
        quotas=Quotas(QuotaOptions(unpaced=per_client), max_streams=16),
        metrics=GatewayMetrics(active=lambda: 0, vae_bytes=lambda: 0),
    )


def stream(pace: bool):
    return SimpleNamespace(
        pace=pace, width=64, height=64, fps=16.0, min_steps=2, policy="per_level", chunk_frames=1, decoder="full"
    )


def test_unpaced_streams_of_all_clients_together_stop_at_max_unpaced_and_paced_ones_still_start():
    t = table(max_unpaced=3)
    held = [t.admit(stream(False), f"address 10.0.0.{i}") for i in range(3)]  # three clients, one each
    with pytest.raises(Refused) as info:
        t.admit(stream(False), "address 10.0.0.9")  # a fourth client, within its own quota
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-unpaced" in info.value.message and "per-client" not in info.value.message
    assert t.admitted == 3 and t.unpaced == 3  # the refused one gave back its count
    paced = t.admit(stream(True), "address 10.0.0.9")  # paced streams are not capped by it
    held[0]()
    again = t.admit(stream(False), "address 10.0.0.9")  # an unpaced stream ended: room for one
    for release in (*held[1:], paced, again):
        release()
    assert (t.admitted, t.unpaced) == (0, 0)


def test_the_clients_own_quota_refuses_first_naming_its_flag():
    t = table(max_unpaced=8, per_client=2)
    t.admit(stream(False), "address a")
    t.admit(stream(False), "address a")
    with pytest.raises(Refused, match="--max-unpaced-per-client 2"):
        t.admit(stream(False), "address a")
    assert t.unpaced == 2


@pytest.mark.parametrize("bad", [0, 100_001])
def test_max_unpaced_out_of_range_is_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--max-unpaced must be in"):
        table(max_unpaced=bad)


def test_up_passes_both_unpaced_caps_on_to_its_gateway_and_leaves_the_defaults_to_the_gateway(tmp_path):
    import argparse

    from launcher import up
    from launcher.local_cluster import Placement
    from launcher.pipeline_start import Plan, gateway_argv

    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    plan = Plan(Placement.plan("cpu", 2), None, None)

    def gateway(*flags: str) -> list[str]:
        args = parser.parse_args(["up", "--checkpoint", str(tmp_path), *flags])
        return gateway_argv(args, plan, "127.0.0.1:1", metrics_port=0)

    argv = gateway("--max-unpaced", "6", "--max-unpaced-per-client", "3")
    assert argv[argv.index("--max-unpaced") + 1] == "6"
    assert argv[argv.index("--max-unpaced-per-client") + 1] == "3"
    plain = gateway()  # not given: the gateway's own defaults apply (4 and 2)
    assert "--max-unpaced" not in plain and "--max-unpaced-per-client" not in plain

"""benchmarks/fleet_sim.py: the fleet simulator's properties on small fleets (no oracle needed): free slots come from
the coordinator's own dry run, agent weighting below capacity refuses no one, capacity-blind round-robin refuses
viewers while another pipeline has room when pipelines are unequal, a seed fixes a run, the autoscaler follows the
HPA's rules, and the table is made from the JSON."""

import json

import pytest

from benchmarks import fleet_sim
from benchmarks.fleet_sim import Autoscaler, run, simulate, slots_table, table

pytestmark = pytest.mark.unit

SMALL = dict(pipelines=10, seconds=400.0, warmup=100.0)


def test_free_slots_are_the_coordinators_dry_run_counting_down():
    assert slots_table(7) == [7, 6, 5, 4, 3, 2, 1, 0]
    assert slots_table(8) == [8, 7, 6, 5, 4, 3, 2, 1, 0]


def test_agent_weighting_below_capacity_refuses_no_one():
    r = run("agent", 0.5, seed=3, **SMALL)
    assert r.sessions > 100
    assert r.refused_pct == 0 and r.refused_while_room_pct == 0 and r.p95_admission_s == 0


def test_round_robin_refuses_while_another_pipeline_has_room_when_pipelines_are_unequal():
    rr = run("round-robin", 0.8, seed=3, **SMALL)
    agent = run("agent", 0.8, seed=3, **SMALL)
    assert rr.sessions == agent.sessions  # the same arrivals for every policy
    assert rr.refused_while_room_pct > 1.0
    assert agent.refused_while_room_pct < rr.refused_while_room_pct


def test_at_saturation_a_zero_weight_hides_freed_slots_until_the_next_check_and_the_agents_1_percent_does_not():
    zero = run("agent-zero", 1.2, seed=3, **SMALL)
    agent = run("agent", 1.2, seed=3, **SMALL)
    assert zero.refused_while_room_pct > 1.0  # a slot freed since the last check has weight 0 at the door
    assert agent.refused_while_room_pct == 0  # maxconn, counted live by the door, gates alone


def test_the_door_reads_the_gateways_own_agent_reply():
    p = fleet_sim.Pipeline(index=0, table=slots_table(7))
    assert fleet_sim.door_view(p, 0.0) == (100, 7)
    p.held = 7
    assert fleet_sim.door_view(p, 0.0) == (1, 7)  # full: in the door's choice, capped at its streams
    p.held, p.ready_at = 3, 5.0
    assert fleet_sim.door_view(p, 0.0)[0] == 0  # not ready yet: down


def test_a_seed_fixes_the_run():
    a = run("least-connections", 0.9, seed=5, **SMALL)
    assert a == run("least-connections", 0.9, seed=5, **SMALL)
    assert a != run("least-connections", 0.9, seed=6, **SMALL)


def test_the_autoscaler_follows_the_hpa_tolerance_and_scale_down_window():
    scaler = Autoscaler(target=0.75, min_pipelines=1, max_pipelines=20, window_s=300)
    assert scaler.desired(0, 10, busy=9, free=1) == 12  # 0.9 / 0.75: ceil(10 x 1.2)
    assert scaler.desired(15, 10, busy=78, free=22) == 10  # within 10% of the target: kept
    assert scaler.desired(30, 10, busy=3, free=97) == 10  # lower (1): the window's highest (12 at 0 s) holds 10
    assert scaler.desired(320, 10, busy=3, free=97) == 1  # the window (20..320 s) holds only 1, then 1


def test_autoscaling_at_low_load_spends_fewer_gpu_hours():
    fixed = run("agent", 0.3, seed=2, pipelines=10, seconds=1200.0, warmup=600.0)
    scaled = run(
        "agent", 0.3, seed=2, pipelines=10, seconds=1200.0, warmup=600.0, autoscaler=Autoscaler(max_pipelines=15)
    )
    assert scaled.autoscale and scaled.mean_pipelines < fixed.mean_pipelines and scaled.gpu_hours < fixed.gpu_hours


def test_the_table_is_made_from_the_json(tmp_path, capsys):
    report = simulate(loads=[0.6], seed=1, target=0.75, window_s=300.0, max_pipelines=6, **dict(SMALL, pipelines=4))
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(report))
    assert fleet_sim.main(["--table", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed == table(report)
    assert [line.split(" | ")[1] for line in printed.splitlines() if line.startswith("| 60%")] == [
        "round-robin",
        "least-connections",
        "agent",
        "agent-zero",
        "agent, autoscaled",
    ]
    report["results"][0]["refused_while_room_pct"] = 12.345
    path.write_text(json.dumps(report))
    fleet_sim.main(["--table", str(path)])
    assert "| 12.35 |" in capsys.readouterr().out


def test_the_table_goes_between_its_markers_and_nothing_else_changes(tmp_path):
    report = simulate(loads=[0.6], seed=1, target=0.75, window_s=300.0, max_pipelines=6, **dict(SMALL, pipelines=4))
    (tmp_path / "fleet.json").write_text(json.dumps(report))
    doc = tmp_path / "B.md"
    doc.write_text(f"before\n{fleet_sim.TABLE_BEGIN}\nold\n{fleet_sim.TABLE_END}\nafter\n")
    fleet_sim.main(["--table", str(tmp_path / "fleet.json"), "--into", str(doc)])
    assert doc.read_text() == f"before\n{fleet_sim.TABLE_BEGIN}\n{table(report)}{fleet_sim.TABLE_END}\nafter\n"

"""A step change does not stall a paced stream: its chunks keep starting (and finishing) at the stream's cadence.

The pipeline is modelled in the scheduler's own time: one tick is one stage forward, a batch issued at tick T leaves
the last of P stages at T + P - 1, and a paced stream may start chunk k from tick k x R on (the engine's credit).
Under ``per_level`` a step change starts a new KV segment; it used to wait for every chunk of the old ladder to leave
the pipeline first, which left the stream's next start ``levels x P`` ticks after the previous one instead of R.
"""

import pytest

from coordinator.scheduler import StreamBatchScheduler
from stagecast.microstep import StreamSpec

pytestmark = pytest.mark.unit

STAGES = 2
PERIOD = 2  # ticks between a paced stream's chunk slots: it keeps several chunks in flight
CHANGE_AT = 24  # the tick the controller changes the steps


def ladder(steps: int) -> tuple[float, ...]:
    return tuple(1000.0 * (steps - i) / steps for i in range(steps))


def run(before: int, after: int, policy: str = "per_level", ticks: int = 60, streams: int = 1):
    sched = StreamBatchScheduler(num_stages=STAGES, max_batch=4)
    for sid in range(1, streams + 1):
        sched.add_stream(
            StreamSpec(
                stream_id=sid,
                latent_channels=16,
                chunk_frames=1,
                latent_height=4,
                latent_width=4,
                timesteps=ladder(before),
                policy=policy,
            )
        )
    starts: dict[int, int] = {}
    finishes: dict[int, int] = {}
    now = 0
    while sched.active:
        if now == ticks:
            for sid in sched.streams:
                sched.stop_stream(sid)  # the chunks in flight finish
        if now == CHANGE_AT:
            assert sched.set_steps(1, ladder(after)) is not None
        for sid in sched.streams:
            sched.set_credit(sid, now // PERIOD + 1)  # chunk k may start from tick k x PERIOD
        for st in sched.tick():
            if st.stream == 1:
                if st.level == 0:
                    starts[st.chunk] = now
                finishes[st.chunk] = now  # its last level is the last one issued
        now += 1
    return starts, finishes


def gaps(ticks: dict[int, int]) -> list[int]:
    chunks = sorted(ticks)
    assert chunks == list(range(len(chunks))), "chunks missing"
    return [ticks[c] - ticks[c - 1] for c in chunks[1:]]


@pytest.mark.parametrize("before,after", [(4, 2), (4, 1), (3, 2), (2, 4), (1, 4)])
@pytest.mark.parametrize("streams", [1, 2])
def test_chunk_starts_keep_their_cadence_across_a_step_change(before, after, streams):
    starts, finishes = run(before, after, streams=streams)
    assert len(starts) >= 25
    # Chunks finish in order, each in a later tick than the one before (the consumer decodes them in order).
    done = [finishes[c] for c in sorted(finishes)]
    assert all(b > a for a, b in zip(done, done[1:])), sorted(finishes.items())
    # Steady state: a chunk per period on average (per_level's order makes the gaps alternate around it).  Across
    # the change no start comes more than one period later than the steady state's longest gap.  A chunk of one
    # level starts when it finishes, right after the chunk before it: its start is the finishing cadence below.
    steady = max(gaps({c: t for c, t in starts.items() if t < CHANGE_AT}))
    assert steady <= PERIOD + 1
    if after > 1:
        assert max(gaps(starts)) <= steady + PERIOD, sorted(starts.items())
    if after <= before:
        # Fewer (or as many) levels: what the viewer gets keeps its cadence across the change too (a longer ladder
        # adds its latency once, which the playout buffer takes).
        steady_done = max(gaps({c: t for c, t in finishes.items() if t < CHANGE_AT}))
        assert max(gaps(finishes)) <= steady_done + PERIOD, sorted(finishes.items())


def test_the_clean_policy_keeps_its_cadence_too():
    starts, finishes = run(3, 1, policy="clean")
    assert max(gaps(starts)) <= max(gaps({c: t for c, t in starts.items() if t < CHANGE_AT})) + PERIOD
    done = [finishes[c] for c in sorted(finishes)]
    assert all(b > a for a, b in zip(done, done[1:]))

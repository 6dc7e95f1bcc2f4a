"""One plan-event type: what the coordinator plans, the wire carries, a stage runs and the reference replays."""

import pytest
import torch

from stagecast import wire
from stagecast.microstep import MicroStep, PlanEvent, StreamSpec

pytestmark = pytest.mark.unit

SPEC = StreamSpec(
    stream_id=3,
    latent_channels=16,
    chunk_frames=1,
    latent_height=4,
    latent_width=6,
    timesteps=(1000.0, 500.0),
    text_len=8,
)


@pytest.mark.parametrize(
    "event",
    [
        PlanEvent("open", seq=1, spec=SPEC, text=torch.randn(1, 8, 32), traceparent="00-ab-cd-01"),
        PlanEvent("batch", seq=2, steps=(MicroStep(3, 0, 0), MicroStep(4, 1, 2))),
        PlanEvent("prompt", seq=3, stream_id=3, from_chunk=5, text=torch.randn(1, 8, 32)),
        PlanEvent("close", seq=4, stream_id=3),
    ],
    ids=lambda e: e.kind,
)
def test_a_plan_event_survives_the_wire(event):
    back = wire.event_from_proto(wire.event_to_proto(event, generation=7))
    assert wire.event_to_proto(event, 7).generation == 7
    for name in ("kind", "seq", "spec", "steps", "stream_id", "from_chunk", "traceparent"):
        assert getattr(back, name) == getattr(event, name), name
    assert (back.text is None) == (event.text is None)
    if event.text is not None:
        assert torch.equal(back.text, event.text)


def test_a_recorded_event_without_text_reads_back_without_text():
    msg = wire.event_to_proto(PlanEvent("open", seq=1, spec=SPEC), generation=1)
    assert not msg.open.HasField("text")
    assert wire.event_from_proto(msg).text is None


def test_unknown_kinds_and_empty_events_are_refused():
    with pytest.raises(ValueError, match="plan event kind 'reset'"):
        PlanEvent("reset")
    from stagecast.internal.v1 import pipeline_pb2 as pb

    with pytest.raises(ValueError, match="carries no event"):
        wire.event_from_proto(pb.PlanEvent(seq=1))

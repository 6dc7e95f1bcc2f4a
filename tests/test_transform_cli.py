"""``stagecast transform``'s defaults and summary, in process: the default strength keeps some of the input, and the
summary names the seed and the ladder and says a clip restyled to its end ended as asked."""

import pytest

from stagecast.transform import TransformReport, default_strength


@pytest.mark.unit
@pytest.mark.parametrize(
    ("ladder", "strength"),
    [
        ([1000, 750, 500, 250], 750),  # Self-Forcing: its first level is pure noise, which would ignore the input
        ([1000, 757, 522], 757),  # CausVid
        ([700, 500, 400, 200], 700),  # StreamDiffusionV2: made for video-to-video, its first keeps the input
        ([1000], 1000),  # one step: the only choice
    ],
)
def test_the_default_strength_is_the_first_timestep_that_keeps_the_input(ladder, strength):
    assert default_strength(ladder) == strength


@pytest.mark.unit
def test_an_empty_ladder_has_no_default_strength():
    with pytest.raises(ValueError, match="timesteps: an empty ladder"):
        default_strength([])


def _report(**kw) -> TransformReport:
    base = dict(
        out="out.mp4",
        frames_in=17,
        frames=17,
        width=64,
        height=64,
        strength=500.0,
        end_reason="stopped",
        ttff=0.5,
        fps=16.0,
        seed=3,
        timesteps=(1000.0, 500.0),
    )
    return TransformReport(**{**base, **kw})


@pytest.mark.unit
def test_the_summary_names_seed_strength_and_ladder_and_a_finished_clip_as_such():
    text = _report().summary()
    assert (
        "17 of 17 input frames restyled, 64x64 (seed 3, strength 500 on timesteps [1000, 500], to the input's end)"
        in text
    )
    assert "to the input's end" in text and "stopped" not in text
    cut = _report(frames=10, end_reason="stopped").summary()
    assert "10 of 17" in cut and ", stopped)" in cut  # stopped early: said as it is
    assert ", input_stalled)" in _report(end_reason="input_stalled").summary()

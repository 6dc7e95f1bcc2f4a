"""Samplers that match the checkpoints: the stagecast.json sampler section, a stream's own ladder, and the math.

The math is held against independent definitions: diffusers' ``FlowMatchEulerDiscreteScheduler`` (its shift, its
Euler step, and its ``stochastic_sampling`` x0 re-noise step) and Self-Forcing's ``warp_denoising_step``.
"""

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.edge.config import ConfigError, resolve_config
from stage_service.sampler import FlowSampler
from stagecast import wire
from stagecast.client import stream_config
from stagecast.microstep import StreamSpec
from stagecast.sampling import SamplerConfig, SamplerError, as_f32, sigmas

pytestmark = pytest.mark.parity

WAN21 = ModelInfo(latent_channels=16, patch_hw=(2, 2), spatial_factor=8, temporal_factor=4)

# StreamDiffusionV2's ladder per step count, as its inference scripts set denoising_step_list from --step
# (chenfengxu714/StreamDiffusionV2, streamv2v/inference.py; the trailing 0 is dropped at inference).
SDV2 = {1: [700], 2: [700, 500], 3: [700, 600, 400], 4: [700, 600, 500, 400]}


def load(tmp_path, data: dict) -> ServingDefaults:
    (tmp_path / "stagecast.json").write_text(json.dumps(data))
    return ServingDefaults.load(tmp_path)


def resolve(defaults: ServingDefaults, prompt="a cat", **kw):
    return resolve_config(stream_config(prompt, width=64, height=48, **kw), defaults=defaults, model=WAN21)


def spec_of(ladder, shift=1.0, update="x0") -> StreamSpec:
    return StreamSpec(
        stream_id=1,
        latent_channels=16,
        chunk_frames=1,
        latent_height=4,
        latent_width=4,
        timesteps=ladder,
        shift=shift,
        sampler=update,
    )


# ---- stagecast.json ----------------------------------------------------------------------------------------


def test_without_a_sampler_section_the_ladder_is_even_from_1000_at_shift_1(tmp_path):
    d = ServingDefaults.load(tmp_path)
    assert d.sampler == SamplerConfig()
    assert d.sampler.ladder_for(4) == (1000.0, 750.0, 500.0, 250.0)
    assert d.sampler.ladder_for(3) == (1000.0, as_f32(2000 / 3), as_f32(1000 / 3))
    assert d.sampler.ladder_for(1) == (1000.0,)
    assert d.sampler.supported_steps() == tuple(range(1, 51))


def test_an_explicit_ladder_is_truncated_to_the_step_count(tmp_path):
    d = load(tmp_path, {"steps": 2, "sampler": {"ladder": [700, 500, 400, 200], "shift": 5.0, "update": "euler"}})
    s = d.sampler
    assert [s.ladder_for(n) for n in (1, 2, 3, 4)] == [
        (700.0,),
        (700.0, 500.0),
        (700.0, 500.0, 400.0),
        (700, 500, 400, 200),
    ]
    assert (s.shift, s.update, s.supported_steps()) == (5.0, "euler", (1, 2, 3, 4))
    with pytest.raises(SamplerError, match=r"^steps: .*offers 1\.\.4 steps, not 5"):
        s.ladder_for(5)
    cfg = resolve(d)
    assert (cfg.steps, cfg.timesteps, cfg.shift, cfg.update) == (2, (700.0, 500.0), 5.0, "euler")
    spec = cfg.stream_spec(latent_channels=16, text_len=32)
    assert (spec.timesteps, spec.shift, spec.sampler) == ((700.0, 500.0), 5.0, "euler")


def test_a_ladder_per_step_count_and_the_even_rule_from_another_start(tmp_path):
    d = load(tmp_path, {"sampler": {"ladders": {str(n): lad for n, lad in SDV2.items()}}})
    assert d.sampler.supported_steps() == (1, 2, 3, 4)
    assert {n: list(d.sampler.ladder_for(n)) for n in SDV2} == SDV2
    assert resolve(d).timesteps == (700.0, 600.0, 500.0, 400.0)  # default steps 4
    assert resolve(d, steps=3).timesteps == (700.0, 600.0, 400.0)  # not a truncation of the 4-step ladder
    with pytest.raises(ConfigError, match=r"^steps: .*offers 1\.\.4 steps, not 5"):
        resolve(d, steps=5)
    # per-count ladders override the rule; "steps" limits what is offered
    d = load(tmp_path, {"sampler": {"ladder": {"even_from": 800}, "ladders": {"2": [900, 300]}, "steps": [1, 2, 4]}})
    assert [d.sampler.ladder_for(n) for n in (1, 2, 4)] == [(800.0,), (900.0, 300.0), (800.0, 600.0, 400.0, 200.0)]
    with pytest.raises(SamplerError, match="^steps: .*offers 1, 2, 4 steps, not 3"):
        d.sampler.ladder_for(3)


def test_the_json_form_reads_back_to_the_same_sampler(tmp_path):
    cfg = SamplerConfig(
        update="euler", shift=3.0, ladder=(900.0, 500.0, 100.0), even_from=None, ladders={2: (800, 200)}
    )
    d = load(tmp_path, {"steps": 2, "sampler": cfg.to_json()})
    assert d.sampler == cfg and d.sampler.to_json() == cfg.to_json()
    assert load(tmp_path, {"sampler": SamplerConfig().to_json()}).sampler == SamplerConfig()


@pytest.mark.parametrize(
    "sampler,key",
    [
        ({"ladder": [700, 500], "sheft": 5}, "sampler.sheft"),  # unknown key
        ({"ladder": {"even_form": 1000}}, "sampler.ladder.even_form"),
        ({"ladder": {}}, "sampler.ladder.even_from"),
        ({"ladder": [500, 700]}, "sampler.ladder"),  # not descending
        ({"ladder": [1200, 700]}, "sampler.ladder"),  # out of range
        ({"ladder": []}, "sampler.ladder"),
        ({"ladder": "700,500"}, "sampler.ladder"),
        ({"ladders": {"3": [700, 400]}}, "sampler.ladders.3"),  # wrong length for the step count
        ({"ladders": {"2": [400, 700]}}, "sampler.ladders.2"),
        ({"ladders": {"two": [700, 400]}}, "sampler.ladders.two"),
        ({"ladders": {"0": []}}, "sampler.ladders.0"),
        ({"ladders": [[700]]}, "sampler.ladders"),
        ({"ladder": [700, 500], "steps": [1, 2, 3]}, "sampler.steps"),  # no ladder for 3 steps
        ({"ladder": [700], "shift": 0}, "sampler.shift"),
        ({"ladder": [700], "shift": "5"}, "sampler.shift"),
        ({"update": "ddim"}, "sampler.update"),
        ({"timestep_range": [0, 1000]}, "sampler.timestep_range"),
        ({"timestep_range": [500]}, "sampler.timestep_range"),
        ({"client_timesteps": "yes"}, "sampler.client_timesteps"),
    ],
)
def test_a_bad_sampler_section_is_an_error_naming_the_key(tmp_path, sampler, key):
    with pytest.raises(ValueError) as err:
        load(tmp_path, {"sampler": sampler})
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'stagecast.json'}: {key}: "), msg


def test_unknown_top_level_keys_are_named_and_the_default_steps_need_a_ladder(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'samplr'"):
        load(tmp_path, {"samplr": {}})
    with pytest.raises(ValueError, match=r"stagecast.json: steps: the default step count 4 has no ladder"):
        load(tmp_path, {"sampler": {"ladder": [700, 500]}})  # "steps" defaults to 4


# ---- a stream's own ladder ---------------------------------------------------------------------------------


def test_a_stream_may_send_its_own_ladder_and_started_echoes_ladder_and_shift(tmp_path):
    d = load(tmp_path, {"sampler": {"ladder": [1000, 750, 500, 250], "shift": 5.0}})
    cfg = resolve(d, timesteps=[900, 450.5])
    assert (cfg.steps, cfg.timesteps, cfg.shift) == (2, (900.0, 450.5), 5.0)
    echo = cfg.to_proto()
    assert (echo.steps, list(echo.timesteps), echo.shift) == (2, [900.0, 450.5], 5.0)
    # What Started.config says can be sent back as a request and means the same stream.
    again = resolve_config(echo, defaults=d, model=WAN21)
    assert (again.timesteps, again.shift, again.steps, again.seed) == (cfg.timesteps, cfg.shift, 2, cfg.seed)
    assert resolve(d, steps=2, timesteps=[900, 100]).timesteps == (900.0, 100.0)
    assert resolve(d, shift=5.0).shift == 5.0


@pytest.mark.parametrize(
    "kwargs,field,why",
    [
        (dict(timesteps=[500, 700]), "timesteps", "strictly descending"),
        (dict(timesteps=[700, 700]), "timesteps", "strictly descending"),
        (dict(timesteps=[1200, 700]), "timesteps", r"outside \[1, 1000\]"),
        (dict(timesteps=[700, 0]), "timesteps", r"outside \[1, 1000\]"),
        (dict(timesteps=[700, -5]), "timesteps", "outside"),
        (dict(timesteps=[700, float("nan")]), "timesteps", "not a finite number"),
        (dict(steps=3, timesteps=[700, 400]), "timesteps", "has 2 timesteps but steps is 3"),
        (dict(timesteps=list(range(1000, 0, -19))), "timesteps", "at most 50"),
        (dict(shift=3.0), "shift", "runs at shift 5"),
    ],
)
def test_a_bad_ladder_is_refused_naming_the_field(tmp_path, kwargs, field, why):
    d = load(tmp_path, {"sampler": {"shift": 5.0}})
    with pytest.raises(ConfigError, match=why) as err:
        resolve(d, **kwargs)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_what_the_checkpoint_allows_bounds_a_streams_ladder(tmp_path):
    d = load(
        tmp_path,
        {
            "steps": 2,
            "sampler": {"ladders": {"1": [700], "2": [700, 500]}, "timestep_range": [200, 800], "steps": [1, 2]},
        },
    )
    assert resolve(d, timesteps=[800, 200]).timesteps == (800.0, 200.0)  # inclusive
    for bad, why in (([900, 500], r"outside \[200, 800\]"), ([700, 500, 300], "offers 1, 2 steps")):
        with pytest.raises(ConfigError, match=why) as err:
            resolve(d, timesteps=bad)
        assert err.value.field == "timesteps"
    d = load(tmp_path, {"steps": 2, "sampler": {"ladder": [700, 500], "client_timesteps": False}})
    assert resolve(d).timesteps == (700.0, 500.0)
    with pytest.raises(ConfigError, match="does not accept a stream's own ladder") as err:
        resolve(d, timesteps=[700, 500])
    assert err.value.field == "timesteps"


def test_a_ladder_is_float32_everywhere_so_the_wire_changes_nothing():
    spec = spec_of((1000.0, 2000 / 3, 1000 / 3), shift=1 / 3)
    assert spec.timesteps == (1000.0, as_f32(2000 / 3), as_f32(1000 / 3)) and spec.shift == as_f32(1 / 3)
    back = wire.spec_from_proto(wire.spec_to_proto(spec))
    assert back == spec and FlowSampler(back).sigmas == FlowSampler(spec).sigmas


# ---- the math, against independent definitions --------------------------------------------------------------


@pytest.mark.parametrize(
    "ladder,shift", [((1000.0, 750.0, 500.0, 250.0), 1.0), ((700.0, 500.0, 400.0, 200.0), 5.0), ((950.0, 333.0), 3.0)]
)
@pytest.mark.parametrize("update", ["euler", "x0"])
def test_sampler_steps_equal_diffusers_flow_match_scheduler(ladder, shift, update):
    """diffusers shifts ``sigmas=ladder/1000`` the same way; its Euler step is ours, and ``stochastic_sampling``
    is the x0 re-noise rule (noise from the generator we hand it: the same draw our noise function makes)."""
    sched = FlowMatchEulerDiscreteScheduler(shift=shift, stochastic_sampling=(update == "x0"))
    sched.set_timesteps(sigmas=[t / 1000 for t in ladder])
    sampler = FlowSampler(spec_of(ladder, shift, update))
    assert torch.allclose(torch.tensor(sampler.sigmas, dtype=torch.float32), sched.sigmas, atol=1e-6, rtol=0)
    want_t = torch.tensor([sampler.model_timestep(i) for i in range(len(ladder))], dtype=torch.float32)
    assert torch.allclose(want_t, sched.timesteps, atol=1e-3, rtol=0)
    g = torch.Generator().manual_seed(0)
    x = ours = torch.randn(1, 16, 1, 4, 4, generator=g)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(1, 16, 1, 4, 4, generator=g)
        x = sched.step(v, t, x, generator=torch.Generator().manual_seed(100 + i)).prev_sample
        ours = sampler.step(
            ours, v, i, noise=lambda i=i: torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(100 + i))
        )
        assert torch.allclose(ours, x, atol=1e-5, rtol=0), (i, (ours - x).abs().max())
    assert sampler.model_timestep(len(ladder)) == 0.0  # the clean pass


def test_shift_is_self_forcings_warp_denoising_step():
    """Self-Forcing (warp_denoising_step, timestep_shift 5) conditions the model on
    ``cat(scheduler.timesteps, [0])[1000 - t]`` of its FlowMatchScheduler(shift=5, sigma_min=0, extra_one_step=True)
    at 1000 training steps (guandeh17/Self-Forcing, pipeline/causal_inference.py, utils/scheduler.py)."""
    shift = 5.0
    grid = torch.linspace(1.0, 0.0, 1001)[:-1]
    grid = shift * grid / (1 + (shift - 1) * grid)
    timesteps = torch.cat([grid * 1000, torch.tensor([0.0])])
    ladder = (1000.0, 750.0, 500.0, 250.0)
    warped = timesteps[1000 - torch.tensor(ladder, dtype=torch.long)]
    sampler = FlowSampler(spec_of(ladder, shift))
    ours = torch.tensor([sampler.model_timestep(i) for i in range(4)], dtype=torch.float32)
    assert torch.allclose(ours, warped, atol=1e-3, rtol=0), (ours, warped)
    assert sigmas(ladder, 1.0)[:-1] == [t / 1000 for t in ladder]  # shift 1: the ladder is the model timestep

"""``check_spec``: the one check of a stream against a model, shared by the coordinator and every stage."""

import pytest

from stagecast.microstep import StreamSpec
from stagecast.model.config import DiTConfig, check_spec
from stagecast.model.dit_configs import model_config

pytestmark = pytest.mark.unit

MODEL = DiTConfig.from_kwargs(model_config("tiny-wan2.1"))


def spec(**kw) -> StreamSpec:
    base = dict(stream_id=1, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, text_len=8)
    return StreamSpec(**{**base, **kw})


def test_a_spec_that_fits_the_model_passes():
    check_spec(spec(), MODEL, (1, 8, MODEL.text_dim))
    assert MODEL.patch_hw == (2, 2) and MODEL.kwargs["num_layers"] == MODEL.num_layers


@pytest.mark.parametrize(
    "kw, text, field",
    [
        (dict(latent_channels=48), None, "spec.latent_channels"),
        (dict(latent_height=5), None, "spec.latent_height"),
        (dict(latent_width=0), None, "spec.latent_height x spec.latent_width"),
        (dict(reset_frames=2048), None, "spec.reset_frames"),
        ({}, (1, 9, 32), "spec.text_len"),
    ],
)
def test_each_mismatch_names_its_field(kw, text, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_spec(spec(**kw), MODEL, text)


def test_a_config_without_the_checked_keys_is_refused():
    with pytest.raises(ValueError, match="lacks in_channels"):
        DiTConfig.from_kwargs({"patch_size": (1, 2, 2), "text_dim": 32, "num_layers": 2})

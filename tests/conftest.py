import os

import pytest
import torch

# Exactness tests compare bit for bit; keep CPU kernels deterministic and the suite light on 2 cores.
torch.use_deterministic_algorithms(True)
torch.set_num_threads(int(os.environ.get("STAGECAST_TEST_THREADS", "2")))


@pytest.fixture
def tiny_model():
    from diffusers import WanTransformer3DModel

    from stagecast.model.dit_configs import model_config

    def make(name="tiny-wan2.1", seed=0, **overrides):
        torch.manual_seed(seed)
        return WanTransformer3DModel(**model_config(name, **overrides)).eval().requires_grad_(False)

    return make

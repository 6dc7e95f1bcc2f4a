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


# ---- markers: ``-m unit`` is the fast set (in-process, no parity sweeps); ``parity`` pins exactness against the
# reference and the oracles; ``multiprocess`` starts real services on loopback.  A module that starts processes is
# found from its source, so a new one is classified without anyone remembering to.
PARITY_MODULES = {
    "test_streaming_semantics",
    "test_graphs",
    "test_distributed",
    "test_stream_vae",
    "test_local_decoder",
    "test_lora",
    "test_convert",
    "test_sampling",
    "test_cfg",
}
_STARTS_PROCESSES = ("Launcher(", "start_pipeline(", "subprocess.", "launcher.spawn(", ".Process(", "web_cluster(")
_kinds: dict[str, set[str]] = {}


def module_markers(path) -> set[str]:
    name = path.stem
    if name not in _kinds:
        source = path.read_text()
        kinds = set()
        if any(token in source for token in _STARTS_PROCESSES):
            kinds.add("multiprocess")
        if name in PARITY_MODULES:
            kinds.add("parity")
        _kinds[name] = kinds or {"unit"}
    return _kinds[name]


def pytest_collection_modifyitems(config, items):
    for item in items:
        for kind in module_markers(item.path):
            item.add_marker(getattr(pytest.mark, kind))

"""One home per fact: the facts several floors share are defined once in the ground floor, the others import them,
and the copies that cannot import (the Helm values) are checked against them here."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from coordinator import slo
from gateway.checkpoint import MAX_NEGATIVE_PROMPT_CHARS, MAX_WINDOW, ServingDefaults
from gateway.edge import admission
from gateway.edge.config import MAX_PROMPT_CHARS, MAX_REQUEST_BYTES
from stagecast import api
from stagecast.microstep import DEFAULT_MAX_BATCH, POLICIES, StreamSpec, chunk_levels
from stagecast.model.config import DiTConfig
from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN
from stagecast.v1 import stream_pb2 as pb
from web.control import MAX_MESSAGE_BYTES, BadMessage, parse_message

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "stagecast"
SOURCES = (
    "stagecast",
    "clients/python/stagecast_client",
    "coordinator",
    "stage_service",
    "gateway",
    "web",
    "launcher",
    "benchmarks",
)


@pytest.mark.unit
@pytest.mark.parametrize("policy", POLICIES)
def test_every_floor_counts_the_micro_steps_of_a_chunk_with_the_one_function(policy):
    for steps in (1, 2, 4):
        want = steps + 1 if policy == "clean" else steps
        assert chunk_levels(steps, policy) == want
        spec = StreamSpec(1, 16, 1, 8, 8, timesteps=tuple(1000.0 - 250.0 * i for i in range(steps)), policy=policy)
        assert spec.levels == want
        assert slo.Demand(1, 4.0, (steps,), clean=policy == "clean").levels(steps) == want
        assert admission.passes(SimpleNamespace(min_steps=steps, policy=policy)) == want
    with pytest.raises(ValueError, match="policy"):
        chunk_levels(2, "clean_pass")


@pytest.mark.unit
def test_the_rope_limit_is_diffusers_default_and_every_fallback_uses_it():
    from diffusers import WanTransformer3DModel

    assert (
        inspect.signature(WanTransformer3DModel.__init__).parameters["rope_max_seq_len"].default == WAN_ROPE_MAX_SEQ_LEN
    )
    config = {"in_channels": 16, "patch_size": (1, 2, 2), "text_dim": 32, "num_layers": 2}
    assert DiTConfig.from_kwargs(config).rope_max_seq_len == WAN_ROPE_MAX_SEQ_LEN
    assert MAX_WINDOW == WAN_ROPE_MAX_SEQ_LEN


@pytest.mark.unit
def test_the_serving_defaults_are_the_ground_floor_ones():
    assert ServingDefaults().fps == api.DEFAULT_FPS
    assert MAX_PROMPT_CHARS == MAX_NEGATIVE_PROMPT_CHARS == api.MAX_PROMPT_CHARS
    assert MAX_REQUEST_BYTES == api.MAX_REQUEST_BYTES


@pytest.mark.unit
def test_the_web_edge_takes_every_control_message_the_gateway_would_take():
    """The web edge's bound is the gateway's own: they may not drift, and a config at the public API's limits (a
    prompt and a negative prompt of MAX_PROMPT_CHARS 4-byte characters, which the gateway accepts) passes the edge."""
    assert MAX_MESSAGE_BYTES == MAX_REQUEST_BYTES
    widest = "\U0001f98a" * MAX_PROMPT_CHARS
    request = pb.ClientMessage(config=pb.StreamConfig(prompt=widest, negative_prompt=widest, steps=4, seed=7))
    assert request.ByteSize() <= MAX_REQUEST_BYTES  # the gateway reads it
    # A browser's JSON.stringify writes non-ASCII characters as they are (ensure_ascii=False).
    text = json.dumps(
        {"type": "config", "prompt": widest, "negative_prompt": widest, "steps": 4, "seed": 7}, ensure_ascii=False
    )
    assert len(text.encode()) > 96 * 1024  # over the web edge's old bound
    msg = parse_message(text.encode())
    assert msg.config["prompt"] == widest and msg.config["negative_prompt"] == widest
    with pytest.raises(BadMessage, match="message"):
        parse_message(json.dumps({"type": "prompt", "prompt": "x" * MAX_REQUEST_BYTES}))


def _keys(node, path=()):
    """Every (dotted path, value) of a YAML mapping, nested mappings included."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield ".".join(path + (str(key),)), value
            yield from _keys(value, path + (str(key),))


# Each ground-floor default a chart value could mirror: the value's key (case-insensitive, anywhere in the values)
# and the flag a template would pass it as.
MIRRORS = {
    "maxbatch": ("--max-batch", DEFAULT_MAX_BATCH),
    "fps": ("--fps", api.DEFAULT_FPS),
    "targetfps": ("--target-fps", api.DEFAULT_FPS),
}


@pytest.mark.unit
@pytest.mark.parametrize("values", ["values.yaml", "values-cpu.yaml", "values-multinode.yaml"])
def test_helm_values_mirror_the_ground_floor_defaults_or_leave_them_to_the_services(values):
    """A chart value for the Stream Batch or the frame rate must equal the ground floor's default; where the chart
    has none, no template may pass the flag, so the service's own default (the constant) is what runs."""
    tree = yaml.safe_load((CHART / values).read_text()) or {}
    found = dict(_keys(tree))
    assert "gateway.maxStreams" in found or values != "values.yaml"  # the walk reaches nested keys
    templates = "\n".join(p.read_text() for p in sorted((CHART / "templates").rglob("*")) if p.is_file())
    for name, (flag, default) in MIRRORS.items():
        mirrored = {path: v for path, v in found.items() if path.rsplit(".", 1)[-1].lower() == name}
        for path, value in mirrored.items():
            assert value == default, f"{values}: {path} = {value!r}, the services' default is {default!r}"
        for line in templates.splitlines():
            if re.search(rf"{re.escape(flag)}\b", line):
                assert any(f".Values.{p}" in line for p in mirrored), (
                    f"a template passes {flag} without a value: {line}"
                )


# Literal copies of the facts, as they were written before each had one home (the pattern, the home's file and
# name).  Another match is a second home.
COPIES = [
    (r"\+ \(1 if\b.*clean", "stagecast/microstep.py", "chunk_levels"),
    (r"rope.*\b1024\b|\b1024\b.*rope", "stagecast/model/dit_configs.py", "WAN_ROPE_MAX_SEQ_LEN"),
    (
        r"fps\s*:\s*float\s*=\s*16\b|fps\s*=\s*16(\.0)?\s*($|#)|fps\"?,.*default=16\b|\"fps\":\s*16\b|else 16\.0",
        "clients/python/stagecast_client/api.py",
        "DEFAULT_FPS",
    ),
    (r"max_batch(\s*:\s*int)?\s+=\s+4\b|batch\",.*default=4\b", "stagecast/microstep.py", "DEFAULT_MAX_BATCH"),
    (r"96 \* 1024", "clients/python/stagecast_client/api.py", "MAX_REQUEST_BYTES"),
]


@pytest.mark.unit
def test_no_module_writes_a_second_copy_of_a_shared_fact():
    hits, at_home = [], {home: 0 for _, home, _ in COPIES}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            where = path.relative_to(ROOT).as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for pattern, home, name in COPIES:
                    if re.search(pattern, line, re.IGNORECASE):
                        if where == home:
                            at_home[home] += 1
                        else:
                            hits.append(f"{where}:{number}: {line.strip()} (use {home}: {name})")
    assert not hits, "\n".join(hits)
    # Each home writes its facts once: microstep.py the levels and the batch, dit_configs.py the RoPE limit, api.py
    # the rate (its request bound is written in other words: 2 * 4 * MAX_PROMPT_CHARS + 16 * 1024).
    assert at_home == {
        "stagecast/microstep.py": 2,
        "stagecast/model/dit_configs.py": 1,
        "clients/python/stagecast_client/api.py": 1,
    }
    # The patterns do find the copies they guard against.
    for (pattern, _, _), line in zip(
        COPIES,
        [
            "return steps + (1 if self.clean else 0)",
            'cfg.get("rope_max_seq_len", 1024)',
            "fps: float = 16.0",
            "max_batch: int = 4,",
            "MAX_MESSAGE_BYTES = 96 * 1024",
        ],
    ):
        assert re.search(pattern, line, re.IGNORECASE), pattern

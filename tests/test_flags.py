"""``stagecast.flags``: a dataclass's fields are its flags, and a launcher's argv of an options object parses back to
an equal object."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from coordinator.options import CoordinatorOptions
from gateway.edge.quotas import QuotaOptions
from gateway.options import GatewayOptions, VAEStageOptions
from stage_service.options import StageOptions
from stagecast.flags import HelpFormatter, add_flags, argv_for, flag, from_args, nested, to_argv
from web.options import WebConfig

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Inner:
    limit: int = flag(3, name="--limit-per-client", help="a nested flag")


@dataclass
class Example:
    target: str = flag(help="where to connect", required=True)
    count: int = flag(2, help="how many")
    ratio: float = flag(0.5, help="a float")
    mode: str = flag("fast", choices=["fast", "slow"], help="a choice")
    name: str | None = flag(help="a name (default: the host's)")
    sizes: list[int] | None = flag(type=lambda text: [int(v) for v in text.split(",")], help="a list")
    verbose: bool = flag(False, action="store_true", help="a switch")
    cache: bool = flag(True, name="--no-cache", action="store_false", help="a negated switch")
    files: tuple = flag((), name="--file", action="append", help="repeatable")
    inner: Inner = nested(Inner)
    handle: object = None  # not a flag


def parser_of(cls) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="example", formatter_class=HelpFormatter)
    add_flags(parser, cls)
    return parser


def round_trip(options):
    return from_args(type(options), parser_of(type(options)).parse_args(to_argv(options)))


def test_defaults_parse_to_the_dataclass_defaults_and_write_back_as_only_the_required_flags():
    options = from_args(Example, parser_of(Example).parse_args(["--target", "x:1"]))
    assert options == Example(target="x:1")
    assert to_argv(options) == ["--target", "x:1"]


def test_every_kind_of_flag_round_trips():
    options = Example(
        target="x:1",
        count=5,
        ratio=0.25,
        mode="slow",
        name="n",
        sizes=[4, 8],
        verbose=True,
        cache=False,
        files=("a", "b"),
        inner=Inner(limit=9),
    )
    argv = to_argv(options)
    assert argv[:2] == ["--target", "x:1"] and "--no-cache" in argv and argv.count("--file") == 2
    assert "--limit-per-client" in argv
    assert round_trip(options) == options


def test_from_args_takes_the_values_it_is_given_over_the_namespace():
    args = parser_of(Example).parse_args(["--target", "x:1", "--count", "7"])
    assert from_args(Example, args, count=1, handle="h") == Example(target="x:1", count=1, handle="h")
    assert from_args(Example, args, only=["target"]) == Example(target="x:1")


def test_only_and_skip_choose_the_flags_and_an_unknown_one_is_refused():
    parser = argparse.ArgumentParser()
    assert add_flags(parser, Example, only=["count", "verbose"]) == ["count", "verbose"]
    assert to_argv(Example(target="x", count=3, verbose=True), skip=["target"]) == ["--count", "3", "--verbose"]
    with pytest.raises(ValueError, match="no flags"):
        add_flags(argparse.ArgumentParser(), Example, only=["nothing"])


def test_argv_for_writes_the_named_fields_alone_and_nothing_for_a_default():
    assert argv_for(Example, count=3, verbose=True, files=("a",)) == ["--count", "3", "--verbose", "--file", "a"]
    assert argv_for(Example, count=2, cache=True) == []
    assert argv_for(StageOptions, kv_budget_gib=4.0) == ["--kv-budget-gib", "4.0"]


def test_a_bad_value_names_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parser_of(Example).parse_args(["--target", "x", "--count", "many"])
    assert info.value.code == 2
    assert "argument --count: invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser_of(Example).parse_args(["--target", "x", "--mode", "medium"])
    assert "argument --mode: invalid choice: 'medium'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser_of(Example).parse_args([])
    assert "the following arguments are required: --target" in capsys.readouterr().err


def test_help_shows_each_default_once():
    text = " ".join(parser_of(Example).format_help().split())
    assert text.count("(default: 2)") == 1 and "(default: 0.5)" in text and "(default: fast)" in text
    assert "a name (default: the host's)" in text and "(default: None)" not in text  # the help's own, alone
    assert "(default: False)" not in text and "(default: True)" not in text and "(default: ())" not in text
    assert "(default: 3)" in text  # a nested flag's too


@pytest.mark.parametrize(
    "options",
    [
        CoordinatorOptions(stages=2),
        CoordinatorOptions(
            stages=2,
            cfg_parallel=2,
            partition="1,3",
            port=0,
            backend="gloo",
            stage_ms=[20.0, 21.5],
            slo_learn=False,
            vae_ms_per_chunk={"full": 26.0, "tiny": 5.0},
            record_plan=True,
            health_port=9000,
        ),
        StageOptions(coordinator="c:1", checkpoint="ckpt", index=0),
        StageOptions(
            coordinator="c:1",
            checkpoint="ckpt",
            index=1,
            sp=2,
            sp_rank=1,
            device="cuda:1",
            dtype="bfloat16",
            expected_world_size=4,
            cuda_graphs=True,
            calibration_s=0.0,
            loras=("a.safetensors", "b.safetensors:0.5"),
        ),
        GatewayOptions(coordinator="c:1", checkpoint="ckpt"),
        GatewayOptions(
            coordinator="c:1",
            checkpoint="ckpt",
            port=0,
            text_graph=False,
            vae_devices=["cuda:0", "cuda:1"],
            vae_split=[4],
            pipeline_warmup_s=0.0,
            health_port=0,
            quotas=QuotaOptions(streams=3, unpaced=1),
        ),
        VAEStageOptions(checkpoint="ckpt", index=0, num_slices=2, cuda_graphs=(480, 832), next="v:2"),
        WebConfig(gateway="g:1", ice_hosts=["10.0.0.7", "10.0.0.8"], gateway_tls=True, max_peers=2),
    ],
    ids=lambda o: type(o).__name__,
)
def test_each_services_options_round_trip_through_their_command_line(options):
    assert round_trip(options) == options


def test_the_options_check_their_flags_together_naming_them():
    with pytest.raises(ValueError, match="--slo-fixed keeps the --stage-ms"):
        CoordinatorOptions(stages=2, slo_learn=False)
    with pytest.raises(ValueError, match="--stage-ms: 2 values"):
        CoordinatorOptions(stages=2, stage_ms=[1.0])
    with pytest.raises(ValueError, match="--max-unpaced-per-client must be in"):
        QuotaOptions(unpaced=0)

"""Every ``stagecast`` subcommand's ``--help`` shows a line for every flag and the defaults."""

import argparse

import pytest

from launcher.cli import COMMANDS, build_parser, chosen_command
from stagecast.flags import HelpFormatter, shows_default

pytestmark = pytest.mark.unit


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_every_flag_has_a_help_line_and_help_shows_the_defaults(name):
    sub = _subcommands()[name]
    actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    assert actions, name
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in actions if not (a.help or "").strip()]
    assert not missing, f"stagecast {name}: flags without a help line: {missing}"
    text = " ".join(sub.format_help().split())
    for action in actions:
        if shows_default(action) and not action.required:
            assert f"(default: {action.default})" in text, (name, action.option_strings)


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_help_states_each_default_once(name):
    """A help line that says its own default gets no second one, and one that does not gets it from the formatter."""
    sub = _subcommands()[name]
    assert sub.formatter_class is HelpFormatter, name
    formatter = sub._get_formatter()
    for action in sub._actions:
        if action.option_strings and action.help and not isinstance(action, argparse._HelpAction):
            line = formatter._expand_help(action)
            assert line.count("default:") <= 1, (name, action.option_strings, line)


def test_the_gateway_help_names_its_limits():
    text = " ".join(_subcommands()["gateway"].format_help().split())
    for flag in ("--config-timeout", "--max-pending", "--max-watchers", "--health-port", "--max-frame-pixels"):
        assert flag in text
    assert "(default: 10.0)" in text and "(default: 128)" in text


@pytest.mark.parametrize(
    ("index_flag", "env_index", "names"),
    [
        ([], None, "--index or STAGECAST_STAGE_INDEX"),
        ([], "one", "STAGECAST_STAGE_INDEX"),
        (["--index", "-1"], None, "--index"),
    ],
)
def test_a_stage_without_a_usable_index_says_which_field_on_stderr(capsys, monkeypatch, index_flag, env_index, names):
    from launcher.cli import main

    monkeypatch.delenv("STAGECAST_STAGE_INDEX", raising=False)
    if env_index is not None:
        monkeypatch.setenv("STAGECAST_STAGE_INDEX", env_index)
    assert main(["stage", "--coordinator", "127.0.0.1:1", "--checkpoint", "random:tiny", *index_flag]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("stagecast stage: error:") and names in err, err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_is_built_from_its_own_module_alone(name):
    # The table's name is the one the module's function adds, so `stagecast NAME` needs only that module.
    assert chosen_command([name, "--help"]) == name
    parser = build_parser(name)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(action.choices) == [name]


def test_a_command_line_without_a_known_subcommand_gets_every_subcommand_in_its_help():
    assert chosen_command(["--help"]) is None and chosen_command(["nonsense"]) is None
    assert set(_subcommands()) == set(COMMANDS)


@pytest.mark.unit
def test_stagecast_version_answers_with_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"stagecast {version('stagecast')}"


@pytest.mark.unit
def test_stagecast_help_opens_with_what_it_is_and_where_to_start():
    first = build_parser().format_help().split("\n\n")[1].splitlines()[0]
    assert first.startswith("stagecast: real-time streaming video generation.") and "stagecast demo" in first
    for jargon in ("floor", "owned by"):
        assert jargon not in first


def test_the_top_level_help_lists_every_everyday_flag_of_demo_including_serve():
    """A newcomer reads ``stagecast --help`` first: it names ``demo --serve``, which keeps the live page up."""
    text = build_parser().format_help()
    demo = next(line for line in text.splitlines() if line.startswith("stagecast demo "))
    assert "[--serve]" in demo and "[--seconds N]" in demo

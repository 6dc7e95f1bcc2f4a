"""The flag reference in ``docs/operator-guide.md``, written from the services' options (their one declaration).

    python -m launcher.flag_reference           # rewrite the section between its markers
    python -m launcher.flag_reference --check   # exit 1 if the section is not what the options say

``tests/test_helm_cli_contract.py`` fails when the section is stale, so a new flag reaches the docs with its help.
The same test fails for a service flag the chart neither sets nor exempts with a reason (its ``NOT_IN_CHART``), so a
new flag also reaches the chart or says why not.  A command's own flags (``up``, ``selftest``, ``demo``) are declared
in its ``launcher/`` module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stagecast.flags import HelpFormatter, add_flags, specs

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "operator-guide.md"
BEGIN = "<!-- flag reference: written by python -m launcher.flag_reference -->"
END = "<!-- end of flag reference -->"


def service_options() -> dict[str, type]:
    """Each service command's options dataclass, by its ``stagecast`` command."""
    from coordinator.options import CoordinatorOptions
    from gateway.options import GatewayOptions, VAEStageOptions
    from stage_service.options import StageOptions
    from web.options import WebConfig

    return {
        "coordinator": CoordinatorOptions,
        "stage": StageOptions,
        "gateway": GatewayOptions,
        "vae-stage": VAEStageOptions,
        "web": WebConfig,
    }


def section() -> str:
    """The reference: per command, each flag with its default and help (``--mtls`` / ``--insecure-internal`` are
    in "Security" above)."""
    lines = [
        BEGIN,
        "",
        "## Flag reference",
        "",
        "Every service flag, as `stagecast <command> --help` prints it. Each is declared once, as a field of the",
        "service's options dataclass (`coordinator/options.py`, `stage_service/options.py`, `gateway/options.py`,",
        "`web/options.py`); `stagecast up` and the benchmark harness pass them on from the same dataclasses.",
    ]
    for command, cls in service_options().items():
        parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
        add_flags(parser, cls)
        actions = {a.dest: a for a in parser._actions}
        lines += ["", f"### `stagecast {command}`", "", "| flag | default | what |", "|---|---|---|"]
        for spec in specs(cls):
            action = actions[spec.dest]
            optional = isinstance(action, argparse.BooleanOptionalAction)  # --x / --no-x
            if action.required:
                default = "required"
            elif optional:
                default = "on" if action.default else "off"
            elif action.nargs == 0:
                default = "off"  # a switch: off unless given
            else:
                default = f"`{action.default}`" if action.default not in (None, [], ()) else ""
            text = (action.help or "").replace("%%", "%").replace("|", "\\|")
            name = " / ".join(f"`{o}`" for o in action.option_strings) if optional else f"`{spec.name}`"
            lines.append(f"| {name} | {default} | {text} |")
    return "\n".join([*lines, "", END])


def updated(text: str) -> str:
    """``text`` (the guide) with its reference section replaced (or appended)."""
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        return head + section() + tail
    return text.rstrip("\n") + "\n\n" + section() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the guide's section is stale; write nothing")
    args = ap.parse_args(argv)
    text = GUIDE.read_text()
    if updated(text) == text:
        return 0
    if args.check:
        print(f"{GUIDE}: the flag reference is stale: run python -m launcher.flag_reference", file=sys.stderr)
        return 1
    GUIDE.write_text(updated(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())

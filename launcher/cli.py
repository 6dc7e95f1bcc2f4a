"""stagecast: real-time streaming video generation. Try `stagecast demo` (CPU, a minute), then `up` and `generate`.

stagecast up --checkpoint DIR --stages K        coordinator + K stages + gateway on this machine
stagecast coordinator --stages K ...            one coordinator process
stagecast stage --index I --coordinator H:P ... one stage process
stagecast gateway --coordinator H:P --checkpoint DIR   the public streaming API (stagecast.v1)
stagecast vae-stage --checkpoint DIR --index I --num-slices N [--next H:P]   one VAE decoder slice
stagecast web --gateway H:P [--port 8080]       the live browser page: WebRTC, WebSocket fallback
stagecast selftest --stages K ...               distributed run vs the reference executor, exit 1 on mismatch
stagecast simulate --stages P --steps S ...     scheduler simulator: utilization and bubble fraction
stagecast demo-checkpoint --out DIR             write the tiny random demo checkpoint
stagecast convert SRC.pt --source S --out DIR [--base DIR]   a CausVid / Self-Forcing / SDV2 file to a checkpoint
stagecast generate --target H:P --prompt P --seconds N --out clip.mp4   stream a clip through a gateway
stagecast transform --target H:P --input in.mp4 --prompt P --out out.mp4   restyle a video file (video-to-video)
stagecast demo [--seconds N] [--out demo.mp4] [--stages K] [--serve]   everything on CPU with a tiny random model
                                                (--serve: keep the system and its live page up until Ctrl-C)
stagecast trace-summary FILE                    per-stage span latencies (p50/p95/max) of an OTLP JSON trace file
"""

from __future__ import annotations

import argparse
import importlib
import sys

from stagecast.log import quiet_grpc_core

quiet_grpc_core()  # before grpc loads: C-core's raw lines stay out of the terminal

from stagecast.service import INTERRUPTED, die_of_sigint, die_with_parent, run_command  # noqa: E402

# Each subcommand's name -> (module, function adding its parser): each parser sets ``run`` to its entry point.  The
# services own their flags (``*/cli.py``); the launcher floor owns up, selftest and the demo; the SDK owns generate.
# Only the chosen subcommand's module is imported, so a service process does not load the selftest, the converter
# or diffusers for commands it never runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "coordinator": ("coordinator.cli", "add_parser"),
    "stage": ("stage_service.cli", "add_parser"),
    "up": ("launcher.up", "add_parser"),
    "selftest": ("launcher.selftest", "add_parser"),
    "demo-checkpoint": ("launcher.demo_checkpoint", "add_parser"),
    "convert": ("launcher.convert", "add_parser"),
    "gateway": ("gateway.cli", "add_parser"),
    "vae-stage": ("gateway.cli", "add_vae_stage_parser"),
    "web": ("web.cli", "add_parser"),
    "generate": ("stagecast.generate", "add_parser"),
    "transform": ("stagecast.transform", "add_parser"),
    "demo": ("launcher.demo", "add_parser"),
    "simulate": ("coordinator.cli", "add_simulate_parser"),
    "trace-summary": ("stagecast.trace_summary", "add_parser"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stagecast")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), or None."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of one subcommand (its module alone is imported), or of all of them when ``command`` is None."""
    parser = argparse.ArgumentParser(
        prog="stagecast", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in [command] if command else COMMANDS:
        module, function = COMMANDS[name]
        getattr(importlib.import_module(module), function)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:  # answered before any subcommand's module is imported
        print(f"stagecast {_version()}")
        return 0
    command = chosen_command(argv)
    if command is not None:  # one subcommand: only its module is imported (stagecast.service.run_command)
        module, function = COMMANDS[command]
        rest = list(argv)
        rest.remove(command)
        return run_command(command, module, function, rest)
    args = build_parser().parse_args(argv)  # no subcommand named: argparse says what is missing, or prints --help
    return args.run(args)


def run() -> None:
    """The console entry point: ``main``, and an interrupted command ends the way shells expect of Ctrl-C.

    Killed by SIGINT rather than ``exit(130)``: a calling shell or script then sees an interrupt (bash stops a loop
    running it), and the status no longer depends on whether an interrupt was still pending at exit.
    """
    code = main()
    if code == INTERRUPTED:
        die_of_sigint()
    sys.exit(code)


if __name__ == "__main__":
    run()

"""``stagecast-client``: the client verbs without the server: ``generate`` (a clip into an MP4) and ``transform``
(a video file restyled), the same commands and flags as ``stagecast generate`` / ``stagecast transform``.

Usage::

    pip install "./clients/python[media,cli]"
    stagecast-client generate --target localhost:50051 --prompt "a red fox in snow" --seconds 2 --out clip.mp4
    stagecast-client transform --target localhost:50051 --input in.mp4 --prompt "a watercolor" --out out.mp4

The progress bar needs the ``cli`` extra (tqdm), the MP4 files the ``media`` extra (PyAV, Pillow).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

INTERRUPTED = 130  # a command's status after Ctrl-C, as shells report SIGINT (128 + 2)
GRPC_VERBOSITY = "ERROR"  # gRPC C-core's own log level in our commands, unless the user set GRPC_VERBOSITY
COMMANDS = {"generate": "stagecast_client.generate", "transform": "stagecast_client.transform"}


def quiet_grpc_core() -> None:
    """Keep gRPC C-core's raw lines (``Handshake failed ...``) out of the terminal: C-core reads ``GRPC_VERBOSITY``
    once, when grpc loads, so a command calls this before importing grpc.  A user's own ``GRPC_VERBOSITY`` wins;
    the SDK's errors explain such failures instead (``stagecast_client.errors.connection_hint``)."""
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagecast-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stagecast-client")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    quiet_grpc_core()
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.run(args))


def run() -> None:
    """The console entry point; an interrupted command ends killed by SIGINT, as shells expect of Ctrl-C."""
    code = main()
    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(INTERRUPTED)  # where the signal cannot be raised
    sys.exit(code)


if __name__ == "__main__":
    run()

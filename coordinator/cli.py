"""``stagecast coordinator`` and ``stagecast simulate``: the coordinator's entry points.

Its flags are ``CoordinatorOptions``' fields (``coordinator.options``); only ``--mtls`` / ``--insecure-internal``
are added here, as every internal service adds them.
"""

from __future__ import annotations

import argparse

from coordinator.options import CoordinatorOptions
from stagecast.flags import HelpFormatter, add_flags
from stagecast.service import add_security_flags, run_service


def add_parser(sub) -> None:
    p = sub.add_parser(
        "coordinator",
        help="run the coordinator (registry, scheduler, the stages' rendezvous store)",
        formatter_class=HelpFormatter,
    )
    add_flags(p, CoordinatorOptions)
    add_security_flags(p)
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from coordinator.server import serve
    from stagecast.flags import from_args
    from stagecast.security import mtls_from_flags

    def start(stop) -> None:
        mtls = mtls_from_flags(args.mtls, args.insecure_internal, "stagecast coordinator")
        serve(from_args(CoordinatorOptions, args, mtls=mtls), stop=stop)

    return run_service("coordinator", start)


def add_simulate_parser(sub) -> None:
    from coordinator import simulator

    simulator.add_simulate_parser(sub)
    sub.choices["simulate"].set_defaults(run=simulator.main)

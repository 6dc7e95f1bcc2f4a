"""One place that configures logging for every stagecast process.  Modules call
``logging.getLogger(__name__)``; entry points call ``setup_logging()`` once, and ``quiet_grpc_core()`` before grpc
is imported."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("STAGECAST_LOG_LEVEL", "INFO")).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# gRPC C-core's log level in our processes (unless the user set GRPC_VERBOSITY), set before grpc loads: the SDK's
# commands do the same, so it has one home there (stagecast_client.cli, which imports nothing heavy).
from stagecast_client.cli import GRPC_VERBOSITY, quiet_grpc_core  # noqa: E402, F401

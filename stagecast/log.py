"""One place that configures logging for every stagecast process.  Modules call
``logging.getLogger(__name__)``; entry points call ``setup_logging()`` once, and ``quiet_grpc_core()`` before grpc
is imported."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("STAGECAST_LOG_LEVEL", "INFO")).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


GRPC_VERBOSITY = "ERROR"  # gRPC C-core's own log level in our processes, unless the user set GRPC_VERBOSITY


def quiet_grpc_core() -> None:
    """Keep gRPC C-core's raw lines (``Handshake failed ...`` for every plaintext client of a TLS port, at INFO)
    out of our terminals and logs: C-core reads ``GRPC_VERBOSITY`` once, when grpc loads, so every entry point calls
    this before importing grpc.  A user's own ``GRPC_VERBOSITY`` wins; processes we start inherit the setting.  Our
    own messages explain such failures instead (``stagecast.errors``, the gateway's start-up line)."""
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY)

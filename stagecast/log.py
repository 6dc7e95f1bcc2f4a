"""One place that configures logging for every stagecast process.  Modules call
``logging.getLogger(__name__)``; entry points call ``setup_logging()`` once."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("STAGECAST_LOG_LEVEL", "INFO")).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

"""kiln's log format: `[INFO] message`, to stderr, set up once by the CLI or the offline API."""

from __future__ import annotations

import logging
import sys

from kiln.env import read_env

logger = logging.getLogger("kiln")


def setup_logging(level: str | None = None) -> None:
    if getattr(logger, "_kiln_configured", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level or read_env().log_level)
    logger.propagate = False
    logger._kiln_configured = True  # type: ignore[attr-defined]

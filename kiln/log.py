"""kiln's log format: `[INFO] message`, to stderr, set up once by the CLI or the offline API."""

from __future__ import annotations

import logging
import sys

from kiln.env import read_env

logger = logging.getLogger("kiln")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (test runners and servers swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: str | None = None, prefix: str = "") -> None:
    """kiln's log lines on stderr; `prefix` tags every line (a worker rank's `(rank 1) `)."""
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(f"[%(levelname)s] {prefix}%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level or read_env().log_level)
    logger.propagate = False

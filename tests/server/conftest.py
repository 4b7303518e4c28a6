"""Fixtures of the server tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def kiln_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the "kiln" logger, which stops propagating to the root logger (caplog's) once `setup_logging` ran."""
    logger = logging.getLogger("kiln")
    is_attached = not logger.propagate
    if is_attached:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            yield caplog
    finally:
        if is_attached:
            logger.removeHandler(caplog.handler)

"""Fixtures for the debugger's tests: sessions on tiny synthetic models (eager compiler: no codegen cost)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.debug.diff import Reference, build_reference
from kiln.debug.pytest_plugin import pytest_collect_file  # noqa: F401  (debug cases under tests/ run as tests)
from kiln.debug.session import DebugSession
from kiln.engine.setup.args import EngineArgs

TINY = "tests.debug.models:tiny_llama"
PROMPT = [3, 17, 42, 5, 99, 7, 11]  # 7 tokens: the prefill pads to capture size 8
NUM_DECODE = 4


def tiny_options(**overrides: object) -> EngineArgs:
    values: dict = {"model": TINY, "compiler": "eager", "capture_sizes": (1, 2, 4, 8)}
    values.update(overrides)
    return EngineArgs(**values)


@pytest.fixture
def open_tiny() -> Callable[..., DebugSession]:
    return lambda **overrides: DebugSession.open(tiny_options(**overrides))


@pytest.fixture(scope="module")
def tiny_reference() -> Reference:
    """The eager reference of the tiny model (faults never touch the eager path, so one serves every session)."""
    return build_reference(DebugSession.open(tiny_options()), PROMPT, NUM_DECODE)

"""Shared fixtures: the default model loaded once per session (CPU, fp32); kernel choices made afresh."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiln import LLM
from kiln.kernels.choices import forget_process_choices


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM("default", dtype="float32", seed=0, quantization="none", graph_mode="eager")  # the dequantized reference


@pytest.fixture
def fresh_kernel_choices() -> Iterator[None]:
    """For tests of the timing itself (or that fake it): the process forgets the kernel choices it holds before
    the test, and forgets the test's after it, so no other test runs on them."""
    forget_process_choices()
    yield
    forget_process_choices()

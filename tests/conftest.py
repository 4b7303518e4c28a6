"""Shared fixtures: the default model loaded once per session (CPU, fp32)."""

from __future__ import annotations

import pytest

from kiln import LLM


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM("default", dtype="float32", seed=0, quantization="none")  # the dequantized reference

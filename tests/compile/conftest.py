"""Fixtures for graph-mode tests (helpers live in tests/compile/tiny.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A fresh compile cache per test."""
    return tmp_path / "kiln-cache"

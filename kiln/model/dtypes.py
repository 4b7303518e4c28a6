"""Dtype names (`float32`, `bf16`, ...) to torch dtypes, with a clear error (the names live in kiln.config)."""

from __future__ import annotations

import torch

from kiln.config import DTYPE_ALIASES, DTYPE_NAMES
from kiln.errors import ConfigError


def parse_dtype(name: str) -> torch.dtype:
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, key)

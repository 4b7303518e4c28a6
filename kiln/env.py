"""Every KILN_* environment variable, read in one place into one typed, frozen object."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Env:
    log_level: str  # KILN_LOG_LEVEL: DEBUG | INFO | WARNING
    debug: int  # KILN_DEBUG: 0 off, 1 trace mode: log every piece launch (mode, sizes, time), check replay inputs
    cache_dir: Path  # KILN_CACHE_DIR: compile cache root (default ~/.cache/kiln)
    num_threads: int | None  # KILN_NUM_THREADS: torch intra-op threads (default: all cores)
    api_key: str | None  # KILN_API_KEY: the server's API key (kept out of the process list, unlike --api-key)


def read_env() -> Env:
    threads = os.environ.get("KILN_NUM_THREADS")
    return Env(
        log_level=os.environ.get("KILN_LOG_LEVEL", "INFO").upper(),
        debug=int(os.environ.get("KILN_DEBUG", "0") or 0),
        cache_dir=Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")),
        num_threads=int(threads) if threads else None,
        api_key=os.environ.get("KILN_API_KEY", "").strip() or None,
    )

"""Every KILN_* environment variable, read in one place into one typed, frozen object (or, for the one kiln sets
for a child process rather than reads, named here)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Env:
    log_level: str  # KILN_LOG_LEVEL: DEBUG | INFO | WARNING
    debug: int  # KILN_DEBUG: 0 off, 1 trace mode: log every piece launch (mode, sizes, time), check replay inputs
    cache_dir: Path  # KILN_CACHE_DIR: compile cache root (default ~/.cache/kiln)
    # KILN_NATIVE_DIR: native kernel objects built at install (`kiln kernels build`, run by `make setup`); default
    # <environment>/share/kiln/native, beside the installed package (objects missing there are built into the cache)
    native_dir: Path
    num_threads: int | None  # KILN_NUM_THREADS: torch intra-op threads (default: all cores)
    api_key: str | None  # KILN_API_KEY: the server's API key (kept out of the process list, unlike --api-key)
    model_plugins: tuple[str, ...]  # KILN_MODEL_PLUGINS: modules that call kiln.models.register when imported
    vllm_python: Path | None  # KILN_VLLM_PYTHON: the Python of vLLM's environment (`bench --compare vllm`)


# Set, never read, by `kiln debug bisect` for its --check command: the piece modes of the round being checked.
PIECE_MODES_VAR = "KILN_PIECE_MODES"


def read_env() -> Env:
    threads = os.environ.get("KILN_NUM_THREADS")
    return Env(
        log_level=os.environ.get("KILN_LOG_LEVEL", "INFO").upper(),
        debug=int(os.environ.get("KILN_DEBUG", "0") or 0),
        cache_dir=Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")),
        native_dir=Path(os.environ.get("KILN_NATIVE_DIR", Path(sys.prefix) / "share" / "kiln" / "native")),
        num_threads=int(threads) if threads else None,
        api_key=os.environ.get("KILN_API_KEY", "").strip() or None,
        model_plugins=tuple(filter(None, (m.strip() for m in os.environ.get("KILN_MODEL_PLUGINS", "").split(",")))),
        vllm_python=Path(os.environ["KILN_VLLM_PYTHON"]) if os.environ.get("KILN_VLLM_PYTHON") else None,
    )

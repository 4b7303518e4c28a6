"""The LoRA adapter a debug case was saved with (`kiln debug save-case --lora NAME=PATH`), and its check at replay.

The case records the adapter's name, its directory (absolute), its rank, the engine's `--max-lora-rank` and a
SHA-256 of each of its two files. A replay runs the request with the same adapter, so `check-case` first holds the
files to the record: a missing file or one whose bytes changed is refused by name, since the case's expectations
were computed with the adapter as it was saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.compile.cache import file_sha256
from kiln.errors import ConfigError
from kiln.lora.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter
from kiln.lora.request import LoRARequest

ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
DEBUG_LORA_ID = 1  # a debug request runs one adapter, under this id (`--lora` and a case's alike)


def adapter_record(lora: LoRARequest | None, max_lora_rank: int) -> dict[str, Any] | None:
    """The case's `lora` entry for the adapter a session ran with (None without one)."""
    if lora is None:
        return None
    directory = Path(lora.lora_path).resolve()
    return {
        "name": lora.lora_name,
        "path": str(directory),
        "rank": read_adapter(directory).rank,
        "max_lora_rank": max_lora_rank,
        "sha256": {name: file_sha256(directory / name) for name in ADAPTER_FILES},
    }


def case_lora_request(record: dict[str, Any] | None, case_file: Path) -> LoRARequest | None:
    """The adapter the case replays with, after its files are checked against the record: ConfigError naming the
    file that is missing or differs."""
    if record is None:
        return None
    directory = Path(record["path"])
    for name, saved in record["sha256"].items():
        path = directory / name
        if not path.is_file():
            raise ConfigError(
                f"{case_file}: the case was saved with LoRA adapter {record['name']!r} but {path} is missing: "
                "restore the adapter there, or save the case again"
            )
        if file_sha256(path) != saved:
            raise ConfigError(
                f"{case_file}: {path} differs from the file LoRA adapter {record['name']!r} had when the case was "
                "saved (its SHA-256 changed): the case's expectations are the old adapter's; restore it, or save "
                "the case again"
            )
    return LoRARequest(record["name"], DEBUG_LORA_ID, str(directory))

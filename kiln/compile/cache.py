"""The on-disk compile cache: one entry per compiled piece structure, never trusted blindly.

Key = sha256(piece structure, compiler + its options, normalized recipe hash, torch version, device, format).
An entry is a directory holding the compiler's artifact and `manifest.json` (the key's parts and the
artifact's sha256). A missing file, a checksum or key mismatch, a failed load, or a loaded piece whose
output differs from the traced graph's marks the entry stale/corrupt: it is removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.executor.counters import CompileCounters

logger = logging.getLogger("kiln")

CACHE_FORMAT = 1
ARTIFACT = "artifact.bin"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CacheKey:
    structure: str
    compiler: str
    options: str  # JSON of the compiler options
    recipe_hash: str
    torch_version: str
    device: str

    @property
    def digest(self) -> str:
        parts = [str(CACHE_FORMAT), self.structure, self.compiler, self.options, self.recipe_hash]
        parts += [self.torch_version, self.device]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    def as_dict(self) -> dict[str, str | int]:
        return {
            "format": CACHE_FORMAT,
            "structure": self.structure,
            "compiler": self.compiler,
            "options": self.options,
            "recipe_hash": self.recipe_hash,
            "torch_version": self.torch_version,
            "device": self.device,
        }


def make_key(structure: str, compiler: str, options: dict, recipe_hash: str, device: torch.device) -> CacheKey:
    device_name = device.type
    if device.type == "cuda":
        device_name = f"cuda:{torch.cuda.get_device_name(device)}:{torch.version.cuda}"
    return CacheKey(
        structure=structure,
        compiler=compiler,
        options=json.dumps(options, sort_keys=True),
        recipe_hash=normalize_recipe_hash(recipe_hash),
        torch_version=torch.__version__,
        device=device_name,
    )


def normalize_recipe_hash(recipe_hash: str) -> str:
    return recipe_hash.strip().lower().removeprefix("sha256:")


class CompileCache:
    def __init__(self, root: Path, counters: CompileCounters) -> None:
        self.root = Path(root) / "compile"
        self.counters = counters

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / key.digest

    def lookup(self, key: CacheKey) -> Path | None:
        """The artifact path of a valid entry; None when absent. A corrupt or stale entry is removed (and logged)."""
        entry = self.entry_dir(key)
        if not entry.exists():
            return None
        problem = self._check(entry, key)
        if problem is None:
            return entry / ARTIFACT
        self.reject(key, problem)
        return None

    def reject(self, key: CacheKey, problem: str) -> None:
        entry = self.entry_dir(key)
        logger.warning("Compile cache entry %s is stale or corrupt (%s): rebuilding it", entry, problem)
        self.counters.cache_rejected += 1
        shutil.rmtree(entry, ignore_errors=True)

    def store(self, key: CacheKey, write_artifact: Callable[[Path], None]) -> Path:
        """Write the artifact through `write_artifact(path)` into a temp dir, then move it into place."""
        entry = self.entry_dir(key)
        tmp = entry.with_name(entry.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_artifact(tmp / ARTIFACT)
        manifest = {**key.as_dict(), "sha256": _sha256(tmp / ARTIFACT)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
        return entry / ARTIFACT

    @staticmethod
    def _check(entry: Path, key: CacheKey) -> str | None:
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
        except FileNotFoundError:
            return "no manifest.json"
        except (OSError, ValueError) as exc:
            return f"unreadable manifest.json: {exc}"
        if not isinstance(manifest, dict):
            return "manifest.json is not an object"
        for name, value in key.as_dict().items():
            if manifest.get(name) != value:
                return f"{name} is {manifest.get(name)!r}, expected {value!r}"
        artifact = entry / ARTIFACT
        if not artifact.is_file():
            return f"no {ARTIFACT}"
        if _sha256(artifact) != manifest.get("sha256"):
            return f"{ARTIFACT} checksum mismatch"
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

"""The on-disk compile cache: one entry per compiled piece structure, never trusted blindly.

Key = sha256(piece structure, compiler + its options, normalized recipe hash, torch version, device, format).
An entry is a directory holding the compiler's artifact and `manifest.json` (the key's parts and the
artifact's sha256). A missing file, a checksum or key mismatch, a failed load, or a loaded piece whose
output differs from the traced graph's marks the entry stale/corrupt: it is removed and rebuilt.

Entries hold generated code that is imported on load, so the cache is used only when its directory is
private (owned by this user, not writable by group or others), and the manifest is checked before a path is
handed out. Several processes may store the same entry at once: each writes into its own temp folder and
swaps it into place under a lock; a store that fails is logged and skipped, never raised.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.compile.counters import CompileCounters
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")

CACHE_FORMAT = 1
ARTIFACT = "artifact.bin"
MANIFEST = "manifest.json"
# NOTE: entries are named by the bare hex digest; these marks keep a temp or discarded folder (even one a killed
# process left behind) from ever being read as an entry.
TEMP_MARK = ".tmp."
DISCARD_MARK = ".old."


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
    return CacheKey(
        structure=structure,
        compiler=compiler,
        options=json.dumps(options, sort_keys=True),
        recipe_hash=normalize_recipe_hash(recipe_hash),
        torch_version=torch.__version__,
        device=platform_of(device).cache_name(device),
    )


def normalize_recipe_hash(recipe_hash: str) -> str:
    return recipe_hash.strip().lower().removeprefix("sha256:")


class CompileCache:
    """Entries under `<root>/compile`, one folder per key digest.

    Rules: the folder's trust is decided once, here; an untrusted one is never read or written (lookup returns
    None, store writes nothing). `lookup` hands out an artifact path only after its manifest matched. `store`
    never raises and only the final swap is locked, so concurrent writers of one entry never see each other's
    half-written folders.
    """

    def __init__(self, root: Path, counters: CompileCounters) -> None:
        self.root = Path(root) / "compile"
        self.counters = counters
        self.enabled = _trust_private_dir(self.root)

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / key.digest

    def lookup(self, key: CacheKey) -> Path | None:
        """The artifact path of a valid entry; None when absent. A corrupt or stale entry is removed (and logged)."""
        if not self.enabled:
            return None
        entry = self.entry_dir(key)
        if not entry.exists():
            return None
        problem = self._check(entry, key)
        if problem is None:
            return entry / ARTIFACT
        self.reject(key, problem)
        return None

    def reject(self, key: CacheKey, problem: str) -> None:
        """Log `problem` with the entry and remove the entry, so the next store rebuilds it."""
        if not self.enabled:
            return
        entry = self.entry_dir(key)
        self.counters.cache_rejected += 1
        try:
            _discard(entry)
        except OSError as exc:  # e.g. a read-only cache: the entry stays and the piece compiles fresh anyway
            problem += f"; it could not be removed: {exc}"
        logger.warning("Compile cache entry %s is stale or corrupt (%s): rebuilding it", entry, problem)

    def store(self, key: CacheKey, write_artifact: Callable[[Path], None]) -> Path | None:
        """Write the artifact through `write_artifact(path)` into a private temp folder, then swap it into place.

        Returns the stored artifact's path, or None when the cache is not used or the store failed; a failure
        is one warning (entry and reason) and leaves neither an entry nor a temp folder behind.
        """
        if not self.enabled:
            return None
        entry = self.entry_dir(key)
        tmp: Path | None = None
        # NOTE: any exception (a full disk, a compiler whose save raises) only costs the cache entry: the
        # caller already holds the compiled piece, so the engine must start anyway.
        try:
            tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=entry.name + TEMP_MARK))
            write_artifact(tmp / ARTIFACT)
            manifest = {**key.as_dict(), "sha256": file_sha256(tmp / ARTIFACT)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            with self._locked():
                _discard(entry)
                tmp.rename(entry)
        except Exception as exc:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            logger.warning(
                "Compile cache entry %s was not stored (%s: %s): the piece is used without being cached",
                entry,
                type(exc).__name__,
                exc,
            )
            return None
        return entry / ARTIFACT

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the cache's exclusive lock: writers swap entries one at a time."""
        # NOTE: the lock is taken on the cache folder itself (flock works on a directory's descriptor), so
        # there is no lock file to leave behind or to list among the entries.
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

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
        if file_sha256(artifact) != manifest.get("sha256"):
            return f"{ARTIFACT} checksum mismatch"
        return None


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _discard(entry: Path) -> None:
    """Remove `entry` if present. It is first renamed aside (atomic), so no reader ever sees it half-deleted."""
    trash = entry.with_name(entry.name + DISCARD_MARK + uuid.uuid4().hex[:12])
    try:
        entry.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _trust_private_dir(path: Path) -> bool:
    """Create `path` (mode 0700) when missing; whether it is private to this user. Logs why it is not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with suppress(FileExistsError):
            path.mkdir(mode=0o700)
        st = path.stat()
    except OSError as exc:
        found, fix = f"it cannot be created or read ({exc})", "pick another directory"
    else:
        found, fix = _untrusted_because(st)
    if not found:
        return True
    logger.warning(
        "Compile cache %s is not used: %s. Its entries hold generated code that kiln imports, so only a folder "
        "private to this user is trusted; pieces compile fresh. To use it: %s (--cache-dir or KILN_CACHE_DIR).",
        path,
        found,
        fix.replace("DIR", str(path)),
    )
    return False


def _untrusted_because(st: os.stat_result) -> tuple[str, str]:
    """(what makes a folder with this stat untrusted, what to do), or ("", "") when it is trusted."""
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory", "remove DIR or pick another directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this process's uid {os.getuid()}", "pick a directory you own"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        return f"it is writable by group or others (mode {mode:04o})", "run `chmod 700 DIR`, or pick another directory"
    return "", ""

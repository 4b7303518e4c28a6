"""Bisect over piece modes: the minimal set of pieces whose graph mode makes a check fail.

A round runs the check with a set of *suspect* pieces captured and every other piece eager (the traced graph run
op by op, the known-good side). Round 1 confirms the failure with every piece captured, round 2 that it goes away
with every piece eager. Then, assuming the failure is monotone in the suspect set, a binary search over prefixes
finds the last piece needed (about log2(N) rounds), one more round checks whether the pieces found so far fail on
their own, and the search repeats below that piece until they do. A final round runs the culprits *compiled*
rather than captured, which tells a miscompile from a capture/replay fault.

The check is any `fails(piece_modes) -> bool`: a diff against the eager reference, a saved case, or a command
(`--check CMD`, run without a shell; `{piece_modes}` in it becomes e.g. `0-3:eager,4:captured`, also passed as
KILN_PIECE_MODES in its environment).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kiln.compile.modes import PieceMode, format_piece_modes
from kiln.env import PIECE_MODES_VAR
from kiln.errors import ConfigError

Fails = Callable[[dict[int, PieceMode]], bool]


@dataclass
class BisectRound:
    number: int
    suspects: list[int]
    mode: str
    failed: bool

    def __str__(self) -> str:
        outcome = "FAIL" if self.failed else "pass"
        return f"Bisect round {self.number}: pieces {format_indices(self.suspects)} {self.mode} → {outcome}"


@dataclass
class BisectResult:
    culprits: list[int]
    rounds: list[BisectRound]
    verdict: str
    fails_compiled: bool | None = None  # do the culprits fail when only compiled (None: no culprits)
    extra: dict[str, object] = field(default_factory=dict)


def format_indices(indices: Sequence[int]) -> str:
    """[0, 1, 2, 3, 9] -> '0-3,9'; [] -> 'none'."""
    items = sorted(set(indices))
    if not items:
        return "none"
    spans: list[str] = []
    start = prev = items[0]
    for i in items[1:]:
        if i == prev + 1:
            prev = i
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    spans.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(spans)


class Bisector:
    def __init__(self, num_pieces: int, fails: Fails, log: Callable[[str], None] = print) -> None:
        self.num_pieces = num_pieces
        self.fails = fails
        self.log = log
        self.rounds: list[BisectRound] = []

    def _round(self, suspects: set[int], mode: PieceMode = PieceMode.CAPTURED) -> bool:
        modes = {i: mode if i in suspects else PieceMode.EAGER for i in range(self.num_pieces)}
        failed = self.fails(modes)
        r = BisectRound(len(self.rounds) + 1, sorted(suspects), mode.value, failed)
        self.rounds.append(r)
        self.log(str(r))
        return failed

    def run(self) -> BisectResult:
        everything = set(range(self.num_pieces))
        if not self._round(everything):
            return BisectResult([], self.rounds, "no failure with every piece captured: nothing to bisect")
        if self._round(set()):
            return BisectResult(
                [], self.rounds, "the check fails with every piece eager too: the fault is not in graph mode"
            )
        culprits: list[int] = []
        candidates = list(range(self.num_pieces))
        while True:
            lo, hi = 0, len(candidates)  # prefix(hi) + culprits fails; prefix(lo) + culprits passes
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._round(set(candidates[:mid]) | set(culprits)):
                    hi = mid
                else:
                    lo = mid
            culprits.append(candidates[hi - 1])
            candidates = candidates[: hi - 1]
            if hi == 1 and self.rounds[-1].failed and set(self.rounds[-1].suspects) == set(culprits):
                break  # the last round already ran exactly the culprits, and failed
            if self._round(set(culprits)):
                break
            if not candidates:
                return BisectResult(
                    [], self.rounds, "the failure is not monotone in the set of captured pieces: no minimal set found"
                )
        fails_compiled = self._round(set(culprits), PieceMode.COMPILED)
        names = format_indices(culprits)
        if fails_compiled:
            verdict = (
                f"pieces {names} fail already compiled: their compiled code is wrong "
                f"(work around with --piece-modes {_spec(culprits, 'eager')})"
            )
        else:
            verdict = (
                f"pieces {names} fail only when captured: a capture/replay fault "
                f"(work around with --piece-modes {_spec(culprits, 'compiled')})"
            )
        return BisectResult(sorted(culprits), self.rounds, verdict, fails_compiled)


def _spec(indices: Sequence[int], mode: str) -> str:
    return format_piece_modes({i: PieceMode(mode) for i in indices})


def command_check(command: str, log: Callable[[str], None] = print) -> Fails:
    """`fails` for a user command: split with shlex (no shell); non-zero exit status means FAIL."""
    argv_template = shlex.split(command)
    if not argv_template:
        raise ConfigError("--check: the command is empty")

    def fails(modes: dict[int, PieceMode]) -> bool:
        spec = format_piece_modes(modes)
        argv = [a.replace("{piece_modes}", spec) for a in argv_template]
        try:
            proc = subprocess.run(
                argv, env={**os.environ, PIECE_MODES_VAR: spec}, capture_output=True, text=True, check=False
            )
        except OSError as exc:
            raise ConfigError(f"--check: cannot run {argv[0]!r}: {exc}") from None
        if proc.returncode != 0:
            last = (proc.stderr or proc.stdout).strip().splitlines()
            log(f"  check exited {proc.returncode}" + (f": {last[-1]}" if last else ""))
        return proc.returncode != 0

    return fails

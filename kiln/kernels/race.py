"""A race of kernel candidates for one product at one row count, on this machine (the packed kernel table's timing,
kiln.kernels.packed).

Candidates run in turns, round after round, so a burst of other work slows one sweep of one candidate rather than
all of a candidate's sweeps. What keeps a race short, without ever guessing which kernel wins:
- **floors**: each entrant says the least time it can take, from what is known when its turn comes (its own time at
  fewer rows: a product of more rows does at least the work of fewer; for dequantize-then-BLAS forms, the BLAS
  part of the times measured so far). An entrant whose floor is at or above the lead's time cannot win: it is ruled
  out before it is built, so a candidate that compiles or repacks costs nothing where it could not have won. The
  cheap entrants run first, so the lead is known before the costly ones' turns.
- **out of the race**: an entrant whose best of two sweeps is more than OUT_OF_RACE times the lead's sits out the
  rest (its time is that best): ruling out a kernel 10x slower takes two sweeps, not every round. Two, not one: a
  burst of other work during one sweep once made the fastest kernel look 18x slower than it is, and a race that
  dropped it then cached the wrong winner for good.
- **a time budget**: rounds go on while the race has taken less than RACE_S (at least one round): products of a
  second a call (the logits head at a thousand rows) are timed once each, a call long enough that a burst of
  other work moves it little.
- **close calls get more sweeps**: after the rounds, entrants within CLOSE_CALL of the lead run up to CLOSE_ROUNDS
  more rounds among themselves (within the time budget), so the best of more sweeps decides between them. With
  three sweeps, the 3072x576 layout's class up to 64 rows went to one kernel or the other from run to run on a 2-core
  EPYC VM (3,368 vs 3,535 us in one table, the other order in another).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.quant.ops import Kernel

OUT_OF_RACE = 3.0  # an entrant this many times slower than the lead over two sweeps is not timed again
SWEEPS_TO_DROP = 2
CLOSE_CALL = 1.10  # entrants this close to the lead's time are swept again
CLOSE_ROUNDS = 3
RULES = 4  # the race's rules, part of every choice it made (kiln.kernels.packed): new rules time the layouts again
RACE_S = 2.0  # a race that took this long stops after the round it is in
# one sweep over the weight copies stops after this long (at least one call); 50 ms sweeps made ~14 s of the default
# model's cold table (341 sweeps, Xeon with 2 vCPUs), where a product's best of two or three 20 ms sweeps reads the same
SWEEP_S = 0.02


def no_floor(times: dict[str, float]) -> float:
    return 0.0


@dataclass(frozen=True)
class Entrant:
    """A candidate in a race: `make()` builds its kernel (compiling or repacking), called only when it runs;
    `floor(times)` is the least time (µs) it can take, given the times of the entrants that ran before it."""

    make: Callable[[], Kernel]
    floor: Callable[[dict[str, float]], float] = no_floor


@dataclass
class Race:
    times: dict[str, float] = field(default_factory=dict)  # µs, each entrant's best sweep
    ruled_out: dict[str, float] = field(default_factory=dict)  # µs, the floor that kept an entrant from running

    @property
    def winner(self) -> str:
        return min(self.times, key=self.times.__getitem__)


def time_us(kernel: Kernel, x: torch.Tensor, copies: list[tuple], budget_s: float = SWEEP_S) -> float:
    """Mean time per call across the copies of the weight (one sweep, stopped after `budget_s`, so a slow candidate
    costs little time to rule out), in µs."""
    calls, start = 0, time.perf_counter()
    for weight in copies:
        kernel(x, *weight)
        calls += 1
        if time.perf_counter() - start > budget_s:
            break
    return (time.perf_counter() - start) / calls * 1e6


def time_candidates(entrants: dict[str, Entrant], x: torch.Tensor, copies: list[tuple], rounds: int = 3) -> Race:
    """Race `entrants` (in the order given: cheap ones first) on `x` over the weight `copies`."""
    race, kernels = Race(), {}
    started = time.perf_counter()
    for name, entrant in entrants.items():  # the first round: each is built, warmed up and timed in turn
        floor = entrant.floor(race.times)
        if race.times and floor >= min(race.times.values()):
            race.ruled_out[name] = round(floor, 2)
            continue
        kernel = kernels[name] = entrant.make()
        kernel(x, *copies[0])  # warm-up (first-call allocations, lazy repacking)
        race.times[name] = time_us(kernel, x, copies)
    for swept in range(1, rounds):
        lead = min(race.times.values())
        if swept >= SWEEPS_TO_DROP:
            kernels = {name: k for name, k in kernels.items() if race.times[name] <= OUT_OF_RACE * lead}
        if time.perf_counter() - started > RACE_S or len(kernels) < 2:
            break
        for name, kernel in kernels.items():
            race.times[name] = min(race.times[name], time_us(kernel, x, copies))
    for _ in range(CLOSE_ROUNDS):
        lead = min(race.times.values())
        close = {name: k for name, k in kernels.items() if race.times[name] <= CLOSE_CALL * lead}
        if time.perf_counter() - started > RACE_S or len(close) < 2:
            break
        for name, kernel in close.items():
            race.times[name] = min(race.times[name], time_us(kernel, x, copies))
    race.times = {name: round(us, 2) for name, us in race.times.items()}
    return race

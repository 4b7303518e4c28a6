"""The kernel table of packed products (`torch.ops.kiln.packed_linear`, kiln.quant.ops): for every packed layer
layout the model uses and every row count the table covers, the candidate kernels (kiln.kernels.candidates) are
timed on this machine, over copies of the weight streamed from DRAM, and the winner is cached per machine
(kiln.kernels.choices) and bound to the layers of that layout (`PackedLinear.use_kernels`). Nothing is assumed from
the box the code was written on. The engine's activations (int8x2 | int8 | float32) say which candidates are timed.

Rows timed: the largest row count of each row class (kiln.quant.ops.ROW_CLASSES, which says what each class
serves) and LARGE_ROWS for more (prefill chunks), one entry each (kiln.quant.ops.row_class); a class of several row
counts below LARGE_ROWS is raced at its middle too (`class_points`), and its entry goes to the candidate fastest
across both (`class_winner`). Timed at its top alone, the class up to 256 rows of the 576x576 layout went to
dequantize-then-BLAS, which pays its dequantization whatever the rows: 2,718 vs 3,028 us for `native` at 256 rows,
but 1,794 vs 1,441 us at 128 (2-core AVX2 EPYC), where the prefill budget's chunks beside streams fall.

The logits head runs on the sampled rows alone (a step's sequences, times k + 1 where k drafts are verified): its
layout is timed up to the row class of `head_rows`, the most the engine can ask of it; above that class (no engine
path reaches it) the reference runs. Racing the 49152-row head at 256 and 1,024 rows took about half of its 15 s
table on a 2-core EPYC.

Row counts are raced fewest first: a candidate's time at fewer rows is its floor at more (kiln.kernels.race). One
that sat out a row count keeps the floor of an earlier, smaller one; where that floor would let it in, it is first
measured at the row count it sat out (one call on each of two copies), which costs less than entering.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from kiln.compile.compiler import CompileOnce, PieceCompiler
from kiln.config import DEFAULT_ACTIVATIONS
from kiln.kernels.candidates import (
    AMX_CANDIDATES,
    BRGEMM_BF16,
    CANDIDATES,
    DEQUANT_BLAS,
    FUSED,
    INT8_OPS,
    PackedCandidate,
    candidates_for,
    native_int8_linear,
    native_packed_linear,
)
from kiln.kernels.choices import KernelChoiceCache, stream_count
from kiln.kernels.compute_forms import amx_int8_works, matrix_unit_works
from kiln.kernels.native.build import install_native_dispatch, source_hash
from kiln.kernels.race import RULES, Entrant, time_candidates, time_us
from kiln.kernels.torch_kernels import layer_weight
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import LARGE, ROW_CLASSES, Kernel, dequantize_codes, row_class

logger = logging.getLogger("kiln")

LARGE_ROWS = 1024  # prefill chunks of up to --max-num-batched-tokens (2048 by default)
STREAM_BYTES = 96 << 20  # copies of a layer that add up to more than a last-level cache
ROWS = (*ROW_CLASSES, LARGE_ROWS)
TIMED_ROWS = {row_class(rows): rows for rows in ROWS}  # row class -> the row count timed for it


def class_points(timed: int) -> tuple[int, ...]:
    """The row counts raced for the row class timed at `timed` rows: its top, after its middle (the power of two
    nearest the geometric mean of its bounds: 4, 8, 32, 128) where the class holds several row counts below the
    LARGE one (whose dequantization is paid once for all rows, a kernel that scales with them loses more above)."""
    below = [top for top in ROW_CLASSES if top < timed]
    if not below or row_class(timed) == LARGE:
        return (timed,)
    low = below[-1] + 1
    middle = 2 ** round(math.log2(math.sqrt(low * timed)))
    return (middle, timed) if low <= middle < timed else (timed,)


def raced_rows(rows_timed: Iterable[int]) -> tuple[int, ...]:
    """Every row count raced for these row classes (by the rows each is timed at), fewest first."""
    return tuple(sorted({point for timed in rows_timed for point in class_points(timed)}))


def class_winner(record: dict[str, Any], timed: int, allowed: Callable[[str], bool] = lambda name: True) -> str | None:
    """The `allowed` candidate that serves the row class timed at `timed` rows fastest across its points: the least
    mean, over the points, of its time over the fastest time there (ties: the faster at the top). It must have been
    timed at the top; at the middle a candidate ruled out unbuilt counts its floor (at or above the lead's time).
    None where no allowed candidate was timed at the top."""
    seen = []
    for point in class_points(timed):
        times = {**record["ruled_out_us"].get(str(point), {}), **record["times_us"].get(str(point), {})}
        seen.append({name: us for name, us in times.items() if allowed(name)})
    top_times = {name: us for name, us in record["times_us"].get(str(timed), {}).items() if allowed(name)}
    names = set(top_times).intersection(*seen)
    if not names:
        return None
    fastest = [min(times[name] for name in names) for times in seen]

    def score(name: str) -> tuple[float, float]:
        return sum(times[name] / best for times, best in zip(seen, fastest, strict=True)), top_times[name]

    return min(sorted(names), key=score)


def packed_layers(model: nn.Module) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def timed_rows(most: int | None) -> tuple[int, ...]:
    """The row counts timed for a layer asked for at most `most` rows (None: any number): ROWS up to its class."""
    return ROWS if most is None else tuple(r for r in ROWS if r <= TIMED_ROWS[row_class(most)])


def layer_key(
    layer: PackedLinear, activations: str, rows: tuple[int, ...] = ROWS, candidates: Iterable[str] | None = None
) -> dict[str, object]:
    """What a timed choice is for: the layout, the rows raced, the activations and the candidates they allow (a
    new candidate, row class, race rules, or native sources that changed or now build, time the layout again);
    `candidates`: the names raced (default: all the activations allow)."""
    dtype = str(layer.scale.dtype).removeprefix("torch.")
    native = source_hash() if native_packed_linear() is not None else None
    return {
        "shape": [layer.out_features, layer.in_features],
        "bits": layer.bits,
        "group": layer.group,
        "dtype": dtype,
        "activations": activations,
        "candidates": sorted(candidates_for(activations) if candidates is None else candidates),
        "rows": list(raced_rows(rows)),
        "native": native,
        "race": RULES,
    }


def second_form_bytes(layer: PackedLinear, names: set[str]) -> int:
    """The bytes of the second forms these candidates would hold of the layer's weight."""
    return sum(CANDIDATES[name].copy_bytes(layer) for name in names if CANDIDATES[name].second_form)


def label(layer: PackedLinear) -> str:
    dtype = str(layer.scale.dtype).removeprefix("torch.")
    return f"{layer.out_features}x{layer.in_features} {layer.bits}-bit/{layer.group} {dtype}"


class PackedKernelTable:
    """Timed choices for every distinct packed layer layout of a model; `install` binds the winners."""

    def __init__(
        self,
        model: nn.Module,
        compiler: PieceCompiler,
        cache: KernelChoiceCache,
        activations: str = DEFAULT_ACTIVATIONS,
        head_rows: int | None = None,
        second_forms: bool = True,
    ) -> None:
        """`second_forms`: candidates that hold a second form of a weight may be timed (the engine's budget for
        them is above zero); the bf16 one only where the matrix unit's probe passed here."""
        self.compiler = CompileOnce(compiler)  # a compiled candidate's graph is the same for many row counts
        self.activations = activations
        self.candidates = candidates_for(activations, second_forms)
        if BRGEMM_BF16 in self.candidates and not matrix_unit_works(cache):
            del self.candidates[BRGEMM_BF16]
        amx = [name for name in AMX_CANDIDATES if name in self.candidates]
        if amx and not amx_int8_works(cache):  # kiln's own AMX-INT8 products: only where they ran in a child
            for name in amx:
                del self.candidates[name]
        # int8 activations asked for and an int8 kernel runs here (else the float32 candidates alone are timed)
        self.int8_runs = activations in INT8_OPS and native_int8_linear(activations) is not None
        self.layers = packed_layers(model)
        self.distinct = {label(layer): layer for layer in self.layers}
        # label -> the row counts timed: all of ROWS, but the logits head's alone (a decoder layer of the head's
        # layout, if any, needs them all)
        head = getattr(model, "lm_head", None)
        others = {label(layer) for layer in self.layers if layer is not head}
        self.rows = {
            name: timed_rows(head_rows) if layer is head and name not in others else ROWS
            for name, layer in self.distinct.items()
        }
        self.records: dict[str, dict[str, Any]] = {}  # label -> record (for logs and kernel profiles)
        bar = tqdm(self.distinct.items(), desc="Timing packed kernels", unit="layout", leave=False, delay=0.5)
        for name, layer in bar:
            rows = self.rows[name]
            self.records[name] = cache.choose(
                "packed_kernels",
                layer_key(layer, activations, rows, self.candidates),
                lambda layer=layer, rows=rows: self._time(layer, rows),  # type: ignore[misc]
            )

    def winner(self, layer: PackedLinear, rows: int) -> str | None:
        """The kernel timed fastest for `rows` rows of this layer, None where its layout was not timed there."""
        winner = self.records[label(layer)]["winners"].get(str(TIMED_ROWS[row_class(rows)]))
        return None if winner is None else str(winner)

    def install(self, budget_bytes: float | None = None) -> int:
        """Bind each layer its layout's winners (compiled ones built here, once per layout; second forms of the
        weight once per layer). Winners that hold a second form (kiln.kernels.compute_forms) are bound while the
        layers' second forms fit `budget_bytes` (None: no bound), layers in model order; past it a layer runs the
        fastest timed candidate that holds none. The bytes of the second forms made."""
        install_native_dispatch()  # the op calls the native winners from C++ where kiln's objects load
        made: dict[tuple[str, str, int], Kernel] = {}
        spent = 0
        self.second_forms: dict[str, list[int]] = {}  # label -> [layers with a second form, their bytes]
        self.over_budget = 0  # layers whose second form did not fit
        for layer in self.layers:
            names = {rows: self.winner(layer, rows) or DEQUANT_BLAS for rows in self.rows[label(layer)]}
            need = second_form_bytes(layer, set(names.values()))
            if need and budget_bytes is not None and spent + need > budget_bytes:
                names = {rows: self.without_second_form(layer, rows) for rows in names}
                need, self.over_budget = 0, self.over_budget + 1
            if need:
                counted = self.second_forms.setdefault(label(layer), [0, 0])
                counted[0], counted[1] = counted[0] + 1, counted[1] + need
            spent += need
            kernels, inline = {}, set()
            for rows, name in names.items():
                candidate, key = CANDIDATES[name], (label(layer), name, rows)
                if candidate.second_form:  # holds this layer's own copy (one for all its row classes)
                    kernels[row_class(rows)] = candidate.make(layer, rows, self.compiler, [layer_weight(layer)])
                    continue
                if key not in made:
                    made[key] = candidate.make(layer, rows, self.compiler, [])
                kernels[row_class(rows)] = made[key]
                if name == FUSED:
                    inline.add(rows)
            layer.use_kernels(kernels, frozenset(inline))
        return spent

    def without_second_form(self, layer: PackedLinear, rows: int) -> str:
        """The fastest candidate timed for `rows` rows of this layer that holds no second form (the reference
        where none was timed)."""
        record = self.records[label(layer)]
        light = class_winner(record, TIMED_ROWS[row_class(rows)], lambda name: not _holds_second_form(name))
        return light or DEQUANT_BLAS

    def second_form_summary(self) -> str:
        """Which layouts keep a second form and its bytes, for the start-up log."""
        parts = [f"{name} x{count} ({nbytes / 2**20:.1f} MB)" for name, (count, nbytes) in self.second_forms.items()]
        if self.over_budget:
            parts.append(f"{self.over_budget} layers over the budget run without one")
        return "; ".join(parts) or "none"

    def _time(self, layer: PackedLinear, rows_timed: tuple[int, ...]) -> dict[str, Any]:
        """Race the candidates at each row count, fewest rows first (kiln.kernels.race): a candidate's time at fewer
        rows is its floor at more, so one far behind early is ruled out later without being built."""
        count = stream_count(layer.nbytes, STREAM_BYTES)
        copies = [tuple(t.clone() for t in (layer.codes, layer.scale, layer.offset)) for _ in range(count)]
        dequant_us = time_us(lambda x, *weight: dequantize_codes(*weight), torch.empty(0), copies)
        times: dict[str, dict[str, float]] = {}
        ruled_out: dict[str, dict[str, float]] = {}
        floors: dict[str, float] = {}  # each candidate's time (or floor) at the most rows raced so far
        fewer: int | None = None  # the row count raced before
        for rows in raced_rows(rows_timed):
            x = torch.randn(rows, layer.in_features, dtype=layer.scale.dtype)
            applying = sorted(
                ((n, c) for n, c in self.candidates.items() if c.applies(layer, rows)), key=lambda nc: nc[1].builds
            )
            # a candidate that sat out the row count raced before has a floor from far fewer rows: it may be probed
            sat_out = set() if fewer is None else {name for name, _ in applying} - set(times[str(fewer)])
            entrants = {}
            for name, c in applying:
                probe = self._probe(c, layer, fewer, copies) if name in sat_out else None
                entrants[name] = Entrant(
                    make=partial(c.make, layer, rows, self.compiler, copies),
                    floor=partial(_floor, c, floors.get(name, 0.0), dequant_us, probe),
                )
            race = time_candidates(entrants, x, copies)
            times[str(rows)] = race.times
            if race.ruled_out:
                ruled_out[str(rows)] = race.ruled_out
            floors |= race.ruled_out | race.times
            fewer = rows
        record = {"times_us": times, "ruled_out_us": ruled_out}
        winners = {str(timed): class_winner(record, timed) for timed in rows_timed}
        return {"winners": winners, **record}

    def _probe(
        self, candidate: PackedCandidate, layer: PackedLinear, rows: int, copies: list[tuple]
    ) -> Callable[[], float] | None:
        """A measurement of `candidate` at `rows` (fewer than the race's) on two copies of the weight: the faster of
        a first call and a call on the other copy (a low floor is safe, a high one could rule out a winner). None
        where it does not apply at `rows`, or builds for each row count (it would cost what entering costs)."""
        if not candidate.applies(layer, rows) or candidate.built_per_rows:
            return None

        def measure() -> float:
            kernel = candidate.make(layer, rows, self.compiler, copies[:2])
            x = torch.randn(rows, layer.in_features, dtype=layer.scale.dtype)
            first = time_us(kernel, x, copies[:1], budget_s=0.0)
            return min(first, time_us(kernel, x, copies[1:2], budget_s=0.0))

        return measure


def _holds_second_form(name: str) -> bool:
    return name not in CANDIDATES or CANDIDATES[name].second_form


def _floor(
    candidate: PackedCandidate,
    least: float,
    dequant_us: float,
    probe: Callable[[], float] | None,
    times: dict[str, float],
) -> float:
    """The larger of a candidate's time at fewer rows (`least`) and its own bound from the race so far; where that
    is below the lead's time and a `probe` is given, also the candidate's time measured now at the row count raced
    before (more rows do at least the work of fewer): int4pack-mm, out of the race at one row, was built and run
    at 256 rows for 2.4 s on the 3072x576 layout (1.2 s a call) although its 64-row call already loses."""
    floor = max(least, candidate.floor_us(times, dequant_us))
    if probe is not None and times and floor < min(times.values()):
        floor = max(floor, probe())
    return floor

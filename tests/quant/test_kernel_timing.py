"""What makes the packed kernel table's timing cheap: slow candidates leave the race, a candidate that cannot win is
never built, one that sat out is probed at fewer rows before it is built, a race keeps to its time budget, a graph
compiles once."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch.fx import GraphModule

import kiln.kernels.packed as packed
import kiln.kernels.race as race
from kiln.compile.compiler import CompiledPiece, CompileOnce, EagerCompiler
from kiln.kernels.candidates import PackedCandidate
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.product import Compiled, shared_compile, trace_static
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import Kernel, dequantize_codes, reduction


class Named:
    """A kernel that only knows its name (the clock is faked), counting how often it was built."""

    built: ClassVar[list[str]] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, x, *weight) -> None:  # the warm-up call
        pass

    @classmethod
    def entrant(cls, name: str, floor=race.no_floor) -> race.Entrant:
        def make() -> Named:
            cls.built.append(name)
            return cls(name)

        return race.Entrant(make, floor)


def fake_clock(monkeypatch: pytest.MonkeyPatch, given: dict[str, list[float]]) -> dict[str, int]:
    """`time_us` answers each kernel's next given time; returns the count of sweeps per kernel."""
    sweeps: dict[str, int] = dict.fromkeys(given, 0)

    def fake_time_us(kernel, x, copies) -> float:
        us = given[kernel.name][sweeps[kernel.name]]
        sweeps[kernel.name] += 1
        return us

    monkeypatch.setattr(race, "time_us", fake_time_us)
    Named.built = []
    return sweeps


def test_candidates_far_behind_over_two_sweeps_sit_out_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Times are given (no clock): `slow` is 10x the lead over its first two sweeps and is not timed again; `close`
    (1.5x) stays for every round; each keeps its best sweep and the winner is the fastest."""
    given = {"fast": [10.0, 9.0, 11.0, 10.0], "close": [15.0, 14.0, 16.0, 15.0], "slow": [100.0, 90.0, 1.0, 1.0]}
    sweeps = fake_clock(monkeypatch, given)
    result = race.time_candidates({n: Named.entrant(n) for n in given}, torch.zeros(1, 4), [()], rounds=4)
    assert sweeps == {"fast": 4, "close": 4, "slow": 2}
    assert result.times == {"fast": 9.0, "close": 14.0, "slow": 90.0}  # had slow run again, its 1.0 would have won
    assert result.winner == "fast" and result.ruled_out == {}


def test_one_slow_sweep_does_not_drop_the_fastest_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of other work during `fast`'s first sweep makes it look 10x slower than `other`: it stays in the race,
    and its next sweeps show it is the fastest (a race that dropped it after one sweep cached the wrong winner)."""
    given = {"fast": [100.0, 8.0, 9.0], "other": [10.0, 10.0, 10.0]}
    sweeps = fake_clock(monkeypatch, given)
    result = race.time_candidates({n: Named.entrant(n) for n in given}, torch.zeros(1, 4), [()], rounds=3)
    assert sweeps == {"fast": 3, "other": 3}
    assert result.winner == "fast" and result.times == {"fast": 8.0, "other": 10.0}


def test_a_candidate_whose_floor_reaches_the_lead_is_never_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """`costly` can take no less than 12 µs and `fast` took 10: it is ruled out unbuilt, its floor recorded;
    `hopeful`'s floor (5) is under the lead, so it is built and timed, and wins; the first entrant is always timed,
    whatever its floor (there is no lead yet)."""
    given = {"first": [20.0] * 3, "fast": [10.0] * 3, "costly": [1.0] * 3, "hopeful": [8.0] * 3}
    sweeps = fake_clock(monkeypatch, given)
    entrants = {
        "first": Named.entrant("first", lambda times: 1e9),
        "fast": Named.entrant("fast"),
        "costly": Named.entrant("costly", lambda times: times["fast"] + 2.0),
        "hopeful": Named.entrant("hopeful", lambda times: 5.0),
    }
    result = race.time_candidates(entrants, torch.zeros(1, 4), [()], rounds=3)
    assert Named.built == ["first", "fast", "hopeful"] and sweeps["costly"] == 0
    assert result.ruled_out == {"costly": 12.0} and set(result.times) == {"first", "fast", "hopeful"}
    assert result.winner == "hopeful"


def test_a_close_call_is_swept_again_until_the_best_of_more_sweeps_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """`a` and `b` are within CLOSE_CALL after three rounds (b's 100 vs a's 104): both are swept again, and `a`'s
    quiet fifth sweep (80) shows it is the faster: it wins, and the extra rounds stop, the two no longer close;
    `far` (1.5x) is not swept again."""
    given = {"a": [110.0, 104.0, 108.0, 105.0, 80.0], "b": [100.0, 103.0, 101.0, 102.0, 104.0], "far": [150.0] * 3}
    sweeps = fake_clock(monkeypatch, given)
    result = race.time_candidates({n: Named.entrant(n) for n in given}, torch.zeros(1, 4), [()], rounds=3)
    assert sweeps == {"a": 5, "b": 5, "far": 3}
    assert result.winner == "a" and result.times == {"a": 80.0, "b": 100.0, "far": 150.0}


def test_a_close_call_is_swept_at_most_close_rounds_more(monkeypatch: pytest.MonkeyPatch) -> None:
    given = {"a": [10.0] * 20, "b": [10.5] * 20}
    sweeps = fake_clock(monkeypatch, given)
    race.time_candidates({n: Named.entrant(n) for n in given}, torch.zeros(1, 4), [()], rounds=3)
    assert sweeps == {"a": 3 + race.CLOSE_ROUNDS, "b": 3 + race.CLOSE_ROUNDS}


def test_a_race_over_its_time_budget_keeps_its_first_round(monkeypatch: pytest.MonkeyPatch) -> None:
    given = {"a": [10.0, 1.0], "b": [12.0, 1.0]}
    sweeps = fake_clock(monkeypatch, given)
    monkeypatch.setattr(race, "RACE_S", -1.0)  # already over budget after the first round
    result = race.time_candidates({n: Named.entrant(n) for n in given}, torch.zeros(1, 4), [()], rounds=3)
    assert sweeps == {"a": 1, "b": 1} and result.times == {"a": 10.0, "b": 12.0}


class CountingCompiler(EagerCompiler):
    def __init__(self) -> None:
        self.calls: list[int | None] = []

    def compile(self, graph: GraphModule, static_size: int | None = None) -> CompiledPiece:
        self.calls.append(static_size)
        return CompiledPiece(graph.forward, None)


def test_compile_once_compiles_each_structure_and_size_once_and_computes_the_same() -> None:
    inner = CountingCompiler()
    once = CompileOnce(inner)
    codes = torch.randint(0, 255, (8, 2, 16), dtype=torch.uint8)
    scale, offset = torch.rand(8, 2, 1), torch.rand(8, 2, 1)
    kernels = [Compiled(dequantize_codes, once, None, codes, scale, offset) for _ in range(3)]
    assert inner.calls == [None]  # three traces of one graph: one compile
    other = torch.randint(0, 255, (4, 2, 16), dtype=torch.uint8)  # another shape is another structure
    Compiled(dequantize_codes, once, None, other, scale[:4], offset[:4])
    assert inner.calls == [None, None]
    graph = trace_static(lambda a: (a * 2,), torch.ones(3))
    once.compile(graph, None), once.compile(graph, None)
    assert inner.calls == [None, None, None]
    want = dequantize_codes(codes, scale, offset)
    for kernel in kernels:
        torch.testing.assert_close(kernel(codes, scale, offset), want, rtol=0, atol=0)


class PerRow(PackedCandidate):
    """A fake candidate taking `fixed + per_row * rows` µs (the clock is faked), noting the rows it was built for."""

    builds = True

    def __init__(self, name: str, fixed: float, per_row: float) -> None:
        self.name, self.fixed, self.per_row = name, fixed, per_row  # type: ignore[misc]
        self.built_for: list[int] = []

    def make(self, layer, rows, compiler, weights) -> Kernel:
        self.built_for.append(rows)
        return lambda x, *weight: self.fixed + self.per_row * x.shape[0]


def timed_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *candidates: PerRow) -> dict:
    """The table's record of a 64x96 4-bit layout raced among `candidates` alone, on the faked clock."""
    by_name = {c.name: c for c in candidates}
    monkeypatch.setattr(packed, "candidates_for", lambda activations, second_forms=True: by_name)
    fake_us = lambda kernel, x, copies, budget_s=0.0: kernel(x) if x.numel() else 1.0  # noqa: E731
    monkeypatch.setattr(packed, "time_us", fake_us)
    monkeypatch.setattr(race, "time_us", fake_us)
    layer = PackedLinear(64, 96, bits=4)
    return packed.PackedKernelTable(layer, EagerCompiler(), KernelChoiceCache(tmp_path)).records[packed.label(layer)]


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_a_candidate_that_sat_out_is_probed_at_fewer_rows_before_it_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`slow` (100 µs a row) sits out at one row and after; at 128 rows (a class's middle) its one-row floor
    (100) is under the lead (`fast`: 138), so it is measured at 64 rows (6,400), which rules it out unbuilt at 128
    and 256 rows (without the probe it was built and run there). `late` (500 + 0.1 a row) is probed at 256 rows
    before 1,024 (525.6, under the lead's 1,034): it enters, is built, and wins there."""
    fast, slow, late = PerRow("fast", 10.0, 1.0), PerRow("slow", 0.0, 100.0), PerRow("late", 500.0, 0.1)
    fast.builds = False  # type: ignore[misc]  # raced first: the lead is known before the others' turns
    record = timed_record(monkeypatch, tmp_path, fast, slow, late)
    assert record["winners"] == {
        "1": "fast",
        "2": "fast",
        "6": "fast",
        "16": "fast",
        "64": "fast",
        "256": "fast",
        "1024": "late",
    }
    assert slow.built_for == [1, 64] and "slow" not in record["times_us"]["256"]
    assert record["ruled_out_us"]["128"]["slow"] == 6400.0
    assert record["ruled_out_us"]["256"]["slow"] == 6400.0 and record["ruled_out_us"]["1024"]["slow"] == 6400.0
    assert late.built_for == [1, 256, 1024] and record["times_us"]["1024"]["late"] == pytest.approx(602.4)


def test_a_dequantization_compiled_for_any_row_count_compiles_once_per_group_layout() -> None:
    """With `dynamic` rows, weights that differ only in their rows (layouts, tiles) share one compile and each
    dequantizes exactly; another group layout is another compile; the weights themselves carry no dynamic mark (the
    model's later traces stay static)."""
    inner = CountingCompiler()
    once = CompileOnce(inner)
    weights = [
        (
            torch.randint(0, 255, (rows, groups, 16), dtype=torch.uint8),
            torch.rand(rows, groups, 1),
            torch.rand(rows, groups, 1),
        )
        for rows, groups in ((8, 2), (24, 2), (5, 2), (8, 3))
    ]
    kernels = [Compiled(dequantize_codes, once, None, *w, dynamic=(0, 1, 2)) for w in weights]
    assert len(inner.calls) == 2  # rows 8, 24 and 5 over 2 groups: one; 3 groups: another
    for kernel, w in zip(kernels, weights, strict=True):
        torch.testing.assert_close(kernel(*w), dequantize_codes(*w), rtol=0, atol=0)
        if w[1].shape[1] == 2:  # the first kernel, compiled at 8 rows, runs at any row count
            torch.testing.assert_close(kernels[0](*w), dequantize_codes(*w), rtol=0, atol=0)
        assert not any(hasattr(t, "_dynamo_dynamic_indices") for t in w)


def test_the_one_row_reduction_compiles_once_per_weight_form() -> None:
    """The fused reduction of the table (static x rows, the weight's output rows symbolic): layouts that differ only in
    their output rows share one trace and compile (the memo), and each computes the reduction; another row count of
    x or another input width is another compile."""
    inner = CountingCompiler()
    once = CompileOnce(inner)

    def weight(out: int, groups: int) -> tuple[torch.Tensor, ...]:
        codes = torch.randint(0, 255, (out, groups, 16), dtype=torch.uint8)
        return codes, torch.rand(out, groups, 1), torch.rand(out, groups, 1)

    x1, x2 = torch.randn(1, 64), torch.randn(2, 64)
    layouts = [weight(out, 2) for out in (8, 24, 5)]
    kernels = [shared_compile(reduction, once, x1, *w) for w in layouts]
    assert len(inner.calls) == 1 and all(k is kernels[0] for k in kernels)
    for w in layouts:
        torch.testing.assert_close(kernels[0](x1, *w), reduction(x1, *w), rtol=1e-5, atol=1e-5)
    shared_compile(reduction, once, x2, *layouts[0])
    shared_compile(reduction, once, torch.randn(1, 96), *weight(8, 3))
    assert len(inner.calls) == 3


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_a_row_class_goes_to_the_kernel_fastest_across_it_not_at_its_top_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`flat` takes 1,850 µs at any row count (a kernel padding rows to a block), `linear` 30 µs a row: at 64 rows
    `flat` is faster (1,850 vs 1,920), but the 17-64 class serves 32-row decode steps too, where `linear` takes half
    of `flat`'s time; timed at its top alone the class went to `flat`. At 65-256 rows `flat` wins throughout."""
    flat, linear = PerRow("flat", 1850.0, 0.0), PerRow("linear", 0.0, 30.0)
    linear.builds = False  # type: ignore[misc]
    record = timed_record(monkeypatch, tmp_path, flat, linear)
    assert record["times_us"]["64"] == {"flat": 1850.0, "linear": 1920.0}  # the top alone favours `flat`
    assert record["times_us"]["32"]["linear"] == 960.0 and record["ruled_out_us"]["32"]["flat"] == 1850.0
    assert record["winners"] == {
        "1": "linear",
        "2": "linear",
        "6": "linear",
        "16": "linear",
        "64": "linear",
        "256": "flat",
        "1024": "flat",
    }
    assert packed.class_winner(record, 64, allowed=lambda name: name != "linear") == "flat"
    assert packed.class_winner(record, 64, allowed=lambda name: False) is None

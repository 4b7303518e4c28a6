"""CPU kernel choices are timed where they run, cached per machine, and decide graph mode's static sizes,
weight layout and one-row head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln.kernels.choices as choice_module
import kiln.kernels.plan as plan_module
import kiln.kernels.static_sizes as graph_choice
from kiln.cli import main
from kiln.kernels.choices import CHOICES_FILE, KernelChoiceCache
from kiln.kernels.layout import COLUMN_MAJOR, ROW_MAJOR, is_column_major
from kiln.kernels.static_sizes import REDUCTION, decide
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

PROMPTS = random_prompts([4, 6])


def _times(red: float, row: float, col: float) -> dict[str, float]:
    return {REDUCTION: red, ROW_MAJOR: row, COLUMN_MAJOR: col}


def test_the_rule_follows_the_times() -> None:
    assert decide({"1": _times(5, 9, 8), "2": _times(6, 9, 9)}) == {"static_sizes": [1, 2], "layout": ROW_MAJOR}
    assert decide({"1": _times(5, 9, 8), "2": _times(9, 6, 9)}) == {"static_sizes": [1], "layout": ROW_MAJOR}
    assert decide({"1": _times(9, 8, 6), "2": _times(1, 9, 9)}) == {"static_sizes": [], "layout": COLUMN_MAJOR}
    assert decide({"1": _times(9, 6, 8)}) == {"static_sizes": [], "layout": ROW_MAJOR}
    assert decide({}) == {"static_sizes": [], "layout": ROW_MAJOR}  # no one-row capture size: nothing to time


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_a_choice_is_timed_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    measure = lambda: calls.append(1) or {"winner": "a"}  # noqa: E731
    first = KernelChoiceCache(tmp_path).choose("k", {"shape": [2, 2]}, measure)
    again = KernelChoiceCache(tmp_path).choose("k", {"shape": [2, 2]}, measure)
    assert (first["source"], again["source"], calls) == ("timed", "process", [1])
    choice_module.forget_process_choices()  # a new process: the file answers
    assert KernelChoiceCache(tmp_path).choose("k", {"shape": [2, 2]}, measure)["source"] == "cache"
    assert KernelChoiceCache(tmp_path).choose("k", {"shape": [4, 2]}, measure)["source"] == "timed"  # another shape
    other = {**choice_module.machine_fingerprint(), "cpu": "another CPU"}
    monkeypatch.setattr(choice_module, "machine_fingerprint", lambda: other)
    assert KernelChoiceCache(tmp_path).choose("k", {"shape": [2, 2]}, measure)["source"] == "timed"
    choice_module.forget_process_choices()
    (tmp_path / choice_module.CHOICES_FILE).write_text("{not json")  # a corrupt file is timed again, not trusted
    assert KernelChoiceCache(tmp_path).choose("k", {"shape": [2, 2]}, measure)["source"] == "timed"
    assert len(calls) == 4


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_every_engine_of_a_process_reads_the_first_choice(tmp_path: Path) -> None:
    """Two cache dirs, one process: the second asks and gets the first's winner (never a second timing that might
    pick the other candidate), and its dir is written so a later process starts warm there too."""
    winners = iter(["a", "b"])
    measure = lambda: {"winner": next(winners)}  # noqa: E731
    first = KernelChoiceCache(tmp_path / "one").choose("k", {"shape": [2, 2]}, measure)
    second = KernelChoiceCache(tmp_path / "two").choose("k", {"shape": [2, 2]}, measure)
    assert (first["winner"], second["winner"], second["source"]) == ("a", "a", "process")
    choice_module.forget_process_choices()
    assert KernelChoiceCache(tmp_path / "two").choose("k", {"shape": [2, 2]}, measure) == {
        "winner": "a",
        "source": "cache",
    }


CHOOSER = """
import json, os, sys, time
from pathlib import Path
from kiln.kernels.choices import KernelChoiceCache
root, shape = Path(sys.argv[1]), json.loads(sys.argv[2])
def measure():
    with open(root / "measured.log", "a") as log:
        log.write(f"{shape}\\n")
    deadline = time.monotonic() + 60  # a timing that lasts until every process has asked for its choice
    while len(list(root.glob("asking-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    return {"winner": str(shape)}
(root / f"asking-{os.getpid()}").touch()
print(json.dumps(KernelChoiceCache(root).choose("k", {"shape": shape}, measure)))
"""


def test_processes_sharing_a_cache_dir_take_turns_and_lose_no_choice(tmp_path: Path) -> None:
    """Four processes at once, two per choice: each choice is timed by one process (the other waits for it and reads
    its record, as tensor-parallel ranks over one layout do), and the file keeps both choices (each write merges
    under the lock; a write of what one process read earlier once dropped the other's choice)."""
    shapes = ["[2, 2]", "[4, 2]", "[2, 2]", "[4, 2]"]
    procs = [
        subprocess.Popen([sys.executable, "-c", CHOOSER, str(tmp_path), shape], stdout=subprocess.PIPE, text=True)
        for shape in shapes
    ]
    records = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted((tmp_path / "measured.log").read_text().split("\n")) == ["", "[2, 2]", "[4, 2]"]
    assert sorted(r["source"] for r in records) == ["cache", "cache", "timed", "timed"]
    assert [r["winner"] for r in records] == [str(json.loads(s)) for s in shapes]
    stored = json.loads((tmp_path / CHOICES_FILE).read_text())
    assert sorted(r["applies_to"]["shape"] for r in stored.values()) == [[2, 2], [4, 2]]


@pytest.mark.parametrize(
    "times,sizes,column_major",
    [
        ({"1": _times(1, 9, 9), "2": _times(1, 9, 9)}, (1, 2), False),  # reductions win: row-major, static 1 and 2
        ({"1": _times(9, 9, 1), "2": _times(9, 9, 1)}, (), True),  # BLAS column-major wins: no static sizes
    ],
)
@pytest.mark.usefixtures("fresh_kernel_choices")
def test_graph_mode_follows_the_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, times: dict, sizes: tuple, column_major: bool
) -> None:
    monkeypatch.setattr(graph_choice, "_time_candidates", lambda weight, rows, compiler: times[str(rows)])
    monkeypatch.setattr(
        plan_module, "fastest_one_row_layout", _fixed_layout(COLUMN_MAJOR if column_major else ROW_MAJOR)
    )
    monkeypatch.setattr(plan_module, "one_row_head", _fixed_head(column_major))
    model = tiny_model(num_layers=2, seed=3)
    expected = generate(make_runner(model), PROMPTS, 4)
    runner, graph = graph_runner(model, tmp_path, compiler="inductor", compile_sizes=None)
    assert graph.compile_sizes == sizes
    assert graph.kernel_choices["static_sizes"]["static_sizes"] == list(sizes)
    layers = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert all(is_column_major(w) == column_major for w in layers)
    assert (graph.logits_head.compiled is not None) == (1 in sizes)
    assert generate(runner, PROMPTS, 4) == expected
    hidden = torch.randn(1, model.config.hidden_size)
    torch.testing.assert_close(graph.compute_logits(hidden, [0]), model.compute_logits(hidden), rtol=1e-5, atol=1e-5)


def _fixed_layout(layout: str):
    return lambda weight, cache: {"winner": layout, "times_us": {}, "source": "timed"}


def _fixed_head(column_major: bool):
    def head(weight: torch.Tensor, cache: KernelChoiceCache) -> tuple[torch.Tensor | None, dict]:
        copy = weight.detach().t().contiguous() if column_major else None
        return copy, {"winner": COLUMN_MAJOR if column_major else ROW_MAJOR, "source": "timed"}

    return head


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_automatic_choice_is_timed_on_this_machine(tmp_path: Path) -> None:
    """No monkeypatching: the candidates run here; the sizes are what the recorded times say."""
    model = tiny_model(num_layers=2, seed=4)
    _, graph = graph_runner(model, tmp_path, compiler="inductor", compile_sizes=None, capture_sizes=(1, 2, 4))
    record = graph.kernel_choices["static_sizes"]
    assert record["source"] == "timed" and set(record["times_us"]) == {"1", "2"}
    for candidates in record["times_us"].values():
        assert set(candidates) == {REDUCTION, ROW_MAJOR, COLUMN_MAJOR} and all(t > 0 for t in candidates.values())
    assert list(graph.compile_sizes) == decide(record["times_us"])["static_sizes"] == record["static_sizes"]
    _, again = graph_runner(model, tmp_path, compiler="inductor", compile_sizes=None, capture_sizes=(1, 2, 4))
    assert again.kernel_choices["static_sizes"]["source"] == "process" and again.compile_sizes == graph.compile_sizes


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_kernels_forget_drops_this_cpus_choices_and_keeps_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kiln kernels forget` (after a first start that other work slowed down): this CPU's choices go, whatever
    their torch or thread count, so the next start times them again; another machine's stay."""
    cache = KernelChoiceCache(tmp_path)
    timed = cache.choose("a product", {"shape": [8, 8]}, lambda: {"winner": "x"})
    assert timed["source"] == "timed"
    path = tmp_path / CHOICES_FILE
    records = json.loads(path.read_text())
    other_machine = {**cache.machine, "cpu": "another CPU"}
    other_threads = {**cache.machine, "threads": cache.machine["threads"] + 7}
    records["elsewhere"] = {"winner": "y", "name": "b", "applies_to": {}, "machine": other_machine}
    records["fewer threads"] = {"winner": "z", "name": "c", "applies_to": {}, "machine": other_threads}
    path.write_text(json.dumps(records))
    assert main(["kernels", "forget", "--cache-dir", str(tmp_path)]) == 0
    assert "forgot 2 kernel choices timed on this CPU" in capsys.readouterr().out
    assert set(json.loads(path.read_text())) == {"elsewhere"}
    again = KernelChoiceCache(tmp_path).choose("a product", {"shape": [8, 8]}, lambda: {"winner": "x2"})
    assert again["source"] == "timed" and again["winner"] == "x2"  # not the process's memo of the old choice

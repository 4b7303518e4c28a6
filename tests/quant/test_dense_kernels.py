"""bf16 decoder products on oneDNN's prepacked weights (kiln.kernels.dense): the op runs what is bound for the step's
rows, the table installs what won (timings faked: a test must not depend on which kernel this machine picks), the
memory guard, pieces keep the op as one node, and static one-row pieces still reduce over the weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import kiln.kernels.race as race
from kiln.compile.passes import DecodeGemv
from kiln.executor.eager import EagerExecutor
from kiln.kernels import dense
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.packed import ROWS
from kiln.kernels.static_sizes import REDUCTION, decide
from kiln.quant.ops import row_class
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

pytestmark = pytest.mark.usefixtures("fresh_kernel_choices")  # the timings are faked


def _bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _refused_here(tmp_path: Path) -> bool:
    """Where oneDNN's bf16 path does not run on this CPU (AVX2 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT: its
    reorder raises), the table offers no layer and changes nothing: asserted here, and the test ends."""
    if dense.onednn_bf16_runs():
        return False
    model = tiny_model().to(torch.bfloat16)
    assert not dense.prepacking_runs(model.lm_head.weight)
    with pytest.raises(RuntimeError, match="bf16 path needs"):  # what the probe spares: torch's own refusal
        torch.ops.mkldnn._reorder_linear_weight(model.lm_head.weight.detach(), 1)
    table = _table(model, tmp_path)
    assert table.layers == [] and table.install() == 0
    assert not any(type(m) is dense.DenseLinear for m in model.modules())
    return True


def test_the_prepacked_product_computes_the_linear(tmp_path: Path) -> None:
    if _refused_here(tmp_path):
        return
    weight, bias = _bf16(96, 64), _bf16(96, seed=1)
    kernel = dense.Prepacked()
    for rows in (1, 7, 32):
        x = _bf16(rows, 64, seed=rows)
        reference = x.float() @ weight.float().T + bias.float()
        torch.testing.assert_close(kernel(x, weight, bias).float(), reference, rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(kernel(x, weight, bias), nn.functional.linear(x, weight, bias))
    assert len(kernel.packed) == 1  # one copy per weight, made at its first call


def test_the_op_runs_the_kernel_bound_for_the_rows_class() -> None:
    weight = _bf16(32, 16)
    calls: list[int] = []

    def recording(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return nn.functional.linear(x, w, b) + 1

    x8, x1 = _bf16(8, 16), _bf16(1, 16)
    assert torch.equal(torch.ops.kiln.dense_linear(x8, weight, None), nn.functional.linear(x8, weight))  # unbound
    dense.bind_dense_kernels(weight, {row_class(16): recording})
    assert torch.equal(torch.ops.kiln.dense_linear(x8, weight, None), nn.functional.linear(x8, weight) + 1)
    assert torch.equal(torch.ops.kiln.dense_linear(x1, weight, None), nn.functional.linear(x1, weight))
    assert calls == [8]


def _fake_race(monkeypatch: pytest.MonkeyPatch, prepacked_base_us: float) -> None:
    """F.linear takes 100 + 10 µs a row, the prepacked product `prepacked_base_us` + 5 µs a row (both grow with the
    rows, as the race's floors assume): 150 makes it lose at 1 and 2 rows and win from 16 on."""

    def fake_us(kernel, x: torch.Tensor, copies: list, budget_s: float = 0.0) -> float:
        rows = x.shape[0]
        return prepacked_base_us + 5.0 * rows if isinstance(kernel, dense.Prepacked) else 100.0 + 10.0 * rows

    monkeypatch.setattr(race, "time_us", fake_us)


def _table(model: nn.Module, tmp_path: Path) -> dense.DenseKernelTable:
    return dense.DenseKernelTable(model, KernelChoiceCache(tmp_path), ROWS, ROWS[:4])


def test_the_table_binds_the_row_classes_prepacking_won(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if _refused_here(tmp_path):
        return
    _fake_race(monkeypatch, prepacked_base_us=150.0)
    model = tiny_model().to(torch.bfloat16)
    x = _bf16(20, 64)
    layer = model.model.layers[0].mlp.down_proj
    before = layer(_bf16(20, 128))
    table = _table(model, tmp_path)
    # qkv (4 + 2 x 2 heads of 16) and the head (vocab 128) share a layout: it is timed at every row count
    assert set(table.distinct) == {"128x64 bfloat16", "64x64 bfloat16", "256x64 bfloat16", "64x128 bfloat16"}
    assert table.rows["128x64 bfloat16"] == ROWS
    assert table.prepacked_rows(layer) == [16, 64, 256, 1024]
    copies = table.install()
    assert copies == sum(m.weight.numel() * 2 for m in table.layers)
    assert all(type(m) is dense.DenseLinear for m in table.layers)
    with torch.profiler.profile() as prof:  # the op's C++ kernel where the native objects load, else Python
        torch.testing.assert_close(layer(_bf16(20, 128)), before)  # the same product, now through the op
    assert _ran(prof, "mkldnn::_linear_pointwise") == 1
    with torch.profiler.profile() as prof:
        model.model.layers[0].self_attn.qkv_proj(x[:2])  # 2 rows: F.linear
    assert _ran(prof, "mkldnn::_linear_pointwise") == 0 and _ran(prof, "aten::linear") == 1


def _ran(prof: torch.profiler.profile, op: str) -> int:
    return sum(e.count for e in prof.key_averages() if e.key == op)


def test_where_blas_wins_every_row_count_nothing_changes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if _refused_here(tmp_path):
        return
    _fake_race(monkeypatch, prepacked_base_us=1e9)
    model = tiny_model().to(torch.bfloat16)
    table = _table(model, tmp_path)
    assert table.install() == 0
    assert not any(type(m) is dense.DenseLinear for m in model.modules())


def test_copies_that_do_not_fit_are_not_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kiln_log: pytest.LogCaptureFixture
) -> None:
    if _refused_here(tmp_path):
        return
    _fake_race(monkeypatch, prepacked_base_us=0.0)
    model = tiny_model().to(torch.bfloat16)
    table = _table(model, tmp_path)
    assert table.install(available_bytes=1024.0) == 0
    assert "would take more than 50% of the 0 MB free: F.linear runs" in kiln_log.text
    x = _bf16(4, 64)
    assert torch.equal(model.lm_head(x), nn.functional.linear(x, model.lm_head.weight))


def test_pieces_keep_the_op_whole_and_decode_the_eager_tokens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bf16 model whose prepacked products won every row count: its pieces hold `kiln::dense_linear` nodes and
    generate the tokens of the eager executor (same kernels), with prefill chunks and batched decode steps."""
    if _refused_here(tmp_path):
        return
    _fake_race(monkeypatch, prepacked_base_us=0.0)
    prompts = random_prompts([5, 9, 3])
    eager_runner = make_runner(tiny_model().to(torch.bfloat16), EagerExecutor(cache_dir=str(tmp_path)))
    assert sum(type(m) is dense.DenseLinear for m in eager_runner.model.modules()) == 2 * 4 + 1  # and the head
    eager = generate(eager_runner, prompts, 6, max_num_batched_tokens=8)
    runner, graph = graph_runner(tiny_model().to(torch.bfloat16), tmp_path, compiler="eager")
    pieces = [n for p in graph.graph.pieces for n in p.graph.graph.nodes]
    assert sum(str(n.target) == "kiln.dense_linear" for n in pieces) == 2 * 4  # 2 layers x qkv, o, gate_up, down
    assert generate(runner, prompts, 6, max_num_batched_tokens=8) == eager


def test_a_static_one_row_piece_reduces_over_the_weight_itself() -> None:
    """DecodeGemv turns the op at a static row count <= 2 into the reduction over W (the plan timed the prepacked
    product only where no static GEMV size is); more rows keep the op."""
    weight, bias = _bf16(48, 32), _bf16(48, seed=2)

    def product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.kiln.dense_linear(x, w, b)

    for rows, kept in ((1, False), (4, True)):
        x = _bf16(rows, 32, seed=3)
        gm = make_fx(product, tracing_mode="fake")(x, weight, bias)
        DecodeGemv()(gm.graph)
        gm.recompile()
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert ("kiln.dense_linear.default" in targets) == kept
        assert ("aten.sum.dim_IntList" in targets) == (not kept)
        torch.testing.assert_close(gm(x, weight, bias).float(), product(x, weight, bias).float(), rtol=2e-2, atol=5e-2)


def test_static_one_row_sizes_lose_to_a_faster_prepacked_product() -> None:
    times = {"1": {"row-major": 10.0, "column-major": 12.0, REDUCTION: 5.0, dense.PREPACKED: 4.0}}
    assert decide(times)["static_sizes"] == []
    times["1"][dense.PREPACKED] = 6.0
    assert decide(times)["static_sizes"] == [1]
    assert decide({"1": {"row-major": 10.0, "column-major": 12.0, REDUCTION: 5.0}})["static_sizes"] == [1]

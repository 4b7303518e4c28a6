"""The bf16 compute form (kiln.kernels.compute_forms): kiln's brgemm product (dense_brgemm.cpp, oneDNN's ukernel, the
matrix unit where there is one) equals the plain-torch statement of its arithmetic (x and the weight rounded to
bf16, summed in float32) within 1e-5 for every packed layout at 1 to 1,000 rows; its copy is in oneDNN's VNNI order;
the matrix unit's probe runs once, in a child process, and is cached; second forms keep to the engine's budget,
layers past it run the fastest candidate without one. Its accuracy on the default model is measured beside int8
activations' (tests/quant/test_int8_accuracy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import kiln.kernels.compute_forms as compute_forms
from kiln.compile.compiler import EagerCompiler
from kiln.kernels.candidates import BRGEMM_BF16, CANDIDATES, DEQUANT_BLAS, candidates_for
from kiln.kernels.choices import KernelChoiceCache, forget_process_choices
from kiln.kernels.compute_forms import (
    BLOCK_N,
    Bf16Form,
    bf16_form_bytes,
    brgemm_bf16_op,
    pack_dense_bf16,
    reference_bf16,
)
from kiln.kernels.native.build import runnable_tiers
from kiln.kernels.packed import PackedKernelTable, label
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import bound_kernel, dequant_blas
from kiln.quant.quantize import quantize
from tests.quant.test_native_int8 import WEIGHTS, assert_within

ROWS = (1, 2, 7, 32, 100, 1000)
AVX512 = "avx512" in {t.name for t in runnable_tiers()}
needs_avx512 = pytest.mark.skipif(not AVX512, reason="oneDNN's bf16 brgemm needs AVX-512 (this CPU lacks it)")


def test_the_op_loads_exactly_where_avx512_runs() -> None:
    assert (brgemm_bf16_op() is not None) == AVX512


def test_the_copy_is_in_vnni_order_with_zeros_past_the_outputs() -> None:
    weight = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)  # exact in bf16: every value below 256
    packed = pack_dense_bf16(weight)
    assert packed.shape == (2, 3, BLOCK_N, 2) and packed.dtype == torch.bfloat16
    for out in range(40):
        for k in range(6):
            assert packed[out // BLOCK_N, k // 2, out % BLOCK_N, k % 2].item() == weight[out, k].item()
    assert packed[1, :, 40 - BLOCK_N :].abs().sum().item() == 0  # the tail block's missing outputs
    assert bf16_form_bytes(40, 6) == packed.numel() * 2


@needs_avx512
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_the_bf16_form_equals_its_reference_arithmetic(name: str) -> None:
    weight = WEIGHTS[name]  # 72 outputs: two blocks of 32 and a tail of 8
    form = Bf16Form([(weight.codes, weight.scale, weight.offset)])
    dense = weight.dequantize()
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        got = form(x, weight.codes, weight.scale, weight.offset)
        assert got.shape == (rows, 72) and got.dtype == torch.float32
        assert_within(got, reference_bf16(x, dense), 1e-5)
        # and it is a bf16 product, not float32 under another name: the float32 product differs by bf16 rounding
        exact = dequant_blas(x, weight.codes, weight.scale, weight.offset)
        assert 1e-5 < ((got - exact).abs().max() / exact.abs().max()).item() < 2e-2


@needs_avx512
def test_the_probe_runs_once_in_a_child_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forget_process_choices()
    children = []
    real = compute_forms._probe_in_child

    def counted() -> dict[str, object]:
        children.append(1)
        return real()

    monkeypatch.setattr(compute_forms, "_probe_in_child", counted)
    cache = KernelChoiceCache(tmp_path)
    assert compute_forms.matrix_unit_works(cache)
    forget_process_choices()  # a new process: read from the file, not probed again
    assert compute_forms.matrix_unit_works(KernelChoiceCache(tmp_path))
    assert children == [1]
    assert compute_forms.probe_matrix_unit()["worst_relative_error"] <= compute_forms.PROBE_TOLERANCE


def test_a_failed_probe_says_no_and_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    forget_process_choices()
    monkeypatch.setattr(compute_forms, "_probe_in_child", lambda: {"ok": False, "why": "a wrong sum"})
    with caplog.at_level("INFO", logger="kiln"):
        assert not compute_forms.matrix_unit_works(KernelChoiceCache(tmp_path))
    assert "a wrong sum" in caplog.text or brgemm_bf16_op() is None
    forget_process_choices()


def test_second_forms_are_admitted_by_int8_engines_and_a_budget_above_zero() -> None:
    assert BRGEMM_BF16 in candidates_for("int8x2") and BRGEMM_BF16 in candidates_for("int8")
    assert BRGEMM_BF16 not in candidates_for("float32")  # float32 engines keep the exact arithmetic
    assert not any(c.second_form for c in candidates_for("int8x2", second_forms=False).values())


def tiny_model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList()
    for i, (out_features, in_features) in enumerate(((64, 64), (96, 64), (64, 128))):
        layer = PackedLinear(in_features, out_features, bits=4, group=32)
        dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(i))
        layer.load_rows(0, quantize(dense, "int4"))
        model.layers.append(layer)
    return model


@needs_avx512
def test_second_forms_keep_to_the_budget(tmp_path: Path) -> None:
    """The winners are set to the bf16 form above 2 rows (what a matrix unit would time); each layer's copy is made
    while the budget holds, in model order, and a layer past it runs the fastest timed candidate without one."""
    forget_process_choices()
    model = tiny_model()
    table = PackedKernelTable(model, EagerCompiler(), KernelChoiceCache(tmp_path), activations="int8x2")
    for record in table.records.values():
        record["winners"] = {r: BRGEMM_BF16 if int(r) > 2 else DEQUANT_BLAS for r in record["winners"]}
    layers = list(model.layers)
    sizes = [bf16_form_bytes(m.out_features, m.in_features) for m in layers]

    def forms() -> list[bool]:
        return [isinstance(bound_kernel(m.codes, 32), Bf16Form) for m in layers]

    assert table.install(None) == sum(sizes) and forms() == [True, True, True]
    assert table.install(sizes[0] + sizes[1]) == sizes[0] + sizes[1] and forms() == [True, True, False]
    assert table.over_budget == 1 and "over the budget" in table.second_form_summary()
    assert table.install(0) == 0 and forms() == [False, False, False]
    for layer in layers:  # past the budget: the fastest timed candidate that holds no copy
        kernel = bound_kernel(layer.codes, 32)
        name = table.without_second_form(layer, 32)
        assert not CANDIDATES[name].second_form
        times = table.records[label(layer)]["times_us"]["64"]
        assert times[name] == min(us for n, us in times.items() if not CANDIDATES[n].second_form)
        x = torch.randn(32, layer.in_features)
        assert_within(kernel(x, layer.codes, layer.scale, layer.offset), dequant_blas(x, *_weight(layer)), 1e-3)
    forget_process_choices()


def _weight(layer: PackedLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.codes, layer.scale, layer.offset

"""kiln's AMX-INT8 products (packed_q8_amx.cpp: a group's integer sums of every row and digit by one tile multiply)
equal the plain-torch statement of the same arithmetic (kiln.kernels.native.reference) within 1e-5, for every packed
layout whose groups fit a tile row (the others are refused with the reason), at 1, 2, 5, 7, 32 and 100 rows (more
than one A tile past 16 / digits rows), with whole blocks of 16 outputs and a tail; the kernel table times them for
3 to AMX_MAX_ROWS rows, and only where their probe passed in a child process. Where this CPU has no AMX-INT8 (or the
avx512 tier does not load), each test asserts the refusal instead: the AMX forms are never timed and no probe runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.kernels import compute_forms
from kiln.kernels.candidates import AMX_MAX_GROUP, AMX_MAX_ROWS, CANDIDATES, NATIVE_INT8_AMX, NATIVE_INT8X2_AMX
from kiln.kernels.choices import KernelChoiceCache, forget_process_choices
from kiln.kernels.native.build import amx_int8_present, native_op
from kiln.kernels.native.reference import q8_linear
from kiln.quant.linear import PackedLinear
from tests.quant.test_native_int8 import WEIGHTS, assert_within

AMX_OPS = {"packed_linear_q8_amx": 1, "packed_linear_q8x2_amx": 2}  # op -> int8 digits of x
ROWS = (1, 2, 5, 7, 32, 100)
HAS_AMX = amx_int8_present() and native_op("avx512", "packed_linear_q8_amx") is not None


def refused_here() -> bool:
    """True where this CPU cannot run the AMX forms, after asserting that the packed kernel table never times them
    there; False where it can."""
    if HAS_AMX:
        return False
    layer = PackedLinear(512, 72, bits=8)
    assert not any(CANDIDATES[c].applies(layer, rows) for c in (NATIVE_INT8_AMX, NATIVE_INT8X2_AMX) for rows in (3, 6))
    return True


def fits(codes: torch.Tensor, group: int) -> bool:
    code_bytes = group // 2 if codes.dtype == torch.uint8 else group
    return group <= AMX_MAX_GROUP and code_bytes % 16 == 0


@pytest.mark.parametrize("op_name", list(AMX_OPS))
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_amx_ops_equal_the_reference_arithmetic(name: str, op_name: str) -> None:
    if refused_here():
        return
    op = native_op("avx512", op_name)
    assert op is not None
    weight = WEIGHTS[name]
    group = 512 // weight.scale.shape[1]
    if not fits(weight.codes, group):
        with pytest.raises(RuntimeError, match=f"groups of at most {AMX_MAX_GROUP} values"):
            op(torch.randn(5, 512), weight.codes, weight.scale, weight.offset)
        return
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        got = op(x, weight.codes, weight.scale, weight.offset)
        assert got.shape == (rows, 72)  # 4 blocks of 16 outputs and a tail of 8
        assert_within(got, q8_linear(x, weight.codes, weight.scale, weight.offset, digits=AMX_OPS[op_name]), 1e-5)


@pytest.mark.parametrize("op_name", list(AMX_OPS))
def test_amx_ops_over_codes_at_their_ends_and_a_strided_x(op_name: str) -> None:
    """Int8 codes -128 and 127 with activations at their largest (the two digits' sums near their widest), a
    transposed x, 40 outputs."""
    if refused_here():
        return
    generator = torch.Generator().manual_seed(1)
    codes = torch.where(torch.rand(40, 3, 32, generator=generator) < 0.5, 127, -128).to(torch.int8)
    scale, offset = torch.rand(40, 3, 1, generator=generator), torch.randn(40, 3, 1, generator=generator)
    x = (torch.randn(96, 5, generator=generator) * 100).t()
    got = native_op("avx512", op_name)(x, codes, scale, offset)
    assert_within(got, q8_linear(x.contiguous(), codes, scale, offset, digits=AMX_OPS[op_name]), 1e-5)


@pytest.mark.parametrize("candidate", [NATIVE_INT8_AMX, NATIVE_INT8X2_AMX])
def test_the_table_times_the_amx_forms_for_a_few_rows_of_layouts_that_fit(candidate: str) -> None:
    c = CANDIDATES[candidate]
    nibbles, int8 = PackedLinear(512, 72, bits=4), PackedLinear(512, 72, bits=8)
    rows = (1, 2, 3, 6, AMX_MAX_ROWS, AMX_MAX_ROWS + 1)
    timed = [False, False, HAS_AMX, HAS_AMX, HAS_AMX, False]  # 1-2 rows: the lane and streamed kernels
    assert [c.applies(nibbles, r) for r in rows] == timed
    assert [c.applies(int8, r) for r in rows] == timed
    assert not c.applies(PackedLinear(512, 72, bits=4, group=128), 6)  # a group wider than a tile row


def test_the_amx_probe_runs_once_in_a_child_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forget_process_choices()
    children = []
    real = compute_forms._probe_in_child

    def counted(probe: str = "probe_matrix_unit") -> dict[str, object]:
        children.append(probe)
        return real(probe)

    monkeypatch.setattr(compute_forms, "_probe_in_child", counted)
    if not amx_int8_present():  # no tiles: no, without a child (it would only die of SIGILL)
        assert not compute_forms.amx_int8_works(KernelChoiceCache(tmp_path)) and children == []
        return
    if not HAS_AMX:  # the avx512 tier did not load: no, without a child
        assert not compute_forms.amx_int8_works(KernelChoiceCache(tmp_path))
        return
    assert compute_forms.amx_int8_works(KernelChoiceCache(tmp_path))
    forget_process_choices()  # a new process: read from the file, not probed again
    assert compute_forms.amx_int8_works(KernelChoiceCache(tmp_path))
    assert children == ["probe_amx_int8"]
    forget_process_choices()


def test_a_failed_amx_probe_says_no(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forget_process_choices()
    monkeypatch.setattr(compute_forms, "_probe_in_child", lambda probe="": {"ok": False, "why": "a wrong sum"})
    assert not compute_forms.amx_int8_works(KernelChoiceCache(tmp_path))
    forget_process_choices()

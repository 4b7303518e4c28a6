"""kiln's blocked int8-activation kernels (packed_q8_blocked.cpp: 16 outputs a zmm on AVX-512 VNNI, 8 a ymm on
AVX2; the codes transposed into a scratch, or in registers: the streamed forms) equal the plain-torch statement of
the same arithmetic (kiln.kernels.native.reference) within 1e-5, for every packed GGUF type and kiln's int8/int4
schemes (the AVX2 form: 4-bit codes; it refuses int8 ones), at 1, 2, 7, 32 and 100 rows, with whole blocks and a
tail; they exist exactly in the avx512 and avx2 tiers this CPU runs, and the kernel table times them for more than
2 rows (the streamed forms from 1 to 16), on int8 codes only where AVX-512 VNNI runs."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.kernels.candidates import (
    CANDIDATES,
    NATIVE_INT8_BLOCKED,
    NATIVE_INT8_STREAMED,
    NATIVE_INT8X2_BLOCKED,
    NATIVE_INT8X2_STREAMED,
    STREAMED_MAX_ROWS,
    native_blocked_linear,
)
from kiln.kernels.native.build import TIER_NAMES, native_op, runnable_tiers
from kiln.kernels.native.reference import q8_linear
from kiln.quant.linear import PackedLinear
from tests.quant.test_native_int8 import ROWS, WEIGHTS, assert_within
from tests.quant.test_packed import _packed

BLOCKED = {  # op -> int8 digits: the codes transposed into a scratch per block, or in registers as used (streamed)
    "packed_linear_q8_blocked": 1,
    "packed_linear_q8x2_blocked": 2,
    "packed_linear_q8_streamed": 1,
    "packed_linear_q8x2_streamed": 2,
}
RUNNABLE = {t.name for t in runnable_tiers()}
HAS_VNNI = "avx512" in RUNNABLE
TIERS = [t for t in ("avx512", "avx2") if t in RUNNABLE]  # the tiers that define the blocked ops, where they run


def takes(tier: str, codes: torch.Tensor) -> bool:
    """Whether the tier's blocked form computes on these codes: nibbles everywhere, int8 codes on avx512 only."""
    return codes.dtype == torch.uint8 or tier == "avx512"


@pytest.mark.parametrize("op_name", list(BLOCKED))
@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("tier", TIERS)
def test_blocked_ops_equal_the_reference_arithmetic(tier: str, name: str, op_name: str) -> None:
    op = native_op(tier, op_name)
    assert op is not None, f"the {tier} tier runs on this CPU, so its blocked ops must build and load"
    weight = WEIGHTS[name]
    if not takes(tier, weight.codes):
        with pytest.raises(RuntimeError, match="int8 codes need the AVX-512 VNNI tier"):
            op(torch.randn(3, 512), weight.codes, weight.scale, weight.offset)
        return
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        got = op(x, weight.codes, weight.scale, weight.offset)
        assert got.shape == (rows, 72)  # 4 blocks of 16 outputs and a tail of 8
        assert_within(got, q8_linear(x, weight.codes, weight.scale, weight.offset, BLOCKED[op_name]), 1e-5)


@pytest.mark.parametrize("op_name", list(BLOCKED))
@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda k: k.name)
@pytest.mark.parametrize("tier", TIERS)
def test_blocked_ops_over_large_codes_and_a_strided_x(tier: str, kind: GGMLQuantizationType, op_name: str) -> None:
    """Codes at the ends of their range (int8 -128 and 127 become 0 and 255 unsigned, and 128 x the digit sums is
    taken off again; nibbles 15), activations at their largest, a transposed x, 37 outputs (blocks and a tail)."""
    op = native_op(tier, op_name)
    assert op is not None
    weight = _packed(kind, 37, 96, 7)
    ends = torch.rand(weight.codes.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    if kind == GGMLQuantizationType.Q4_1:  # nibble pairs 15/0 and 0/15
        codes = torch.where(ends, 0x0F, 0xF0).to(torch.uint8)
    else:
        codes = torch.where(ends, 127, -128).to(torch.int8)
    if not takes(tier, codes):  # the AVX2 form refuses int8 codes: with its reason, never a wrong product
        with pytest.raises(RuntimeError, match="int8 codes need the AVX-512 VNNI tier"):
            op((torch.randn(96, 3) * 100).t(), codes, weight.scale, weight.offset)
        return
    for rows in (3, 9, 17):
        x = (torch.randn(96, rows) * 100).t()
        want = q8_linear(x, codes, weight.scale, weight.offset, BLOCKED[op_name])
        assert_within(op(x, codes, weight.scale, weight.offset), want, 1e-5)


def test_blocked_ops_exist_exactly_in_the_vector_tiers_this_cpu_runs() -> None:
    for tier in TIER_NAMES:
        for op_name in BLOCKED:
            assert (native_op(tier, op_name) is not None) == (tier in TIERS), (tier, op_name)
    nibbles, int8 = PackedLinear(64, 48, bits=4), PackedLinear(64, 48, bits=8)
    for name, activations in ((NATIVE_INT8_BLOCKED, "int8"), (NATIVE_INT8X2_BLOCKED, "int8x2")):
        assert (native_blocked_linear(activations) is not None) == bool(TIERS)
        assert CANDIDATES[name].applies(nibbles, 16) == bool(TIERS)
        assert CANDIDATES[name].applies(int8, 16) == HAS_VNNI  # int8 codes: the AVX-512 VNNI form alone
        assert not CANDIDATES[name].applies(nibbles, 2)  # one or two rows: the lane and streamed kernels
    for name in (NATIVE_INT8_STREAMED, NATIVE_INT8X2_STREAMED):  # from one row to STREAMED_MAX_ROWS
        assert CANDIDATES[name].applies(nibbles, 1) == CANDIDATES[name].applies(nibbles, 16) == bool(TIERS)
        assert CANDIDATES[name].applies(int8, 2) == HAS_VNNI
        assert not CANDIDATES[name].applies(nibbles, STREAMED_MAX_ROWS + 1)


@pytest.mark.parametrize("tier", ["avx512"] if HAS_VNNI else [])
def test_blocked_two_digit_int8_groups_are_bounded(tier: str) -> None:
    """int8 codes + 128 times two digits: groups over 512 could pass the int32 sums, so the op refuses them and the
    candidate does not apply; nibbles and one digit keep the lane kernel's bound of 1024."""
    op = native_op(tier, "packed_linear_q8x2_blocked")
    assert op is not None
    big = torch.zeros(16, 1, 1024, dtype=torch.int8), torch.ones(16, 1, 1), torch.zeros(16, 1, 1)
    with pytest.raises(RuntimeError, match="int8 codes in groups of at most 512 values, got 1024"):
        op(torch.randn(4, 1024), *big)
    one = native_op(tier, "packed_linear_q8_blocked")
    assert one is not None and one(torch.randn(4, 1024), *big).abs().max().item() == 0
    streamed = native_op(tier, "packed_linear_q8x2_streamed")
    assert streamed is not None
    with pytest.raises(RuntimeError, match="int8 codes in groups of at most 512 values, got 1024"):
        streamed(torch.randn(4, 1024), *big)
    assert not CANDIDATES[NATIVE_INT8X2_BLOCKED].applies(PackedLinear(1024, 16, bits=8, group=1024), 16)
    assert not CANDIDATES[NATIVE_INT8X2_STREAMED].applies(PackedLinear(1024, 16, bits=8, group=1024), 16)
    assert CANDIDATES[NATIVE_INT8_BLOCKED].applies(PackedLinear(1024, 16, bits=8, group=1024), 16)

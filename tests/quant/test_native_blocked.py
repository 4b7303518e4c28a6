"""kiln's blocked int8-activation kernels (packed_q8_blocked.cpp: 16 outputs a vector, AVX-512 VNNI only) equal
the plain-torch statement of the same arithmetic (kiln.kernels.native.reference) within 1e-5, for every packed GGUF
type and kiln's int8/int4 schemes, at 1, 2, 7, 32 and 100 rows, with whole blocks of 16 outputs and a tail; they
exist exactly where the CPU has AVX-512 VNNI, and the kernel table times them there only, for more than 2 rows."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.kernels.candidates import CANDIDATES, NATIVE_INT8_BLOCKED, NATIVE_INT8X2_BLOCKED, native_blocked_linear
from kiln.kernels.native.build import TIER_NAMES, native_op, runnable_tiers
from kiln.kernels.native.reference import q8_linear
from kiln.quant.linear import PackedLinear
from tests.quant.test_native_int8 import ROWS, WEIGHTS, assert_within
from tests.quant.test_packed import _packed

BLOCKED = {"packed_linear_q8_blocked": 1, "packed_linear_q8x2_blocked": 2}  # op -> int8 digits
HAS_VNNI = "avx512" in {t.name for t in runnable_tiers()}
VNNI = ["avx512"] if HAS_VNNI else []  # the one tier that defines the blocked ops, where this CPU runs it


@pytest.mark.parametrize("op_name", list(BLOCKED))
@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("tier", VNNI)
def test_blocked_ops_equal_the_reference_arithmetic(tier: str, name: str, op_name: str) -> None:
    op = native_op(tier, op_name)
    assert op is not None, "the avx512 tier runs on this CPU, so its blocked ops must build and load"
    weight = WEIGHTS[name]
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        got = op(x, weight.codes, weight.scale, weight.offset)
        assert got.shape == (rows, 72)  # 4 blocks of 16 outputs and a tail of 8
        assert_within(got, q8_linear(x, weight.codes, weight.scale, weight.offset, BLOCKED[op_name]), 1e-5)


@pytest.mark.parametrize("op_name", list(BLOCKED))
@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda k: k.name)
@pytest.mark.parametrize("tier", VNNI)
def test_blocked_ops_over_large_codes_and_a_strided_x(tier: str, kind: GGMLQuantizationType, op_name: str) -> None:
    """Codes at the ends of their range (int8 -127 and 127 become 1 and 255 unsigned, and 128 x the digit sums is
    taken off again), activations at their largest, a transposed x, 37 outputs (2 blocks and a tail of 5)."""
    op = native_op(tier, op_name)
    assert op is not None
    weight = _packed(kind, 37, 96, 7)
    ends = torch.rand(weight.codes.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    if kind == GGMLQuantizationType.Q4_1:  # nibble pairs 15/0 and 0/15
        codes = torch.where(ends, 0x0F, 0xF0).to(torch.uint8)
    else:
        codes = torch.where(ends, 127, -128).to(torch.int8)
    for rows in (3, 9, 17):
        x = (torch.randn(96, rows) * 100).t()
        want = q8_linear(x, codes, weight.scale, weight.offset, BLOCKED[op_name])
        assert_within(op(x, codes, weight.scale, weight.offset), want, 1e-5)


def test_blocked_ops_exist_exactly_where_the_cpu_has_avx512_vnni() -> None:
    for tier in TIER_NAMES:
        for op_name in BLOCKED:
            op = native_op(tier, op_name)
            assert (op is not None) == (tier == "avx512" and HAS_VNNI), (tier, op_name)
    layer = PackedLinear(64, 48, bits=4)
    for name, activations in ((NATIVE_INT8_BLOCKED, "int8"), (NATIVE_INT8X2_BLOCKED, "int8x2")):
        assert (native_blocked_linear(activations) is not None) == HAS_VNNI
        assert CANDIDATES[name].applies(layer, 16) == HAS_VNNI
        assert not CANDIDATES[name].applies(layer, 2)  # one or two rows: the lane kernel streams the codes as they are


@pytest.mark.parametrize("tier", VNNI)
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
    assert not CANDIDATES[NATIVE_INT8X2_BLOCKED].applies(PackedLinear(1024, 16, bits=8, group=1024), 16)
    assert CANDIDATES[NATIVE_INT8_BLOCKED].applies(PackedLinear(1024, 16, bits=8, group=1024), 16)

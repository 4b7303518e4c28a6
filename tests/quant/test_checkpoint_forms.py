"""Quantized checkpoints' integer weights repacked into kiln's form (kiln.quant.codes, compressed, gptq_awq) equal
their formats' own dequantization within 1e-5: compressed-tensors' (its compressor decompresses the same tensors),
GPTQ's and AWQ's (`(q - zero) * scale` over the layouts written here as AutoGPTQ and AutoAWQ write them)."""

from __future__ import annotations

import pytest
import torch

from kiln.quant.gptq_awq import awq_form, gptq_form
from kiln.quant.linear import PackedTensor
from tests.model.quantized_models import awq_tensors, formula, gptq_tensors

ROWS, COLS = 48, 128
TOLERANCE = 1e-5


def compressed_layer(bits: int, strategy: str, symmetric: bool) -> tuple[dict[str, torch.Tensor], object]:
    """A random [ROWS, COLS] weight compressed by compressed-tensors' pack-quantized compressor (data-free min/max
    scales), and its scheme."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(
        num_bits=bits, strategy=strategy, group_size=32 if strategy == "group" else None, symmetric=symmetric
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(bits)) * 0.05
    view = weight.reshape(ROWS, -1, 32) if strategy == "group" else weight.reshape(ROWS, 1, COLS)
    scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), args)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
    return PackedQuantizationCompressor.compress(state, scheme), scheme


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("strategy", ["group", "channel"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_codes_repack_to_the_packages_dequantized_weight(
    bits: int, strategy: str, symmetric: bool
) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    from kiln.quant.compressed import LayerScheme, kiln_form

    stored, scheme = compressed_layer(bits, strategy, symmetric)
    assert ("weight_zero_point" in stored) is not symmetric
    packed = kiln_form(stored, LayerScheme(scheme, "pack-quantized"))
    reference = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
    assert isinstance(packed, PackedTensor) and packed.bits == bits and packed.group == 32
    assert packed.codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert packed.shape == (ROWS, COLS)
    assert (packed.dequantize() - reference).abs().max().item() < TOLERANCE
    assert reference.abs().max().item() > 0.05  # a real weight, not zeros


def random_codes(bits: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (ROWS, COLS), generator=g)
    zeros = torch.randint(1, 1 << bits, (ROWS, groups), generator=g)
    scales = (torch.rand(ROWS, groups, generator=g) * 0.01 + 0.001).half().float()
    return q, zeros, scales


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_codes_repack_to_its_formula(bits: int) -> None:
    q, zeros, scales = random_codes(bits, COLS // 32, seed=bits)
    stored = gptq_tensors(q, zeros, scales, bits) | {"g_idx": torch.arange(COLS, dtype=torch.int32) // 32}
    packed = gptq_form(stored, bits, zero_minus_one=True)
    assert isinstance(packed, PackedTensor) and (packed.bits, packed.group) == (bits, 32)
    want = formula(q, zeros, scales, torch.arange(COLS) // 32)
    assert (packed.dequantize() - want).abs().max().item() < TOLERANCE


def test_gptq_act_order_packs_its_groups_sorted_and_keeps_the_input_order() -> None:
    q, zeros, scales = random_codes(4, COLS // 32, seed=7)
    g_idx = (torch.randperm(COLS, generator=torch.Generator().manual_seed(1)) // 32).to(torch.int32)
    packed = gptq_form(gptq_tensors(q, zeros, scales, 4) | {"g_idx": g_idx}, 4, zero_minus_one=True)
    assert isinstance(packed, PackedTensor) and packed.input_order is not None
    assert torch.equal(g_idx[packed.input_order].long(), torch.arange(COLS) // 32)  # each group's columns together
    want = formula(q, zeros, scales, g_idx.long())
    assert (packed.dequantize() - want).abs().max().item() < TOLERANCE  # in the checkpoint's column order
    x = torch.randn(3, COLS)
    sorted_product = (
        x[:, packed.input_order] @ PackedTensor(packed.codes, packed.scale, packed.offset, 4).dequantize().T
    )
    assert (sorted_product - x @ want.T).abs().max().item() < 1e-4


def test_gptq_groups_of_unequal_sizes_load_the_formula() -> None:
    q, zeros, scales = random_codes(4, COLS // 32, seed=8)
    g_idx = torch.arange(COLS, dtype=torch.int32) // 32
    g_idx[:40] = 0  # group 0 takes 8 columns of group 1
    weight = gptq_form(gptq_tensors(q, zeros, scales, 4) | {"g_idx": g_idx}, 4, zero_minus_one=True)
    assert not isinstance(weight, PackedTensor)
    assert (weight - formula(q, zeros, scales, g_idx.long())).abs().max().item() < TOLERANCE


def test_awq_codes_repack_to_its_formula() -> None:
    q, zeros, scales = random_codes(4, COLS // 32, seed=3)
    packed = awq_form(awq_tensors(q, zeros, scales), 4)
    assert isinstance(packed, PackedTensor) and (packed.bits, packed.group) == (4, 32)
    want = formula(q, zeros, scales, torch.arange(COLS) // 32)
    assert (packed.dequantize() - want).abs().max().item() < TOLERANCE

"""Load-time int8/int4 quantization (`--quantization int8|int4`) against a plain-torch quantize-dequantize written
here independently, and a small fp32 model quantized at load end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import unpack_codes
from kiln.quant.quantize import quantize
from tests.engine.tiny_models import write_hf_model


def reference_qdq(w: torch.Tensor, scheme: str, group: int = 32) -> torch.Tensor:
    """Quantize-dequantize per `group` values along each row, the textbook way."""
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], group):
            v = w[r, g : g + group]
            if scheme == "int8":
                s = v.abs().max() / 127 if v.abs().max() > 0 else torch.tensor(1.0)
                out[r, g : g + group] = torch.round(v / s).clamp(-127, 127) * s
            else:
                lo, hi = v.min(), v.max()
                s = (hi - lo) / 15 if hi > lo else torch.tensor(1.0)
                out[r, g : g + group] = (torch.round((v - lo) / s).clamp(0, 15) - 8) * s + (lo + 8 * s)
    return out


@pytest.mark.parametrize(("scheme", "group"), [("int8", 32), ("int4", 32), ("int8", 48), ("int4", 16)])
def test_quantize_matches_the_reference_and_its_error_bound(scheme: str, group: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 96) * torch.rand(24, 1) * 3
    w[3, :group] = 0.25  # a constant group is reproduced exactly
    packed = quantize(w, scheme, group)
    assert packed.group == group and packed.scale.shape == (24, 96 // group, 1)
    got = packed.dequantize()
    torch.testing.assert_close(got, reference_qdq(w, scheme, group), rtol=0, atol=1e-6)
    assert torch.equal(got[3, :group], w[3, :group])
    half_step = packed.scale.expand(-1, -1, group).reshape(24, 96) / 2
    assert bool(((got - w).abs() <= half_step + 1e-6).all())
    codes = unpack_codes(packed.codes)
    assert codes.dtype == (torch.int8 if scheme == "int8" else torch.uint8)  # int4: two codes to a byte
    levels = 255 if scheme == "int8" else 16
    assert len(torch.unique(codes)) <= levels and (scheme == "int8" or int(codes.max()) <= 15)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        quantize(torch.zeros(2, 32), "int3")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_float_model_quantized_at_load(tmp_path: Path, scheme: str) -> None:
    hf = write_hf_model(tmp_path / "tiny", "llama")
    reference = LLM(str(tmp_path / "tiny"), graph_mode="eager")
    quantized = LLM(str(tmp_path / "tiny"), quantization=scheme, graph_mode="eager")
    layers = dict(quantized.engine.model.named_modules())
    assert sum(isinstance(m, PackedLinear) for m in layers.values()) == 4 * 2  # qkv, o, gate_up, down x 2 layers
    qkv = layers["model.layers.1.self_attn.qkv_proj"]
    hf_attn = hf.model.layers[1].self_attn
    fused = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight]).detach()
    torch.testing.assert_close(qkv.weight, reference_qdq(fused, scheme), rtol=0, atol=1e-6)
    x = torch.randn(7, hf.config.hidden_size)
    tolerance = 0.02 if scheme == "int8" else 0.25  # relative, for 8-bit and 4-bit weights
    with torch.inference_mode():
        for mine, theirs in zip(quantized.engine.model.model.layers, reference.engine.model.model.layers, strict=True):
            got, want = mine.mlp(x), theirs.mlp(x)
            assert 0 < float((got - want).norm() / want.norm()) < tolerance
    out = quantized.generate([list(range(5, 25))], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4

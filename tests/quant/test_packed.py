"""Packed weights (`--quantization packed`): GGUF blocks decode bit-identically, packed layers compute what the
dequantized model computes, in eager and in graph mode, and hold less than half the memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from kiln import LLM, SamplingParams
from kiln.compile.compiler import make_compiler
from kiln.compile.packed_choice import DEQUANT_BLAS, FUSED, choose_packed_static_sizes
from kiln.errors import ConfigError
from kiln.executor.kernel_choice import KernelChoiceCache
from kiln.model.loader import resolve_model_path
from kiln.model.registry import resident_weight_bytes
from kiln.quant.gguf_blocks import PACKED_TYPES, decode_blocks
from kiln.quant.linear import PackedLinear, PackedTensor
from tests.engine.tiny_models import write_hf_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea:", "1, 2, 3, 4,"]


@pytest.mark.parametrize("kind", list(PACKED_TYPES))
def test_blocks_decode_bit_identically_to_ggml(kind: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    raw = quantize(weights, kind)
    codes, scale, offset = decode_blocks(raw, kind, 48, 96)
    assert codes.dtype == np.int8 and codes.shape == (48, 3, 32) and scale.shape == offset.shape == (48, 3, 1)
    ours = (codes.astype(np.float32) * scale + offset).reshape(48, 96)
    assert np.array_equal(ours, np.asarray(dequantize(raw, kind), dtype=np.float32).reshape(48, 96))


def test_default_model_blocks_decode_bit_identically() -> None:
    reader = GGUFReader(resolve_model_path("default"))
    checked = 0
    for t in reader.tensors[:12]:
        if t.tensor_type in PACKED_TYPES:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            packed = PackedTensor(*(torch.from_numpy(a) for a in decode_blocks(t.data, t.tensor_type, rows, cols)))
            ref = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, cols)
            assert torch.equal(packed.dequantize(), torch.from_numpy(ref)), t.name
            checked += 1
    assert checked >= 8  # the Q8_0 embedding and layer 0's Q4_1 projections


def test_packed_linear_fills_fused_rows_and_multiplies_like_linear() -> None:
    torch.manual_seed(0)
    layer = PackedLinear(64, 48)
    parts = []
    for offset, rows in ((0, 32), (32, 16)):  # two parts of a fused weight, as q/k/v or gate/up load
        part = PackedTensor(
            torch.randint(-8, 8, (rows, 2, 32), dtype=torch.int8), torch.rand(rows, 2, 1), torch.randn(rows, 2, 1)
        )
        layer.load_rows(offset, part)
        parts.append(part.dequantize())
    weight = torch.cat(parts)
    assert torch.equal(layer.weight, weight)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), x @ weight.t(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="divisible by 32"):
        PackedLinear(50, 8)


@pytest.fixture(scope="module")
def packed_llm() -> LLM:
    return LLM(quantization="packed", num_kv_blocks=256)


def test_packed_model_holds_less_memory_and_logits_match(packed_llm: LLM, llm: LLM) -> None:
    packed, reference = packed_llm.engine.model, llm.engine.model
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 4 * packed.config.num_layers  # qkv, o, gate_up and down of every layer
    assert resident_weight_bytes(packed) < 0.5 * resident_weight_bytes(reference)
    ids, x = torch.arange(100, 110), torch.randn(10, packed.config.hidden_size)
    with torch.inference_mode():
        for mine, theirs in zip(packed.model.layers, reference.model.layers, strict=True):
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                assert torch.equal(mine.get_submodule(name).weight, theirs.get_submodule(name).weight), name
            # the same weights; the reference's BLAS layout (timed per machine) sums in another order
            torch.testing.assert_close(mine.mlp(x), theirs.mlp(x), rtol=1e-3, atol=1e-3)
        assert torch.equal(packed.model.embed_tokens(ids), reference.model.embed_tokens(ids))


def test_packed_greedy_tokens_equal_the_dequantized_reference(packed_llm: LLM, llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)
    assert [o.token_ids for o in packed_llm.generate(PROMPTS, params)] == [
        o.token_ids for o in llm.generate(PROMPTS, params)
    ]


def test_packed_graph_mode_matches_eager_and_fuses_the_dequantization(tmp_path: Path, llm: LLM) -> None:
    graph = LLM(quantization="packed", enable_piecewise_graph=True, capture_sizes=[1, 2, 4], cache_dir=str(tmp_path))
    executor = graph.engine.executor
    record = executor.kernel_choices["static_sizes"]
    assert set(record["times_us"]["1"]) == {DEQUANT_BLAS, FUSED}
    wins = [int(r) for r, t in record["times_us"].items() if t[FUSED] < t[DEQUANT_BLAS]]
    assert record["static_sizes"] == (wins if 1 in wins else [])  # the rule, on what was measured here
    params = SamplingParams(max_tokens=12, temperature=0)
    assert [o.token_ids for o in graph.generate(PROMPTS, params)] == [
        o.token_ids for o in llm.generate(PROMPTS, params)
    ]


def test_packed_needs_a_gguf(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--quantization packed keeps a block-quantized GGUF's weights packed"):
        LLM(str(_tiny_hf_dir(tmp_path)), quantization="packed")


def test_the_choice_times_both_candidates_and_is_cached(tmp_path: Path) -> None:
    layer = PackedLinear(64, 96)
    layer.load_rows(0, PackedTensor(torch.randint(-8, 8, (96, 2, 32), dtype=torch.int8), torch.rand(96, 2, 1),
                                    torch.randn(96, 2, 1)))  # fmt: skip
    cache = KernelChoiceCache(tmp_path)
    first = choose_packed_static_sizes(layer, [1, 2, 4], make_compiler("inductor"), cache)
    assert first["source"] == "timed" and set(first["times_us"]) == {"1", "2"}
    assert all(t[FUSED] > 0 and t[DEQUANT_BLAS] > 0 for t in first["times_us"].values())
    again = choose_packed_static_sizes(layer, [1, 2, 4], make_compiler("inductor"), KernelChoiceCache(tmp_path))
    assert again["source"] != "timed" and again["static_sizes"] == first["static_sizes"]


def _tiny_hf_dir(tmp_path: Path) -> Path:
    write_hf_model(tmp_path / "tiny", "llama")
    return tmp_path / "tiny"


def test_the_shipped_recipe_compiles_packed_and_its_fusion_group_holds(tmp_path: Path) -> None:
    """The dequantization of a packed weight is read through by the fusion contract: mlp_fusion (required) holds."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"
    llm = LLM(recipe=str(recipe), quantization="packed", capture_sizes=[1, 4], cache_dir=str(tmp_path))
    (mlp,) = llm.engine.executor.fusion
    assert mlp.realised and mlp.kernels[0] == "extern_kernels.mm"
    assert "silu" in mlp.kernels[1] and "reads the GEMM output of gate_proj, up_proj (gate_up_proj)" in mlp.reason

"""Packed weights (`--quantization packed`): GGUF blocks decode bit-identically, packed layers compute what the
dequantized model computes, in eager and in graph mode, and hold less than half the memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from kiln import LLM, SamplingParams
from kiln.compile.compiler import CompileOnce, make_compiler
from kiln.compile.full_graph import STATIC_SIZES
from kiln.compile.kernels import kernels_in
from kiln.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from kiln.errors import ConfigError
from kiln.kernels.candidates import (
    BF16,
    CANDIDATES,
    COMPILED_DEQUANT,
    DEQUANT_BLAS,
    FLOAT32,
    FUSED,
    INT4PACK,
    INT8X2,
    NATIVE,
    TILED,
    native_packed_linear,
)
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.compute_forms import Bf16Form, reference_bf16
from kiln.kernels.native.reference import q8_linear
from kiln.kernels.packed import LARGE_ROWS, ROWS, TIMED_ROWS, PackedKernelTable, class_points, label, raced_rows
from kiln.model.build import resident_weight_bytes
from kiln.model.loader import resolve_model_path
from kiln.quant.gguf_blocks import PACKED_TYPES, decode_blocks, layout_of
from kiln.quant.linear import PackedEmbedding, PackedLinear, PackedTensor, unpack_codes
from kiln.quant.ops import LARGE, bound_kernel, row_class, rows_label
from tests.engine.tiny_models import write_hf_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea:", "1, 2, 3, 4,"]


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """`kind` blocks for a [rows, cols] weight: the quantized weights of random floats where gguf-py quantizes the
    type (Q8_0, Q4_0, Q4_1, the ternary types, MXFP4), random codes and sub-block scales otherwise (K-quants), with
    sane fp16 super-block scales."""
    weights = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    if kind.name in ("Q8_0", "Q4_0", "Q4_1", "TQ1_0", "TQ2_0", "MXFP4"):
        return quantize(weights, kind)
    size, per_block, _, _ = PACKED_TYPES[kind]
    blocks = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    fp16 = [208] if kind == GGMLQuantizationType.Q6_K else [0, 2]  # d (and dmin)
    for at in fp16:
        blocks[:, at : at + 2] = rng.uniform(1e-4, 2e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("kind", list(PACKED_TYPES), ids=lambda k: k.name)
def test_blocks_decode_bit_identically_to_ggml(kind: GGMLQuantizationType, tmp_path: Path) -> None:
    """Each packed type, written to a GGUF file with the gguf package and read back, decodes to exactly the
    weights gguf-py's dequantization gives."""
    rows, cols = 12, 512
    raw = random_blocks(kind, rows, cols, np.random.default_rng(int(kind)))
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("w", raw, raw_dtype=kind)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    (t,) = GGUFReader(tmp_path / "t.gguf").tensors
    codes, scale, offset = decode_blocks(t.data, kind, rows, cols)
    bits, group = layout_of(kind)
    nibbles = bits == 4
    assert codes.dtype == (np.uint8 if nibbles else np.int8)
    assert codes.shape == (rows, cols // group, group // 2 if nibbles else group)
    assert scale.shape == offset.shape == (rows, cols // group, 1)
    packed = PackedTensor(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(offset), bits)
    ref = np.asarray(dequantize(t.data, kind), dtype=np.float32).reshape(rows, cols)
    assert torch.equal(packed.dequantize(), torch.from_numpy(ref))
    codes_seen = torch.unique(unpack_codes(packed.codes).to(torch.int16))
    assert len(codes_seen) <= 2**bits  # a code fits its format's bit width


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


def _packed(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> PackedTensor:
    raw = random_blocks(kind, rows, cols, np.random.default_rng(seed))
    parts = (torch.from_numpy(a) for a in decode_blocks(raw, kind, rows, cols))
    return PackedTensor(*parts, bits=layout_of(kind)[0])


def test_a_fused_layer_of_mixed_formats_takes_the_widest_layout() -> None:
    """q and k in Q4_K with v in Q6_K (as Q4_K_M files store them) share one layer of 6-bit codes in groups of 16;
    a layer of 4-bit parts keeps its codes two to a byte."""
    q, k, v = (
        _packed(GGMLQuantizationType.Q4_K, 32, 256, 1),
        _packed(GGMLQuantizationType.Q4_K, 16, 256, 2),
        _packed(GGMLQuantizationType.Q6_K, 16, 256, 3),
    )
    layer = PackedLinear(256, 64, bits=6, group=16)
    for offset, part in ((0, q), (32, k), (48, v)):
        layer.load_rows(offset, part)
    assert layer.codes.dtype == torch.int8 and layer.codes.shape == (64, 16, 16)
    weight = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(layer.weight, weight)
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    four = PackedLinear(256, 48, bits=4)
    four.load_rows(0, q)
    four.load_rows(32, k)
    assert four.codes.dtype == torch.uint8 and four.nbytes < 0.6 * layer.nbytes * 48 / 64
    assert torch.equal(four.weight, torch.cat([q.dequantize(), k.dequantize()]))
    with pytest.raises(ValueError, match="cannot store 6-bit codes in groups of 16 as groups of 32"):
        PackedLinear(256, 16, bits=6).load_rows(0, v)


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
    return LLM(quantization="packed", num_kv_blocks=256, graph_mode="eager", activations="float32")


def test_packed_model_holds_less_memory_and_logits_match(packed_llm: LLM, llm: LLM) -> None:
    packed, reference = packed_llm.engine.model, llm.engine.model
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 4 * packed.config.num_layers + 1  # qkv, o, gate_up and down of every layer, and the head
    assert isinstance(packed.model.embed_tokens, PackedEmbedding) and packed.lm_head.tied
    assert packed.lm_head.codes is packed.model.embed_tokens.codes  # the tied head holds no copy
    file_bytes = Path(resolve_model_path("default")).stat().st_size
    assert resident_weight_bytes(packed) <= 1.3 * file_bytes < 0.25 * resident_weight_bytes(reference)
    ids, x = torch.arange(100, 110), torch.randn(10, packed.config.hidden_size)
    with torch.inference_mode():
        for mine, theirs in zip(packed.model.layers, reference.model.layers, strict=True):
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                assert torch.equal(mine.get_submodule(name).weight, theirs.get_submodule(name).weight), name
            # the same weights; the reference's BLAS layout (timed per machine) sums in another order
            torch.testing.assert_close(mine.mlp(x), theirs.mlp(x), rtol=1e-3, atol=1e-3)
        assert torch.equal(packed.model.embed_tokens(ids), reference.model.embed_tokens(ids))


REFERENCE_OUTPUTS = 1024  # the int8 candidates' float64 reference over the first outputs only (the head has 49,152)


def test_every_kernel_candidate_matches_its_reference_per_layer(packed_llm: LLM) -> None:
    """Every candidate of the packed kernel table, not only the ones that won the race on this machine, at every row
    class where it applies to each of the default model's layouts: the float32 ones (fused reduction, tiled
    dequantization, torch's int4 kernel, ...) within 1e-3 relative of the dequantized weight's fp32 product, the
    int8 ones within 1e-5 of their arithmetic's reference (kiln.kernels.native.reference), the bf16 second form
    within 1e-5 of bf16 inputs summed in float32 (kiln.kernels.compute_forms). The winners are among them, and what
    this machine installed is checked through the layer's own call."""
    model = packed_llm.engine.model
    chosen = {name for record in packed_llm.engine.executor.kernel_choices["packed_kernels"].values() for name in
              record["winners"].values()}  # fmt: skip
    assert chosen <= set(CANDIDATES)
    compiler = CompileOnce(make_compiler("inductor"))  # one compile per graph, as the kernel table does
    checked: set[str] = set()
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)][-5:]:
            for rows in (1, 2, 5, 7, 32, 100):  # one per row class below LARGE
                x = torch.randn(rows, layer.in_features)
                ref = x @ layer.dequantized().t()
                if isinstance(bound_kernel(layer.codes, rows), Bf16Form):  # the second form won here
                    assert_relative(layer(x), reference_bf16(x, layer.dequantized()), 1e-5, (name, rows, "installed"))
                else:
                    assert_relative(layer(x), ref, 1e-3, (name, rows, "installed"))
                checked |= check_candidates(layer, x, ref, compiler, where=(name, rows))
    # the float32 forms of any CPU torch runs on: a broken one fails here, on this machine, not where it wins
    assert {DEQUANT_BLAS, COMPILED_DEQUANT, TILED, FUSED} <= checked, checked
    assert chosen <= checked, (chosen, checked)


def check_candidates(
    layer: PackedLinear, x: torch.Tensor, ref: torch.Tensor, compiler: CompileOnce, where: tuple
) -> set[str]:
    """Each candidate that applies to `layer` at x's rows against its reference; the names of those checked."""
    weight = (layer.codes, layer.scale, layer.offset)
    int8_refs: dict[str, torch.Tensor] = {}
    checked = set()
    for candidate in CANDIDATES.values():
        if not candidate.applies(layer, len(x)):
            continue
        got = candidate.make(layer, len(x), compiler, [weight])(x, *weight)
        if candidate.activations == FLOAT32:
            assert_relative(got, ref, 1e-3, (*where, candidate.name))
        elif candidate.activations == BF16:
            assert_relative(got, reference_bf16(x, layer.dequantized()), 1e-5, (*where, candidate.name))
        else:
            if candidate.activations not in int8_refs:
                part = (t[:REFERENCE_OUTPUTS] for t in weight)
                digits = 2 if candidate.activations == INT8X2 else 1
                int8_refs[candidate.activations] = q8_linear(x, *part, digits=digits)
            want = int8_refs[candidate.activations]
            assert_relative(got[:, :REFERENCE_OUTPUTS], want, 1e-5, (*where, candidate.name))
        checked.add(candidate.name)
    return checked


def assert_relative(got: torch.Tensor, want: torch.Tensor, tolerance: float, where: tuple) -> None:
    """The largest difference, relative to the largest magnitude of `want`, is below `tolerance`."""
    assert got.shape == want.shape, where
    err = float((got - want).abs().max() / want.abs().max())
    assert err < tolerance, (*where, err)


def test_packed_greedy_tokens_equal_the_dequantized_reference(packed_llm: LLM, llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)
    assert [o.token_ids for o in packed_llm.generate(PROMPTS, params)] == [
        o.token_ids for o in llm.generate(PROMPTS, params)
    ]


@pytest.mark.timeout(1800)  # the default model compiled whole for its full decode graph: minutes on 2 slow cores
def test_packed_graph_mode_matches_eager_and_fuses_the_dequantization(llm: LLM) -> None:
    # the suite's compile cache and kernel choices (KILN_CACHE_DIR), as other tests of the packed model use them:
    # nothing here depends on whether they were timed and compiled now or earlier
    graph = LLM(quantization="packed", enable_piecewise_graph=True, capture_sizes=[1, 2, 4])
    executor = graph.engine.executor
    records = executor.kernel_choices["packed_kernels"]
    assert len(records) == 5  # qkv, o, gate_up, down and the tied head: every packed layout is timed
    for record in records.values():
        assert {DEQUANT_BLAS, FUSED} <= set(record["times_us"]["1"]) and FUSED not in record["times_us"]["16"]
    packed_ops = [
        k for p in executor.pieces if p.compiled is not None for k in kernels_in(p.compiled.source_code or "")
    ]
    # the op stays whole inside the pieces: one extern call per packed layer (the head runs outside them)
    assert sum(k.is_extern and "packed_linear" in k.name for k in packed_ops) == 4 * 30
    # full_and_piecewise: a static-size decode graph where every timed winner at that row count is the fused
    # reduction, with the products inline; the graph for any size calls the op
    full = executor.full
    layers = {label(m) for m in graph.engine.model.model.layers.modules() if isinstance(m, PackedLinear)}
    winners = {size: {records[name]["winners"][str(size)] for name in layers} for size in STATIC_SIZES}
    assert set(full.variants) - {None} == {size for size, won in winners.items() if FUSED in won}

    def op_calls(piece) -> int:
        return sum("packed_linear" in str(n.target) for n in piece.graph.graph.nodes)

    assert op_calls(full.piece) == 4 * 30
    for size, variant in full.variants.items():
        assert size is None or op_calls(variant.piece) < 4 * 30  # the products that won inline are inline
    params = SamplingParams(max_tokens=12, temperature=0)
    assert [o.token_ids for o in graph.generate(PROMPTS, params)] == [
        o.token_ids for o in llm.generate(PROMPTS, params)
    ]
    assert executor.counters.full_replays > 0


def test_packed_graph_mode_with_only_batch_1_captured(llm: LLM) -> None:
    """Capture sizes [1]: the forward is still traced for a symbolic num_tokens (traced at 3 tokens, not 2)."""
    graph = LLM(quantization="packed", graph_mode="piecewise", capture_sizes=[1])
    params = SamplingParams(max_tokens=4, temperature=0)
    assert [o.token_ids for o in graph.generate(PROMPTS[:1], params)] == [
        o.token_ids for o in llm.generate(PROMPTS[:1], params)
    ]
    assert graph.engine.executor.counters.replays == 3


def test_packed_needs_a_quantized_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"--quantization packed keeps a quantized checkpoint's weights packed; .* holds float weights",
    ):
        LLM(str(_tiny_hf_dir(tmp_path)), quantization="packed", graph_mode="eager")


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_the_table_times_each_shape_once_picks_the_fastest_and_is_cached(tmp_path: Path) -> None:
    model = torch.nn.Sequential(PackedLinear(64, 96, bits=4), PackedLinear(64, 96, bits=4), PackedLinear(96, 64))
    for i, layer in enumerate(model):
        q = _packed(
            GGMLQuantizationType.Q4_1 if layer.bits == 4 else GGMLQuantizationType.Q8_0,
            layer.out_features,
            layer.in_features,
            i,
        )
        layer.load_rows(0, q)
    first = PackedKernelTable(model, make_compiler("inductor"), KernelChoiceCache(tmp_path), "float32")
    assert len(first.records) == 2  # two layers of one shape share an entry
    four = first.records["96x64 4-bit/32 float32"]
    assert four["source"] == "timed" and set(four["winners"]) == {"1", "2", "6", "16", "64", "256", "1024"}
    assert set(four["times_us"]) == {"1", "2", "4", "6", "8", "16", "32", "64", "128", "256", "1024"}  # + middles
    native = {NATIVE} if native_packed_linear() is not None else set()  # where kiln's C++ kernels build here
    assert raced(four, "1") == {DEQUANT_BLAS, COMPILED_DEQUANT, FUSED, INT4PACK, *native}
    assert raced(first.records["64x96 8-bit/32 float32"], "64") == {DEQUANT_BLAS, COMPILED_DEQUANT, *native}
    assert FUSED not in raced(four, "16") and FUSED not in raced(four, "256")
    assert INT4PACK not in str(first.records["64x96 8-bit/32 float32"])
    for record in first.records.values():
        for top, winner in record["winners"].items():
            at_top = record["times_us"][top]
            assert winner in at_top  # a class's winner was timed at its top
            if len(class_points(int(top))) == 1:
                assert winner == min(at_top, key=at_top.__getitem__)
        for rows, times in record["times_us"].items():
            assert min(times.values()) > 0
            # a candidate left unbuilt could not have won: its floor was at or above a time measured in its race
            assert all(floor >= min(times.values()) for floor in record["ruled_out_us"].get(rows, {}).values())
            assert not set(times) & set(record["ruled_out_us"].get(rows, {}))
    again = PackedKernelTable(model, make_compiler("inductor"), KernelChoiceCache(tmp_path), "float32")
    assert all(r["source"] == "process" for r in again.records.values())
    assert {k: r["winners"] for k, r in again.records.items()} == {k: r["winners"] for k, r in first.records.items()}
    again.install()
    for rows in (1, 2, 3, 32, 33, 300, 1100):  # every kernel the table installed computes what the plain forward does
        x = torch.randn(rows, 64)
        torch.testing.assert_close(model[0](x), x @ model[0].weight.t(), rtol=1e-4, atol=1e-4)


class _HeadedModel(torch.nn.Module):
    """A decoder layer and a packed logits head (`lm_head`, as the models name it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.lm_head = PackedLinear(64, 96, bits=4), PackedLinear(96, 64)
        for i, layer in enumerate((self.layer, self.lm_head)):
            kind = GGMLQuantizationType.Q4_1 if layer.bits == 4 else GGMLQuantizationType.Q8_0
            layer.load_rows(0, _packed(kind, layer.out_features, layer.in_features, i))


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_the_head_is_timed_only_at_the_rows_a_step_samples(tmp_path: Path) -> None:
    """The logits head runs on the sampled rows alone: with at most 16 a step (EngineConfig.sampled_rows), its
    layout is timed at 1, 2, 6 and 16 rows, the decoder layer at every row class; more rows than were timed (no engine
    path asks for them) still compute the product, on the reference."""
    model = _HeadedModel()
    table = PackedKernelTable(model, make_compiler("inductor"), KernelChoiceCache(tmp_path), "float32", head_rows=16)
    head, layer = table.records["64x96 8-bit/32 float32"], table.records["96x64 4-bit/32 float32"]
    assert set(head["winners"]) == {"1", "2", "6", "16"} and set(head["times_us"]) == {"1", "2", "4", "6", "8", "16"}
    assert set(layer["times_us"]) == {str(r) for r in raced_rows(ROWS)}
    table.install()
    for rows in (1, 16, 300):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(model.lm_head(x), x @ model.lm_head.weight.t(), rtol=1e-4, atol=1e-4)
    # the same layout as a decoder layer too: every row class, the head's bound notwithstanding
    model.layer = PackedLinear(96, 64)
    model.layer.load_rows(0, _packed(GGMLQuantizationType.Q8_0, 64, 96, 1))
    shared = PackedKernelTable(model, make_compiler("inductor"), KernelChoiceCache(tmp_path), "float32", head_rows=16)
    assert set(shared.records["64x96 8-bit/32 float32"]["winners"]) == {str(r) for r in ROWS}


def test_a_step_samples_every_sequence_and_each_verified_draft() -> None:
    plain = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8))
    assert plain.sampled_rows == 8
    speculating = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=8), speculative=SpeculativeConfig("ngram", num_speculative_tokens=3)
    )
    assert speculating.sampled_rows == 32


def raced(record: dict, rows: str) -> set[str]:
    """The candidates of a table record's race at `rows`: timed, or ruled out by their floor before being built."""
    return set(record["times_us"][rows]) | set(record["ruled_out_us"].get(rows, {}))


def _tiny_hf_dir(tmp_path: Path) -> Path:
    write_hf_model(tmp_path / "tiny", "llama")
    return tmp_path / "tiny"


@pytest.mark.timeout(1800)  # the shipped recipe's mode, full_and_piecewise, on the default model: minutes here
def test_the_shipped_recipe_runs_packed_and_its_fusion_group_holds(tmp_path: Path) -> None:
    """The shipped recipe with `quantization: {weights: int4}` over its Q4_1 file runs the blocks packed, and the
    fusion contract reads through the packed product: mlp_fusion (required) holds."""
    shipped = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"
    text = shipped.read_text().replace("quantization: {weights: none}", "quantization: {weights: int4}")
    assert "weights: int4" in text
    (tmp_path / "recipe.yaml").write_text(text)
    llm = LLM(recipe=str(tmp_path / "recipe.yaml"), capture_sizes=[1, 4])  # the suite's cache, as above
    assert isinstance(llm.engine.model.model.layers[0].mlp.gate_up_proj, PackedLinear)
    (mlp,) = llm.engine.executor.fusion
    assert mlp.realised and mlp.kernels[0] == "torch.ops.kiln.packed_linear.default"  # the packed product, whole
    assert "silu" in mlp.kernels[1] and "reads the GEMM output of gate_proj, up_proj (gate_up_proj)" in mlp.reason


def test_every_row_count_has_one_timed_entry_that_covers_it() -> None:
    """Each row count runs the kernel timed for the smallest timed count at least as large, or for LARGE_ROWS
    past the last class: a 33-row decode step (32 sequences and a newcomer) runs a decode-batch kernel, not the
    prefill one."""
    for rows in range(1, 1200):
        timed = TIMED_ROWS[row_class(rows)]
        smallest = min((r for r in ROWS if r >= rows), default=LARGE_ROWS)
        assert timed == (smallest if row_class(rows) != LARGE else LARGE_ROWS)
    assert row_class(33) == row_class(64) != row_class(65) == row_class(256) != row_class(257) == row_class(2048)
    labels = ["1 row", "2 rows", "3-6 rows", "7-16 rows", "17-64 rows", "65-256 rows", "257+ rows"]
    assert [rows_label(r) for r in ROWS] == labels

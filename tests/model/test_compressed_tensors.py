"""compressed-tensors checkpoints (tiny Llamas quantized and compressed by the compressed-tensors package itself):
kiln's logits equal transformers' loading the same checkpoint with `CompressedTensorsConfig(dequantize=True)` (its
weights decompressed, activations in float, as kiln runs them) within 1e-4, greedy tokens equal where the top-2 gap
allows, and transformers' default load (which also quantizes activations where the scheme says so) within a bound
per format. Integer weights stay packed in kiln's form; FP8 weights are dequantized at load, and the log says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from kiln import LLM, SamplingParams
from kiln.quant.linear import PackedLinear
from tests.engine.parity import kiln_batch_logits
from tests.model.quantized_models import PRESETS, write_compressed_model

PROMPTS = [[5, 17, 42, 7, 99, 3, 61, 250, 11, 8], [9, 180, 4, 66, 23]]
WEIGHT_ONLY_BOUND = 1e-4
# |kiln - transformers' default load|: its activations are quantized (dynamic int8 per token, FP8 per tensor, token
# or group) where kiln runs them in float; measured 0.019 (W8A8) and 0.06-0.08 (FP8) on these models
ACTIVATION_BOUNDS = {"W8A8": 0.05, "FP8": 0.2, "FP8_DYNAMIC": 0.2, "FP8_BLOCK": 0.2}
# preset -> (bits, group) of kiln's packed form; None: dequantized at load
FORMS = {
    "W4A16": (4, 32),
    "W4A16_CHANNEL": (4, 32),
    "W4A16_ASYM": (4, 32),
    "W8A16": (8, 32),
    "W8A8": (8, 32),
    "FP8": None,
    "FP8_DYNAMIC": None,
    "FP8_BLOCK": None,
}
GAP = 1e-3  # greedy tokens are compared up to the first step whose reference top-2 logits are closer than this


@pytest.fixture(scope="module", params=list(PRESETS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    directory = tmp_path_factory.mktemp(request.param.lower())
    write_compressed_model(directory, request.param)
    return request.param, directory


def dequantized_reference(directory: Path) -> nn.Module:
    config = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=config).eval()


def test_logits_equal_transformers_decompressed_weights(checkpoint: tuple[str, Path]) -> None:
    preset, directory = checkpoint
    got = kiln_batch_logits(str(directory), PROMPTS)
    reference = dequantized_reference(directory)
    with torch.no_grad():
        for ids, logits in zip(PROMPTS, got, strict=True):
            expected = reference(torch.tensor([ids])).logits[0]
            assert (logits - expected).abs().max().item() < WEIGHT_ONLY_BOUND, preset
    if preset in ACTIVATION_BOUNDS:
        default = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            expected = default(torch.tensor([PROMPTS[0]])).logits[0]
        assert 0 < (got[0] - expected).abs().max().item() < ACTIVATION_BOUNDS[preset], preset


def test_greedy_tokens_equal_transformers(checkpoint: tuple[str, Path]) -> None:
    preset, directory = checkpoint
    reference = dequantized_reference(directory)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([PROMPTS[0]]),
            max_new_tokens=8,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(PROMPTS[0]) :].tolist()
    gaps = [s[0].topk(2).values.diff().abs().item() for s in out.scores]
    compared = next((i for i, gap in enumerate(gaps) if gap < GAP), len(gaps))
    llm = LLM(str(directory), num_kv_blocks=32, graph_mode="eager", activations="float32")
    got = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    assert compared >= 4, f"{preset}: the reference's top-2 gaps {gaps} leave too few tokens to compare"
    assert got[:compared] == expected[:compared], preset


def test_weights_stay_in_kilns_packed_form_or_load_dequantized_with_a_line(
    checkpoint: tuple[str, Path], kiln_log: pytest.LogCaptureFixture
) -> None:
    preset, directory = checkpoint
    model = LLM(str(directory), num_kv_blocks=16, graph_mode="eager", activations="float32").engine.model
    layers = model.model.layers
    linears = [layers[0].self_attn.qkv_proj, layers[0].self_attn.o_proj, layers[1].mlp.gate_up_proj]
    lines = [r.getMessage() for r in kiln_log.records]
    assert any(line.startswith("Checkpoint quantization: compressed-tensors") for line in lines), lines
    if FORMS[preset] is None:
        assert all(type(m) is nn.Linear for m in linears), preset
        assert any("float-quantized float8" in line and "dequantizes them" in line for line in lines), lines
    else:
        assert all(isinstance(m, PackedLinear) and (m.bits, m.group) == FORMS[preset] for m in linears), preset
    assert type(model.lm_head) is nn.Linear  # ignored: stored unquantized
    if preset in ACTIVATION_BOUNDS:
        assert any("input_activations" in line and "kiln runs weight-only" in line for line in lines), lines


@pytest.mark.parametrize(
    ("family", "overrides"), [("qwen3", {"head_dim": 16}), ("qwen2", {}), ("phi3", {"pad_token_id": 0})]
)
def test_other_families_load_their_w4a16_checkpoints(tmp_path: Path, family: str, overrides: dict) -> None:
    """Qwen3 (q/k norms), Qwen2 (biased q/k/v: kept dequantized, the packed form has no bias) and Phi-3 (whose HF
    checkpoint fuses qkv_proj and gate_up_proj itself)."""
    write_compressed_model(tmp_path, "W4A16", family=family, **overrides)
    (got,) = kiln_batch_logits(str(tmp_path), PROMPTS[:1])
    with torch.no_grad():
        expected = dequantized_reference(tmp_path)(torch.tensor(PROMPTS[:1])).logits[0]
    assert (got - expected).abs().max().item() < WEIGHT_ONLY_BOUND, family
    model = LLM(str(tmp_path), num_kv_blocks=16, graph_mode="eager", activations="float32").engine.model
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear), family

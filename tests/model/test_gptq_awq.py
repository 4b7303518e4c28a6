"""GPTQ and AWQ checkpoints (tiny Llamas whose tensors the tests write in the layouts AutoGPTQ and AutoAWQ write,
their config.json's quantization_config as transformers describes it): kiln's logits equal an HF model holding the
weights the codes dequantize to within 1e-4 and its greedy tokens equal; the codes stay packed in kiln's 4- or 8-bit
form, act-ordered ones (desc_act) sorted into contiguous groups with the input permuted to match, and the log says
so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import LLM, SamplingParams
from kiln.quant.linear import PackedLinear
from tests.engine.parity import kiln_batch_logits
from tests.model.quantized_models import write_gptq_awq_model

PROMPTS = [[5, 17, 42, 7, 99, 3, 61, 250, 11, 8], [9, 180, 4, 66, 23]]
CASES = {  # name -> (method, bits, act order)
    "gptq-int4": ("gptq", 4, False),
    "gptq-int8": ("gptq", 8, False),
    "gptq-int4-desc-act": ("gptq", 4, True),
    "awq-int4": ("awq", 4, False),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, nn.Module]:
    directory = tmp_path_factory.mktemp(request.param)
    method, bits, act_order = CASES[request.param]
    return request.param, directory, write_gptq_awq_model(directory, method, bits, act_order)


def test_logits_and_greedy_tokens_equal_the_dequantized_weights(checkpoint: tuple[str, Path, nn.Module]) -> None:
    case, directory, reference = checkpoint
    got = kiln_batch_logits(str(directory), PROMPTS)
    with torch.no_grad():
        for ids, logits in zip(PROMPTS, got, strict=True):
            assert (logits - reference(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4, case
        expected = reference.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False)
    llm = LLM(str(directory), num_kv_blocks=32, graph_mode="eager", activations="float32")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected[0, len(PROMPTS[0]) :].tolist(), case


def test_the_codes_stay_packed_act_ordered_ones_with_their_input_order(
    checkpoint: tuple[str, Path, nn.Module], kiln_log: pytest.LogCaptureFixture
) -> None:
    case, directory, _ = checkpoint
    method, bits, act_order = CASES[case]
    model = LLM(str(directory), num_kv_blocks=16, graph_mode="eager", activations="float32").engine.model
    layer = model.model.layers[1]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    lines = [r.getMessage() for r in kiln_log.records]
    assert f"Checkpoint quantization: {method} int{bits} (group 32, zero points" in "\n".join(lines)
    assert all(isinstance(m, PackedLinear) and (m.bits, m.group) == (bits, 32) for m in linears), case
    assert all((m.input_order is not None) == act_order for m in linears), case
    if act_order:
        assert any(line.startswith("quantization_config.desc_act is true: each layer's act-ordered") for line in lines)

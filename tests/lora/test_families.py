"""Every family kiln runs takes PEFT adapters on the layers it has: Qwen2 (biased qkv), Qwen3 (q/k norms), Mistral,
Phi-3 (qkv and gate_up stored fused: adapted whole), Mixtral (attention only: experts are not adapted), Gemma 2 and 3;
greedy tokens and logits (1e-4, fp32) equal HF + PEFT, next to a base-only row in the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.executor.eager import EagerExecutor
from kiln.lora import BASE_ONLY, LoRALimits, attach_lora, read_adapter
from tests.lora.adapters import SEVEN, kiln_model, reference, reference_greedy, write_adapter, write_base
from tests.lora.steps import Stepper

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True)
# HF family -> (its config fields, the layers an adapter targets)
FAMILIES: dict[str, tuple[dict[str, object], list[str]]] = {
    "Qwen2": ({}, SEVEN),
    "Qwen3": ({"head_dim": 16}, ["q_proj", "k_proj", "up_proj"]),
    "Mistral": ({"sliding_window": 6}, SEVEN),
    "Phi3": ({"pad_token_id": 0}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "Mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, ATTENTION),
    "Gemma2": ({**GEMMA, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 1.5}, SEVEN),
    "Gemma3": ({**GEMMA, "sliding_window_pattern": 2}, ["v_proj", "o_proj", "gate_proj", "down_proj"]),
}
PROMPTS = [[5, 17, 42, 7, 99, 3, 61, 11, 8], [9, 100, 4]]
MAX_TOKENS = 4


@pytest.mark.parametrize("family", FAMILIES)
def test_family_with_adapter_equals_hf_peft(family: str, tmp_path: Path) -> None:
    overrides, targets = FAMILIES[family]
    hf = write_base(tmp_path / "base", num_layers=2, family=family, **overrides)
    adapter = write_adapter(hf, tmp_path / "adapter", targets, rank=4, seed=3)
    model = kiln_model(tmp_path / "base")
    slots = attach_lora(model, LoRALimits(max_loras=1, max_rank=4, max_num_tokens=32))
    slots.load(0, read_adapter(adapter))
    tokens, logits = Stepper(model, EagerExecutor(keep_layout=True), slots).generate(
        PROMPTS, [0, BASE_ONLY], MAX_TOKENS
    )
    for i, want_model in enumerate((reference(hf, adapter), reference(hf, None))):
        want_tokens, want_logits = reference_greedy(want_model, PROMPTS[i], MAX_TOKENS)
        assert tokens[i] == want_tokens
        torch.testing.assert_close(logits[i], want_logits, rtol=0, atol=1e-4)
    with_base = reference_greedy(reference(hf, None), PROMPTS[0], MAX_TOKENS)[1]
    assert (with_base - logits[0]).abs().max() > 1e-2  # the adapter changed the model

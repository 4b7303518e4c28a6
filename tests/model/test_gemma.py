"""Gemma 2 and Gemma 3 (text): tiny random models built with HF transformers' own classes (nothing downloaded),
saved as safetensors, loaded by kiln. Prompt-batch logits (a prompt longer than the sliding window) and decode
log-probabilities equal HF's in fp32, both graph modes give eager's tokens, and the attention op's soft-cap
(Gemma 2) matches a dense reference in prefill, chunked prefill and decode, through both attention paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import ModelConfig
from kiln.errors import ModelLoadError
from kiln.model.forward_context import DecodeInputs, ForwardContext, set_forward_context
from kiln.model.graph_attention import decode_attention
from kiln.model.loader import open_checkpoint
from kiln.model.loader.hf_config import parse_config
from tests.engine.parity import kiln_batch_logits
from tests.engine.tiny_models import default_tokenizer_json
from tests.model.test_sliding_window import (
    HEAD_DIM,
    LENGTHS,
    NULL_BLOCK,
    NUM_HEADS,
    NUM_KV_HEADS,
    STEPS,
    TABLES,
    WINDOW,
    random_cache,
    step_metadata,
)

LONG = [5, 17, 42, 7, 99, 3, 61, 250, 11, 8, 130, 77, 19, 64, 200, 33, 2, 91, 45, 120]  # past the window of 8
SHORT = [9, 180, 4, 66, 23, 150, 12]
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    max_position_embeddings=512,
    query_pre_attn_scalar=24,  # not head_dim: kiln's query pre-scaling matters
)
# small caps, so that they bite on a tiny model's small scores and logits (Gemma 2 ships 50 and 30)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window_pattern=2, final_logit_softcapping=1.5)),
}
SOFTCAP = 1.5  # the op tests' attention soft-cap


def write_gemma(directory: Path, family: str, **changes: object) -> torch.nn.Module:
    """Save a tiny random HF Gemma with every parameter perturbed (HF starts Gemma's norm weights at zero, where
    (1 + w) and w differ most) and a tokenizer; returns the HF model."""
    import transformers

    config_cls, model_cls, overrides = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **overrides, **changes})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer.json").write_text(default_tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_gemma_fields(tmp_path: Path, family: str) -> None:
    write_gemma(tmp_path, family)
    config = open_checkpoint(str(tmp_path)).config
    assert (config.hidden_act, config.head_dim, config.tie_word_embeddings) == ("gelu_tanh", 16, True)
    assert [config.layer_window(i) for i in range(4)] == [8, 0, 8, 0]
    assert config.query_pre_attn_scalar == 24 and config.final_logit_softcapping == 1.5
    if family == "gemma2":
        assert config.attn_logit_softcapping == 2.0 and not config.qk_norm
    else:  # transformers 5 keeps Gemma 3's rotary settings per layer kind
        assert (config.rope_theta, config.rope_local_base_freq) == (1e6, 1e4) and config.qk_norm


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_and_decode_logprobs_match_transformers(tmp_path: Path, family: str) -> None:
    hf = write_gemma(tmp_path, family)
    got = kiln_batch_logits(str(tmp_path), [LONG, SHORT])
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=20, ignore_eos=True)
    llm = LLM(str(tmp_path), num_kv_blocks=32, graph_mode="eager", kv_cache_dtype="float32")  # logprobs at 1e-4
    # a batch of two decodes and one alone: one-row logits, for which executors may take a fast head of their own
    outs = [*llm.generate([LONG, SHORT], params), *llm.generate([LONG], params)]
    with torch.no_grad():
        for ids, logits in zip([LONG, SHORT], got, strict=True):
            assert (logits - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4
        for ids, out in zip([LONG, SHORT, LONG], outs, strict=True):
            full = torch.tensor([ids + out.token_ids])
            expected = hf(full).logits[0, len(ids) - 1 : -1].log_softmax(-1)
            assert out.token_ids == expected.argmax(-1).tolist()
            for row, step in zip(expected, out.logprobs, strict=True):
                tokens = list(step)
                torch.testing.assert_close(torch.tensor([step[t] for t in tokens]), row[tokens], rtol=0, atol=1e-4)


def test_gemma3_linear_rope_scaling_applies_to_global_layers_only(tmp_path: Path) -> None:
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    hf = write_gemma(tmp_path, "gemma3", rope_parameters=rope)
    (got,) = kiln_batch_logits(str(tmp_path), [LONG])
    with torch.no_grad():
        assert (got - hf(torch.tensor([LONG])).logits[0]).abs().max().item() < 1e-4


def legacy_config(family: str, **changes: object) -> ModelConfig:
    """A config.json as transformers 4 wrote Gemma's (no layer_types, Gemma 3's rotary settings at the top), read."""
    config = {"architectures": [FAMILIES[family][1]], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
    config |= {"num_attention_heads": 4, "num_hidden_layers": 12, "sliding_window": 512, "query_pre_attn_scalar": 256}
    config |= {"head_dim": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    config |= {"rope_scaling": {"rope_type": "linear", "factor": 8}}
    return parse_config(Path("config.json"), {**config, **changes})


def test_legacy_configs_take_hf_default_layer_patterns_and_rotary_settings() -> None:
    gemma2 = legacy_config("gemma2")
    assert gemma2.layer_types[:4] == ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    gemma3 = legacy_config("gemma3")
    assert [i for i, kind in enumerate(gemma3.layer_types) if kind == "full_attention"] == [5, 11]
    assert (gemma3.rope_theta, gemma3.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert gemma3.rope_local_base_freq == 1e4
    assert gemma2.attn_logit_softcapping == gemma3.final_logit_softcapping == 0.0  # null
    with pytest.raises(ModelLoadError, match=r"rope_scaling.rope_type is 'yarn'"):
        legacy_config("gemma3", rope_scaling={"rope_type": "yarn", "factor": 8})
    with pytest.raises(ModelLoadError, match=r"rope_scaling.rope_type is 'llama3'; kiln runs Gemma 3's default"):
        legacy_config("gemma3", rope_scaling={"rope_type": "llama3", "factor": 8})
    with pytest.raises(ModelLoadError, match=r"field use_bidirectional_attention is true"):
        legacy_config("gemma3", use_bidirectional_attention=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_modes_give_eager_tokens_and_pieces_compile_once_per_structure(tmp_path: Path, family: str) -> None:
    write_gemma(tmp_path, family)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = [
        o.token_ids for o in LLM(str(tmp_path), num_kv_blocks=32, graph_mode="eager").generate([LONG, SHORT], params)
    ]
    graph = LLM(str(tmp_path), num_kv_blocks=32, graph_mode="piecewise", compiler="eager", capture_sizes=(1, 2, 4))
    assert [o.token_ids for o in graph.generate([LONG, SHORT], params)] == eager
    counters = graph.engine.executor.counters
    # 4 attention calls split the forward into 5 pieces: the first (embedding to layer 0's q/k/v), the last (layer
    # 3's output to the final norm) and 3 middle ones. The window and the soft-cap are arguments of the attention
    # op, outside the pieces, and the two rotary tables of Gemma 3 are inputs of the same shape, so sliding and
    # global layers make one middle structure: 3 compiled.
    counters.expect(pieces_seen=5, pieces_compiled=3)
    assert counters.replays > 0
    # the default mode's decode steps replay the full decode graph: windows and soft-caps traced as constants
    full = LLM(str(tmp_path), num_kv_blocks=32, enable_piecewise_graph=True, compiler="eager", capture_sizes=(1, 2, 4))
    assert [o.token_ids for o in full.generate([LONG, SHORT], params)] == eager
    assert full.engine.executor.counters.full_replays > 0


def sequences(scale: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """q, k, v of every position of each sequence; q scaled up so that scores reach the soft-cap."""
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(n, NUM_HEADS * HEAD_DIM, generator=gen) * scale,
            torch.randn(n, NUM_KV_HEADS * HEAD_DIM, generator=gen),
            torch.randn(n, NUM_KV_HEADS * HEAD_DIM, generator=gen),
        )
        for n in LENGTHS
    ]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, softcap: float) -> torch.Tensor:
    """HF's eager attention over one whole sequence: scale, soft-cap, mask, softmax."""
    n, group = q.shape[0], NUM_HEADS // NUM_KV_HEADS
    qh = q.view(n, NUM_HEADS, HEAD_DIM).transpose(0, 1)
    kh = k.view(n, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(group, 0)
    vh = v.view(n, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(group, 0)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    scores = qh @ kh.transpose(-1, -2) * HEAD_DIM**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(n, NUM_HEADS * HEAD_DIM)


@pytest.mark.parametrize("window", [WINDOW, 0])
@pytest.mark.parametrize("name", list(STEPS))
def test_softcapped_op_matches_dense_attention(name: str, window: int) -> None:
    seqs, cache = sequences(scale=4.0), random_cache()
    want = [dense_attention(*qkv, window, SOFTCAP) for qkv in seqs]
    uncapped = [dense_attention(*qkv, window, 0.0) for qkv in seqs]
    assert min((w - u).abs().max().item() for w, u in zip(want, uncapped, strict=True)) > 0.1  # the cap bites
    context = [0] * len(seqs)
    for step in STEPS[name]:
        entries = [(s, context[s], new) for s, new in step]
        meta = step_metadata(entries)
        q, k, v = (torch.cat([seqs[s][t][c : c + new] for s, c, new in entries]) for t in range(3))
        with set_forward_context(ForwardContext(meta, [cache])):
            out = torch.ops.kiln.attention(q, k, v, 0, window, SOFTCAP)
        for (s, c, new), start in zip(entries, meta.query_start_loc[:-1], strict=True):
            torch.testing.assert_close(out[start : start + new], want[s][c : c + new], rtol=0, atol=1e-5)
            context[s] += new


@pytest.mark.parametrize("window", [WINDOW, 0])
def test_softcapped_traced_decode_attention_matches_dense_attention(window: int) -> None:
    """Prefill 8 and 6 tokens with the op, then decode to the ends with the full decode graph's attention over a
    fixed-width table (a padding row on the null block in every step), traced whole (`fullgraph=True`)."""
    seqs, cache = sequences(scale=4.0), random_cache()
    want = [dense_attention(*qkv, window, SOFTCAP) for qkv in seqs]
    traced = torch.compile(decode_attention, fullgraph=True, backend="eager", dynamic=False)
    context = [8, 6]
    meta = step_metadata([(0, 0, 8), (1, 0, 6)])
    q, k, v = (torch.cat([seqs[s][t][: context[s]] for s in (0, 1)]) for t in range(3))
    with set_forward_context(ForwardContext(meta, [cache])):
        torch.ops.kiln.attention(q, k, v, 0, window, SOFTCAP)
    table = torch.tensor([t + [NULL_BLOCK] * (5 - len(t)) for t in TABLES] + [[NULL_BLOCK] * 5])
    while context[0] < LENGTHS[0]:
        live = [s for s in (0, 1) if context[s] < LENGTHS[s]]
        decode = DecodeInputs(torch.tensor([context[s] + 1 for s in live] + [1]), table[[*live, 2]])
        q, k, v = (
            torch.cat([seqs[s][t][context[s] : context[s] + 1] for s in live] + [seqs[0][t][:1]]) for t in range(3)
        )
        out = traced(q, k, v, cache, decode, window, SOFTCAP)
        for row, s in enumerate(live):
            torch.testing.assert_close(out[row], want[s][context[s]], rtol=0, atol=1e-5)
            context[s] += 1
        assert out[len(live)].isfinite().all()

"""Model families beyond Llama: tiny random models built with HF transformers' own classes (nothing downloaded),
saved as safetensors, loaded by kiln: prompt-batch logits and greedy decodes equal HF's, piecewise graph mode
gives eager's tokens, and identical layers compile once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.engine.parity import kiln_batch_logits
from tests.engine.tiny_models import write_hf_model

LAYERS = 4
WINDOW = 6  # shorter than the long prompt, not a multiple of the block size
LONG = [5, 17, 42, 7, 99, 3, 61, 250, 11, 8, 130, 77, 19, 64, 200, 33, 2, 91, 45, 120]
SHORT = [9, 180, 4, 66, 23, 150, 12]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "qwen3": dict(head_dim=16),
    "mistral": dict(sliding_window=WINDOW),
    "phi3": dict(
        pad_token_id=0,
        sliding_window=WINDOW,
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1 + i / 8 for i in range(8)], "long_factor": [2.0] * 8},
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(**MOE, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(**MOE, head_dim=16, norm_topk_prob=True),
}


def write_family(directory: Path, family: str) -> torch.nn.Module:
    return write_hf_model(directory, family, perturb=0.05, num_hidden_layers=LAYERS, **FAMILIES[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_decode_match_transformers(tmp_path: Path, family: str) -> None:
    hf = write_family(tmp_path, family)
    got = kiln_batch_logits(str(tmp_path), [LONG, SHORT])
    with torch.no_grad():
        for ids, logits in zip([LONG, SHORT], got, strict=True):
            expected = hf(torch.tensor([ids])).logits[0]
            assert (logits - expected).abs().max().item() < 1e-4
        # decode steps past the window: HF's greedy continuation
        expected_tokens = hf.generate(torch.tensor([LONG]), max_new_tokens=8, do_sample=False)[0, len(LONG) :]
    out = LLM(str(tmp_path), num_kv_blocks=32, graph_mode="eager").generate(
        [LONG], SamplingParams(max_tokens=8, temperature=0)
    )
    assert out[0].token_ids == expected_tokens.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_piecewise_gives_eager_tokens_and_identical_layers_compile_once(tmp_path: Path, family: str) -> None:
    write_family(tmp_path, family)
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [LONG, SHORT]
    eager = [o.token_ids for o in LLM(str(tmp_path), num_kv_blocks=32, graph_mode="eager").generate(prompts, params)]
    graph = LLM(str(tmp_path), num_kv_blocks=32, graph_mode="piecewise", compiler="eager", capture_sizes=(1, 2, 4))
    assert [o.token_ids for o in graph.generate(prompts, params)] == eager
    counters = graph.engine.executor.counters
    # LAYERS + 1 pieces split at attention: the first, the last and one shared by the LAYERS - 1 middle ones
    counters.expect(pieces_seen=LAYERS + 1, pieces_compiled=3)
    assert counters.replays > 0


def test_the_checkpoint_family_is_read_from_config_json(tmp_path: Path) -> None:
    write_family(tmp_path, "qwen2_moe")
    config = LLM(str(tmp_path), num_kv_blocks=32, graph_mode="eager").engine.model.config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("qwen2_moe", 4, 2)
    assert config.moe is not None and config.moe.shared_expert_intermediate_size == 64
    assert config.attention_bias and not config.moe.norm_topk_prob


def _one_expert(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token to expert 0 (its other choices weighted zero): the most skewed routing there is."""
    weights = torch.zeros(router_logits.shape[0], top_k)
    weights[:, 0] = 1.0
    return weights, torch.zeros(router_logits.shape[0], top_k, dtype=torch.long)


def test_moe_layers_sit_in_captured_pieces_and_no_routing_recompiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor pieces hold the kiln.moe op; spread and one-expert routing replay the same captures."""
    import kiln.model.moe as moe

    write_family(tmp_path, "qwen3_moe")
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [LONG, SHORT, LONG[:5]]
    eager = LLM(str(tmp_path), num_kv_blocks=32, graph_mode="eager")
    graph = LLM(str(tmp_path), num_kv_blocks=32, graph_mode="piecewise", capture_sizes=(1, 2, 4))
    executor = graph.engine.executor
    assert all(any(str(n.target) == "kiln.moe" for n in p.graph.graph.nodes) for p in executor.pieces[1:])
    built = dict(executor.counters.as_dict())
    spread = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graph.generate(prompts, params)] == spread
    replays = executor.counters.replays
    monkeypatch.setattr(moe, "route", _one_expert)
    skewed = [o.token_ids for o in eager.generate(prompts, params)]
    assert skewed != spread  # the routing really changed what the layers compute
    assert [o.token_ids for o in graph.generate(prompts, params)] == skewed
    after = executor.counters
    assert after.replays > replays  # decode steps replayed the captured pieces under the new routing
    for name in ("pieces_compiled", "static_compiles", "graphs_traced", "pieces_captured"):
        assert getattr(after, name) == built[name], name  # nothing traced, compiled or captured again


@pytest.mark.parametrize("family", ["qwen2_moe", "mistral"])
def test_the_debugger_diffs_a_family_boundary_by_boundary(tmp_path: Path, family: str) -> None:
    """Taps on every layer boundary of a MoE (and a sliding-window) model: captured graph mode agrees with eager
    at each one; a fault injected into one layer's MLP is the first divergence."""
    from kiln.debug.diff import build_reference, run_diff
    from kiln.debug.faults import inject, parse_fault
    from kiln.debug.session import DebugSession
    from kiln.engine.setup.args import EngineArgs

    write_family(tmp_path, family)
    options = EngineArgs(
        model=str(tmp_path), compiler="eager", capture_sizes=(1, 2, 4, 8), num_kv_blocks=32, graph_mode="eager"
    )
    session = DebugSession.open(options)
    reference = build_reference(session, LONG[:11], 4)
    report = run_diff(session, reference, "captured")
    assert report.first_divergence is None, report.first_divergence
    inject(session, parse_fault("layer=2:mlp"))
    first = run_diff(session, reference, "captured").first_divergence
    assert first is not None and first.name == "layers.2.mlp"

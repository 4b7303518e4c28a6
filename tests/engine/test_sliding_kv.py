"""The KV cache of a model whose every layer slides (Mistral) releases the blocks behind the window.

A tiny random Mistral (window 6, 4-token blocks) generates 60 greedy tokens: the tokens are HF transformers' own
(so no released block was ever read), the sequence never holds more than a few live blocks, a pool far smaller
than the sequence serves it without preemption, and every block is back in the pool at the end. A model with a
global layer keeps every block of that layer, in a pool of its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compile.full_graph import max_table_width
from kiln.config import ModelConfig
from kiln.engine.scheduling.kv_window import max_decode_blocks, num_dead_blocks
from tests.engine.tiny_models import rewrite_config, write_hf_model

WINDOW, BLOCK = 6, 4
PROMPT = [5, 17, 42, 7, 99, 3, 61, 250, 11, 8, 130, 77, 19]  # 13 tokens: past the window already
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(45)]  # 45 tokens: more than the small pool's 32
NUM_TOKENS = 60
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
LIVE_BOUND = -(-(WINDOW + 1) // BLOCK) + 1  # ceil((W + 1) / bs) + 1


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("mistral")
    hf = write_hf_model(path, "mistral", sliding_window=WINDOW, num_hidden_layers=2, perturb=0.05)
    hf.generation_config.eos_token_id = None  # 60 tokens whatever comes, as kiln's ignore_eos
    return path, hf


def hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(mistral: tuple[Path, torch.nn.Module]) -> dict[str, list[int]]:
    _, hf = mistral
    return {"short": hf_greedy(hf, PROMPT), "long": hf_greedy(hf, LONG_PROMPT)}


def generate_stepwise(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], list[int]]:
    """Drive the engine step by step: (the greedy tokens, per block pool the most live blocks the sequence held
    after a step). A sliding pool's released entries are a prefix of null blocks."""
    engine = llm.engine
    req = engine.add_request("seq", prompt, params)
    most_live = [0] * len(engine.scheduler.groups)
    while engine.has_unfinished:
        engine.step()
        if req.is_finished:
            break
        for g in engine.scheduler.groups:
            blocks, null = req.block_tables[g.index], g.pool.null_block
            dead = num_dead_blocks(req.num_computed_tokens, g.window, BLOCK)
            assert blocks[:dead] == [null] * dead and null not in blocks[dead:]
            assert len(blocks) == -(-req.num_computed_tokens // BLOCK)  # entries keep their logical index
            most_live[g.index] = max(most_live[g.index], len(blocks) - dead)
    return req.output_token_ids, most_live


def test_window_rule_of_the_config() -> None:
    base = dict(architecture="mistral", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3)
    heads = dict(num_heads=2, num_kv_heads=1, head_dim=4)
    assert ModelConfig(**base, **heads, sliding_window=4096).uniform_sliding_window == 4096
    mixed = ("sliding_attention", "full_attention", "sliding_attention")
    assert ModelConfig(**base, **heads, sliding_window=4096, layer_types=mixed).uniform_sliding_window == 0
    assert ModelConfig(**base, **heads, sliding_window=4096, layer_types=mixed).hybrid_sliding_window == 4096
    assert ModelConfig(**base, **heads, sliding_window=4096).hybrid_sliding_window == 0
    assert (
        ModelConfig(**base, **heads).uniform_sliding_window == ModelConfig(**base, **heads).hybrid_sliding_window == 0
    )


@pytest.mark.parametrize("window", [1, 3, 4, 5, 6, 8, 9])
def test_max_decode_blocks_is_the_most_a_decode_holds(window: int) -> None:
    held = [-(-(p + 1) // BLOCK) - num_dead_blocks(p, window, BLOCK) for p in range(200)]  # decoding position p
    assert max(held) == max_decode_blocks(window, BLOCK) <= -(-(window + 1) // BLOCK) + 1


def test_generation_matches_hf_within_few_live_blocks(mistral: tuple[Path, torch.nn.Module], expected) -> None:
    llm = LLM(str(mistral[0]), block_size=BLOCK, num_kv_blocks=64, graph_mode="eager")
    assert llm.engine.scheduler.window == WINDOW
    tokens, (most_live,) = generate_stepwise(llm, PROMPT)
    assert tokens == expected["short"]
    assert most_live <= LIVE_BOUND
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_pool_smaller_than_the_sequence(mistral: tuple[Path, torch.nn.Module], expected, prompt: str) -> None:
    """8 blocks of 4 = 32 tokens for 73 (or 105) tokens: the long prompt is prefilled in chunks the pool holds."""
    llm = LLM(str(mistral[0]), block_size=BLOCK, num_kv_blocks=8, graph_mode="eager")
    out = llm.generate(PROMPT if prompt == "short" else LONG_PROMPT, GREEDY)[0]
    assert out.error is None and out.token_ids == expected[prompt]
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_preemption_and_recompute_under_a_window(mistral: tuple[Path, torch.nn.Module]) -> None:
    """Three sequences in 7 blocks (a decode holds up to 3): they are preempted and recomputed, and still match."""
    prompts = [PROMPT[:3], PROMPT[3:6], LONG_PROMPT[:3]]
    llm = LLM(str(mistral[0]), block_size=BLOCK, num_kv_blocks=7, graph_mode="eager")
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(mistral[1], p) for p in prompts]
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_a_global_layer_keeps_every_block_and_the_sliding_one_its_window(
    mistral: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """Sliding and global layers mixed: the global layer's pool holds every block, the sliding layer's (its own
    pool, its own cache tensor) only the window's."""
    path = tmp_path / "mixed"
    shutil.copytree(mistral[0], path)
    rewrite_config(path, {"layer_types": ["sliding_attention", "full_attention"]})
    llm = LLM(
        str(path), block_size=BLOCK, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16, graph_mode="eager"
    )
    engine = llm.engine
    assert engine.scheduler.window == WINDOW and engine.window_pool is not None
    # 2 sequences x (3 live + 1 new) blocks + 16 tokens of one step = 12 blocks for the sliding layer, plus its null
    assert engine.window_pool.num_blocks == 12
    assert [c.shape[2] for c in engine.runner.kv_caches] == [13, 65]
    _, most_live = generate_stepwise(llm, PROMPT)
    assert most_live[0] == -(-(len(PROMPT) + NUM_TOKENS - 1) // BLOCK)  # every computed token's block
    assert most_live[1] <= LIVE_BOUND
    for pool in (engine.pool, engine.window_pool):
        assert pool.num_free_blocks == pool.num_blocks


def test_full_decode_graph_reads_released_entries_as_the_null_block(
    mistral: tuple[Path, torch.nn.Module], expected
) -> None:
    """The traced decode attention gathers the whole logical table, released (null) entries masked by the window."""
    llm = LLM(
        str(mistral[0]),
        block_size=BLOCK,
        num_kv_blocks=8,
        enable_piecewise_graph=True,
        compiler="eager",
        capture_sizes=(1, 2),
    )
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == expected["short"]
    assert llm.engine.executor.counters.full_replays > 0


def test_cuda_decode_tables_may_be_wider_than_the_pool_under_a_window() -> None:
    assert max_table_width(WINDOW, num_blocks=8, block_size=BLOCK, max_model_len=512) == 128
    assert max_table_width(0, num_blocks=8, block_size=BLOCK, max_model_len=512) == 8
    assert max_table_width(WINDOW, num_blocks=8, block_size=BLOCK, max_model_len=None) == 8

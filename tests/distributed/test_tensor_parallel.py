"""Tensor parallelism on CPU: two gloo ranks (this process and one it spawns) on the default model give the greedy
tokens and log-probabilities of one process, in eager and in piecewise graph mode, and each step moves exactly the
collectives the model's shape implies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiln import LLM
from kiln.distributed.ops import COMM
from kiln.distributed.state import rank_state
from kiln.engine.request import RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import ConfigError

PROMPTS = ["The capital of France is", "def fib(n):", "Three primary colors are", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=5)
HIDDEN, LAYERS, VOCAB = 576, 30, 49152  # SmolLM2-135M


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[RequestOutput]:
    return llm.generate(PROMPTS, GREEDY)  # one process, fp32, the dequantized weights


@pytest.fixture(scope="module")
def tp_eager() -> Iterator[LLM]:
    with LLM(
        "default", dtype="float32", seed=0, quantization="none", tensor_parallel_size=2, graph_mode="eager"
    ) as llm:
        yield llm
    assert rank_state() is None  # closing left the process group: this process is one device again


def assert_same(outputs: list[RequestOutput], reference: list[RequestOutput], tol: float) -> None:
    for out, ref in zip(outputs, reference, strict=True):
        assert out.token_ids == ref.token_ids, (out.prompt, out.text, ref.text)
        assert out.logprobs is not None and ref.logprobs is not None
        for mine, theirs in zip(out.logprobs, ref.logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            assert max(abs(mine[t] - theirs[t]) for t in mine) < tol


def test_eager_matches_one_process(tp_eager: LLM, reference: list[RequestOutput]) -> None:
    assert_same(tp_eager.generate(PROMPTS, GREEDY), reference, 1e-4)


def test_ranks_hold_their_shards(tp_eager: LLM) -> None:
    model = tp_eager.engine.model
    layer = model.model.layers[0]
    # rank 0 holds KV heads 0-1 of 3 and their query heads 0-5 of 9: q 6*64 rows, k and v 2*64 rows each
    assert layer.self_attn.qkv_proj.weight.shape == (6 * 64 + 2 * 2 * 64, HIDDEN)
    assert layer.self_attn.o_proj.weight.shape == (HIDDEN, 6 * 64)
    assert layer.mlp.gate_up_proj.weight.shape == (1536, HIDDEN) and layer.mlp.down_proj.weight.shape == (HIDDEN, 768)
    assert model.model.embed_tokens.weight.shape == (VOCAB // 2, HIDDEN)
    assert tp_eager.engine.runner.kv_caches[0].shape[1] == 2  # its KV heads only


def test_step_communication_volume(tp_eager: LLM) -> None:
    prompt = tp_eager.tokenizer.encode("Count the collectives of one step")
    COMM.reset()
    (out,) = tp_eager.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert len(out.token_ids) == 1  # one step: the prefill, which samples one token
    stats = COMM.as_dict()
    # two all-reduces per layer (after o_proj and down_proj) and one for the vocab-parallel embedding
    assert stats["all_reduce"] == {"calls": 2 * LAYERS + 1, "bytes": (2 * LAYERS + 1) * len(prompt) * HIDDEN * 4}
    assert stats["all_gather"] == {"calls": 1, "bytes": VOCAB // 2 * 4}  # this rank's logits of the sampled row
    assert stats["plan"]["calls"] == 1  # the step's plan, pickled, sent to the other rank


def test_one_multi_device_engine_at_a_time(tp_eager: LLM) -> None:
    with pytest.raises(ConfigError, match="already running in this process"):
        LLM("default", quantization="none", tensor_parallel_size=2, graph_mode="eager")
    assert tp_eager.generate(["Still"], SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"


def test_cached_prefixes_and_sibling_copies_hold_on_both_ranks(tp_eager: LLM, llm: LLM) -> None:
    """Rank 0 schedules the prefix cache for both ranks: a prompt sent again finds its full blocks, and the choices
    of one client request copy the first's partial block in each rank's own cache (a rank that missed the copy
    would attend over garbage); every choice has the greedy tokens of one process."""
    words = llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome. " * 5)
    prompt = words[:53]  # 3 full 16-token blocks and a partial one
    (ref,) = llm.generate([prompt], GREEDY)
    engine = tp_eager.engine
    stats = engine.scheduler.prefix.stats
    assert_same(tp_eager.generate([prompt], GREEDY), [ref], 1e-4)
    for i in range(3):
        engine.add_request(f"sib{i}", prompt, GREEDY, group="siblings")
    copies = []
    execute = engine.runner.execute
    engine.runner.execute = lambda sched, *probs: copies.extend(sched.block_copies) or execute(sched, *probs)
    hits = stats.hits
    done: dict[str, RequestOutput] = {}
    try:
        while engine.has_unfinished:
            done.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        engine.runner.execute = execute
    assert stats.hits - hits >= 3 * (len(prompt) // 16 * 16)  # each sibling found the full blocks
    assert len(copies) == 2  # the second and third choices copied the first's partial block
    assert_same([done[f"sib{i}"] for i in range(3)], [ref] * 3, 1e-4)


def test_piecewise_matches_one_process(tp_eager: LLM, reference: list[RequestOutput]) -> None:
    tp_eager.close()  # one multi-device engine per process
    with LLM(
        "default", dtype="float32", seed=0, quantization="none", tensor_parallel_size=2, graph_mode="piecewise"
    ) as llm:
        counters = llm.engine.executor.counters
        outputs = llm.generate(PROMPTS, GREEDY)
        assert counters.replays > 0  # decode steps replayed the captured pieces, collectives inside them
    assert_same(outputs, reference, 1e-4)

"""Pipeline parallelism on CPU: two gloo stages (this process and one it spawns) on the default model give the
greedy tokens and log-probabilities of one process, evenly split or placed by a recipe's device_affinity, in eager and
in graph mode; each step passes one hidden state per token forward and the sampled rows' logits back."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import LLM
from kiln.distributed.ops import COMM
from kiln.engine.loop.pipelined import PipelinedSteps
from kiln.engine.request import RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from tests.distributed.test_tensor_parallel import GREEDY, HIDDEN, PROMPTS, VOCAB, assert_same

RECIPE = Path(__file__).parents[2] / "recipes" / "smollm2-135m-pp2.yaml"


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[RequestOutput]:
    return llm.generate(PROMPTS, GREEDY)


def test_eager_stages_match_one_process(reference: list[RequestOutput]) -> None:
    with LLM(
        "default", dtype="float32", seed=0, quantization="none", pipeline_parallel_size=2, graph_mode="eager"
    ) as llm:
        model = llm.engine.model
        assert model.model.norm is None and model.lm_head is None  # the last stage's, not rank 0's
        assert [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "mlp")] == list(range(15))
        assert llm.engine.runner.kv_caches[15].numel() == 0 < llm.engine.runner.kv_caches[14].numel()
        assert_same(llm.generate(PROMPTS, GREEDY), reference, 1e-4)

        prompt = llm.tokenizer.encode("Count what one step sends")
        COMM.reset()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        stats = COMM.as_dict()
        # rank 0 sends its hidden states once, and receives the sampled row's logits from the last stage
        assert stats["send"] == {"calls": 1, "bytes": len(prompt) * HIDDEN * 4}
        assert stats["recv"] == {"calls": 1, "bytes": VOCAB * 4}


def test_steps_in_flight_keep_both_stages_busy_and_survive_an_abort(reference: list[RequestOutput]) -> None:
    """Rank 0 launches a step of half the requests while stage 1 runs the other half's: the tokens are one
    process's. A request aborted while its step is in flight loses nothing of the others, and frees its blocks."""
    with LLM(
        "default", dtype="float32", seed=0, quantization="none", pipeline_parallel_size=2, graph_mode="eager"
    ) as llm:
        engine = llm.engine
        assert isinstance(engine.loop, PipelinedSteps) and engine.runner.micro_batches == 1
        assert_same(llm.generate(PROMPTS, GREEDY), reference, 1e-4)
        assert engine.loop.most_in_flight == 2
        # 4 prompts of 8 tokens in two halves: 8 steps each, counted when they complete
        assert engine.num_steps == 2 * GREEDY.max_tokens
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        engine.step()  # launches the first half of the prompts
        assert engine.scheduler.in_flight == {"r0", "r1"} and engine.abort("r0").finish_reason == "abort"
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished:
            outputs |= {out.request_id: out.token_ids for out in engine.step() if out.finished}
        assert "r0" not in outputs and not engine.scheduler.in_flight
        assert [outputs[f"r{i}"] for i in range(1, len(PROMPTS))] == [r.token_ids for r in reference[1:]]
        assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_recipe_placement_runs_in_graph_mode(tmp_path: Path, reference: list[RequestOutput]) -> None:
    # the example recipe, with an uneven placement: layers 0-9 on stage 0, 10-29 on stage 1
    text = RECIPE.read_text()
    head, _, _ = text.partition("device_affinity:")
    first = ", ".join(f"decoder_layer_{i}" for i in range(10))
    second = ", ".join(f"decoder_layer_{i}" for i in range(10, 30))
    recipe = tmp_path / "pp.yaml"
    recipe.write_text(
        head + "device_affinity:\n"
        f"  - {{device_id: 0, kernel_groups: [{first}]}}\n"
        f"  - {{device_id: 1, kernel_groups: [{second}]}}\n"
        "debug: {debug_mode: false}\n"
    )
    with LLM(recipe=str(recipe), seed=0, graph_mode="piecewise") as llm:
        assert llm.engine.config.parallel.stage_layers == (tuple(range(10)), tuple(range(10, 30)))
        layers = llm.engine.model.model.layers
        assert [i for i, layer in enumerate(layers) if hasattr(layer, "mlp")] == list(range(10))
        outputs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.executor.counters.replays > 0
    assert_same(outputs, reference, 1e-4)

"""Echo and prompt logprobs through the app `kiln serve` builds, over a real engine on a tiny float32 Llama (in
process, as tests/server/app_harness runs a FakeCore): lm-evaluation-harness's `local-completions` loglikelihood
request (token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`) parsed as the harness parses it gives HF
transformers' loglikelihoods; `max_tokens: 0` echoes the prompt alone; streamed answers carry what the whole answer
does; vLLM's `prompt_logprobs` has vLLM's shape on both endpoints, for every `n`."""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any

import httpx
import pytest
import torch

from kiln import LLM
from kiln.engine.core import EngineCore
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.admission import Admission
from kiln.engine.scheduling.step_shape import StepShaper
from kiln.errors import RequestError
from tests.engine.hf_ranks import assert_rank_as_hf
from tests.engine.tiny_models import write_hf_model
from tests.server.app_harness import openai_error, serve_engine

CONTEXTS = [[5, 17, 300, 42, 9, 1000], [77, 12, 12, 5000, 3]]
CONTINUATIONS = [[8, 2000], [31]]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[EngineCore, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny_llama_echo")
    hf = write_hf_model(path, "llama", vocab_size=49152, perturb=0.05)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    fp32 = dict(dtype="float32", activations="float32", kv_cache_dtype="float32")
    core = LLM(str(path), graph_mode="eager", num_kv_blocks=64, block_size=4, **fp32).engine
    return core, hf


def post(core: EngineCore, route: str, payload: dict[str, Any]) -> httpx.Response:
    async def body(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(f"/v1/{route}", json=payload)

    return serve_engine(core, body)


def streamed(core: EngineCore, payload: dict[str, Any], route: str = "completions") -> list[dict[str, Any]]:
    async def body(client: httpx.AsyncClient) -> list[dict[str, Any]]:
        response = await client.post(f"/v1/{route}", json={**payload, "stream": True})
        assert response.status_code == 200, response.text
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    return serve_engine(core, body)


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def lm_eval_parse(outputs: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's LocalCompletionsAPI.parse_logprobs (lm_eval/models/openai_completions.py), as it
    reads an echoed answer: the continuation's logprobs sum and whether each was the likeliest token."""
    res = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=itemgetter("index")), ctxlens, strict=True):
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs, strict=True))
        res.append((sum(tokens_logprobs), is_greedy))
    return res


def test_lm_eval_loglikelihood_requests_get_hf_loglikelihoods(tiny) -> None:
    core, hf = tiny
    prompts = [c + k for c, k in zip(CONTEXTS, CONTINUATIONS, strict=True)]
    payload = {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234}
    response = post(core, "completions", payload)
    assert response.status_code == 200, response.text
    answer = response.json()
    for choice, ids in zip(sorted(answer["choices"], key=itemgetter("index")), prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # OpenAI's null for the first
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        prompt_text = core.tokenizer.decode(ids, skip_special_tokens=False)
        assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
        expected = hf_logprobs(hf, ids)
        for q in range(1, len(ids)):
            assert abs(lp["token_logprobs"][q] - expected[q - 1, ids[q]].item()) < 1e-4
            top_id = int(expected[q - 1].argmax())
            top_text = core.tokenizer.decode([top_id], skip_special_tokens=False)
            assert abs(lp["top_logprobs"][q][top_text] - expected[q - 1, top_id].item()) < 1e-4
    assert answer["usage"]["completion_tokens"] == 2
    parsed = lm_eval_parse(answer, [len(c) for c in CONTEXTS])
    for (loglikelihood, is_greedy), context, continuation in zip(parsed, CONTEXTS, CONTINUATIONS, strict=True):
        ids = context + continuation
        rows = hf_logprobs(hf, ids)[len(context) - 1 : -1]
        assert abs(loglikelihood - sum(rows[i, t].item() for i, t in enumerate(continuation))) < 1e-4
        assert is_greedy == (rows.argmax(-1).tolist() == continuation)


def test_max_tokens_zero_echoes_the_prompt_alone_streamed_and_not(tiny) -> None:
    core, hf = tiny
    text = "The quick brown fox"
    ids = core.tokenizer.encode(text)
    payload = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2, "n": 2, "temperature": 0}
    answer = post(core, "completions", payload).json()
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(ids)
    expected = hf_logprobs(hf, ids)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert choice["text"] == text and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
        assert all(abs(lp["token_logprobs"][q] - expected[q - 1, ids[q]].item()) < 1e-4 for q in range(1, len(ids)))
        assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])
    chunks = streamed(core, payload)
    for index, choice in enumerate(answer["choices"]):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in mine) == text
        assert [t for c in mine for t in c["logprobs"]["token_logprobs"]] == choice["logprobs"]["token_logprobs"]
        assert mine[-1]["finish_reason"] == "length"


def test_streamed_echo_gives_the_text_and_logprobs_of_the_whole_answer(tiny) -> None:
    core, _ = tiny
    payload = {"prompt": CONTEXTS[0], "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    whole = post(core, "completions", payload).json()["choices"][0]
    chunks = [c for chunk in streamed(core, payload) for c in chunk["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] == whole["logprobs"][key], key


def test_echo_without_logprobs_prefixes_the_text_only(tiny) -> None:
    core, _ = tiny
    plain = post(core, "completions", {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}).json()
    echoed = post(core, "completions", {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "echo": True})
    choice = echoed.json()["choices"][0]
    assert choice["text"] == "Hello there" + plain["choices"][0]["text"] and choice["logprobs"] is None


def assert_vllm_prompt_logprobs(got: list[Any], ids: list[int], hf: torch.nn.Module, top: int) -> None:
    expected = hf_logprobs(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    for q in range(1, len(ids)):
        entry = got[q]
        actual = entry[str(ids[q])]
        assert abs(actual["logprob"] - expected[q - 1, ids[q]].item()) < 1e-4
        assert_rank_as_hf(actual["rank"], expected[q - 1], ids[q])
        assert set(actual) == {"logprob", "rank", "decoded_token"}
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[q]) or v["rank"] <= top)
        assert ranks[:top] == list(range(1, top + 1))


def test_vllm_prompt_logprobs_on_completions_for_every_n(tiny) -> None:
    core, hf = tiny
    payload = {"prompt": CONTEXTS[1], "max_tokens": 2, "prompt_logprobs": 3, "n": 2, "temperature": 0.5}
    answer = post(core, "completions", payload).json()
    for choice in answer["choices"]:
        assert choice["logprobs"] is None and not choice["text"].startswith(str(CONTEXTS[1]))
        assert_vllm_prompt_logprobs(choice["prompt_logprobs"], CONTEXTS[1], hf, 3)
    first = [c for chunk in streamed(core, payload) for c in chunk["choices"] if "prompt_logprobs" in c]
    assert sorted(c["index"] for c in first) == [0, 1]  # once per choice, in its first chunk
    assert first[0]["prompt_logprobs"] == answer["choices"][0]["prompt_logprobs"]


def test_vllm_prompt_logprobs_on_chat(tiny) -> None:
    core, hf = tiny
    messages = [{"role": "user", "content": "Say hi"}]
    ids = core.tokenizer.encode_chat(messages)
    payload = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1, "n": 2}
    answer = post(core, "chat/completions", payload).json()
    assert_vllm_prompt_logprobs(answer["prompt_logprobs"], ids, hf, 1)
    assert all("prompt_logprobs" not in choice for choice in answer["choices"])
    chunks = streamed(core, payload, "chat/completions")
    first = [c for chunk in chunks for c in chunk["choices"] if "prompt_logprobs" in c]
    assert sorted(c["index"] for c in first) == [0, 1]
    assert all(c["prompt_logprobs"] == answer["prompt_logprobs"] for c in first)


def test_max_tokens_zero_without_echo_is_a_400_naming_it(tiny) -> None:
    core, _ = tiny
    error = openai_error(post(core, "completions", {"prompt": "hi", "max_tokens": 0}), 400)
    assert error["param"] == "max_tokens" and "echo=true" in error["message"]
    error = openai_error(post(core, "completions", {"prompt": "hi", "prompt_logprobs": 21}), 400)
    assert error["param"] == "prompt_logprobs"


def multi_device_admission() -> Admission:
    """The admission of a tensor- or pipeline-parallel engine (a tiny vocabulary, no tokenizer: ids only)."""
    return Admission(
        tokenizer=None,
        vocab_size=256,
        max_model_len=64,
        recipe=None,
        shaper=StepShaper(None, lambda n: n, 0, 0),
        chunked_prefill=True,
        blocks_short=lambda total: None,
        seed=0,
        multi_device=True,
    )


def test_multi_device_engines_refuse_prompt_logprobs_naming_the_field() -> None:
    """Prompt rows are scored on one device: a tensor- or pipeline-parallel engine refuses them (a 400)."""
    admission = multi_device_admission()
    with pytest.raises(RequestError, match="single device") as exc:
        admission.make_request("r", [1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert exc.value.param == "prompt_logprobs"
    assert admission.make_request("r", [1, 2, 3], SamplingParams(max_tokens=2)).prompt_logprobs is None

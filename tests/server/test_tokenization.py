"""vLLM's tokenizer endpoints (kiln/server/tokenization.py) over the default model's tokenizer, through the app
`kiln serve` builds: /tokenize counts what the completion of the same prompt or messages prefills, /detokenize
round-trips and names an id outside the vocabulary, /tokenizer_info answers what lm-evaluation-harness reads, all
behind the API key, with unknown fields refused as on the other routes."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from kiln.model.tokenizer import KilnTokenizer
from tests.server.app_harness import Served, openai_error, serve
from tests.server.fake_core import FakeCore

PROMPT = "<|im_start|>user\nThe quick brown fox<|im_end|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour <|im_end|>"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer() -> KilnTokenizer:
    return load_tokenizer(open_checkpoint("default"))


def core_over(tokenizer: KilnTokenizer) -> FakeCore:
    return FakeCore(max_model_len=512, num_blocks=512, tokenizer=tokenizer)


async def prompt_tokens(s: Served, route: str, request: dict[str, Any]) -> int:
    """usage.prompt_tokens of a one-token completion of `request`."""
    response = await s.client.post(f"/v1/{route}", json={**request, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_tokenize_counts_what_a_completion_of_the_same_prompt_or_messages_prefills(tokenizer: KilnTokenizer) -> None:
    async def body(s: Served) -> None:
        answer = (await s.client.post("/tokenize", json={"prompt": PROMPT})).json()
        assert answer == {"count": len(answer["tokens"]), "max_model_len": 512, "tokens": tokenizer.encode(PROMPT)}
        assert answer["count"] == await prompt_tokens(s, "completions", {"prompt": PROMPT})
        assert tokenizer.tokenizer.token_to_id("<|im_start|>") in answer["tokens"]  # parsed, as completions parse it
        for request in ({"messages": CHAT}, {"messages": CHAT, "tools": [TOOL]}):
            chat = (await s.client.post("/tokenize", json=request)).json()
            assert chat["count"] == len(chat["tokens"]) == await prompt_tokens(s, "chat/completions", request)
            text = tokenizer.decode(chat["tokens"], skip_special_tokens=False)
            assert text.endswith("<|im_start|>assistant\n") and "Name a colour <|im_end|>" in text
            assert ("get_weather" in text) == ("tools" in request)  # the tools reach the prompt
        unprompted = (await s.client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})).json()
        assert unprompted["tokens"] == chat_ids(tokenizer, add_generation_prompt=False)
        assert not tokenizer.decode(unprompted["tokens"], skip_special_tokens=False).endswith("assistant\n")

    serve(core_over(tokenizer), body)


def chat_ids(tokenizer: KilnTokenizer, add_generation_prompt: bool) -> list[int]:
    return tokenizer.encode_chat(CHAT, add_generation_prompt=add_generation_prompt)


def test_tokenize_options_and_text_kept_as_text(tokenizer: KilnTokenizer) -> None:
    """`return_token_strs` gives the vocabulary entries; `add_special_tokens` follows the tokenizer; with
    `--completion-special-tokens text` special-token text is counted as characters, as completions count it;
    lm-evaluation-harness finds the EOS id by tokenizing the EOS text without special tokens."""

    async def body(s: Served) -> None:
        answer = (await s.client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})).json()
        assert answer["token_strs"] == [tokenizer.tokenizer.id_to_token(i) for i in answer["tokens"]]
        assert "".join(answer["token_strs"]).replace("Ġ", " ") == "hello world"
        bare = {"prompt": tokenizer.eos_token, "add_special_tokens": False}
        assert (await s.client.post("/tokenize", json=bare)).json()["tokens"] == [tokenizer.eos_token_id]
        error = openai_error(await s.client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}), 400)
        assert error["param"] == "add_special_tokens"

    serve(core_over(tokenizer), body)

    async def as_text(s: Served) -> None:
        answer = (await s.client.post("/tokenize", json={"prompt": PROMPT})).json()
        assert tokenizer.tokenizer.token_to_id("<|im_start|>") not in answer["tokens"]
        assert answer["count"] == await prompt_tokens(s, "completions", {"prompt": PROMPT})

    serve(core_over(tokenizer), as_text, ["--completion-special-tokens", "text"])


def test_detokenize_round_trips_and_names_an_id_outside_the_vocabulary(tokenizer: KilnTokenizer) -> None:
    async def body(s: Served) -> None:
        ids = tokenizer.encode(PROMPT)
        answer = await s.client.post("/detokenize", json={"tokens": ids})
        assert answer.status_code == 200 and answer.json() == {"prompt": PROMPT}  # special tokens kept
        bad = [*ids[:3], tokenizer.vocab_size, 5]
        error = openai_error(await s.client.post("/detokenize", json={"tokens": bad}), 400)
        assert (
            error["param"] == "tokens.3"
            and "index 3" in error["message"]
            and f"token id {tokenizer.vocab_size} " in error["message"]
        )
        error = openai_error(await s.client.post("/detokenize", json={"tokens": [1, -1]}), 400)
        assert error["param"] == "tokens.1"
        error = openai_error(await s.client.post("/detokenize", json={"tokens": [1] * 513}), 400)
        assert error["param"] == "tokens" and "max_model_len=512" in error["message"]
        error = openai_error(await s.client.post("/detokenize", json={"tokens": ["1"]}), 400)
        assert error["param"] == "tokens.0"  # strict: a string is not an id

    serve(core_over(tokenizer), body)


def test_tokenizer_info_answers_what_lm_eval_reads(tokenizer: KilnTokenizer) -> None:
    async def body(s: Served) -> None:
        info = (await s.client.get("/tokenizer_info")).json()
        assert info["eos_token"] == tokenizer.eos_token == "<|im_end|>"
        assert "bos_token" in info and "pad_token" in info and info["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert info["model_max_length"] == 512 and info["vocab_size"] == tokenizer.vocab_size
        assert info["chat_template"] == tokenizer.chat_template

    serve(core_over(tokenizer), body)


def test_the_tokenizer_routes_check_the_key_the_model_and_their_fields(tokenizer: KilnTokenizer) -> None:
    core = core_over(tokenizer)

    async def body(s: Served) -> None:
        for method, path, request in (
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", "/tokenizer_info", None),
        ):
            refused = await s.client.request(method, path, json=request)
            assert openai_error(refused, 401)["code"] == "invalid_api_key"
            keyed = await s.client.request(method, path, json=request, headers={"Authorization": "Bearer k3y"})
            assert keyed.status_code == 200, keyed.text
        key = {"Authorization": "Bearer k3y"}
        mistakes = {
            "promt": {"prompt": "hi", "promt": "hi"},
            "messages.0.role": {"messages": [{"role": "robot", "content": "hi"}]},
            "chat_template_kwargs.enable_thinking": {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": 0}},
            "tokens": {"prompt": "hi", "tokens": [1]},
        }
        for param, request in mistakes.items():
            error = openai_error(await s.client.post("/tokenize", json=request, headers=key), 400)
            assert error["param"] == param, (param, error)
        surrogate = b'{"prompt": "\\ud800"}'  # JSON's escape for a lone surrogate, which httpx will not encode
        headers = {**key, "Content-Type": "application/json"}
        error = openai_error(await s.client.post("/tokenize", content=surrogate, headers=headers), 400)
        assert error["param"] == "prompt" and "surrogate" in error["message"]
        wrong_model = await s.client.post("/tokenize", json={"prompt": "hi", "model": "gpt-4"}, headers=key)
        assert openai_error(wrong_model, 404)["param"] == "model"
        error = openai_error(await s.client.post("/tokenize", content=b"[1]", headers=key), 400)
        assert "JSON object" in error["message"]
        assert not core.requests  # nothing reached the engine
        metrics = (await s.client.get("/metrics")).text
        assert 'kiln_http_requests_total{endpoint="/tokenize",status="400"}' in metrics
        assert 'kiln_http_requests_total{endpoint="/tokenizer_info",status="200"} 1.0' in metrics

    serve(core, body, environ={"KILN_API_KEY": "k3y"})

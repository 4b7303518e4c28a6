"""`kiln serve --completion-special-tokens`: a /v1/completions text prompt that spells `<|im_start|>` gets the
control token by default (as vLLM), and the characters with `text`. Chat messages are text either way
(tests/model/test_chat_tokens.py)."""

from __future__ import annotations

import pytest

from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from kiln.model.tokenizer import KilnTokenizer
from tests.server.app_harness import Served, serve
from tests.server.fake_core import FakeCore

PROMPT = "<|im_start|>system\nobey<|im_end|>\n<|im_start|>user\nhi"


@pytest.fixture(scope="module")
def tokenizer() -> KilnTokenizer:
    return load_tokenizer(open_checkpoint("default"))


def prompt_ids(tokenizer: KilnTokenizer, argv: list[str]) -> list[int]:
    """The ids the engine got for PROMPT from the app `kiln serve ARGV` builds."""
    core = FakeCore(max_model_len=256, tokenizer=tokenizer)
    added = []
    add_request = core.add_request
    core.add_request = lambda rid, prompt, params, **kw: added.append(prompt) or add_request(rid, prompt, params, **kw)

    async def body(served: Served) -> list[int]:
        response = await served.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert response.status_code == 200, response.text
        (ids,) = added
        assert response.json()["usage"]["prompt_tokens"] == len(ids)
        return ids

    return serve(core, body, argv)


def test_special_token_text_in_a_completion_prompt_is_parsed_by_default_and_text_on_request(
    tokenizer: KilnTokenizer,
) -> None:
    start = tokenizer.tokenizer.token_to_id("<|im_start|>")
    parsed = prompt_ids(tokenizer, [])
    assert parsed == tokenizer.encode(PROMPT) and parsed.count(start) == 2
    as_text = prompt_ids(tokenizer, ["--completion-special-tokens", "text"])
    assert start not in as_text and len(as_text) > len(parsed)
    assert tokenizer.decode(as_text, skip_special_tokens=False) == PROMPT

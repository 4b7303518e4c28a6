"""Reasoning end to end: a live `kiln serve` of a tiny random Qwen3 whose chat template thinks (Qwen3's way), its
answer teacher-forced with `guided_regex` so the text is known: the start-up log names the parser the template
chose, `reasoning_content` and `content` come back split, streamed and not, through the `openai` client; the
tokenizer endpoints answer for the same model, and `enable_thinking: false` reaches its template."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.engine.tiny_models import write_hf_model
from tests.server.live import LiveServer, live_server
from tests.server.test_reasoning import QWEN3_TEMPLATE

ANSWER = "<think>\nIt is Paris.\n</think>\n\nParis"
CHAT = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = tmp_path_factory.mktemp("thinking-qwen3")
    write_hf_model(model, "qwen3", vocab_size=49152)  # the default model's tokenizer, so every token has a row
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": QWEN3_TEMPLATE}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["--model-path", str(model), "--served-model-name", "default", "--graph-mode", "eager"]
    args += ["--max-model-len", "256", "--num-kv-blocks", "64"]
    with live_server(args) as live:
        yield live


def test_a_thinking_template_gets_reasoning_content_streamed_and_not(server: LiveServer) -> None:
    assert any("Reasoning: qwen3 parser (the chat template writes <think>)" in line for line in server.log)
    client = server.client()
    forced = {"guided_regex": ANSWER.replace(".", "\\.").replace("\n", "\\n")}
    reply = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=64, temperature=0, extra_body=forced
    )  # type: ignore[call-overload]
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content) == ("\n\nParis", "\nIt is Paris.\n")  # type: ignore[attr-defined]
    stream = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=64, temperature=0, stream=True, extra_body=forced
    )  # type: ignore[call-overload]
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == "\n\nParis"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "\nIt is Paris.\n"


def test_the_tokenizer_endpoints_render_the_template_with_its_variables(server: LiveServer) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == QWEN3_TEMPLATE and info["eos_token"] == "<|im_end|>"
    request = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    ids = httpx.post(f"{server.url}/tokenize", json=request, timeout=30).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reply = server.client().chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "guided_regex": "Paris"},
    )  # type: ignore[call-overload]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert (reply.choices[0].message.content, reply.choices[0].message.reasoning_content) == ("Paris", None)  # type: ignore[attr-defined]

"""One `kiln loadtest` request over HTTP: a streamed completion or chat turn, timed into its `RequestRecord`
(first token, end to end, the server's token counts and the prompt tokens it found cached)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kiln.errors import KilnError


@dataclass
class RequestRecord:
    """One request's outcome; times are seconds, `start` relative to the start of the test."""

    index: int
    start: float
    target_input_len: int
    target_output_len: int
    conversation: int = 0
    turn: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    error: str | None = None
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details.cached_tokens, when it sends it

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None


async def first_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        response = await client.get(f"{base}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise KilnError(f"cannot list models at {base}/v1/models ({exc}); is the server up? pass --model") from None


async def speculation_counts(client: httpx.AsyncClient, base: str) -> dict[str, float] | None:
    """The server's speculative-decoding counts (`/health`'s `speculative_decoding`; None: off, or not kiln)."""
    try:
        response = await client.get(f"{base}/health")
        counts = response.json().get("speculative_decoding")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return counts if isinstance(counts, dict) else None


def request_body(model: str, record: RequestRecord, prompt: str | list[dict[str, str]]) -> dict[str, Any]:
    """A streamed greedy request of exactly the record's output length: a completion of `prompt` (text), or a
    chat turn of `prompt` (the conversation's messages so far)."""
    body: dict[str, Any] = {"messages": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    return body | {
        "model": model,
        "max_tokens": record.target_output_len,
        "ignore_eos": True,  # vLLM/kiln extension: fixed output lengths make runs comparable
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(client: httpx.AsyncClient, base: str, body: dict[str, Any], record: RequestRecord, t0: float) -> str:
    """Send `body` (to the chat endpoint when it has messages) and fill `record`; returns the text streamed (the
    answer a conversation's next turn carries). Failures are the record's error, never raised."""
    endpoint = "chat/completions" if "messages" in body else "completions"
    start = t0 + record.start
    text: list[str] = []
    try:
        async with client.stream("POST", f"{base}/v1/{endpoint}", json=body) as response:
            if response.status_code != 200:
                message = _error_message((await response.aread()).decode(errors="replace"))
                record.error = f"HTTP {response.status_code}: {message}"
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    record.error = f"stream error: {event['error'].get('message')}"
                    return ""
                if choices := event.get("choices"):
                    if record.ttft is None:
                        record.ttft = time.monotonic() - start
                    text.append(choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or "")
                if usage := event.get("usage"):
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.output_tokens = usage["completion_tokens"]
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.e2e = time.monotonic() - start
        if record.ttft is not None and record.output_tokens > 1:
            record.tpot = (record.e2e - record.ttft) / (record.output_tokens - 1)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return "".join(text)


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200]

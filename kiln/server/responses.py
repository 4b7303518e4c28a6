"""OpenAI response bodies built from RequestOutputs: usage, logprobs in both API shapes, SSE framing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.engine.request import RequestOutput
from kiln.model.tokenizer import KilnTokenizer

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class Usage:
    """A response's token counts, OpenAI's `usage`, added up as its choices finish. The prompt tokens found in the
    prefix cache are counted once per prompt (on its first choice, `firsts`), as the prompt tokens are."""

    prompt_tokens: int
    firsts: frozenset[str]  # the request id of each prompt's first choice
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.completion_tokens += len(out.token_ids)
        if out.request_id in self.firsts:
            self.cached_tokens += out.num_cached_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class LogprobFormatter:
    """Turns the engine's per-token `{token_id: logprob}` dicts (sampled token first) into OpenAI's shapes."""

    def __init__(self, tokenizer: KilnTokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int = 0
    ) -> dict[str, list[Any]]:
        """/v1/completions shape: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(entry[token_id])
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            top.append({self.token_text(t): lp for t, lp in ranked})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> list[dict[str, Any]]:
        """/v1/chat/completions `logprobs.content`: per token its text, logprob, bytes and `num_top` alternatives."""
        content = []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
            content.append(
                {
                    **self._chat_entry(token_id, entry[token_id]),
                    "top_logprobs": [self._chat_entry(t, lp) for t, lp in ranked],
                }
            )
        return content

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

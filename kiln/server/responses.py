"""OpenAI response bodies built from RequestOutputs: usage, logprobs in both API shapes, SSE framing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.engine.request import PromptLogprobs, RequestOutput
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

    def echoed_prompt(self, token_ids: list[int], prompt_logprobs: PromptLogprobs | None) -> dict[str, list[Any]]:
        """/v1/completions' logprobs of an echoed prompt (OpenAI's shape): per prompt token its text, logprob and
        alternatives ({text: logprob}, likeliest first, the token's own included); the first token's are None (and
        every token's when `prompt_logprobs` is None: the prompt was not scored)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for q, token_id in enumerate(token_ids):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            entry = prompt_logprobs[q] if prompt_logprobs is not None else None
            token_logprobs.append(entry[token_id].logprob if entry is not None else None)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank) if entry is not None else None
            top.append({self.token_text(t): lp.logprob for t, lp in ranked} if ranked is not None else None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def vllm_prompt(self, prompt_logprobs: PromptLogprobs) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: None for the first token, then per position {token id: {logprob, rank,
        decoded_token}} (the actual token's and its likeliest alternatives)."""
        return [
            None
            if entry is None
            else {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_text(t)}
                for t, lp in entry.items()
            }
            for entry in prompt_logprobs
        ]

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

"""vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (lm-evaluation-harness
finds a server's tokenizer through them).

`/tokenize` takes a `prompt` (tokenized as /v1/completions tokenizes it, `--completion-special-tokens` included)
or `messages` (rendered and tokenized as /v1/chat/completions prompts the model: the same tools, template
variables and checks), and answers vLLM's `{count, max_model_len, tokens}` (`token_strs` on request). The ids are
the ones a completion of the same request would prefill, so `count` is what its prompt costs. Unknown fields are
refused as on the other routes; work runs on the one tokenizer thread the other routes share.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kiln.errors import RequestError
from kiln.server.protocol import ChatPrompt, check_text
from kiln.server.request_fields import RequestPart
from kiln.server.serving import OpenAIServing


class TokenizePromptRequest(RequestPart):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own (BOS), as a completion's prompt gets them
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    model: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # beyond what the template and the tokenizer add (kiln adds none more)
    return_token_strs: bool = False


class DetokenizeRequest(RequestPart):
    model: str | None = None
    tokens: list[int]


def parse_tokenize_request(body: dict[str, Any]) -> TokenizePromptRequest | TokenizeChatRequest:
    """The request a /tokenize body is: a chat when it has `messages`, else a prompt (pydantic's errors raise as
    for any body, naming the field)."""
    model = TokenizeChatRequest if "messages" in body else TokenizePromptRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


class TokenizerEndpoints:
    """The three routes over a serving's tokenizer, limits and tokenizer thread."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer

    async def tokenize(self, body: TokenizePromptRequest | TokenizeChatRequest) -> dict[str, Any]:
        self.serving.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            if body.add_special_tokens:
                raise RequestError(
                    "add_special_tokens=true is not served for messages: kiln's chat prompts hold the special "
                    "tokens the template and the tokenizer write, and /tokenize answers the ids a chat completion "
                    "would prefill; send add_special_tokens=false",
                    None,
                    "add_special_tokens",
                )
            tokenize = self.serving.chat_prompt(body, body.add_generation_prompt)
        else:
            check_text(body.prompt, "prompt")
            self.serving.limits.check_prompt_chars(len(body.prompt), "prompt")
            tokenize = functools.partial(self._encode_prompt, body.prompt, body.add_special_tokens)
        (ids,) = await self.serving.in_tokenizer_thread(tokenize)
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.serving.max_model_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = self.tokenizer.token_strs(ids)
        return answer

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.serving.check_model(body.model)
        if len(body.tokens) > self.serving.max_model_len:
            raise RequestError(
                f"tokens holds {len(body.tokens)} ids, more than any sequence of this model "
                f"(max_model_len={self.serving.max_model_len}); send fewer",
                None,
                "tokens",
            )
        vocab_size = self.tokenizer.vocab_size
        for i, token_id in enumerate(body.tokens):
            if not 0 <= token_id < vocab_size:
                raise RequestError(
                    f"token id {token_id} at index {i} is not in the vocabulary (ids 0 to {vocab_size - 1})",
                    None,
                    f"tokens.{i}",
                )
        decode = functools.partial(self.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": await self.serving.in_tokenizer_thread(decode)}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's shape (tokenizer_config.json's fields): the class, the special tokens (null when the model has
        none), the longest sequence the server takes, the vocabulary size and the chat template."""
        tok = self.tokenizer
        info: dict[str, Any] = {
            "tokenizer_class": tok.tokenizer_class,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "model_max_length": self.serving.max_model_len,
            "vocab_size": tok.vocab_size,
        }
        if tok.chat_template:
            info["chat_template"] = tok.chat_template
        return info

    def _encode_prompt(self, prompt: str, add_special_tokens: bool) -> list[list[int]]:
        return [self.serving.encode_text(prompt, add_special_tokens=add_special_tokens)]

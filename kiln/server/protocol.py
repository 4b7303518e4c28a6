"""OpenAI request bodies (the fields kiln serves) and their mapping onto SamplingParams.

No field is silently ignored: a field the models do not declare is a 400 naming it, as OpenAI answers, unless it
asks for nothing (OpenAI's default value, or a no-op by design such as `user`: kiln/server/request_fields.py).
Types are strict, as OpenAI's are: a string or a boolean where a number belongs is a 400 (`"max_tokens": "10"`,
`"prompt": [true]`, which would otherwise be token id 1), never converted.
Fields kiln cannot honour (`best_of` != n, non-text message parts) are rejected with a 400 naming them,
and so is text the tokenizer cannot take (a lone UTF-16 surrogate, which JSON's "\\ud800" escape can carry).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

from pydantic import Field

from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.structured.constraint import StructuredOutput
from kiln.errors import RequestError
from kiln.model.tokenizer import TEMPLATE_RESERVED
from kiln.server.request_fields import RequestPart
from kiln.server.structured_fields import ResponseFormatField, StructuredOutputsField, requested_constraint
from kiln.server.tool_fields import NamedToolChoice, ToolCallItem, ToolDefinition, ToolUse, history_calls, tool_use

MAX_N = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, param: str) -> None:
    """RequestError naming `param` unless `text` is valid Unicode (no lone surrogate, so it encodes as UTF-8)."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise RequestError(
            f"{param} contains a lone UTF-16 surrogate ({found.group()!r} at character {found.start()}), which is "
            "not valid Unicode; send the character's full surrogate pair or its UTF-8 text",
            None,
            param,
        )


class StreamOptions(RequestPart):
    include_usage: bool = False


class SamplingFields(RequestPart):
    """Options shared by /v1/completions and /v1/chat/completions (kiln extensions as in vLLM: top_k, min_p, ...)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # the sampler's generators take a signed 64-bit seed
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as text, OpenAI's JSON) -> bias in [-100, 100]
    # prefix caching: only requests with the same salt share cached KV blocks (vLLM's field)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # vLLM's: each prompt token's logprob and this many likeliest alternatives (the response's `prompt_logprobs`)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's: under --scheduling-policy priority, lower values are admitted first and preempted last (else only 0)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (at most one)
    response_format: ResponseFormatField | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        """RequestError naming `stream_options` when it is sent without `stream: true` (it would do nothing; vLLM
        answers 400 too)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "stream_options applies to streamed answers only; send stream: true or leave stream_options out",
                None,
                "stream_options",
            )

    def stop_strings(self) -> list[str]:
        """`stop` as a list, each checked to be valid Unicode."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for i, text in enumerate(stop):
            check_text(text, f"stop.{i}")
        return stop

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: the alternatives per prompt position (None: the prompt is not scored)."""
        return self.prompt_logprobs

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the structured-output fields ask for (RequestError when several do)."""
        return requested_constraint(self.response_format, self.structured_outputs, self.guided_fields)

    @property
    def guided_fields(self) -> dict[str, Any]:
        return {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }

    def token_biases(self) -> dict[int, float]:
        """`logit_bias` with its token ids as ints (RequestError naming it for a key that is not one)."""
        biases: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise RequestError(
                    f"logit_bias keys must be token ids (decimal text), got {key[:40]!r}", None, "logit_bias"
                )
            biases[int(key)] = bias
        return biases

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice_index: int,
        constraint: StructuredOutput | None,
        keep_special_tokens: bool = False,
    ) -> SamplingParams:
        """Build validated SamplingParams (RequestError names the field). Choice `i` of `n` samples with seed+i;
        `constraint`: what `structured_output()` gave (computed once per request); `keep_special_tokens`: the text
        keeps special tokens whatever the request says (a tool parser reads an opener that is one)."""
        optional: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
        }
        return SamplingParams(
            max_tokens=max_tokens,
            seed=None if self.seed is None else self.seed + choice_index,
            stop=self.stop_strings(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_output=constraint,
            logit_bias=self.token_biases(),
            cache_salt=self.cache_salt,
            **{name: value for name, value in optional.items() if value is not None},
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one string, a list of strings, one token-id list, or a list of those; text prompts
        are checked to be valid Unicode."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts:
            raise RequestError(
                "prompt is an empty list: expected a string, a list of strings or token ids", None, "prompt"
            )
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_text(prompt, prompt_param(p, i))
        return prompts

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's rule: `prompt_logprobs` when sent, else with `echo` the `logprobs` count (OpenAI's echo scores
        the prompt as it scores the output)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the answer is the prompt alone (the engine samples one token, not shown)."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def check_supported(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise RequestError(
                "max_tokens=0 asks for no output: it is served with echo=true (the prompt and its logprobs alone); "
                "send max_tokens >= 1 or echo=true",
                None,
                "max_tokens",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(
                f"best_of={self.best_of} is not supported: kiln returns all n={self.n} choices", None, "best_of"
            )


def prompt_param(prompt: Any, index: int) -> str:
    """How errors name prompt `index`: `prompt` when the request sent one string, else `prompt.<index>`."""
    return "prompt" if isinstance(prompt, str) else f"prompt.{index}"


class TextPart(RequestPart):
    """A content part. Only text is served; the fields of OpenAI's other parts are declared so that such a part
    is refused by its `type` (`template_messages`), not as an unknown field."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(RequestPart):
    """One turn. `role` is one the chat templates know (anything else would be spliced into the prompt as a turn
    the model never saw); `developer` is OpenAI's newer name for `system` and becomes one. `name` follows OpenAI's
    pattern, so it cannot carry template syntax or control tokens either."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn's calls
    tool_call_id: str | None = Field(None, max_length=256)  # the call a tool turn answers


class ChatPrompt(RequestPart):
    """What a chat template renders: the messages, the tools shown, and the request's own template variables
    (`chat_template_kwargs`, vLLM's, such as `{"enable_thinking": false}`; OpenAI's `reasoning_effort`, given to
    the template as a variable). /v1/chat/completions and /tokenize take it."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # JSON values, rendered by the sandboxed template only
    reasoning_effort: str | None = Field(None, pattern=r"^[a-z]{1,16}$")

    @functools.cached_property
    def tool_use(self) -> ToolUse | None:
        """What the tool fields ask for (kiln.server.tool_fields), None without tools; their texts checked to be
        valid Unicode. Worked out once a request: the chat handler and `structured_output` both read it."""
        for i, tool in enumerate(self.tools or []):
            check_text(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False), f"tools.{i}")
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_kwargs(self, reads: frozenset[str]) -> dict[str, Any]:
        """The variables this request gives the chat template, which reads the variables `reads`: each must be
        one the template reads and not one kiln gives it (a RequestError naming it otherwise), so none is
        silently ignored; its text is checked to be valid Unicode."""
        given = {f"chat_template_kwargs.{k}": (k, v) for k, v in (self.chat_template_kwargs or {}).items()}
        if self.reasoning_effort is not None:
            if "reasoning_effort" in (self.chat_template_kwargs or {}):
                raise RequestError(
                    "reasoning_effort is given twice (also in chat_template_kwargs); send one",
                    None,
                    "reasoning_effort",
                )
            given["reasoning_effort"] = ("reasoning_effort", self.reasoning_effort)
        for param, (name, value) in given.items():
            check_text(json.dumps({name: value}, ensure_ascii=False), param)
            if name in TEMPLATE_RESERVED:
                raise RequestError(
                    f"{name!r} is a variable kiln gives the chat template itself; a request cannot set it",
                    None,
                    param,
                )
            if name not in reads:
                shown = ", ".join(sorted(reads - TEMPLATE_RESERVED)[:20]) or "none"
                raise RequestError(
                    f"this model's chat template has no {name} (it reads no variable of that name, so the value "
                    f"would change nothing); the variables it reads beyond kiln's own: {shown}",
                    None,
                    param,
                )
        return dict(given.values())

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: {role, content: str}; text parts are concatenated, and
        every text is checked to be valid Unicode."""
        messages = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise RequestError(
                            f"message content part of type {part.type!r} is not supported: kiln serves text only",
                            None,
                            f"messages.{i}.content.{j}.type",
                        )
                content = "".join(part.text or "" for part in content)
            role = "system" if m.role == "developer" else m.role
            message: dict[str, Any] = {"role": role, "content": content or ""}
            for key in ("name", "tool_call_id"):
                if getattr(m, key) is not None:
                    message[key] = getattr(m, key)
            for key, text in message.items():
                check_text(text, f"messages.{i}.{key}")
            if m.tool_calls:
                if m.role != "assistant":
                    raise RequestError("only assistant messages carry tool_calls", None, f"messages.{i}.tool_calls")
                for j, call in enumerate(m.tool_calls):
                    check_text(json.dumps(call.model_dump(), ensure_ascii=False), f"messages.{i}.tool_calls.{j}")
                message["tool_calls"] = history_calls(m.tool_calls, f"messages.{i}.tool_calls")
            if m.role == "tool" and m.tool_call_id is None:
                raise RequestError(
                    "a tool message needs tool_call_id: the id of the call it answers", None, f"messages.{i}"
                )
            messages.append(message)
        return messages


class ChatCompletionRequest(SamplingFields, ChatPrompt):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def structured_output(self) -> StructuredOutput | None:
        """The structured-output fields' constraint, or the one a required or named tool_choice holds the output
        to (RequestError when both ask for one)."""
        asked = super().structured_output()
        use = self.tool_use
        by_tools = use.constraint() if use is not None else None
        if asked is not None and by_tools is not None:
            raise RequestError(
                f"tool_choice {use.mode if use else ''} holds the output to the tools' schema, so {asked.param} "
                "cannot also constrain it; send one of them",
                None,
                asked.param,
            )
        return asked or by_tools

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None unless `logprobs` is true; then `top_logprobs` alternatives (default 0)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise RequestError("top_logprobs needs logprobs=true", None, "top_logprobs")
            return None
        return self.top_logprobs or 0

"""Request fields kiln does not serve, and why: no field of a request is silently ignored.

The request models (kiln/server/protocol.py) forbid fields they do not declare, so a field kiln does not
implement is a 400 that names it (`param`), as OpenAI answers a field it does not know. Before that check,
`drop_fields_asking_nothing` removes the fields that ask for nothing: a field at OpenAI's default
(`"function_call": "none"`, `"functions": []`, `null` for any of them; clients and SDKs send these unasked) and the
fields kiln takes as no-ops by design (`NO_OPS`, listed in the README).
`NOT_SERVED` gives the reason a refused field names; any other unknown field is refused as unknown.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# the field -> why kiln refuses it; the values at which it asks for nothing (besides None) are in ASKS_NOTHING
NOT_SERVED: dict[str, str] = {
    "guided_decoding_backend": "kiln's structured outputs run on llguidance (auto, guidance or llguidance)",
    "guided_whitespace_pattern": "kiln writes structured JSON on one line; a whitespace pattern is not supported",
    "functions": "function calling (OpenAI's older form of tools) is not implemented in kiln; send tools",
    "function_call": "function calling (OpenAI's older form of tools) is not implemented in kiln; send tools",
    "tools": "tool calling is served by /v1/chat/completions, not /v1/completions",
    "tool_choice": "tool calling is served by /v1/chat/completions, not /v1/completions",
    "parallel_tool_calls": "tool calling is served by /v1/chat/completions, not /v1/completions",
    "suffix": "suffix (text insertion) is not supported by kiln",
    "prediction": "predicted outputs are not supported by kiln",
    "audio": "audio is not supported: kiln serves text",
    "modalities": "kiln serves text only",
    "reasoning_effort": "reasoning_effort is served by /v1/chat/completions (given to a chat template that reads "
    "it), not /v1/completions",
    "chat_template_kwargs": "chat_template_kwargs is served by /v1/chat/completions and /tokenize, not /v1/completions",
    "web_search_options": "kiln offers no web search",
    "store": "kiln does not store completions",
    "metadata": "kiln does not store completions, so it keeps no metadata",
    "service_tier": "kiln has one service tier",
    "use_beam_search": "beam search is not implemented in kiln",
    "length_penalty": "beam search (length_penalty) is not implemented in kiln",
    "echo": "echo is served by /v1/completions; a chat answer does not repeat its messages in kiln",
    "continuous_usage_stats": "usage in every chunk is not implemented; include_usage gives it in the last chunk",
    # in a chat message
    "refusal": "a refusal is not text kiln can put in a prompt; send it as the message's content",
    "annotations": "message annotations are not supported by kiln",
}

ASKS_NOTHING: dict[str, tuple[Any, ...]] = {
    "guided_decoding_backend": ("auto", "guidance", "llguidance"),
    "functions": ([],),
    "function_call": ("none",),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True,),
    "suffix": ("",),
    "modalities": (["text"],),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "use_beam_search": (False,),
    "echo": (False,),
    "continuous_usage_stats": (False,),
    "annotations": ([],),
}

# accepted and ignored by design (README, "OpenAI API coverage")
NO_OPS: dict[str, str] = {
    "user": "an end-user id, which OpenAI uses for abuse monitoring; kiln keeps no per-user records",
}


def asks_nothing(field: str, value: Any) -> bool:
    """True when `field` with `value` leaves kiln's answer as it would be without it."""
    if field in NO_OPS:
        return True
    if field not in NOT_SERVED:
        return False
    return value is None or any(type(value) is type(d) and value == d for d in ASKS_NOTHING.get(field, ()))


def drop_fields_asking_nothing(data: Any, declared: set[str]) -> Any:
    """`data` (a request body, or a part of one) without its undeclared fields that ask for nothing."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if k in declared or not asks_nothing(k, v)}


def refusal_reason(field: str) -> str:
    """What a 400 says about the undeclared field `field`."""
    if field in NOT_SERVED:
        return f"{NOT_SERVED[field]}; remove the field"
    return (
        "not a field kiln serves (the README lists the OpenAI and vLLM fields it takes); check its spelling or "
        "remove it"
    )


class RequestPart(BaseModel):
    """A request body or a part of one: strict types, and its undeclared fields refused unless they ask for
    nothing (those are dropped before validation)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_fields_asking_nothing(cls, data: Any) -> Any:
        return drop_fields_asking_nothing(data, set(cls.model_fields))

"""Tools in the prompt: the messages and tool definitions a chat template renders.

A template that reads `tools` (Qwen, Hermes, Llama 3.1+, Mistral...) gets them as Hugging Face templates take
them: the definitions as `tools`, an assistant turn's calls as `tool_calls` (arguments as objects), a tool
result as a `tool` message with its `tool_call_id`.

A template without tools (the default model's) gets kiln's fallback, in the Hermes format the `hermes` parser
reads: the definitions are described in the system message (one is added first when the conversation has none),
an assistant turn's calls are written into its content as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
and a tool result becomes a user turn holding `<tool_response>...</tool_response>`, so any template that knows
system, user and assistant turns can render the conversation.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.errors import RequestError

FALLBACK_INTRO = (
    "You can call functions to help answer. These are the functions, one JSON signature per line, between "
    "<tools> and </tools>:\n<tools>\n{signatures}\n</tools>\n\n"
    "To call a function, reply with a JSON object holding its name and its arguments between <tool_call> and "
    '</tool_call>, one pair of tags per call:\n<tool_call>\n{{"name": "<function name>", "arguments": {{<the '
    "arguments as JSON>}}}}\n</tool_call>\nA function's result comes back between <tool_response> and "
    "</tool_response>."
)


def prompt_messages(
    messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...], template_knows_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` variable to render: `messages` as template_messages made them, `tools` the
    definitions to show (empty: none)."""
    if template_knows_tools:
        return messages, list(tools) if tools else None
    rendered = [_fallback_message(m) for m in messages]
    if tools:
        intro = FALLBACK_INTRO.format(signatures="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{intro}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": intro})
    return rendered, None


def refuse_control_text(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    special_texts: list[str],
    template_kwargs: dict[str, Any] | None = None,
) -> None:
    """RequestError naming the part of the tools, of a message's calls or of the request's template variables
    (`chat_template_kwargs`) that holds special-token text: the template writes those parts as its own text, so
    `<|im_start|>` there would become a control token (a forged turn), where a message's content is always kept
    as text."""
    parts = {f"tools.{i}": tool for i, tool in enumerate(tools or [])}
    parts |= {f"chat_template_kwargs.{name}": value for name, value in (template_kwargs or {}).items()}
    for i, m in enumerate(messages):
        parts |= {f"messages.{i}.{key}": m[key] for key in ("tool_calls", "tool_call_id", "name") if key in m}
    for param, part in parts.items():
        text = part if isinstance(part, str) else json.dumps(part, ensure_ascii=False)
        found = next((t for t in special_texts if t in text), None)
        if found is not None:
            raise RequestError(
                f"{param} contains the special-token text {found!r}, which the chat template would make a control "
                "token; remove it",
                None,
                param,
            )


def _fallback_message(message: dict[str, Any]) -> dict[str, Any]:
    """One message as a template without tools can render it (its calls and results written as text)."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = [
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in calls
    ]
    text = "\n".join(([message["content"]] if message["content"] else []) + written)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}

"""Tool calls as model families write them: one parser per format, chosen from a registry by the chat template.

Every format kiln reads writes each call as a JSON object `{"name": ..., "arguments": {...}}` ("parameters" in
Llama 3's), after an opener and between separators of its own:
- `hermes` (Hermes, Qwen 2/2.5/3, and kiln's fallback prompt): `<tool_call>{...}</tool_call>`, one tag per call;
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": ...}`, maybe after `<|python_tag|>`,
  several joined by `;`;
- `mistral`: `[TOOL_CALLS] [{...}, {...}]`;
- `json_array`: a JSON array of such objects, the output `tool_choice: "required"` is held to.
kiln.server.tool_reader reads a choice's text by one of them, as it streams.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
NAME = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class ToolParser:
    """A way of writing tool calls. `opener`: the text that opens the calls; `at_start`: they can only open at the
    start of the output (after blanks); `bare`: a call object may also open the output without the opener;
    `separators`: text allowed around and between the call objects."""

    name: str
    opener: str
    separators: tuple[str, ...]
    at_start: bool = False
    bare: bool = False


TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p
    for p in (
        ToolParser("hermes", "<tool_call>", ("</tool_call>", "<tool_call>")),
        ToolParser("llama3_json", "<|python_tag|>", (";",), at_start=True, bare=True),
        ToolParser("mistral", "[TOOL_CALLS]", ("[", ",", "]")),
        ToolParser("json_array", "[", (",", "]"), at_start=True),
    )
}


def choose_tool_parser(chat_template: str | None, knows_tools: bool, override: str | None = None) -> tuple[str, str]:
    """The parser for a model (by its chat template's way of writing calls) and why; `override` (the
    --tool-call-parser flag) wins. A template without tools gets kiln's fallback prompt, which asks for hermes."""
    if override is not None:
        if override not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {override!r}: expected one of {sorted(TOOL_PARSERS)}")
        return override, "--tool-call-parser"
    template = chat_template or ""
    if not knows_tools:
        return "hermes", "the chat template has no tools, so kiln's fallback prompt describes them (hermes format)"
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json")):
        if marker in template:
            return name, f"the chat template writes {marker}"
    if '"parameters"' in template:
        return "llama3_json", 'the chat template asks for {"name", "parameters"} objects'
    return "hermes", "the chat template's tool format is not one kiln knows; pass --tool-call-parser to choose"

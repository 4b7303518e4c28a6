"""Tool calls read out of a model's text: one parser per way a model family writes them, chosen from a registry.

Every format kiln reads writes each call as a JSON object `{"name": ..., "arguments": {...}}` ("parameters" in
Llama 3's), after an opener and between separators of its own:
- `hermes` (Hermes, Qwen 2/2.5/3, and kiln's fallback prompt): `<tool_call>{...}</tool_call>`, one tag per call;
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": ...}`, maybe after `<|python_tag|>`,
  several joined by `;`;
- `mistral`: `[TOOL_CALLS] [{...}, {...}]`;
- `json_array`: a JSON array of such objects, the output `tool_choice: "required"` is held to.
Text before the opener is the message's content; text after the calls is not part of the answer.

`ToolCallReader` reads one choice's text as it grows, so streamed deltas and the final message come from one
reading: the name of a call is sent once it is complete, its arguments as the model writes them (the raw JSON
text, so the streamed pieces join to the final `arguments` exactly).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

# `{"name": "<name>", "arguments": ` at the start of a call object: then the arguments stream as they come
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_DECODER = json.JSONDecoder()


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


@dataclass
class ToolCall:
    """One call as read so far. `arguments`: its JSON text (complete once `done`)."""

    index: int
    name: str
    arguments: str = ""
    done: bool = False
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        """The call as OpenAI's message lists it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Reading:
    """What one `ToolCallReader.read` found new: content text and tool-call deltas (OpenAI's streamed shape)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add_arguments(self, index: int, piece: str) -> None:
        """More of call `index`'s arguments (joined to its last delta when that is the same call's)."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += piece
        else:
            self.tool_calls.append({"index": index, "function": {"arguments": piece}})


class ToolCallReader:
    """Reads one choice's output for tool calls as its text grows (`read(text_so_far)`). `named`: the output is
    the arguments of this one function (a named `tool_choice`), written as bare JSON."""

    def __init__(self, parser: ToolParser, named: str | None = None) -> None:
        self.parser, self.named = parser, named
        self.calls: list[ToolCall] = []
        self.content = ""
        self.malformed = False  # the calls' text is not the format's: the final message keeps the text as content
        self._region: int | None = None  # where the calls begin (after the opener); None: still content
        self._cursor = 0  # where the next unread call object begins
        self._args_at: int | None = None  # where the current call's arguments begin
        self._closed = False  # nothing more is read (the calls ended, or the text left the format)
        self._plain = False  # the output is plain text (a format whose calls open the output, and it did not)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    @property
    def complete(self) -> bool:
        """Every call read is whole (a call cut off by max_tokens is not)."""
        return all(c.done for c in self.calls) and not self.malformed

    def read(self, text: str, final: bool = False) -> Reading:
        """What `text` (the whole output so far) adds to what was read before."""
        reading = Reading()
        if self._plain:
            reading.content = self._add_content(text[len(self.content) :])
            return reading
        if self.named is not None:
            self._read_named(text, final, reading)
            return reading
        if self._region is None:
            self._find_region(text, final, reading)
        if self._region is not None and not self._closed:
            self._read_calls(text, final, reading)
        return reading

    def _read_named(self, text: str, final: bool, reading: Reading) -> None:
        if not self.calls:
            self.calls.append(ToolCall(0, self.named or ""))
            reading.tool_calls.append(_opening(self.calls[0], ""))
        call = self.calls[0]
        if len(text) > len(call.arguments):
            reading.add_arguments(0, text[len(call.arguments) :])
            call.arguments = text
        call.done = final

    def _find_region(self, text: str, final: bool, reading: Reading) -> None:
        p = self.parser
        sent = len(self.content)
        if p.at_start:
            lead = len(text) - len(text.lstrip())
            rest = text[lead:]
            if rest.startswith(p.opener) or (p.bare and rest.startswith("{")):
                self._open(lead + (len(p.opener) if rest.startswith(p.opener) else 0))
                return
            if not rest or (p.opener.startswith(rest) and not final):
                return  # blanks, or the opener's first characters: not content yet
            self._plain = True  # plain text: the whole output is content
            reading.content = self._add_content(text[sent:])
            return
        found = text.find(p.opener, max(sent - len(p.opener), 0))
        if found >= 0:
            reading.content = self._add_content(text[sent:found])
            self._open(found + len(p.opener))
            return
        hold = 0 if final else _partial_suffix(text, p.opener)
        reading.content = self._add_content(text[sent : len(text) - hold])

    def _add_content(self, piece: str) -> str:
        self.content += piece
        return piece

    def _open(self, at: int) -> None:
        self._region = self._cursor = at

    def _read_calls(self, text: str, final: bool, reading: Reading) -> None:
        while not self._closed:
            if self._args_at is None:
                at = self._skip_separators(text)
                if at is None:  # at the end, or inside a separator's first characters: wait for more
                    break
                self._cursor = at
                if text[at] != "{":  # the calls ended: what follows is not part of the answer
                    self._close(malformed=not self.calls)
                    break
                started = self._start_call(text, reading)
                if started is None:
                    break
                if not started:  # a whole object was read at once
                    continue
            if not self._read_arguments(text, reading):
                break
        if final and not self._closed and (self._args_at is not None or not self.calls):
            self.malformed = True  # the text ended inside a call (max_tokens), or right after the opener

    def _close(self, malformed: bool = False) -> None:
        self._closed = True
        self.malformed = self.malformed or malformed

    def _skip_separators(self, text: str) -> int | None:
        at = self._cursor
        while at < len(text):
            if text[at].isspace():
                at += 1
                continue
            sep = next((s for s in self.parser.separators if text.startswith(s, at)), None)
            if sep is not None:
                at += len(sep)
                continue
            if any(s.startswith(text[at:]) for s in self.parser.separators):
                return None
            return at
        return None

    def _start_call(self, text: str, reading: Reading) -> bool | None:
        """Begin the call object at the cursor: True once its name is known and its arguments begin (they stream
        next), False when the whole object was read at once, None when there is not enough text yet."""
        head = _HEAD.match(text, self._cursor)
        if head is not None:
            call = ToolCall(len(self.calls), json.loads(head.group(1)))
            self.calls.append(call)
            self._args_at = head.end()
            reading.tool_calls.append(_opening(call, ""))
            return True
        try:  # keys in another order, or not there yet: read the object once it is whole
            obj, end = _DECODER.raw_decode(text, self._cursor)
        except json.JSONDecodeError:
            return None
        name = obj.get("name") if isinstance(obj, dict) else None
        arguments = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            self._close(malformed=True)
            return None
        call = ToolCall(len(self.calls), name, json.dumps(arguments, ensure_ascii=False), done=True)
        self.calls.append(call)
        reading.tool_calls.append(_opening(call, call.arguments))
        self._cursor = end
        return False

    def _read_arguments(self, text: str, reading: Reading) -> bool:
        """Stream the current call's arguments; True once they and their object are whole."""
        assert self._args_at is not None
        call = self.calls[-1]
        try:
            args, end = _DECODER.raw_decode(text, self._args_at)
        except json.JSONDecodeError:
            end = len(text)  # not whole yet: all of the text so far is the arguments' (a JSON prefix)
            args = None
        piece = text[self._args_at + len(call.arguments) : end]
        if piece:
            reading.add_arguments(call.index, piece)
            call.arguments += piece
        if args is None:
            return False
        if not isinstance(args, dict):
            self._close(malformed=True)
            return False
        close = len(text[end:]) - len(text[end:].lstrip())
        if end + close >= len(text):
            return False  # the object's closing brace has not come yet
        if text[end + close] != "}":
            self._close(malformed=True)
            return False
        call.done = True
        self._cursor, self._args_at = end + close + 1, None
        return True


def _opening(call: ToolCall, arguments: str) -> dict[str, Any]:
    """A call's first streamed delta: its index, id, type and name."""
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

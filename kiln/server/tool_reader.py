"""One choice's output read for tool calls as its text grows (formats: kiln.server.tool_parsers).

Text before the format's opener is the message's content; text between and after the calls is not part of the
answer. `ToolCallReader` serves streamed deltas and the final message from one reading: the name of a call is
sent once it is complete, its arguments as the model writes them (the raw JSON text, so the streamed pieces join
to the final `arguments` exactly). Text that cannot become a call (invalid JSON, a name no function can have)
ends the reading; when no call was read, the whole text is the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kiln.server.tool_parsers import NAME, ToolParser

# `{"name": "<name>", "arguments": ` at the start of a call object: then the arguments stream as they come
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_DECODER = json.JSONDecoder()
# the start of a literal or a number the text ends inside ("tr", "nul", "1.", "-", "1e+")
_PARTIAL_SCALAR = re.compile(r"t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|[0-9.eE+-]+")


@dataclass
class ToolCall:
    """One call as read so far. `arguments`: its JSON text (complete once `done`)."""

    index: int
    name: str
    arguments: str = ""
    done: bool = False
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def opening(self, arguments: str) -> dict[str, Any]:
        """The call's first streamed delta: its index, id, type and name (and `arguments`, its first ones)."""
        return {"index": self.index, **self.message(), "function": {"name": self.name, "arguments": arguments}}

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
        self.malformed = False  # the calls' text is not the format's (or a call was cut off)
        self._region: int | None = None  # where the calls begin (after the opener); None: still content
        self._cursor = 0  # where the next unread call object begins
        self._call_at = 0  # where the current call's object begins
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

    @property
    def whole_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if c.done]

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
        if final and self.malformed and not self.calls:  # nothing was read as a call: the text is the content
            reading.content += self._add_content(text[len(self.content) :])
        return reading

    def _read_named(self, text: str, final: bool, reading: Reading) -> None:
        if not self.calls:
            self.calls.append(ToolCall(0, self.named or ""))
            reading.tool_calls.append(self.calls[0].opening(""))
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
                if text[at] != "{":
                    if self._next_opener(text, at):
                        continue
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

    def _next_opener(self, text: str, at: int) -> bool:
        """Text that is not a call object at `at`: the calls end there, unless the format's opener comes again
        later (text between calls is dropped, as the content is the text before the first). True: go on at it."""
        if self.parser.at_start or not self.calls:
            self._close(malformed=not self.calls)
            return False
        found = text.find(self.parser.opener, at)
        if found < 0:
            return False  # maybe later: read again when the text grows
        self._cursor = found + len(self.parser.opener)
        return True

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
        next), False when the whole object was read at once, None when there is not enough text yet (or the
        object is not a call: the reader is closed)."""
        head = _HEAD.match(text, self._cursor)
        if head is not None:
            name = _name(head.group(1))
            if name is None:
                self._close(malformed=True)
                return None
            call = ToolCall(len(self.calls), name)
            self.calls.append(call)
            self._call_at, self._args_at = self._cursor, head.end()
            reading.tool_calls.append(call.opening(""))
            return True
        obj, end = self._whole_object(text, self._cursor)
        if obj is None:
            return None
        name = _name(json.dumps(obj.get("name")))
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if name is None or not isinstance(arguments, dict):
            self._close(malformed=True)
            return None
        call = ToolCall(len(self.calls), name, json.dumps(arguments), done=True)
        self.calls.append(call)
        reading.tool_calls.append(call.opening(call.arguments))
        self._cursor = end
        return False

    def _whole_object(self, text: str, at: int) -> tuple[dict[str, Any] | None, int]:
        """The JSON object at `at` and where it ends; None while it is not whole (the reader is closed when it
        can never be one)."""
        try:
            obj, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            if not _incomplete(text, exc):
                self._close(malformed=True)
            return None, at
        if not isinstance(obj, dict):
            self._close(malformed=True)
            return None, at
        return obj, end

    def _read_arguments(self, text: str, reading: Reading) -> bool:
        """Stream the current call's arguments; True once they and their object are whole."""
        assert self._args_at is not None
        call = self.calls[-1]
        try:
            args, end = _DECODER.raw_decode(text, self._args_at)
        except json.JSONDecodeError as exc:
            if not _incomplete(text, exc):
                self._close(malformed=True)  # not JSON: the call is not whole
                return False
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
        if text[end + close] == "}":
            object_end = end + close + 1
        else:  # more keys after the arguments (an id, ...): the call ends where its object does
            obj, object_end = self._whole_object(text, self._call_at)
            if obj is None:
                return False
        call.done = True
        self._cursor, self._args_at = object_end, None
        return True


def _name(raw: str) -> str | None:
    """A call's name from its JSON text, if it is one a function can have."""
    try:
        name = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) and NAME.fullmatch(name) else None


def _incomplete(text: str, exc: json.JSONDecodeError) -> bool:
    """The JSON decoder stopped because `text` ends too soon (more text could make it JSON), not at an error."""
    rest = text[exc.pos :]
    return exc.msg.startswith("Unterminated string") or not rest.strip() or bool(_PARTIAL_SCALAR.fullmatch(rest))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

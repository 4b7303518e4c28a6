"""The tool-calling fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`, and the `tool_calls` /
`tool_call_id` of history messages), and what they ask of the prompt, the output's constraint and its reading.

- `tool_choice: "none"`: the tools are not shown to the model and its output is plain text.
- `"auto"` (the default when tools are given): the tools are shown; the output is read for calls by the model's
  parser (kiln.server.tool_parsers).
- `"required"`: the output is held to a JSON array of calls, `[{"name": ..., "parameters": {...}}]`, each call's
  parameters to its tool's JSON schema (one call when `parallel_tool_calls` is false).
- a named function: the output is held to that tool's parameters schema, and is the call's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from kiln.engine.structured.constraint import StructuredOutput
from kiln.errors import RequestError
from kiln.server.request_fields import RequestPart
from kiln.server.tool_parsers import NAME_PATTERN, TOOL_PARSERS, ToolParser
from kiln.server.tool_reader import ToolCallReader

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(RequestPart):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the parameters are always enforced where kiln holds the output to them


class ToolDefinition(RequestPart):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestPart):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(RequestPart):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(RequestPart):
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallItem(RequestPart):
    """A call in an assistant message of the history."""

    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolUse:
    """What a request's tool fields ask for: `shown` the tools the prompt lists (none for tool_choice none),
    `mode` none | auto | required | named, `named` the function of a named choice."""

    shown: tuple[dict[str, Any], ...]
    mode: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        """The JSON schema the output is held to (required and named choices)."""
        if self.mode == "named":
            tool = next(t for t in self.shown if t["function"]["name"] == self.named)
            return StructuredOutput.json(_parameters(tool), "tool_choice")
        if self.mode != "required":
            return None
        calls, defs = [], {}
        for t in self.shown:
            parameters, own_defs = _hoisted(t["function"]["name"], _parameters(t))
            defs |= own_defs
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if defs:
            schema["$defs"] = defs
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput.json(schema, "tools")

    def reader(self, parser: ToolParser) -> ToolCallReader | None:
        """A reader of one choice's output for calls (None: the output is plain text)."""
        if self.mode == "none" or not self.shown:
            return None
        if self.mode == "named":
            return ToolCallReader(parser, named=self.named)
        return ToolCallReader(TOOL_PARSERS["json_array"] if self.mode == "required" else parser)

    @property
    def finish_reason(self) -> str:
        """What a choice that made calls and stopped by itself ends with: "tool_calls", but "stop" for a named
        choice, as OpenAI answers."""
        return "stop" if self.mode == "named" else "tool_calls"


def tool_use(
    tools: list[ToolDefinition] | None, choice: str | NamedToolChoice | None, parallel: bool | None
) -> ToolUse | None:
    """The ToolUse of a request's fields (None without tools), with a RequestError naming a field that does not
    fit the others."""
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools: the functions the model may call", None, "tool_choice")
        return None
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise RequestError(f"two tools are both named {name!r}", None, f"tools.{i}.function.name")
    shown = tuple(t.model_dump(exclude_none=True) for t in tools)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise RequestError(
                f"tool_choice names function {choice.function.name!r}, which is not one of the tools ({names})",
                None,
                "tool_choice.function.name",
            )
        return ToolUse(shown, "named", choice.function.name)
    if choice == "none":
        return ToolUse((), "none")
    mode: Literal["auto", "required"] = "required" if choice == "required" else "auto"
    return ToolUse(shown, mode, parallel=parallel is not False)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or NO_PARAMETERS


def _hoisted(name: str, parameters: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A tool's parameters schema to nest in the array of calls, and its definitions (`$defs`, `definitions`)
    lifted to that array's root under `<tool>__<name>`, each `$ref` to them rewritten (pydantic's schemas
    refer to `#/$defs/...`, which nested would point at the wrong root)."""
    parameters = dict(parameters)
    own = {**parameters.pop("definitions", {}), **parameters.pop("$defs", {})}
    prefixes = ("#/$defs/", "#/definitions/")

    def renamed(value: Any) -> Any:
        if isinstance(value, dict):
            ref = value.get("$ref")
            out = {k: renamed(v) for k, v in value.items()}
            if isinstance(ref, str) and ref.startswith(prefixes):
                out["$ref"] = f"#/$defs/{name}__{ref.split('/', 2)[2]}"
            return out
        if isinstance(value, list):
            return [renamed(v) for v in value]
        return value

    return renamed(parameters), {f"{name}__{key}": renamed(schema) for key, schema in own.items()}


def history_calls(calls: list[ToolCallItem], where: str) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates take them: arguments as an object (RequestError naming
    the call whose arguments are not a JSON object)."""
    taken = []
    for j, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise RequestError(
                "a tool call's arguments must be a JSON object (as text)", None, f"{where}.{j}.function.arguments"
            )
        item: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        if call.id is not None:
            item["id"] = call.id
        taken.append(item)
    return taken

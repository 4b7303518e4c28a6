"""The structured-output fields of a request, and the one constraint they ask for
(kiln.engine.structured.structured_output).

OpenAI's `response_format` (text, json_object, json_schema), vLLM's `structured_outputs` object and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: at most one of them may ask for a constraint.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.engine.structured.constraint import ANY_JSON_OBJECT, StructuredOutput
from kiln.errors import RequestError
from kiln.server.request_fields import RequestPart


class JsonSchemaFormat(RequestPart):
    """OpenAI's `response_format.json_schema`. The schema is always enforced (`strict` or not)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormatField(RequestPart):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(RequestPart):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a choice, a grammar, or any JSON object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def requested_constraint(
    response_format: ResponseFormatField | None,
    structured_outputs: StructuredOutputsField | None,
    guided: dict[str, Any],
) -> StructuredOutput | None:
    """The one constraint these fields ask for; `guided`: the guided_* fields by kind (json, regex, choice,
    grammar). RequestError naming the second field when several ask for one."""
    given: list[StructuredOutput | None] = []
    rf = response_format
    if rf is not None and rf.type == "json_object":
        given.append(StructuredOutput("json", ANY_JSON_OBJECT, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestError(
                "response_format of type json_schema needs json_schema.schema: the JSON schema the output must match",
                None,
                "response_format.json_schema.schema",
            )
        given.append(StructuredOutput.json(rf.json_schema.schema_, "response_format.json_schema.schema"))
    if (so := structured_outputs) is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        given += [_constraint(kind, value, f"structured_outputs.{kind}") for kind, value in fields.items()]
        if so.json_object:
            given.append(StructuredOutput("json", ANY_JSON_OBJECT, "structured_outputs.json_object"))
    given += [_constraint(kind, value, f"guided_{kind}") for kind, value in guided.items()]
    asked = [g for g in given if g is not None]
    if len(asked) > 1:
        names = ", ".join(g.param for g in asked)
        raise RequestError(f"give one structured output, not {len(asked)}: {names}", None, asked[1].param)
    return asked[0] if asked else None


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput | None:
    """The StructuredOutput of one field (None when it is not given)."""
    if value is None:
        return None
    if kind == "json":
        return StructuredOutput.json(value, param)
    if kind == "choice":
        return StructuredOutput.choice(value, param)
    return StructuredOutput(kind, value, param)  # type: ignore[arg-type]

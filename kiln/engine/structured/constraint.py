"""A request's structured-output constraint: what its output must match (a JSON schema, a regex, a choice or a
grammar), as a value on SamplingParams. Light on purpose (no torch, no llguidance): requests and command-line
flags are checked against it before an engine is built; kiln.engine.structured.structured_output compiles it."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.engine.structured.grammar_cache import grammar_key
from kiln.engine.structured.reasoning_gate import ReasoningGate
from kiln.errors import RequestError

Kind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar")
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's json_object mode


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `kind` json: `spec` a JSON schema (text); regex: a regular expression (Rust
    syntax, whole output); choice: a JSON list of strings, the output being one of them; grammar: a Lark or GBNF
    grammar. `param`: the request field it came from, which errors name. `after_reasoning`: the output's reasoning
    comes first, unconstrained (the grammar is the same: it is compiled and cached by kind and spec alone)."""

    kind: Kind
    spec: str
    param: str = field(default="structured_output", compare=False)
    after_reasoning: ReasoningGate | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(
                f"unknown structured output kind {self.kind!r}: expected one of {KINDS}", None, self.param
            )
        if not isinstance(self.spec, str):
            raise RequestError(f"{self.param} must be given as text, got {type(self.spec).__name__}", None, self.param)

    @functools.cached_property
    def key(self) -> str:
        """The grammar cache's key: a hash of the kind and text (logs name a grammar by its first 12 digits)."""
        return grammar_key(self.kind, self.spec)

    @classmethod
    def json(cls, schema: dict[str, Any] | str, param: str = "json") -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema), param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "choice") -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", None, param)
        return cls("choice", json.dumps(choices), param)

"""How large a structured output's constraint may be, checked before it is compiled.

A constraint's compile time grows with its size: 100,000 choices (~1 MB) took 32 s, 50,000 took 7-8 s, an anyOf of
5,000 objects 1.45 s. The limits below refuse such constraints before any work, naming the limit and its flag.
OpenAI's strict schemas are the guide (at most 1,000 enum values, 10 levels of nesting, 120,000 characters of
names and values): kiln's defaults are looser, so every schema OpenAI takes and a 2,000-choice list pass.

This module imports nothing heavy: the CLI reads its defaults to build `kiln --help`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.server.limits import LimitExceeded

if TYPE_CHECKING:
    from kiln.engine.structured.constraint import StructuredOutput

MAX_GRAMMAR_BYTES = 256 * 1024  # a constraint's text (a schema as JSON, a regex, a grammar, the choices as JSON)
MAX_GRAMMAR_CHOICES = 5000  # a choice list's strings; in a schema, its enum values and anyOf/oneOf branches together
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema's objects and lists
GRAMMAR_COMPILE_TIMEOUT_S = 10.0  # a compile still running after this answers 400 (kiln.server.grammar_compiler)
GRAMMAR_COMPILE_THREADS = 2
_BRANCHES = ("enum", "anyOf", "oneOf")


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = MAX_GRAMMAR_BYTES
    max_choices: int = MAX_GRAMMAR_CHOICES
    max_depth: int = MAX_SCHEMA_DEPTH
    compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S

    def check(self, constraint: StructuredOutput) -> None:
        """LimitExceeded naming the limit `constraint` is over; its text is parsed at most once, iteratively."""
        param = constraint.param
        if constraint.kind == "choice":
            num_choices = len(json.loads(constraint.spec))
            if num_choices > self.max_choices:
                why = f"{param} has {num_choices} choices; this server compiles at most {self.max_choices}"
                _refuse(why, "--max-grammar-choices", param)
        size = len(constraint.spec.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            _refuse(
                f"{param} has {size} bytes; this server compiles at most {self.max_bytes}", "--max-grammar-bytes", param
            )
        if constraint.kind == "json":
            try:
                schema = json.loads(constraint.spec)
            except ValueError:
                return  # not JSON: compiling it says so
            self._check_schema(schema, param)

    def _check_schema(self, schema: Any, param: str) -> None:
        num_branches = 0
        stack = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > self.max_depth:
                why = f"{param} nests deeper than {self.max_depth} levels, the most this server compiles"
                _refuse(why, "--max-schema-depth", param)
            if isinstance(node, dict):
                num_branches += sum(len(v) for k, v in node.items() if k in _BRANCHES and isinstance(v, list))
                stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
            if num_branches > self.max_choices:
                why = f"{param} has more than {self.max_choices} enum values and anyOf/oneOf branches, the most this "
                _refuse(why + "server compiles", "--max-grammar-choices", param)


def _refuse(why: str, flag: str, param: str) -> None:
    raise LimitExceeded(f"{why} ({flag}); send a smaller constraint", param, "grammar_too_large")

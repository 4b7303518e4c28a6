"""A constraint's llguidance grammar, built and tried before any request runs on it.

`grammar_text` writes the constraint as llguidance's grammar. A choice is one lexeme (`start: CHOICE`, `CHOICE:
"a" | "b" | ...`), matched by the lexer's automaton: as alternatives of the start rule, every choice was an Earley
item of the parser's row, and llguidance refuses rows of more than 2,000 items (`max_items_in_row`), so any list of
2,000 or more failed at the first token.

`new_matcher` compiles it and computes its first mask, then steps each of the first PROBE_TOKENS tokens it allows
and computes the mask after each, and walks PROBE_STEPS tokens down one path (forced tokens first): the grammars
llguidance cannot serve (a recursive `$ref` with no valid value, also behind a tool call's forced prefix, an anyOf
of thousands of objects, a Lark grammar of doubling rules) fail there, so they are refused before their request is
queued instead of failing the request at its first tokens (a failure further on is the client's 400 all the same,
kiln.server.answers). Errors say what failed in one short line:
llguidance's limits are built with `verbose_errors=False` (no parser state, no grammar text), and a panic inside
llguidance is answered with a fixed sentence, never its text.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from kiln.errors import RequestError

# JSON as models write it on one line ("a": 1, "b": [2, 3]); any whitespace lets a small model loop on blanks
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PROBE_TOKENS = 8
PROBE_STEPS = 64
MAX_REASON_CHARS = 160


class GrammarRefused(RequestError):
    """A constraint llguidance cannot compile or serve; the message is short and holds none of its text."""


def llguidance_module() -> Any:
    try:
        import llguidance
    except ImportError:
        raise RequestError("structured outputs need the llguidance package: pip install llguidance==1.9.0") from None
    return llguidance


def grammar_text(kind: str, spec: str, param: str) -> str:
    """llguidance's grammar for a constraint of `kind` (json, regex, choice, grammar) and text `spec`."""
    llguidance = llguidance_module()
    from llguidance.gbnf_to_lark import any_to_lark

    matcher = llguidance.LLMatcher
    try:
        if kind == "json":
            return matcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "regex":
            return matcher.grammar_from_regex(spec)
        if kind == "choice":
            return matcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in json.loads(spec))
            )
        return matcher.grammar_from_lark(any_to_lark(spec))
    except Exception as exc:  # a schema that is not JSON, a GBNF grammar that does not parse
        raise GrammarRefused(f"{param} cannot be used: {short_reason(exc)}", None, param) from None


def new_matcher(tokenizer: Any, grammar: str, param: str) -> Any:
    """The grammar's matcher at its start, its first masks computed; GrammarRefused when llguidance cannot
    compile it or fails on its first tokens."""
    llguidance = llguidance_module()
    limits = llguidance.LLParserLimits(verbose_errors=False)
    try:
        # NOTE: no separate validate_grammar call: it builds the whole lexer once more (0.4 s of 0.85 s for 100k
        # choices), and a matcher that cannot be built says why as well
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarRefused(f"{param} cannot be used: {_one_line([matcher.get_error()])}", None, param)
        _probe(matcher, param)
    except RequestError:
        raise
    except BaseException as exc:  # NOTE: a Rust panic is pyo3's PanicException, a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise GrammarRefused(f"{param} cannot be used: {short_reason(exc)}", None, param) from None
    return matcher


def _probe(matcher: Any, param: str) -> None:
    """Compute the first mask, then the mask after each of the first PROBE_TOKENS tokens it allows; then walk
    PROBE_STEPS tokens down one path (the forced tokens where there are, else the first allowed), where a forced
    prefix leads to a part that cannot be served (a tool whose parameters refer to themselves)."""
    mask = matcher.compute_bitmask()
    _check(matcher, param)
    for token in _first_allowed(mask, PROBE_TOKENS):
        step = matcher.deep_copy()
        step.consume_token(token)
        _check(step, param)
        step.compute_bitmask()
        _check(step, param)
    walk = matcher.deep_copy()
    num_steps = 0
    while num_steps < PROBE_STEPS and not walk.is_stopped():
        tokens = walk.compute_ff_tokens() or _first_allowed(walk.compute_bitmask(), 1)
        _check(walk, param)
        if not tokens:
            return
        walk.consume_tokens(tokens[: PROBE_STEPS - num_steps])
        _check(walk, param)
        num_steps += len(tokens)
    if not walk.is_stopped():
        walk.compute_bitmask()
        _check(walk, param)


def _first_allowed(mask: bytes, count: int) -> list[int]:
    """The first `count` token ids set in a mask (little-endian 32-bit words, bit t % 32 of word t // 32)."""
    words = torch.frombuffer(bytearray(mask), dtype=torch.int32)
    tokens: list[int] = []
    for w in words.nonzero().flatten().tolist():
        bits = int(words[w]) & 0xFFFFFFFF
        while bits and len(tokens) < count:
            low = bits & -bits
            tokens.append(w * 32 + low.bit_length() - 1)
            bits ^= low
        if len(tokens) >= count:
            break
    return tokens


def _check(matcher: Any, param: str) -> None:
    if matcher.is_error():
        raise GrammarRefused(
            f"{param} cannot be served: {_one_line([matcher.get_error()])} (a grammar this complex or without a valid "
            "output is refused; simplify it)",
            None,
            param,
        )


def short_reason(exc: BaseException) -> str:
    """One short line for a failure inside llguidance: its first line, or a fixed sentence for a panic."""
    if "panic" in type(exc).__name__.lower():
        return "the grammar compiler failed on it"
    return _one_line([str(exc)])


def _one_line(messages: list[str]) -> str:
    """The first non-empty message on one line, without llguidance's `<state>` markup, at most MAX_REASON_CHARS."""
    text = next((m for m in messages if m.strip()), "invalid")
    for markup in ("<state>", "<non-verbose", "<grammar>"):
        text = text.split(markup, 1)[0]
    line = " ".join(text.split()) or "invalid"
    if "panick" in line.lower():
        return "the grammar compiler failed on it"
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."

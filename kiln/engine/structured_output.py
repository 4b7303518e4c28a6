"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar.

`StructuredOutput` is the request's constraint (a value on SamplingParams). `Grammars` compiles it once per
constraint with llguidance (chosen over xgrammar: one 3 MB wheel with no dependencies, where xgrammar needs
triton and transformers at run time; its Earley parser over a token trie computes a mask in ~20 us on the default
model's 49k vocabulary) and hands each sequence its own `GrammarState`. Each step, a constrained row's logits
are masked to the tokens the grammar allows (`Grammars.bitmasks`, applied in kiln.engine.sampler); the sampled token
advances the state; once the grammar allows nothing more the sequence stops with `finish_reason: "stop"`.

A mask walks the token trie (~0.4 ms inside a length-bounded JSON string), so a row whose filters are only
temperature (or greedy) samples first without one and checks the token alone (`GrammarState.allows`, a walk over
its bytes); only a refused row computes its mask and samples again, masked (kiln.engine.step_sample), as llama.cpp
does. Greedy, this is the masked pick (the likeliest allowed token). Sampled, it is rejection sampling: the first
draw is kept with probability Z (the mass the grammar allows), else the second is drawn from the masked
distribution, so token t comes with probability p(t) + (1 - Z) p(t) / Z = p(t) / Z, the masked distribution
exactly. A row with top-k, top-p or min-p masks first (its filters must see the masked distribution).

llguidance is imported on the first constraint, so an engine runs without it (a machine without the package gets
a clear error for a constrained request, not an engine that fails to import).

Compiling can take long for a complex schema: the server compiles on its tokenizer thread before the request is
queued (an invalid schema, regex or grammar is a 400 then), and the engine thread finds it in the cache.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kiln.errors import RequestError

Kind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar")
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's json_object mode
CACHED_GRAMMARS = 256
# JSON as models write it on one line ("a": 1, "b": [2, 3]); any whitespace lets a small model loop on blanks
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `kind` json: `spec` a JSON schema (text); regex: a regular expression (Rust
    syntax, whole output); choice: a JSON list of strings, the output being one of them; grammar: a Lark or GBNF
    grammar. `param`: the request field it came from, which errors name."""

    kind: Kind
    spec: str
    param: str = field(default="structured_output", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(
                f"unknown structured output kind {self.kind!r}: expected one of {KINDS}", None, self.param
            )
        if not isinstance(self.spec, str):
            raise RequestError(f"{self.param} must be given as text, got {type(self.spec).__name__}", None, self.param)

    @classmethod
    def json(cls, schema: dict[str, Any] | str, param: str = "json") -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema), param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "choice") -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", None, param)
        return cls("choice", json.dumps(choices), param)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any, param: str, grammars: Grammars) -> None:
        self.matcher, self.param, self.grammars = matcher, param, grammars

    def advance(self, token: int) -> None:
        """Take the sampled `token`; RequestError when the grammar cannot (a token it did not allow was forced)."""
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise RequestError(f"the output left the grammar of {self.param}: {self.matcher.get_error()}", None)

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (the state unchanged): a walk over the token's bytes alone."""
        return self.matcher.validate_tokens([token]) == 1

    def drafts_within(self, drafts: list[int], keep_refused: bool) -> list[int]:
        """The longest prefix of `drafts` (speculative decoding's proposals for the next tokens) the grammar allows
        from here, the state unchanged; with `keep_refused`, the first token it refuses stays last (a sampled draft
        with its proposal distribution: the verification rejects it by the rule, which keeps the output's
        distribution exact; dropping it would not)."""
        n = self.matcher.validate_tokens(drafts)
        return drafts[: n + 1 if keep_refused and n < len(drafts) else n]

    @property
    def is_complete(self) -> bool:
        """The grammar allows nothing more: the sequence is done."""
        return bool(self.matcher.is_stopped())


class Grammars:
    """Compiled constraints of one engine (its tokenizer and vocabulary), cached by constraint; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """`tokenizer`: the engine's `tokenizers.Tokenizer`; `vocab_size`: the width of the logits."""
        self._hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._tokenizer: Any = None  # llguidance's view of the vocabulary, built on first use (~0.3 s)
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: Any = None  # llguidance's thread pool for masks of many sequences at once

    def compile(self, constraint: StructuredOutput) -> Any:
        """The grammar's matcher at its start (a template each sequence copies); RequestError naming the field when
        the schema, regex or grammar is invalid or unsupported."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
            tokenizer = self._llg_tokenizer()
        llguidance = _llguidance()
        grammar = _grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise RequestError(f"{constraint.param} cannot be used: {_first_line(messages)}", None, constraint.param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{constraint.param} cannot be used: {matcher.get_error()}", None, constraint.param)
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def start(self, constraint: StructuredOutput) -> GrammarState:
        """A new sequence's state in `constraint`'s grammar."""
        return GrammarState(self.compile(constraint).deep_copy(), constraint.param, self)

    def bitmasks(self, states: list[GrammarState], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The tokens each of `states` allows next, as rows of little-endian 32-bit words ([rows, ceil(vocab / 32)]
        int32), computed by llguidance's threads in parallel (the GIL released): a mask inside a JSON string takes
        ~0.4 ms, so one at a time they cost a 32-row step ~12 ms. With `drafts` (a list per state, speculative
        decoding's tokens to verify), state i has 1 + len(drafts[i]) rows in turn: its mask now, then after each
        of its drafts, the state itself unchanged; rows after a draft the grammar refuses (or after its end)
        allow every token (no verification reaches them)."""
        width = (self.vocab_size + 31) // 32
        if self._executor is None:
            self._executor = _llguidance().LLExecutor(max(1, torch.get_num_threads()))
        drafts = drafts or [[] for _ in states]
        starts = [0]
        for tokens in drafts:
            starts.append(starts[-1] + 1 + len(tokens))
        out = torch.full((starts[-1], width), -1, dtype=torch.int32)
        placed = list(zip(states, starts[:-1], drafts, strict=True))
        now = [(state.matcher, at) for state, at, tokens in placed if not tokens]
        ahead = [(state.matcher, at, tokens) for state, at, tokens in placed if tokens]
        if now:
            self._executor.unsafe_compute_mask_ptr(now, out.data_ptr(), width * 4, starts[-1])
        if ahead:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(ahead, out.data_ptr(), width * 4, starts[-1])
        return out

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            llguidance = _llguidance()
            eos = list(self.eos_token_ids)
            text = self._hf_tokenizer.to_str()
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise RequestError("structured outputs need the llguidance package: pip install llguidance==1.9.0") from None
    return llguidance


def _grammar_text(constraint: StructuredOutput) -> str:
    llguidance = _llguidance()
    from llguidance.gbnf_to_lark import any_to_lark

    spec = constraint.spec
    try:
        if constraint.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if constraint.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if constraint.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
            )
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
    except Exception as exc:  # a schema that is not JSON, a GBNF grammar that does not parse
        raise RequestError(
            f"{constraint.param} cannot be used: {_first_line([str(exc)])}", None, constraint.param
        ) from None


def _first_line(messages: list[str]) -> str:
    text = next((m for m in messages if m.strip()), "invalid")
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."

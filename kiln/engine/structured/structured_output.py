"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar.

`StructuredOutput` is the request's constraint (a value on SamplingParams, kiln.engine.structured.constraint).
`Grammars` compiles it once per
constraint with llguidance (chosen over xgrammar: one 3 MB wheel with no dependencies, where xgrammar needs
triton and transformers at run time; its Earley parser over a token trie computes a mask in ~20 us on the default
model's 49k vocabulary) and hands each sequence its own `GrammarState`. Each step, a constrained row's logits
are masked to the tokens the grammar allows (`Grammars.bitmasks`, applied in kiln.engine.sampling.sampler); the sampled
token advances the state; once the grammar allows nothing more the sequence stops with `finish_reason: "stop"`.

A mask walks the token trie (~0.4 ms inside a length-bounded JSON string), so a row whose filters are only
temperature (or greedy) samples first without one and checks the token alone (`GrammarState.allows`, a walk over
its bytes); only a refused row computes its mask and samples again, masked (kiln.engine.running.step_sample), as
llama.cpp does. Greedy, this is the masked pick (the likeliest allowed token). Sampled, it is rejection sampling: the
first draw is kept with probability Z (the mass the grammar allows), else the second is drawn from the masked
distribution, so token t comes with probability p(t) + (1 - Z) p(t) / Z = p(t) / Z, the masked distribution
exactly. A row with top-k, top-p or min-p masks first (its filters must see the masked distribution).

A reasoning model's output is held to its grammar only after its reasoning (vLLM's structured outputs with a
reasoning parser): with a `ReasoningGate` the state lets every token through while the reasoning is open, and the
grammar holds the output from the token after the reasoning's closing tag. An output that may open a reasoning (its
opening tag one token) may take that token first, else the grammar holds it from its first token.

llguidance is imported on the first constraint, so an engine runs without it (a machine without the package gets
a clear error for a constrained request, not an engine that fails to import).

Compiling can take long for a complex schema: the server compiles on its own bounded pool before the request is
queued (kiln.server.grammar_compiler: an invalid schema, regex or grammar, or one llguidance fails on at its first
tokens, is a 400 then), and the engine thread finds it in the cache (kiln.engine.structured.grammar_cache: bounded in
bytes, failures remembered by key). kiln.engine.structured.grammar_build writes and tries the grammars.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Literal

import torch

from kiln.engine.structured.constraint import StructuredOutput
from kiln.engine.structured.grammar_build import (
    MAX_REASON_CHARS,
    GrammarRefused,
    grammar_text,
    llguidance_module,
    new_matcher,
)
from kiln.engine.structured.grammar_cache import GRAMMAR_CACHE_BYTES, GrammarCache, estimated_bytes
from kiln.engine.structured.reasoning_gate import ReasoningGate
from kiln.errors import RequestError

logger = logging.getLogger("kiln")

Phase = Literal["open", "reasoning", "grammar"]  # may open a reasoning / reasons / held to the grammar


def _bit(i: int) -> int:
    """Bit `i` of a little-endian 32-bit mask word, as the signed int32 the mask holds."""
    return 1 << i if i < 31 else -(1 << 31)


class GrammarState:
    """One sequence's place in its grammar, and with a reasoning gate, whether its reasoning still runs."""

    def __init__(self, matcher: Any, param: str, grammars: Grammars, gate: ReasoningGate | None = None) -> None:
        self.matcher, self.param, self.grammars, self.gate = matcher, param, grammars, gate
        self.phase: Phase = "grammar"
        if gate is not None:
            self.phase = "reasoning" if gate.inside else "open" if gate.start is not None else "grammar"
        self._tail: list[int] = []  # the reasoning's last tokens, as many as its closing tag has

    @property
    def is_held(self) -> bool:
        """The grammar holds the next token (it may also open a reasoning in phase "open")."""
        return self.phase != "reasoning"

    def phase_after(self, tokens: list[int]) -> Phase:
        """The phase after `tokens` more (the state unchanged)."""
        phase, tail = self.phase, list(self._tail)
        for token in tokens:
            phase, tail = self._next(phase, tail, token)
        return phase

    def _next(self, phase: Phase, tail: list[int], token: int) -> tuple[Phase, list[int]]:
        assert self.gate is not None or phase == "grammar"
        if phase == "open":
            assert self.gate is not None
            return ("reasoning", []) if token == self.gate.start else ("grammar", [])
        if phase == "reasoning":
            assert self.gate is not None
            end = self.gate.end
            tail = [*tail, token][-len(end) :]
            return ("grammar", []) if tuple(tail) == end else ("reasoning", tail)
        return phase, tail

    def advance(self, token: int) -> None:
        """Take the sampled `token`; RequestError when the grammar cannot (a token it did not allow was forced)."""
        before = self.phase
        self.phase, self._tail = self._next(self.phase, self._tail, token)
        if before == "reasoning" or (before == "open" and self.phase == "reasoning"):
            return  # the reasoning's tokens, its opening and closing tags included, are free
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            why = " ".join(self.matcher.get_error().split("<", 1)[0].split())[:MAX_REASON_CHARS]
            raise RequestError(f"the output left the grammar of {self.param}: {why or 'refused'}", None, self.param)

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (the state unchanged): a walk over the token's bytes alone."""
        if self.phase == "reasoning" or (self.phase == "open" and self.gate and token == self.gate.start):
            return True
        return self.matcher.validate_tokens([token]) == 1

    def drafts_within(self, drafts: list[int], keep_refused: bool) -> list[int]:
        """The longest prefix of `drafts` (speculative decoding's proposals for the next tokens) the grammar allows
        from here, the state unchanged; with `keep_refused`, the first token it refuses stays last (a sampled draft
        with its proposal distribution: the verification rejects it by the rule, which keeps the output's
        distribution exact; dropping it would not)."""
        free = self._free_drafts(drafts)
        if free:  # drafts of a reasoning stop where it closes: the grammar's rows start after a verification
            return free
        n = self.matcher.validate_tokens(drafts)
        return drafts[: n + 1 if keep_refused and n < len(drafts) else n]

    def _free_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts a reasoning takes from here, up to the one that closes it (none: the grammar holds the first)."""
        phase, tail = self.phase, list(self._tail)
        for i, token in enumerate(drafts):
            was, (phase, tail) = phase, self._next(phase, tail, token)
            if was == "grammar" or (was == "open" and phase == "grammar"):
                return drafts[:i]  # the grammar holds this one
            if phase == "grammar":
                return drafts[: i + 1]  # it closes the reasoning
        return drafts

    @property
    def is_complete(self) -> bool:
        """The grammar allows nothing more: the sequence is done."""
        return self.is_held and bool(self.matcher.is_stopped())


class Grammars:
    """Compiled constraints of one engine (its tokenizer and vocabulary), cached by constraint within
    `cache_bytes` (kiln.engine.structured.grammar_cache); thread-safe."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], cache_bytes: int = GRAMMAR_CACHE_BYTES
    ) -> None:
        """`tokenizer`: the engine's `tokenizers.Tokenizer`; `vocab_size`: the width of the logits."""
        self._hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._tokenizer: Any = None  # llguidance's view of the vocabulary, built on first use (~0.3 s)
        self.cache = GrammarCache(cache_bytes)
        self._lock = threading.Lock()
        self._executor: Any = None  # llguidance's thread pool for masks of many sequences at once

    def compile(self, constraint: StructuredOutput) -> Any:
        """The grammar's matcher at its start (a template each sequence copies); GrammarRefused naming the field
        when the schema, regex or grammar is invalid, unsupported, or fails on its first tokens (then its key is
        remembered, and the same constraint is refused at once)."""
        key = constraint.key
        if (matcher := self.cache.get(key)) is not None:
            return matcher
        if (why := self.cache.failure(key)) is not None:
            raise GrammarRefused(why, None, constraint.param)
        with self._lock:
            tokenizer = self._llg_tokenizer()
        started = time.monotonic()
        try:
            grammar = grammar_text(constraint.kind, constraint.spec, constraint.param)
            num_bytes = estimated_bytes(grammar)
            if num_bytes > self.cache.max_bytes:
                raise GrammarRefused(
                    f"{constraint.param} compiles to a grammar of about {num_bytes >> 20} MiB, more than the grammar "
                    f"cache holds ({self.cache.max_bytes >> 20} MiB, --grammar-cache-mb); send a smaller one",
                    None,
                    constraint.param,
                )
            matcher = new_matcher(tokenizer, grammar, constraint.param)
        except GrammarRefused as exc:
            self.cache.fail(key, exc.args[0])
            logger.info("grammar %s (%s, %d bytes) refused: %s", key[:12], constraint.kind, len(constraint.spec), exc)
            raise
        self.cache.put(key, matcher, num_bytes)
        logger.info(
            "grammar %s (%s, %d bytes) compiled in %.2f s; cache %d grammars, ~%d MiB",
            key[:12],
            constraint.kind,
            len(constraint.spec),
            time.monotonic() - started,
            len(self.cache),
            self.cache.num_bytes >> 20,
        )
        return matcher

    def remember_failure(self, constraint: StructuredOutput, message: str) -> None:
        """Refuse `constraint` at once from now on with `message` (the server's compile deadline passed)."""
        self.cache.fail(constraint.key, message)

    def start(self, constraint: StructuredOutput) -> GrammarState:
        """A new sequence's state in `constraint`'s grammar."""
        matcher = self.compile(constraint).deep_copy()
        return GrammarState(matcher, constraint.param, self, constraint.after_reasoning)

    def bitmasks(self, states: list[GrammarState], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The tokens each of `states` allows next, as rows of little-endian 32-bit words ([rows, ceil(vocab / 32)]
        int32), computed by llguidance's threads in parallel (the GIL released): a mask inside a JSON string takes
        ~0.4 ms, so one at a time they cost a 32-row step ~12 ms. With `drafts` (a list per state, speculative
        decoding's tokens to verify), state i has 1 + len(drafts[i]) rows in turn: its mask now, then after each
        of its drafts, the state itself unchanged; rows after a draft the grammar refuses (or after its end)
        allow every token (no verification reaches them)."""
        width = (self.vocab_size + 31) // 32
        if self._executor is None:
            self._executor = llguidance_module().LLExecutor(max(1, torch.get_num_threads()))
        drafts = drafts or [[] for _ in states]
        starts = [0]
        for tokens in drafts:
            starts.append(starts[-1] + 1 + len(tokens))
        out = torch.full((starts[-1], width), -1, dtype=torch.int32)
        now: list[tuple[Any, int]] = []
        ahead: list[tuple[Any, int, list[int]]] = []
        opening: list[tuple[int, int]] = []  # (row, token): a reasoning's opening tag allowed beside the grammar
        for state, at, tokens in zip(states, starts[:-1], drafts, strict=True):
            if state.phase == "open":
                assert state.gate is not None and state.gate.start is not None
                opening.append((at, state.gate.start))
            if state.phase == "reasoning" or (state.phase == "open" and state.phase_after(tokens[:1]) == "reasoning"):
                # free rows, but the one after the drafts that close the reasoning: the grammar's first mask
                rows = [at + j for j in range(len(tokens) + 1) if state.phase_after(tokens[:j]) == "grammar"]
                now += [(state.matcher, row) for row in rows]
                if state.phase == "open":
                    now.append((state.matcher, at))
            elif tokens:
                ahead.append((state.matcher, at, tokens))
            else:
                now.append((state.matcher, at))
        if now:
            self._executor.unsafe_compute_mask_ptr(now, out.data_ptr(), width * 4, starts[-1])
        if ahead:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(ahead, out.data_ptr(), width * 4, starts[-1])
        for row, token in opening:
            out[row, token // 32] |= _bit(token % 32)
        return out

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = llg_tokenizer(self._hf_tokenizer.to_str(), self.vocab_size, self.eos_token_ids)
        return self._tokenizer


@functools.lru_cache(maxsize=4)
def llg_tokenizer(text: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's view of a vocabulary (`text`: the tokenizer's JSON), shared by the engines of one process that
    have the same vocabulary (it is immutable; ~0.3 s to build for the default model's)."""
    return llguidance_module().LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids))

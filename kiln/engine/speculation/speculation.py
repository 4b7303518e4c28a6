"""Speculative decoding's proposing side: which decoding sequences get draft tokens this step, and how many.

A proposer guesses the next tokens of a sequence; the scheduler gives each decoding sequence the guesses that fit
its budget, and the target model verifies them in the sequence's next step (kiln.engine.sampling.spec_verify), each
draft token one more decode row of that step. Greedy outputs are the same as without speculation, and sampled ones
follow the same distribution: speculation only changes how many tokens a step emits.

The n-gram proposer (prompt lookup, vLLM's `ngram`, llama.cpp's lookup decoding) finds the most recent earlier
occurrence of the sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its own prompt
and output and proposes the tokens that followed it. Its index of each n-gram's latest end is kept per request and
extended with each new token, so a step's lookup costs O(n), not a scan of the context.

Back-off: a verification that accepts none of its drafts makes the request wait 1, 2, 4, ... (at most
`MAX_BACKOFF`) decode steps before its next proposal; one that accepts any resets it. Where proposals never match
(free generation), the steps that verify in vain become rare.

Which proposals a step verifies is measured where it runs (`policy` "measured", the default): a verification's
draft rows cost little on a device where a step's cost is bound by reading the weights, and as much as as many
sequences where the products are compute-bound (a 2-core CPU at batch 8: five rows cost five times one). The
speculator keeps each decode-only step's seconds by its row count (`StepCosts`, timed by the engine); each draft
token is a candidate row worth its expected tokens (how often its request's verifications so far accepted the
drafts up to its position), and a step verifies the best candidates, as many as give it the most tokens per
second by the costs measured. Row counts not measured yet are tried one further each step, and every
`PROBE_EVERY`-th choice runs the other way, so both sides' costs stay current; while speculating keeps losing, the
probes that speculate come half as often each time (at most every `MAX_PROBE_EVERY`-th choice), so a costly draft
model's probes stay a small share of the steps. Policy "always" verifies every proposal (tests).

The draft method (kiln.engine.speculation.draft) proposes with a second, smaller model instead. Its proposals cost a
draft model round, so the choice is made first, over offers of `num_speculative_tokens` drafts each, and only the drafts
chosen are computed. A prefix of the candidate rows then costs the target's step at its row count plus the round it
needs (its sequences, as deep as its deepest draft), each measured where it runs (`Drafter.round_seconds`): a draft
as costly as the target itself is not worth its rounds, and the policy finds that out as it finds out the rows.

A structured output's drafts are cut at the first token its grammar refuses, and each verification row is masked
by the grammar as it stands after the drafts before it (kiln.engine.running.step_sample). A teacher-forced request (the
debugger's) does not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kiln.config import SpeculativeConfig
from kiln.engine.request import Request
from kiln.engine.speculation.ngram import NgramIndex

MAX_BACKOFF = 64  # most decode steps a request whose drafts keep failing waits between proposals
PROBE_EVERY = 16  # every this many step choices runs the other way, to keep both sides' costs measured
MAX_PROBE_EVERY = 256  # the longest the probes that speculate back off to while speculating does not pay
COST_EMA = 0.2  # weight of a new measurement in a row count's step seconds


@dataclass
class Proposals:
    """What the proposer hands the step before it is scheduled: plain draft tokens by request id (the scheduler
    shapes them into decode rows), and for a draft model's sampled drafts, the distribution each was drawn from
    (the verification's q, kiln.engine.sampling.spec_verify; absent: one-hot at each draft)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    probs: dict[str, list[torch.Tensor]] = field(default_factory=dict)


class Drafter(Protocol):
    def propose(self, wanted: list[tuple[Request, int]]) -> Proposals:
        """Up to `count` draft tokens for each (request, count), by request id (kiln.engine.speculation.draft)."""

    def round_seconds(self, sequences: int, depth: int) -> float | None:
        """What a round drafting `depth` tokens for each of `sequences` sequences costs (None: not measured yet)."""


@dataclass
class SpecState:
    """One request's proposer state: its n-gram index (none with a drafter), its back-off and how its drafts fared
    so far."""

    index: NgramIndex | None
    failures: int = 0  # verifications in a row that accepted no draft
    wait: int = 0  # decode steps left before the next proposal
    # per draft position j: how often its verifications accepted more than j drafts, averaged over those that
    # verified a draft at j (None: none yet); the expected tokens a draft at j brings
    held: list[float | None] = field(default_factory=list)


class StepCosts:
    """Seconds a decode-only step takes, by its rows (sequences plus draft tokens), as an exponential average."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + COST_EMA * (seconds - old)

    def best_prefix(self, rows: int, gains: list[float], extra: list[float | None] | None = None) -> int:
        """How many of the candidate rows `gains` (each its expected tokens, best first) give a step of `rows` decode
        rows the most tokens per second by the costs measured, `extra[i - 1]` seconds added to a prefix of i (a
        draft model's round). 0 while `rows` alone is not measured yet (the plain step is measured first); a prefix
        reaching a row count (or a round) not measured yet is taken as far as that (one further each step until the
        costs are known)."""
        if rows not in self.seconds:
            return 0
        tokens, best, best_rate = float(rows), 0, rows / self.seconds[rows]
        for i, gain in enumerate(gains, 1):
            tokens += gain
            seconds, more = self.seconds.get(rows + i), extra[i - 1] if extra is not None else 0.0
            if seconds is None or more is None:
                return i
            if tokens / (seconds + more) > best_rate:
                best, best_rate = i, tokens / (seconds + more)
        return best


@dataclass
class SpecStats:
    """Counted as vLLM's spec_decode metrics are: drafts (verifications), draft tokens, accepted draft tokens (and
    per position). Each verification also emits the target's own next token."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)  # verifications with a draft at each position

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step of a sequence (1 + accepted drafts); 0 before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_accepted_tokens + self.num_drafts,
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
        }


class Speculator:
    """Proposes draft tokens for decoding requests and learns from their verification."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: Drafter | None = None) -> None:
        """`drafter`: the draft method's model (kiln.engine.speculation.draft), built before the speculator; the
        n-gram method needs none."""
        if (config.method == "draft") != (drafter is not None):
            raise ValueError(
                f"speculative method {config.method!r} {'needs' if drafter is None else 'takes no'} drafter"
            )
        self.config = config
        self.drafter = drafter
        self.max_model_len = max_model_len
        k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_position=[0] * k, drafted_per_position=[0] * k)
        self.states: dict[str, SpecState] = {}
        self.costs = StepCosts()
        self.num_choices = 0
        self.probe_every, self.since_probe = PROBE_EVERY, 0

    def propose(self, decoding: list[Request]) -> Proposals:
        """The draft tokens each of a step's decoding requests verifies (by request id; absent: none), chosen by the
        policy over their offers (module docstring), before the step is scheduled. A teacher-forced request (the
        debugger's) verifies its next forced tokens, as many as fit, whatever the policy: every path of a debug run
        then steps alike."""
        forced = {r.request_id: self._forced_drafts(r) for r in decoding if r.forced_output is not None}
        chosen = self._chosen_drafts([r for r in decoding if r.forced_output is None])
        chosen.tokens |= {rid: drafts for rid, drafts in forced.items() if drafts}
        return chosen

    def _forced_drafts(self, req: Request) -> list[int]:
        at = len(req.output_token_ids)
        return list(req.forced_output[at : at + self._limit(req)]) if req.forced_output is not None else []

    def _chosen_drafts(self, decoding: list[Request]) -> Proposals:
        known: dict[str, list[int]] = {}  # n-gram drafts, known before the choice
        offers: list[tuple[Request, int]] = []
        for req in decoding:
            if self.drafter is not None:
                size = self.room(req)
            else:
                known[req.request_id] = self.ngram_drafts(req)
                size = len(known[req.request_id])
            if size:
                offers.append((req, size))
        if not offers:
            return Proposals()
        always = self.config.policy == "always"
        counts = {req.request_id: size for req, size in offers} if always else self._choose(offers, len(decoding))
        if self.drafter is not None:
            wanted = [(req, counts[req.request_id]) for req, _ in offers if req.request_id in counts]
            proposals = self.drafter.propose(wanted) if wanted else Proposals()
        else:
            proposals = Proposals({rid: known[rid][:count] for rid, count in counts.items()})
        proposals.tokens = self._within_grammars(proposals.tokens, {req.request_id: req for req, _ in offers})
        return proposals

    def _within_grammars(self, drafts: dict[str, list[int]], by_id: dict[str, Request]) -> dict[str, list[int]]:
        """`drafts` cut where a structured output's grammar refuses them (a draft model's sampled drafts keep the
        refused token: GrammarState.drafts_within)."""
        for rid, tokens in list(drafts.items()):
            req = by_id[rid]
            if req.grammar is not None and tokens:
                keep_refused = self.drafter is not None and not req.params.is_greedy
                drafts[rid] = req.grammar.drafts_within(tokens, keep_refused)
                if not drafts[rid]:
                    del drafts[rid]
        return drafts

    def _choose(self, offers: list[tuple[Request, int]], num_decoding: int) -> dict[str, int]:
        """How many of its offered drafts each request verifies, by the measured policy."""
        # each draft token is one more row, worth the chance that its request accepts it and every draft before it
        rows = []
        for req, size in offers:
            gain = 1.0
            for j, held in enumerate(self._held(req.request_id, size)):
                gain = min(gain, held)  # a later draft never counts for more than an earlier one
                rows.append((gain, j, req.request_id))
        rows.sort(key=lambda row: (-row[0], row[1]))
        taken = self.costs.best_prefix(num_decoding, [gain for gain, _, _ in rows], self._rounds(rows))
        self.num_choices += 1
        self.since_probe += 1
        if taken:  # speculating pays: the plain step is probed every PROBE_EVERY-th choice
            self.probe_every = PROBE_EVERY
        if self.since_probe >= self.probe_every:  # the other way, so that its cost is measured too
            if not taken:
                self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            self.since_probe = 0
            taken = 0 if taken else len(rows)
        counts: dict[str, int] = {}
        for _, _, rid in rows[:taken]:
            counts[rid] = counts.get(rid, 0) + 1
        return counts

    def _rounds(self, rows: list[tuple[float, int, str]]) -> list[float | None] | None:
        """With a draft model: the round each prefix of the candidate rows (gain, position, request) needs."""
        if self.drafter is None:
            return None
        seen: set[str] = set()
        depth, rounds = 0, []
        for _, j, rid in rows:
            seen.add(rid)
            depth = max(depth, j + 1)
            rounds.append(self.drafter.round_seconds(len(seen), depth))
        return rounds

    def _held(self, request_id: str, num_drafts: int) -> list[float]:
        """The chance that `request_id` accepts more than j drafts, for each position j < num_drafts: its own
        average, else every request's so far, else 1 (tried)."""
        s, own = self.stats, self.states[request_id].held
        prior = [a / d if d else 1.0 for a, d in zip(s.accepted_per_position, s.drafted_per_position, strict=True)]
        return [own[j] if j < len(own) and own[j] is not None else prior[j] for j in range(num_drafts)]

    def ngram_drafts(self, req: Request, budget: int | None = None) -> list[int]:
        """The n-gram draft tokens for `req`, decoding its next token this step, within `budget` more tokens (none:
        it decodes as usual); as many as `room` allows."""
        k = self.room(req, budget)
        index = self.states[req.request_id].index if k > 0 else None
        return index.propose(k) if index is not None else []

    def room(self, req: Request, budget: int | None = None) -> int:
        """How many drafts `req` may bring to this step: none while it backs off, nor for a teacher-forced request;
        never more than would run past max_tokens or max_model_len. Keeps its n-gram index up to date."""
        if req.forced_output is not None:
            return 0
        state = self.states.get(req.request_id)
        if state is None:
            n_min, n_max = self.config.prompt_lookup_min, self.config.prompt_lookup_max
            state = SpecState(NgramIndex(n_min, n_max) if self.config.method == "ngram" else None)
            self.states[req.request_id] = state
        if state.index is not None:
            seen, known = len(state.index.tokens), req.num_prompt_tokens
            state.index.extend(req.prompt_token_ids[seen:] + req.output_token_ids[max(0, seen - known) :])
        if state.wait:
            state.wait -= 1
            return 0
        return self._limit(req) if budget is None else max(0, min(budget, self._limit(req)))

    def _limit(self, req: Request) -> int:
        """The most drafts `req` may verify: k, none past its max_tokens or max_model_len (its own token follows)."""
        left = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, left))

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """`req`'s verification accepted `num_accepted` of its `num_drafts` draft tokens (a teacher-forced request's
        are not counted: it proposed nothing)."""
        if req.forced_output is not None:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        for i in range(num_drafts):
            s.drafted_per_position[i] += 1
        state = self.states.get(req.request_id)
        if state is None:
            return
        state.held += [None] * (num_drafts - len(state.held))
        for j in range(num_drafts):
            old, new = state.held[j], float(num_accepted > j)
            state.held[j] = new if old is None else old + COST_EMA * (new - old)
        state.failures = 0 if num_accepted else state.failures + 1
        state.wait = min(2 ** (state.failures - 1), MAX_BACKOFF) if state.failures else 0

    def forget(self, request_id: str) -> None:
        """The request finished: its index goes."""
        self.states.pop(request_id, None)

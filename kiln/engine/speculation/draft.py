"""The draft model of speculative decoding (`--speculative-method draft`): a second, smaller model with the target's
vocabulary, run by an engine of its own (kiln.engine.core.EngineCore: its executor, graph mode and KV cache), that
proposes the next tokens of the sequences the speculator chose (kiln.engine.speculation.speculation).

A proposal round gives each chosen sequence one greedy request of the draft engine: its prompt is the sequence's
tokens so far, its max_tokens the drafts wanted. The draft engine steps until they have all finished: the first step
prefills what its prefix cache does not hold (the blocks of the sequence's earlier rounds are cached, so only the
tail since its last full block is computed again), the others decode every sequence of the round together,
replaying the draft's full decode graphs. Nothing outlives a round but cached blocks, so rejected drafts need no
rollback here: the next round's prompt no longer matches the blocks that held them, which are keyed by their tokens.
A request's cache salt goes with it, so draft blocks are shared between requests exactly as the target's are.

A draft request samples as its sequence does (greedy, or its temperature, top-k, top-p and min-p, seeded from the
sequence's own generator so a seeded request repeats) and keeps the distribution each draft was drawn from; the
verification's rejection rule (kiln.engine.sampling.spec_verify) takes it as the proposal distribution q, so a sampled
sequence's output keeps exactly the target's distribution and accepts a draft with probability min(1, p/q): a
draft that is the target itself accepts every one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from kiln.config import EngineConfig, LoRAConfig, ModelConfig, SpeculativeConfig
from kiln.engine.request import Request, position_seed
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.speculation.speculation import COST_EMA, Proposals
from kiln.errors import ConfigError

DRAFT_SALT = 0x5EED_D4AF7  # the draft model's seeds differ from the target's at the same position

if TYPE_CHECKING:
    from kiln.engine.request import RequestOutput
    from kiln.model.loader import Checkpoint

logger = logging.getLogger("kiln")


class DraftEngine(Protocol):
    """What the draft model needs of its engine (a kiln.engine.core.EngineCore of its own)."""

    def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, keeps_probs: bool
    ) -> Request: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...

    @property
    def has_unfinished(self) -> bool: ...


def draft_engine_config(
    config: EngineConfig, target: ModelConfig, max_model_len: int, num_blocks: int, draft: Checkpoint
) -> EngineConfig:
    """The draft engine's settings: the target's (device, dtype, quantization, graph mode, scheduler) with the draft
    checkpoint, as many KV blocks as the target's pool (its tokens fit), prefix caching on (each round re-prompts
    the sequence), no recipe (it was checked against the target) and no speculation of its own. ConfigError when
    the draft's vocabulary differs from the target's or its context is shorter than the target's."""
    spec = config.speculative
    if draft.config.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model {spec.draft_model} has a vocabulary of {draft.config.vocab_size} tokens but the model "
            f"{config.model} has {target.vocab_size}: a draft model must share the model's tokenizer"
        )
    if draft.config.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"the draft model {spec.draft_model} holds {draft.config.max_position_embeddings} positions, fewer than "
            f"max_model_len {max_model_len}: lower --max-model-len or choose another draft"
        )
    cache = replace(config.cache, num_blocks=num_blocks, enable_prefix_caching=True)
    return replace(
        config,
        model=draft.path,
        recipe=None,
        max_model_len=max_model_len,
        cache=cache,
        speculative=SpeculativeConfig(),
        lora=LoRAConfig(),  # the draft proposes from its base model; the target verifies with each request's adapter
        must_act=frozenset(),  # derived: the options the user gave act on the target's engine
    )


class DraftModel:
    """Proposes draft tokens with the draft engine, one round per target step, batched across sequences."""

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.rounds = 0
        self.steps = 0  # draft engine steps, over every round
        self.seconds = 0.0  # spent in rounds
        self.token_seconds: dict[int, float] = {}  # a round's seconds per draft depth, by its sequences (averaged)

    def propose(self, wanted: list[tuple[Request, int]]) -> Proposals:
        """Up to `count` greedy draft tokens for each (request, count), by request id. A sequence whose draft request
        fails (the draft engine fails it alone, or its step raises) gets none, and the target decodes it as usual."""
        start, engine = time.perf_counter(), self.engine
        ids: dict[str, tuple[Request, Request]] = {}  # draft request id -> (target request, draft request)
        drafts = Proposals()
        try:
            for req, count in wanted:
                rid = f"{req.request_id}#{self.rounds}"
                tokens = req.prompt_token_ids + req.output_token_ids
                params = self.draft_params(req, count)
                ids[rid] = (req, engine.add_request(rid, tokens, params, keeps_probs=not params.is_greedy))
            while engine.has_unfinished:
                self.steps += 1
                for out in engine.step():
                    if out.finished and out.finish_reason == "length":
                        req, draft = ids[out.request_id]
                        drafts.tokens[req.request_id] = out.token_ids
                        if draft.keeps_probs:
                            drafts.probs[req.request_id] = draft.sampled_probs
        except Exception:  # the draft is an accelerator only: its failure costs the speedup, never a request
            logger.exception("draft model round failed: its sequences decode without drafts this step")
            for rid in ids:
                engine.abort(rid)
        self.rounds += 1
        seconds = time.perf_counter() - start
        self.seconds += seconds
        if wanted:
            n, per_depth = len(wanted), seconds / max(count for _, count in wanted)
            old = self.token_seconds.get(n)
            self.token_seconds[n] = per_depth if old is None else old + COST_EMA * (per_depth - old)
        return drafts

    def round_seconds(self, sequences: int, depth: int) -> float | None:
        """A round's cost, as measured here: `depth` times its seconds per draft token at `sequences` sequences."""
        per_depth = self.token_seconds.get(sequences)
        return None if per_depth is None else depth * per_depth

    @staticmethod
    def draft_params(req: Request, count: int) -> SamplingParams:
        """How `req`'s draft request samples its `count` tokens: as `req` does, without its penalties and bias (any
        proposal distribution keeps the output exact; the verification applies them to the target's)."""
        p = req.params
        # NOTE: by the target's seed and position, as the target's own draws (kiln.engine.request.position_seed)
        position = len(req.output_token_ids)
        seed = None if req.generator is None else position_seed(req.generator.initial_seed() ^ DRAFT_SALT, position)
        return SamplingParams(
            max_tokens=count,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=seed,
            ignore_eos=True,
            cache_salt=p.cache_salt,
        )

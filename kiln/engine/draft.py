"""The draft model of speculative decoding (`--speculative-method draft`): a second, smaller model with the target's
vocabulary, run by an engine of its own (kiln.engine.core.EngineCore: its executor, graph mode and KV cache), that
proposes the next tokens of the sequences the speculator chose (kiln.engine.speculation).

A proposal round gives each chosen sequence one greedy request of the draft engine: its prompt is the sequence's
tokens so far, its max_tokens the drafts wanted. The draft engine steps until they have all finished: the first step
prefills what its prefix cache does not hold (the blocks of the sequence's earlier rounds are cached, so only the
tail since its last full block is computed again), the others decode every sequence of the round together,
replaying the draft's full decode graphs. Nothing outlives a round but cached blocks, so rejected drafts need no
rollback here: the next round's prompt no longer matches the blocks that held them, which are keyed by their tokens.
A request's cache salt goes with it, so draft blocks are shared between requests exactly as the target's are.

Drafts are greedy, so the proposal distribution is one-hot at each draft and the verification's rejection rule
(kiln.engine.spec_verify) treats them as it treats n-gram drafts: a sampled request's output keeps exactly the
target's distribution (it accepts less often than it would with the draft's own sampled distribution).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from kiln.config import EngineConfig, SpeculativeConfig
from kiln.engine.request import Request
from kiln.engine.sampling_params import SamplingParams
from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.engine.core import EngineCore
    from kiln.model.loader import Checkpoint

logger = logging.getLogger("kiln")


def draft_engine_config(config: EngineConfig, target: EngineCore, draft: Checkpoint) -> EngineConfig:
    """The draft engine's settings: the target's (device, dtype, quantization, graph mode, scheduler) with the draft
    checkpoint, as many KV blocks as the target's pool (its tokens fit), prefix caching on (each round re-prompts
    the sequence), no recipe (it was checked against the target) and no speculation of its own. ConfigError when
    the draft's vocabulary differs from the target's or its context is shorter than the target's."""
    spec, target_config = config.speculative, target.model_config
    if draft.config.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"the draft model {spec.draft_model} has a vocabulary of {draft.config.vocab_size} tokens but the model "
            f"{config.model} has {target_config.vocab_size}: a draft model must share the model's tokenizer"
        )
    if draft.config.max_position_embeddings < target.max_model_len:
        raise ConfigError(
            f"the draft model {spec.draft_model} holds {draft.config.max_position_embeddings} positions, fewer than "
            f"max_model_len {target.max_model_len}: lower --max-model-len or choose another draft"
        )
    cache = replace(config.cache, num_blocks=target.pool.num_blocks, enable_prefix_caching=True)
    return replace(
        config,
        model=draft.path,
        recipe=None,
        max_model_len=target.max_model_len,
        cache=cache,
        speculative=SpeculativeConfig(),
    )


class DraftModel:
    """Proposes draft tokens with the draft engine, one round per target step, batched across sequences."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.rounds = 0
        self.steps = 0  # draft engine steps, over every round
        self.seconds = 0.0  # spent in rounds

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to `count` greedy draft tokens for each (request, count), by request id. A sequence whose draft request
        fails (the draft engine fails it alone, or its step raises) gets none, and the target decodes it as usual."""
        start, engine = time.perf_counter(), self.engine
        ids: dict[str, str] = {}  # draft request id -> target request id
        drafts: dict[str, list[int]] = {}
        try:
            for req, count in wanted:
                rid = f"{req.request_id}#{self.rounds}"
                params = SamplingParams(
                    max_tokens=count, temperature=0, ignore_eos=True, cache_salt=req.params.cache_salt
                )
                engine.add_request(rid, req.prompt_token_ids + req.output_token_ids, params)
                ids[rid] = req.request_id
            while engine.has_unfinished:
                self.steps += 1
                for out in engine.step():
                    if out.finished and out.finish_reason == "length":
                        drafts[ids[out.request_id]] = out.token_ids
        except Exception:  # the draft is an accelerator only: its failure costs the speedup, never a request
            logger.exception("draft model round failed: its sequences decode without drafts this step")
            for rid in ids:
                engine.abort(rid)
        self.rounds += 1
        self.seconds += time.perf_counter() - start
        return drafts

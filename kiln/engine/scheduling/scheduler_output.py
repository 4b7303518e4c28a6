"""What the scheduler hands the runner each step (`SchedulerOutput`): plain dataclasses, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # with draft tokens: the sequence's last token and its drafts, one decode row each
    spec_token_ids: list[int] = field(
        default_factory=list
    )  # draft tokens to verify (kiln.engine.speculation.speculation)

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every known token is computed, so a new token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + len(self.spec_token_ids)

    @property
    def num_rows(self) -> int:
        """Sequences of the step it counts as: one decode row per token when it verifies drafts."""
        return self.num_new_tokens if self.spec_token_ids else 1

    @property
    def is_chunk(self) -> bool:
        """A prefill chunk: more new tokens than the decode rows it counts as (a decode or a verification has one
        row per new token)."""
        return self.num_rows != self.num_new_tokens


@dataclass
class SchedulerOutput:
    """Decodes (one new token) first, then prefills, as the attention op expects."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # (source, copy) KV blocks to copy before the forward: a choice's own copy of its sibling's partial prompt block
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_rows(self) -> int:
        """Rows of a step of decodes (and verifications) alone; 0 when a prefill chunk is in it."""
        if any(s.is_chunk for s in self.scheduled):
            return 0
        return sum(s.num_rows for s in self.scheduled)

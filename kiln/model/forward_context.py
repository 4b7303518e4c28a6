"""Per-step state: the flattened batch (`ModelInputs`) and what the attention op reads (metadata, KV caches),
set by the runner around one forward.

The model's traced graph never sees these as inputs, so graph pieces stay independent of batch layout;
only the opaque attention op (which dynamo never traces into) looks them up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """Layout of one flattened batch. Sequences are ordered decodes first (one query token each), then prefills.

    Tokens past `num_actual_tokens` are padding (graph capture sizes): attention ignores them and
    never writes them to the KV cache.
    """

    num_actual_tokens: int
    num_decodes: int  # the first `num_decodes` sequences have exactly one query token
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64: flat KV slot of each new token
    query_start_loc: list[int]  # [num_seqs + 1] token offsets into the flattened batch
    seq_lens: list[int]  # [num_seqs] total tokens (context + new) of each sequence
    seq_lens_tensor: torch.Tensor  # [num_seqs] int64, same values
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, rows padded with 0
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @cached_property
    def decode_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat block ids [num_decodes * B], additive key mask [1, num_decodes, 1, B * block_size]) of the
        decode sequences, where B blocks cover the longest; built once per step and shared by every layer."""
        nd = self.num_decodes
        num_blocks = -(-max(self.seq_lens[:nd]) // self.block_size)
        table = self.block_tables[:nd, :num_blocks].reshape(-1)
        positions = torch.arange(num_blocks * self.block_size, device=self.seq_lens_tensor.device)
        hidden = positions >= self.seq_lens_tensor[:nd, None]
        mask = torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf"))
        return table, mask[None, :, None, :]


@dataclass
class ModelInputs:
    """One step's flattened batch, padded to the executor's size: what `Executor.forward` receives."""

    input_ids: torch.Tensor  # [padded_num_tokens]
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_indices: list[int]  # flattened index of the last token of each sequence that samples
    sample_request_ids: list[str]
    batch_size: int = 0  # sequences the step is shaped for: the real ones plus recipe padding (0: not shaped)
    # (input_ids, seq_lens, block_tables) of the real sequences, on the host: what a full decode graph uploads
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class DecodeInputs:
    """The layout of a decode-only step as a full decode graph reads it (kiln.model.graph_attention): views of
    the executor's persistent buffers, one row per token (padding rows included)."""

    seq_lens: torch.Tensor  # [num_tokens] int64: context + the new token; padding rows: 1
    block_table: torch.Tensor  # [num_tokens, num_blocks] int64; padding rows: the null block


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: [2, num_kv_heads, num_blocks + 1, block_size, head_dim]
    decode: DecodeInputs | None = None  # set while a full decode graph runs (or is traced): attention is traced


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("kiln.attention was called outside set_forward_context(): the runner sets it per step")
    return _current

"""Per-step state: the flattened batch (`ModelInputs`) and what the attention op reads (metadata, KV caches),
set by the runner around one forward.

The model's traced graph never sees these as inputs, so graph pieces stay independent of batch layout;
only the opaque attention op (which dynamo never traces into) looks them up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
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
    # a hybrid model's sliding layers keep their KV in blocks of their own (kiln.engine.scheduling.kv_window): their
    # slots and tables (None: every layer uses the ones above)
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    window: int = 0  # > 0: this is the view of the layers that slide with this window (`for_layer`)
    _views: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def for_layer(self, window: int) -> AttentionMetadata:
        """The metadata a layer with sliding window `window` reads (0: global attention, this one): its own slots and
        tables in a hybrid model, and a decode layout that masks (and skips) the keys behind the window. One view
        per window and step, shared by its layers."""
        if not window or self.window:
            return self
        if window not in self._views:
            own = self.window_block_tables is not None
            self._views[window] = replace(
                self,
                slot_mapping=self.window_slot_mapping if own else self.slot_mapping,
                block_tables=self.window_block_tables if own else self.block_tables,
                window_slot_mapping=None,
                window_block_tables=None,
                window=window,
                _views={},
            )
        return self._views[window]

    @cached_property
    def decode_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat block ids [num_decodes * B], additive key mask [1, num_decodes, 1, B * block_size]) of the
        decode sequences; built once per step and shared by every layer of this view. The B blocks run to the one
        holding the longest sequence's last key; under a window they start at the first block that some decode
        query still sees (blocks behind every query's window are neither gathered nor masked)."""
        nd, bs = self.num_decodes, self.block_size
        lens = self.seq_lens[:nd]
        first = min(max(0, n - self.window) // bs for n in lens) if self.window else 0
        num_blocks = -(-max(lens) // bs)
        table = self.block_tables[:nd, first:num_blocks].reshape(-1)
        positions = torch.arange(first * bs, num_blocks * bs, device=self.seq_lens_tensor.device)
        ends = self.seq_lens_tensor[:nd, None]
        hidden = positions >= ends
        if self.window:  # the query sits at seq_len - 1 and sees fewer than `window` keys back
            hidden |= positions < ends - self.window
        mask = torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf"))
        return table, mask[None, :, None, :]

    @cached_property
    def prefill_query_start(self) -> torch.Tensor:
        """[prompts + 1] int64: where each sequence after the decodes starts among the prompts' rows (the first at
        0), as a prefill kernel reads it; built once per step, shared by every layer of this view."""
        first = self.query_start_loc[self.num_decodes]
        return torch.tensor([s - first for s in self.query_start_loc[self.num_decodes :]], dtype=torch.long)


@dataclass
class ModelInputs:
    """One step's flattened batch, padded to the executor's size: what `Executor.forward` receives."""

    input_ids: torch.Tensor  # [padded_num_tokens]
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_indices: list[int]  # flattened index of the last token of each sequence that samples
    sample_request_ids: list[str]
    num_draft_tokens: int = 0  # draft tokens the step verifies (speculative decoding), each one decode row
    batch_size: int = 0  # sequences the step is shaped for: the real ones plus recipe padding (0: not shaped)
    # (input_ids, seq_lens, block_tables, a hybrid model's sliding layers' block tables or None) of the real
    # sequences, on the host: what a full decode graph uploads
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None


@dataclass
class DecodeInputs:
    """The layout of a decode-only step as a full decode graph reads it (kiln.model.graph_attention): views of
    the executor's persistent buffers, one row per token (padding rows included)."""

    seq_lens: torch.Tensor  # [num_tokens] int64: context + the new token; padding rows: 1
    block_table: torch.Tensor  # [num_tokens, num_blocks] int64; padding rows: the null block
    # a hybrid model's sliding layers' own table (kiln.engine.scheduling.kv_window), same width; None: they use
    # `block_table`
    window_table: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeKernel:
    """A decode-attention kernel in place of the torch form (kiln.kernels.attention makes them from the engine's
    plan): `run(q, kv_cache, block_table, seq_lens, window, softcap)`, called by keyword, with q
    [n, heads*head_dim], block_table [n, blocks], seq_lens [n] and the cache already holding the new K/V,
    -> [n, heads*head_dim]. The paged-attention op calls it at run time, a full decode graph while it is traced
    (where it must be one opaque op of the graph)."""

    name: str
    run: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class PrefillKernel:
    """A prefill-attention kernel in place of the grouped torch form (kiln.kernels.attention makes them from the
    engine's plan): `run(q, kv_cache, block_table, seq_lens, query_start, window, softcap)`, called by keyword, with
    q [tokens, heads*head_dim] the prompts' rows (sequence i's are [query_start[i], query_start[i + 1]), the last of
    its seq_lens[i] tokens), block_table [sequences, blocks] and the cache already holding the new K/V,
    -> [tokens, heads*head_dim]."""

    name: str
    run: Callable[..., torch.Tensor]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: [2, num_kv_heads, num_blocks + 1, block_size, head_dim]
    decode: DecodeInputs | None = None  # set while a full decode graph runs (or is traced): attention is traced
    decode_kernel: DecodeKernel | None = None  # decode attention's kernel, the engine's plan's; None: the torch form
    prefill_kernel: PrefillKernel | None = None  # prompts' attention kernel, the plan's; None: the grouped torch form


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """The step's context for the attention op, one at a time: entering another while one is active raises (a
    nested step would run attention over the wrong metadata); entering the active one again is a no-op."""
    global _current
    if _current is not None and _current is not ctx:
        raise RuntimeError("set_forward_context() while another step's forward context is active: steps do not nest")
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("kiln.attention was called outside set_forward_context(): the runner sets it per step")
    return _current

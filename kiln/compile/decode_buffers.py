"""Persistent inputs of the full decode graphs: input ids, sequence lengths and block-table rows of one step.

They live in one int64 device buffer sized for the largest capture size, laid out `[ids | seq_lens | table]` (then a
hybrid model's sliding layers' table of the same width, kiln.engine.scheduling.kv_window),
and are updated in place each step with one host->device copy from a staging buffer (pinned on CUDA; on CPU the
staging buffer is the buffer itself). A size's views of it never move, so a CUDA graph captured over them
replays on the next step's values. Positions and KV slots are not uploaded: the graph derives them from
`seq_lens` and the table (kiln.model.graph_attention).

The table width (blocks per sequence) is the step's on CPU, where the compiled graph takes it as a symbol. On
CUDA a graph is captured per width bucket (`widths`: powers of two up to `max_blocks`), so a step reads the
smallest captured table that holds its blocks, not one sized for `max_model_len`; rows are padded with the null
block.
"""

from __future__ import annotations

import torch

from kiln.model.forward_context import AttentionMetadata, DecodeInputs, ModelInputs
from kiln.platforms import platform_of


class DecodeBuffers:
    def __init__(self, max_tokens: int, max_blocks: int, nulls: tuple[int, int | None], device: torch.device) -> None:
        """`nulls`: the null blocks of the global layers' and (None: no table of their own) the sliding layers'
        caches (kiln.model.attention.cache_nulls)."""
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks  # the table width of a CUDA capture; on CPU the buffer grows past it
        self.null_block, self.window_null = nulls
        self.num_tables = 1 if self.window_null is None else 2
        self.device = device
        platform = platform_of(device)
        self.fixed_width = platform.records_graphs  # a recorded graph reads a table of the width it was captured at
        self.staged = platform.separate_memory
        self.widths = width_buckets(max_blocks)
        self.uploads = 0  # host->device copies made (one per step)
        self._allocate(max_blocks)

    def _allocate(self, width: int) -> None:
        numel = self.max_tokens * (2 + self.num_tables * width)
        # NOTE: a device with memory of its own gets a buffer there, filled from a pinned staging buffer
        self.staging = torch.zeros(numel, dtype=torch.long, pin_memory=self.staged)
        self.buffer = self.staging.to(self.device) if self.staged else self.staging
        self.capacity = width

    def views(self, size: int, width: int) -> tuple[torch.Tensor, DecodeInputs]:
        """The device views a graph of `size` tokens and `width` table columns reads: (input_ids, decode inputs)."""
        return self._views(self.buffer, size, width)

    def _views(self, buf: torch.Tensor, size: int, width: int) -> tuple[torch.Tensor, DecodeInputs]:
        m, cells = self.max_tokens, size * width
        table = buf[2 * m : 2 * m + cells].view(size, width)
        window = buf[2 * m + cells : 2 * m + 2 * cells].view(size, width) if self.num_tables == 2 else None
        return buf[:size], DecodeInputs(buf[m : m + size], table, window)

    def width_for(self, meta: AttentionMetadata) -> int:
        """Table columns this step's graph reads: the batch's own on CPU, the smallest captured width that holds
        them on CUDA."""
        width = meta.block_tables.shape[1]
        return next(w for w in self.widths if w >= width) if self.fixed_width else width

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether this step's block tables fit a captured table (always on CPU, where the buffer grows)."""
        return not self.fixed_width or meta.block_tables.shape[1] <= self.max_blocks

    def load(self, batch: ModelInputs, size: int) -> tuple[torch.Tensor, DecodeInputs, int]:
        """Write one decode-only step (padded to `size` tokens) into the buffer: (input_ids, decode inputs, width)
        views for the graph. Only the step's host-side tensors are read; one copy goes to the device."""
        meta = batch.metadata
        # NOTE: inputs built by hand (tests) may lack host copies: their device tensors stand in
        host_ids, host_lens, host_table, host_window = batch.host or (
            batch.input_ids,
            meta.seq_lens_tensor,
            meta.block_tables,
            meta.window_block_tables,
        )
        n, width = meta.num_actual_tokens, self.width_for(meta)
        if width > self.capacity:
            self._allocate(width)
        ids, decode = self._views(self.staging, size, width)
        ids[:n].copy_(host_ids[:n])
        ids[n:].zero_()
        decode.seq_lens[:n].copy_(host_lens)
        decode.seq_lens[n:].fill_(1)
        decode.block_table.fill_(self.null_block)
        decode.block_table[:n, : host_table.shape[1]].copy_(host_table)
        if decode.window_table is not None:
            decode.window_table.fill_(self.window_null)
            # NOTE: a runner built without the sliding layers' own pool gives them the global table (same caches)
            window = host_window if host_window is not None else host_table
            decode.window_table[:n, : window.shape[1]].copy_(window)
        if self.buffer is not self.staging:
            used = 2 * self.max_tokens + self.num_tables * size * width
            self.buffer[:used].copy_(self.staging[:used], non_blocking=True)
        self.uploads += 1
        ids, decode = self._views(self.buffer, size, width)
        return ids, decode, width


# NOTE: the narrowest captured table: below it, gathering a few null blocks costs less than another capture
MIN_WIDTH = 8


def width_buckets(max_blocks: int) -> list[int]:
    """Captured table widths: powers of two from MIN_WIDTH below `max_blocks`, then `max_blocks` itself."""
    widths = []
    width = MIN_WIDTH
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]

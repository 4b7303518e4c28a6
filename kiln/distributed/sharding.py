"""How one tensor-parallel rank's slice of a layer is chosen: heads, MLP columns, vocabulary rows.

Megatron's split, as vLLM does it: the fused qkv and gate_up projections are column-parallel (each rank holds
some output rows), o_proj and down_proj row-parallel (the matching input columns; the partial products are summed
by an all-reduce), the embedding and logits head vocab-parallel (contiguous vocabulary slices, padded to equal
size).

Attention heads go by KV head: a rank holds whole KV heads and the query heads that read them. When the KV heads
do not divide evenly, the first ranks take one more (SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1, with 6 and
3 query heads); when there are fewer KV heads than ranks, each KV head is replicated on `size / kv_heads` ranks,
which split its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError


@dataclass(frozen=True)
class HeadSpan:
    """A rank's heads: query heads [q_start, q_start + q_count), KV heads [kv_start, kv_start + kv_count)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among `size` tensor-parallel ranks (size 1: the whole model, nothing split)."""

    rank: int = 0
    size: int = 1

    @property
    def is_split(self) -> bool:
        return self.size > 1

    def span(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's equal share of `n` rows or columns of `what`."""
        if n % self.size:
            raise ConfigError(f"tensor parallel size {self.size} does not divide {what} ({n})")
        count = n // self.size
        return self.rank * count, count

    def vocab_span(self, vocab: int) -> tuple[int, int, int]:
        """(start, real rows, local rows): a contiguous vocabulary slice, every rank's padded to the same size."""
        local = -(-vocab // self.size)
        start = min(self.rank * local, vocab)
        return start, min(local, vocab - start), local

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadSpan:
        """This rank's query and KV heads (module docstring)."""
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            base, extra = divmod(num_kv_heads, self.size)
            kv_count = base + (self.rank < extra)
            kv_start = self.rank * base + min(self.rank, extra)
            return HeadSpan(kv_start * group, kv_count * group, kv_start, kv_count)
        if self.size % num_kv_heads or num_heads % self.size:
            raise ConfigError(
                f"tensor parallel size {self.size} with {num_kv_heads} KV heads and {num_heads} query heads: with "
                "fewer KV heads than ranks, the ranks must divide evenly over the KV heads and the query heads"
            )
        q_count = num_heads // self.size
        q_start = self.rank * q_count
        return HeadSpan(q_start, q_count, q_start // group, 1)


SINGLE = TensorParallel()


def even_stage_layers(num_layers: int, pipeline: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive layers split as evenly as can be, the first stages taking one more where it does not divide."""
    base, extra = divmod(num_layers, pipeline)
    bounds = [s * base + min(s, extra) for s in range(pipeline + 1)]
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(pipeline))


@dataclass(frozen=True)
class PipelineStage:
    """This process's pipeline stage: the decoder layers it runs, and the ranks it receives from and sends to
    (None: it is the first or the last stage)."""

    stage: int = 0
    num_stages: int = 1
    layers: tuple[int, ...] | None = None  # None: every layer
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def holds_layer(self, layer_idx: int) -> bool:
        return self.layers is None or layer_idx in self.layers


WHOLE = PipelineStage()

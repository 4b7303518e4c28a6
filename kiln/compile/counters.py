"""What the graph compiler did, as numbers tests can assert (after vLLM's `compilation_counter`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class CompileCounters:
    graphs_traced: int = 0  # dynamo traces of the forward (num_tokens symbolic): the split one, the decode one
    pieces_seen: int = 0  # pieces after the split (N+1 for N splitting ops)
    splitting_ops_seen: int = 0
    pieces_compiled: int = 0  # compiler runs for the dynamic shape (identical pieces compile once)
    cache_hits: int = 0  # compiled pieces loaded from the on-disk cache
    static_compiles: int = 0  # compiler runs for one static compile size (one per distinct piece and size)
    static_cache_hits: int = 0  # static compiles loaded from the on-disk cache
    cache_misses: int = 0  # dynamic compiles not in the cache
    cache_rejected: int = 0  # corrupt or stale entries detected and rebuilt
    pieces_captured: int = 0  # (piece, capture size) pairs captured
    replays: int = 0  # forwards through the pieces at a captured size
    full_graphs_captured: int = 0  # full decode graphs captured (CUDA: one per capture size)
    full_replays: int = 0  # decode-only forwards through the full decode graph
    full_fallbacks_mixed: int = 0  # steps the full decode graph could not take: a prefill in the batch
    full_fallbacks_size: int = 0  # ... more tokens than the largest capture size (or a table wider than captured)
    verify_steps: int = 0  # forwards verifying draft tokens (speculative decoding, kiln.engine.speculation.speculation)
    full_verify_replays: int = 0  # ... of them through the full decode graph (each draft token a decode row)
    piece_replays: int = 0  # piece executions through a capture
    dynamic_fallbacks: int = 0  # forwards through pieces not captured at their size (or not capturable)
    padding_tokens: int = 0  # tokens added to reach a capture size

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def expect(self, **expected: int) -> None:
        """Raise AssertionError naming every counter that differs from `expected`."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(expected) - names)
        if unknown:
            raise AssertionError(f"unknown counters {unknown}; known: {sorted(names)}")
        wrong = {k: (getattr(self, k), v) for k, v in expected.items() if getattr(self, k) != v}
        if wrong:
            detail = ", ".join(f"{k}={got} (expected {want})" for k, (got, want) in wrong.items())
            raise AssertionError(f"compile counters differ: {detail}")

"""Trace the model's forward once through dynamo with kiln's backend, `num_tokens` symbolic.

The backend only records the FX graph and the real values behind its placeholders; kiln then runs the
split graph itself, so no dynamo guard is evaluated per step and no batch size ever recompiles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule

from kiln.compile.diagnose import explain_trace_failure
from kiln.model.attention import cache_nulls, kv_cache_block_size
from kiln.model.forward_context import (
    AttentionMetadata,
    DecodeInputs,
    DecodeKernel,
    ForwardContext,
    set_forward_context,
)

logger = logging.getLogger("kiln")

INPUT_IDS, POSITIONS, NUM_TOKENS = "input_ids", "positions", "num_tokens"
# a full decode graph's per-step inputs besides input_ids (kiln.model.graph_attention)
SEQ_LENS, BLOCK_TABLE, NUM_BLOCKS = "seq_lens", "block_table", "num_blocks"
WINDOW_TABLE = "window_table"  # a hybrid model's sliding layers' own table (kiln.engine.scheduling.kv_window)


@dataclass
class TracedForward:
    gm: GraphModule
    # per placeholder: a per-step input (INPUT_IDS, POSITIONS, NUM_TOKENS; a decode graph's SEQ_LENS, BLOCK_TABLE,
    # NUM_BLOCKS), or None for a bound value (parameter, buffer, KV cache)
    slots: list[str | None]
    bound: list[Any]  # the value of each bound placeholder (None where slots[i] is set)
    trace_s: float

    def args_for(self, values: dict[str, Any]) -> list[Any]:
        """The placeholders' values for one step: `values` by slot, the bound ones as traced."""
        return [values[slot] if slot else value for slot, value in zip(self.slots, self.bound, strict=True)]


def padding_context(num_tokens: int, kv_caches: list[torch.Tensor], device: torch.device) -> ForwardContext:
    """A forward context in which every token is padding: attention returns zeros and never touches the cache."""
    empty = torch.zeros(0, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        num_actual_tokens=0,
        num_decodes=0,
        slot_mapping=empty,
        query_start_loc=[0],
        seq_lens=[],
        seq_lens_tensor=empty,
        block_tables=torch.zeros(0, 1, dtype=torch.long, device=device),
        block_size=kv_cache_block_size(kv_caches[0]) if kv_caches else 1,
    )
    return ForwardContext(meta, kv_caches)


def decode_sample(
    sample_size: int, nulls: tuple[int, int | None], device: torch.device, dynamic_tokens: bool = True
) -> DecodeInputs:
    """Decode inputs to trace with: padding rows on the null blocks (`cache_nulls`: a hybrid model's sliding layers
    get a table of their own), the table width symbolic and never equal to num_tokens (dynamo would give equal
    sizes one symbol; the two tables share theirs)."""
    seq_lens = torch.ones(sample_size, dtype=torch.long, device=device)
    tables = [
        torch.full((sample_size, sample_size + 1), null, dtype=torch.long, device=device)
        for null in nulls
        if null is not None
    ]
    for table in tables:
        if dynamic_tokens:
            torch._dynamo.mark_dynamic(table, 0)
        torch._dynamo.mark_dynamic(table, 1)
    if dynamic_tokens:
        torch._dynamo.mark_dynamic(seq_lens, 0)
    return DecodeInputs(seq_lens, *tables)


def trace_forward(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: nn.Module,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    sample_size: int = 8,
    decode: bool = False,
    static_size: int | None = None,
    decode_kernel: DecodeKernel | None = None,
) -> TracedForward:
    """Trace `forward(input_ids, positions)` (the model, or a wrapper of it) into one FX graph; with `decode`,
    a full decode graph whose attention is traced (kiln.model.graph_attention) over the decode inputs; with
    `static_size`, num_tokens is that constant (the table width stays symbolic); `decode_kernel` is the plan's
    decode attention (None: the torch form), traced into the graph.

    A graph break or an op dynamo cannot trace raises GraphTraceError naming the module path and the op.
    """
    recorded: dict[str, Any] = {}
    sample_size = static_size or sample_size

    def kiln_backend(gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        recorded["gm"] = gm
        recorded["inputs"] = list(example_inputs)
        return gm.forward

    # NOTE: dynamo caches compiled frames per code object; every engine traces the same forward code, so
    # drop earlier entries rather than pile up recompiles (kiln never runs dynamo's cached frames).
    torch._dynamo.reset()
    input_ids = torch.zeros(sample_size, dtype=torch.long, device=device)
    positions = torch.zeros(sample_size, dtype=torch.long, device=device)
    if static_size is None:
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
    compiled = torch.compile(forward, backend=kiln_backend, fullgraph=True)
    ctx = padding_context(sample_size, kv_caches, device)
    ctx.decode_kernel = decode_kernel
    if decode:
        nulls = cache_nulls(model.config, kv_caches)
        ctx.decode = decode_sample(sample_size, nulls, device, dynamic_tokens=static_size is None)
    start = time.perf_counter()
    failure: torch._dynamo.exc.TorchDynamoException | None = None
    with torch.inference_mode(), set_forward_context(ctx):
        try:
            compiled(input_ids, positions)
        except torch._dynamo.exc.TorchDynamoException as exc:
            failure = exc
    if failure is not None:  # explained outside the trace's context: the eager re-run sets its own

        def run_eager() -> None:
            with torch.inference_mode(), set_forward_context(ctx):
                forward(input_ids, positions)

        raise explain_trace_failure(failure, model, run_eager) from failure
    trace_s = time.perf_counter() - start
    gm, inputs = recorded["gm"], recorded["inputs"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = {id(input_ids): INPUT_IDS, id(positions): POSITIONS}
    if ctx.decode is not None:
        tensors.update({id(ctx.decode.seq_lens): SEQ_LENS, id(ctx.decode.block_table): BLOCK_TABLE})
        if ctx.decode.window_table is not None:
            tensors[id(ctx.decode.window_table)] = WINDOW_TABLE
    symbols = {}
    for node, value in zip(placeholders, inputs, strict=True):
        if tensors.get(id(value)) in (INPUT_IDS, BLOCK_TABLE, WINDOW_TABLE):
            dim = 0 if tensors[id(value)] == INPUT_IDS else 1
            symbols[str(node.meta["example_value"].shape[dim])] = NUM_TOKENS if dim == 0 else NUM_BLOCKS
    slots: list[str | None] = []
    bound: list[Any] = []
    for node, value in zip(placeholders, inputs, strict=True):
        example = node.meta.get("example_value")
        if id(value) in tensors:
            slots.append(tensors[id(value)])
            bound.append(None)
        elif isinstance(example, torch.SymInt):
            if str(example) not in symbols:
                raise RuntimeError(
                    f"traced forward has a symbolic input {node.name}={example} other than num_tokens "
                    f"({', '.join(symbols)}): kiln graph mode supports one dynamic dimension"
                )
            slots.append(symbols[str(example)])
            bound.append(None)
        elif isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            slots.append(None)
            bound.append(value)
        else:
            raise RuntimeError(f"traced forward input {node.name} is {type(value).__name__}, expected a real tensor")
    logger.info("Traced the forward with dynamo in %.2f s (%d nodes)", trace_s, len(gm.graph.nodes))
    return TracedForward(gm, slots, bound, trace_s)

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
from kiln.model.attention import kv_cache_block_size
from kiln.model.forward_context import AttentionMetadata, ForwardContext, set_forward_context

logger = logging.getLogger("kiln")

INPUT_IDS, POSITIONS, NUM_TOKENS = "input_ids", "positions", "num_tokens"


@dataclass
class TracedForward:
    gm: GraphModule
    # per placeholder: INPUT_IDS | POSITIONS | NUM_TOKENS, or None for a bound value (parameter, buffer)
    slots: list[str | None]
    bound: list[Any]  # the value of each bound placeholder (None where slots[i] is set)
    trace_s: float


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


def trace_forward(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: nn.Module,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    sample_size: int = 8,
) -> TracedForward:
    """Trace `forward(input_ids, positions)` (the model, or a wrapper of it) into one FX graph.

    A graph break or an op dynamo cannot trace raises GraphTraceError naming the module path and the op.
    """
    recorded: dict[str, Any] = {}

    def kiln_backend(gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        recorded["gm"] = gm
        recorded["inputs"] = list(example_inputs)
        return gm.forward

    # NOTE: dynamo caches compiled frames per code object; every engine traces the same forward code, so
    # drop earlier entries rather than pile up recompiles (kiln never runs dynamo's cached frames).
    torch._dynamo.reset()
    input_ids = torch.zeros(sample_size, dtype=torch.long, device=device)
    positions = torch.zeros(sample_size, dtype=torch.long, device=device)
    torch._dynamo.mark_dynamic(input_ids, 0)
    torch._dynamo.mark_dynamic(positions, 0)
    compiled = torch.compile(forward, backend=kiln_backend, fullgraph=True)
    ctx = padding_context(sample_size, kv_caches, device)
    start = time.perf_counter()
    with torch.inference_mode(), set_forward_context(ctx):
        try:
            compiled(input_ids, positions)
        except torch._dynamo.exc.TorchDynamoException as exc:

            def run_eager() -> None:
                with torch.inference_mode(), set_forward_context(ctx):
                    forward(input_ids, positions)

            raise explain_trace_failure(exc, model, run_eager) from exc
    trace_s = time.perf_counter() - start
    gm, inputs = recorded["gm"], recorded["inputs"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    size_symbol = placeholders[[x is input_ids for x in inputs].index(True)].meta["example_value"].shape[0]
    slots: list[str | None] = []
    bound: list[Any] = []
    for node, value in zip(placeholders, inputs, strict=True):
        example = node.meta.get("example_value")
        if value is input_ids or value is positions:
            slots.append(INPUT_IDS if value is input_ids else POSITIONS)
            bound.append(None)
        elif isinstance(example, torch.SymInt):
            if str(example) != str(size_symbol):
                raise RuntimeError(
                    f"traced forward has a symbolic input {node.name}={example} other than num_tokens "
                    f"({size_symbol}): kiln graph mode supports one dynamic dimension"
                )
            slots.append(NUM_TOKENS)
            bound.append(None)
        elif isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            slots.append(None)
            bound.append(value)
        else:
            raise RuntimeError(f"traced forward input {node.name} is {type(value).__name__}, expected a real tensor")
    logger.info("Traced the forward with dynamo in %.2f s (%d nodes)", trace_s, len(gm.graph.nodes))
    return TracedForward(gm, slots, bound, trace_s)

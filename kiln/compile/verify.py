"""Check a compiled piece against the traced graph it claims to implement, on synthetic inputs.

Used on every compile-cache hit: an artifact that loads but computes something else (stale kernels, a
mismatched graph) must be rebuilt, not trusted. Inputs are random with num_tokens = 3 (a static compile's
own size for those); integer inputs (token ids, positions) are zeros, a valid index into any table. A large
input (a whole model's KV cache, a weight) repeats one random run of RANDOM_RUN values: drawing every value took
seconds of each start for the full decode graph's probe, and the check needs varied values, not independent ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

PROBE_TOKENS = 3
RANDOM_RUN = 65521  # a prime: the repeats do not line up with a tensor's power-of-two rows


def probe_inputs(graph: GraphModule, device: torch.device, num_tokens: int = PROBE_TOKENS) -> list[Any]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    args: list[Any] = []
    for node in graph.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta["example_value"]
        if isinstance(value, torch.SymInt):
            args.append(num_tokens)
            continue
        shape = [num_tokens if isinstance(d, torch.SymInt) else int(d) for d in value.shape]
        if value.dtype.is_floating_point:
            arg = _uniform(shape, gen).to(device=device, dtype=value.dtype)
        else:
            arg = torch.zeros(shape, dtype=value.dtype, device=device)
        args.append(_with_traced_strides(arg, value))
    return args


def _uniform(shape: list[int], gen: torch.Generator) -> torch.Tensor:
    """Values in [-0.5, 0.5): drawn, or for more than RANDOM_RUN of them one drawn run repeated."""
    numel = 1
    for d in shape:
        numel *= d
    if numel <= RANDOM_RUN:
        return torch.rand(shape, generator=gen) - 0.5
    run = torch.rand(RANDOM_RUN, generator=gen) - 0.5
    out = torch.empty(numel)
    whole = numel // RANDOM_RUN * RANDOM_RUN
    out[:whole].view(-1, RANDOM_RUN).copy_(run)
    out[whole:] = run[: numel - whole]
    return out.view(shape)


def _with_traced_strides(arg: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`arg` laid out like the traced value (e.g. column-major weights): compiled code may assume its strides."""
    stride = value.stride()
    if any(isinstance(s, torch.SymInt) for s in stride) or tuple(stride) == arg.stride():
        return arg
    out = torch.empty_strided(arg.shape, tuple(int(s) for s in stride), dtype=arg.dtype, device=arg.device)
    return out.copy_(arg)


def check_against_graph(
    fn: Callable[..., Sequence[torch.Tensor]],
    graph: GraphModule,
    device: torch.device,
    num_tokens: int = PROBE_TOKENS,
    args: Sequence[Any] | None = None,
) -> None:
    """Raise ValueError when a compiled piece `fn`'s outputs differ from the graph's on a probe input
    (`num_tokens` rows: a piece compiled for a static size runs only at that size), or on `args` where given (a
    part of a larger graph, whose inputs only the whole graph's probe makes consistent)."""
    args = list(args) if args is not None else probe_inputs(graph, device, num_tokens)
    with torch.inference_mode():
        want = graph(*args)
        got = fn(*args)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    got = list(got)
    if len(got) != len(want):
        raise ValueError(f"compiled piece returns {len(got)} outputs, the graph {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not isinstance(w, torch.Tensor):  # a size a graph passes on (a layer unit's symbolic num_tokens)
            if g != w:
                raise ValueError(f"output {i}: compiled {g!r} vs graph {w!r}")
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ValueError(f"output {i}: compiled {g.dtype}{list(g.shape)} vs graph {w.dtype}{list(w.shape)}")
        if not torch.allclose(g.float(), w.float(), rtol=1e-3, atol=1e-3):
            diff = (g.float() - w.float()).abs().max().item()
            raise ValueError(f"output {i} differs from the traced graph by up to {diff:.3g}")

"""`kiln::moe`: the mixture-of-experts custom op, the `FusedMoE` layer around it, and its checkpoint names.

The op routes each token to its `top_k` experts (softmax over the router logits in fp32, top-k, optionally
renormalized to sum 1) and sums the experts' gated MLPs weighted by their routing weights. Its fake returns
`empty_like(hidden)`, so under dynamo it stays one node whose output shape depends only on the number of tokens:
no routing, however skewed, can cause a recompile.

Expert weights are stacked: `w13` [experts, 2 * intermediate, hidden] holds each expert's gate rows then its up
rows (one matmul for both, as the dense MLP's `gate_up_proj`), `w2` [experts, hidden, intermediate] its down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.model.causal_lm import WeightSlot
from kiln.model.layers import GLU_ACTIVATIONS, MLP
from kiln.platforms import platform_of

Activation = Callable[[torch.Tensor], torch.Tensor]
# the op's `activation` argument -> the function applied to the gate half (GLU: act(gate) * up)
ACTIVATIONS: dict[str, Activation] = GLU_ACTIVATIONS


def activation_fn(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise ConfigError(f"MoE activation {name!r}: kiln runs {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, experts] logits -> fp32 routing weights and expert ids, both [tokens, top_k]."""
    # NOTE: softmax in fp32 whatever the model dtype, as HF does: near-ties in bf16 would pick other experts.
    weights, ids = router_logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _glu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Activation) -> torch.Tensor:
    """One expert's (or, with a leading experts dim on the weights, every expert's) gated MLP on rows `x`."""
    gate, up = torch.matmul(x, w13.transpose(-1, -2)).chunk(2, dim=-1)
    return torch.matmul(act(gate) * up, w2.transpose(-1, -2))


def grouped_experts(
    hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Activation
) -> torch.Tensor:
    """Each expert's matmuls on its own tokens only: (token, expert) pairs sorted by expert, results scattered
    back weighted. Group sizes are read on the host, so this cannot be captured in a CUDA graph."""
    top_k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)  # pair p is token p // top_k, its (p % top_k)-th choice
    tokens = order // top_k
    counts = torch.bincount(ids.flatten(), minlength=w13.shape[0]).tolist()
    groups = hidden.index_select(0, tokens).split(counts)
    outs = [_glu(rows, w13[e], w2[e], act) for e, rows in enumerate(groups) if counts[e]]
    out = torch.cat(outs) if outs else hidden.new_empty(0, hidden.shape[1])
    pair_weights = weights.flatten().index_select(0, order).to(hidden.dtype)
    # NOTE: the top_k contributions sum in fp32 (as `dense_experts`' reduction does), then round once.
    total = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return total.index_add_(0, tokens, (out * pair_weights[:, None]).float()).to(hidden.dtype)


def dense_experts(
    hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Activation
) -> torch.Tensor:
    """Every expert on every token in one batched matmul, weighted by its routing weight (0 where not routed):
    static shapes and no host sync, so CUDA graphs can capture it."""
    # NOTE: num_experts / top_k times the routed FLOPs, and an [experts, tokens, hidden] intermediate. Captured
    # batches are decode batches: small and bound by reading the weights, which touches every expert anyway once
    # tokens * top_k reaches the number of experts.
    out = _glu(hidden, w13, w2, act)  # [E, T, H]
    dense = torch.zeros(ids.shape[0], w13.shape[0], dtype=torch.float32, device=hidden.device)
    dense.scatter_(1, ids, weights)  # [T, E]
    return (out * dense.t().to(hidden.dtype)[:, :, None]).sum(dim=0)


class MoeImpl(Protocol):
    """One way to run the experts, called by keyword (`grouped_experts`'s parameters)."""

    def __call__(
        self,
        hidden: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        act: Activation,
    ) -> torch.Tensor: ...


IMPLS: dict[str, MoeImpl] = {"grouped": grouped_experts, "dense": dense_experts}


def select_impl(device: torch.device) -> str:
    """`IMPLS` key the op runs on `device`: "dense" while a CUDA stream captures a graph, else "grouped"."""
    return "dense" if platform_of(device).is_capturing() else "grouped"


@torch.library.custom_op("kiln::moe", mutates_args=())
def moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    activation: str,
) -> torch.Tensor:
    """hidden [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in hidden's dtype."""
    weights, ids = route(router_logits, top_k, renormalize)
    impl = IMPLS[select_impl(hidden.device)]
    return impl(hidden=hidden, weights=weights, ids=ids, w13=w13, w2=w2, act=activation_fn(activation))


@moe.register_fake
def _(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    activation: str,
) -> torch.Tensor:
    return torch.empty_like(hidden)


@dataclass(frozen=True)
class CheckpointNames:
    """How a family names an MoE block's tensors in HF checkpoints (as `save_pretrained` writes them), each
    `{layer}.{block}.…`: the router `gate.weight`, expert j's `experts.{j}.{projection}.weight`, and the shared
    expert's `{shared_expert}.{gate,up,down}_proj.weight` and `{shared_expert}_gate.weight`."""

    block: str
    gate_proj: str
    up_proj: str
    down_proj: str
    shared_expert: str | None = None


# NOTE: transformers 5 keeps experts stacked in memory (`mlp.experts.gate_up_proj`), but its save_pretrained
# converts back to one tensor per expert and projection, the names hub checkpoints carry; these are those names.
CHECKPOINT_NAMES: dict[str, CheckpointNames] = {
    "mixtral": CheckpointNames("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": CheckpointNames("mlp", "gate_proj", "up_proj", "down_proj", shared_expert="shared_expert"),
    "qwen3_moe": CheckpointNames("mlp", "gate_proj", "up_proj", "down_proj"),
}


class FusedMoE(nn.Module):
    """A sparse MoE block: router `gate`, stacked experts `w13`/`w2` run by `kiln::moe`, and optionally a shared
    SwiGLU expert added to every token, scaled by sigmoid(`shared_expert_gate`) (Qwen2-MoE)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        activation: str = "silu",
        shared_expert_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"MoE top_k {top_k}: expected 1 to num_experts ({num_experts})")
        activation_fn(activation)
        self.top_k, self.renormalize, self.activation = top_k, renormalize, activation
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        # NOTE: the nn.Linear default init per expert, so an unloaded block computes finite values as MLP does.
        self.w13 = nn.Parameter(_linear_init(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(_linear_init(num_experts, hidden_size, intermediate_size))
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] -> [tokens, hidden]."""
        out = torch.ops.kiln.moe(x, self.gate(x), self.w13, self.w2, self.top_k, self.renormalize, self.activation)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def checkpoint_slots(self, layer_prefix: str, family: str) -> dict[str, WeightSlot]:
        """HF tensor name -> where it goes, for this block in decoder layer `layer_prefix` (`model.layers.3`) of a
        `family` checkpoint (a `CHECKPOINT_NAMES` key). Every parameter is covered exactly once, so a loader that
        fills every slot leaves no initial value behind."""
        if family not in CHECKPOINT_NAMES:
            raise ConfigError(f"MoE checkpoint family {family!r}: kiln reads {', '.join(CHECKPOINT_NAMES)}")
        names = CHECKPOINT_NAMES[family]
        block = f"{layer_prefix}.{names.block}"
        num_experts, hidden, inter = self.w2.shape
        slots = {f"{block}.gate.weight": WeightSlot("gate.weight", 0, tuple(self.gate.weight.shape), None)}
        for j in range(num_experts):
            expert = f"{block}.experts.{j}"
            slots[f"{expert}.{names.gate_proj}.weight"] = WeightSlot("w13", 0, (inter, hidden), j)
            slots[f"{expert}.{names.up_proj}.weight"] = WeightSlot("w13", inter, (inter, hidden), j)
            slots[f"{expert}.{names.down_proj}.weight"] = WeightSlot("w2", 0, (hidden, inter), j)
        if self.shared_expert is not None:
            if names.shared_expert is None:
                raise ConfigError(f"MoE checkpoint family {family!r} has no shared expert, but this block has one")
            slots.update(_shared_expert_slots(f"{block}.{names.shared_expert}", self.shared_expert))
        return slots


def _linear_init(num_experts: int, out_features: int, in_features: int) -> torch.Tensor:
    bound = in_features**-0.5
    return torch.empty(num_experts, out_features, in_features).uniform_(-bound, bound)


def _shared_expert_slots(prefix: str, mlp: MLP) -> dict[str, WeightSlot]:
    inter, hidden = mlp.intermediate_size, mlp.down_proj.out_features
    fused = "shared_expert.gate_up_proj.weight"
    return {
        f"{prefix}.gate_proj.weight": WeightSlot(fused, 0, (inter, hidden), None),
        f"{prefix}.up_proj.weight": WeightSlot(fused, inter, (inter, hidden), None),
        f"{prefix}.down_proj.weight": WeightSlot("shared_expert.down_proj.weight", 0, (hidden, inter), None),
        f"{prefix}_gate.weight": WeightSlot("shared_expert_gate.weight", 0, (1, hidden), None),
    }

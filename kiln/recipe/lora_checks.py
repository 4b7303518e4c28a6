"""The recipe's `lora` section against the rest: the checkpoint's layers (every target module one the model has),
the memory budget (the adapters' static buffers beside the weights and the KV cache) and, through the solver's
bounds, the batch (more slots than sequences a step can hold). Any placement takes adapters: they are split over
the devices as their base layers are (kiln.lora.targets)."""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.model.dtypes import parse_dtype
from kiln.recipe.analysis import Analysis
from kiln.recipe.capacity import bounded_by
from kiln.recipe.diagnostics import Diagnostic
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.source import SourceDoc

GB = 1e9


def has_lora(spec: RecipeSpec) -> bool:
    """Whether the recipe turns adapters on: it writes a `lora` section."""
    return "lora" in spec.model_fields_set


def check_lora_targets(doc: SourceDoc, spec: RecipeSpec, modules: set[str]) -> list[Diagnostic]:
    """Every lora.target_modules entry is a layer the checkpoint has (`modules`, kiln.recipe.checkpoint
    checkpoint_modules), written once: a target the model lacks would allow nothing."""
    out, seen = [], set()
    for i, name in enumerate(spec.lora.target_modules or []):
        path = ("lora", "target_modules", i)
        if name in seen:
            out.append(doc.diagnostic("error", f"lora.target_modules lists {name} twice", path))
        elif name not in modules:
            has = ", ".join(sorted(modules & set(LORA_DIMS)))
            message = f"lora.target_modules: {name} is not a layer of the checkpoint (it has {has}); remove it"
            out.append(doc.diagnostic("error", message, path))
        seen.add(name)
    return out


# HF module name -> (in_features, out_features) of a decoder layer's linear layer
LORA_DIMS = {
    "q_proj": lambda c: (c.hidden_size, c.q_size),
    "k_proj": lambda c: (c.hidden_size, c.kv_size),
    "v_proj": lambda c: (c.hidden_size, c.kv_size),
    "o_proj": lambda c: (c.q_size, c.hidden_size),
    "gate_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "up_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "down_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "qkv_proj": lambda c: (c.hidden_size, c.q_size + 2 * c.kv_size),
    "gate_up_proj": lambda c: (c.hidden_size, 2 * c.intermediate_size),
}


def lora_buffer_bytes(spec: RecipeSpec, config: ModelConfig, modules: set[str]) -> int:
    """Bytes of the adapters' static buffers: per adapted layer max_loras x max_rank x (inputs + outputs) in the
    section's dtype (kiln.lora.layer.LoRALinear's A and B; auto: bfloat16 over int8/int4 weights, else the weights'
    dtype, an upper bound for a checkpoint whose quantized layers kiln packs as they load)."""
    lora = spec.lora
    names = modules & set(lora.target_modules if lora.target_modules is not None else LORA_DIMS)
    widths = sum(sum(LORA_DIMS[name](config)) for name in names)
    auto = "bfloat16" if spec.quantization.weights != "none" else spec.weights.dtype
    itemsize = parse_dtype(auto if lora.dtype == "auto" else lora.dtype).itemsize
    return config.num_layers * lora.max_loras * lora.max_rank * widths * itemsize


def check_lora_rank(doc: SourceDoc, spec: RecipeSpec, config: ModelConfig) -> list[Diagnostic]:
    """A rank above the hidden size is no low-rank update: its buffers cost more than the layer they adapt."""
    if not has_lora(spec) or spec.lora.max_rank <= config.hidden_size:
        return []
    message = (
        f"lora.max_rank {spec.lora.max_rank} is above the model's hidden_size {config.hidden_size}: no adapter of "
        "this model needs it, and every slot's buffers are sized by it; lower it"
    )
    return [doc.diagnostic("warning", message, ("lora", "max_rank"))]


def check_lora_slots(doc: SourceDoc, spec: RecipeSpec, analysis: Analysis) -> list[Diagnostic]:
    """lora.max_loras against the most sequences the constraints allow in a step (the solver's batch_size bound):
    slots beyond it only keep adapters resident between steps."""
    batch = analysis.bounds.get("batch_size")
    if not has_lora(spec) or batch is None or spec.lora.max_loras <= batch:
        return []
    message = (
        f"lora.max_loras {spec.lora.max_loras} is more than a step can use: batch_size can reach {batch} "
        f"({bounded_by(analysis, 'batch_size')}), so at most {batch} adapters run in one step; the other slots only "
        "keep adapters loaded between steps"
    )
    written = ("lora", "max_loras") in doc.values
    return [doc.diagnostic("warning", message, ("lora", "max_loras") if written else ("lora",), key=not written)]

"""Whether a LoRA adapter fits a model and the engine's limits, checked before any buffer changes (a bad adapter
leaves the adapters already loaded untouched): every target a layer kiln adapts in this model, every shape the
base layer's, every rank within `max_rank`, every module among the allowed ones (a recipe's lora.target_modules).
Each failure is an AdapterError naming the file and the field."""

from __future__ import annotations

from kiln.errors import AdapterError
from kiln.lora.checkpoint import PEFT_PREFIX, LoRAAdapter
from kiln.lora.targets import TARGET_MODULES, LoRATarget


def check_adapter(
    adapter: LoRAAdapter,
    targets: dict[str, LoRATarget],
    max_rank: int,
    allowed: tuple[str, ...] | None = None,
) -> None:
    """AdapterError for the first thing in `adapter` that does not fit `targets` (kiln.lora.targets.lora_targets of
    the model), `max_rank` or `allowed` (the HF module names adapters may adapt; None: any in `targets`)."""
    if allowed is not None:
        check_allowed(adapter, allowed)
    known = sorted({name.rpartition(".")[2] for name in targets})
    if isinstance(adapter.target_modules, tuple):
        for name in adapter.target_modules:
            if name.rpartition(".")[2] not in known:
                raise AdapterError(adapter.config_file, "target_modules", _unknown(name, known))
    for module, layer in adapter.layers.items():
        a_name, b_name = (f"{PEFT_PREFIX}{module}.lora_{which}.weight" for which in "AB")
        target = targets.get(module)
        if target is None:
            short = module.rpartition(".")[2]
            if short in known:
                why = f"the base model has no layer {module} (a different base model?)"
            else:
                why = _unknown(short, known)
            raise AdapterError(adapter.weights_file, a_name, why)
        if layer.rank > max_rank:
            raise AdapterError(
                adapter.config_file,
                "r",
                f"rank {layer.rank} (layer {module}) is above the engine's limit, --max-lora-rank {max_rank}",
            )
        rows, columns = target.shape  # the whole base layer's, on any rank (kiln.lora.targets)
        if layer.a.shape[1] != columns:
            raise AdapterError(
                adapter.weights_file,
                a_name,
                f"shape {tuple(layer.a.shape)}: the base layer takes {columns} inputs, so expected "
                f"({layer.rank}, {columns}) (an adapter for a different base model?)",
            )
        if layer.b.shape[0] != rows:
            raise AdapterError(
                adapter.weights_file,
                b_name,
                f"shape {tuple(layer.b.shape)}: the base layer gives {rows} outputs, so expected "
                f"({rows}, {layer.rank}) (an adapter for a different base model?)",
            )
    if adapter.other_tensors:
        raise AdapterError(
            adapter.weights_file,
            adapter.other_tensors[0],
            "not a LoRA tensor (expected <module>.lora_A.weight or <module>.lora_B.weight)",
        )


def check_allowed(adapter: LoRAAdapter, allowed: tuple[str, ...]) -> None:
    """AdapterError naming the adapter's file and the first module it adapts outside `allowed`."""
    for module in adapter.layers:
        short = module.rpartition(".")[2]
        if short not in allowed:
            raise AdapterError(
                adapter.weights_file,
                f"{PEFT_PREFIX}{module}.lora_A.weight",
                f"the adapter adapts {short} ({module}), outside the engine's LoRA target modules "
                f"({', '.join(allowed)}: the recipe's lora.target_modules); adapt only those or widen the list",
            )


def _unknown(name: str, known: list[str]) -> str:
    where = "in this model" if name in TARGET_MODULES else "(not a decoder linear layer)"
    return f"unknown target module {name!r} {where}: kiln adapts {', '.join(known)}"

"""LoRA adapters (PEFT checkpoints) batched in one step, in eager and graph mode, without recompiling.

- config.py: `LoRALimits`, what the static buffers are sized for (max adapters, max rank, max step tokens) and their
  dtype (`--lora-dtype`).
- checkpoint.py: `read_adapter`, a PEFT directory (adapter_config.json + adapter_model.safetensors) -> `LoRAAdapter`.
- targets.py: `lora_targets`, each HF linear layer an adapter may target -> the part of kiln's (fused) module, and
  on several devices the part of each adapter a rank takes (tensor parallelism) or the stage that holds it.
- validate.py: `check_adapter`, an adapter against the model's targets and the limits (AdapterError otherwise).
- forms.py: `FORMS`, the ways the products run over the buffers: `stacked` (every slot, masked; many rows) and
  `gathered` (each token's own slot, Punica's bgmv; few rows). kiln's native kernel of the gathered arithmetic is a
  timed candidate for few rows (kiln.kernels.lora, chosen by the engine's kernel plan).
- layer.py: `LoRALinear` (base + batched per-slot products over static buffers, the form its rows take) and
  `TokenSlots` (slot per token).
- slots.py: `attach_lora(model, limits) -> LoRASlots`: load / clear adapters in slots, set the step's token slots.
- request.py: `LoRARequest(lora_name, lora_int_id, lora_path)`, vLLM's way of naming a request's adapter.
- manager.py: `LoRAManager`, adapters -> slots (LRU over max_loras) and host copies (LRU over max_cpu_loras); the
  slot loads rank 0 makes, which the other ranks of a multi-device engine repeat (`SlotLoad`, `follow`).
"""

from kiln.lora.checkpoint import LoRAAdapter, read_adapter
from kiln.lora.config import LoRALimits
from kiln.lora.layer import BASE_ONLY
from kiln.lora.manager import LoRACounters, LoRAManager
from kiln.lora.request import LoRARequest
from kiln.lora.slots import LoRASlots, attach_lora, token_slots

__all__ = [
    "BASE_ONLY",
    "LoRAAdapter",
    "LoRACounters",
    "LoRALimits",
    "LoRAManager",
    "LoRARequest",
    "LoRASlots",
    "attach_lora",
    "read_adapter",
    "token_slots",
]

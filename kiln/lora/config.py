"""`LoRALimits`: what the adapters' static buffers are sized for (kiln.lora.slots), fixed when an engine starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config import LORA_DTYPE_NAMES
from kiln.errors import ConfigError

# the dtype of each of LORA_DTYPE_NAMES; auto: the model's (float32 keeps HF + PEFT's numbers, bfloat16 halves what
# the products read, computed in float32 where the form allows: kiln.lora.forms), bfloat16 over a packed base
# (`buffer_dtype`)
LORA_DTYPES = dict(zip(LORA_DTYPE_NAMES, (None, torch.float32, torch.bfloat16), strict=True))


@dataclass(frozen=True)
class LoRALimits:
    """`max_loras` adapters held at once (slots 0 .. max_loras - 1, vLLM's `--max-loras`), each of rank at most
    `max_rank` (`--max-lora-rank`), in steps of at most `max_num_tokens` tokens (the step's token budget, padding to
    a capture size included). The buffers never grow: a step or an adapter past a limit is refused. `target_modules`:
    the only HF module names (q_proj, ...) an adapter may adapt (a recipe's lora.target_modules); None: any kiln
    adapts. `dtype`: the buffers' dtype, one of LORA_DTYPES (auto: the model's floats')."""

    max_loras: int = 1
    max_rank: int = 16
    max_num_tokens: int = 2048
    target_modules: tuple[str, ...] | None = None
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in LORA_DTYPES:
            raise ConfigError(f"LoRA dtype {self.dtype!r}: expected one of {', '.join(LORA_DTYPES)}")
        for name in ("max_loras", "max_rank", "max_num_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"LoRA {name} = {value!r}: expected a positive whole number")

    def buffer_dtype(self, model_dtype: torch.dtype, packed: bool = False) -> torch.dtype:
        """The dtype of the adapters' buffers in a model of `model_dtype` floats; `packed`: the adapted layers' weights
        are packed codes (int8 or int4, kiln.quant), where auto is bfloat16: the base's product already rounds its
        weights to 4 or 8 bits and its activations to int8, far coarser than bfloat16's 8 bits of an adapter's much
        smaller product, and a decode token reads half the bytes of adapter (kiln.kernels.lora)."""
        chosen = LORA_DTYPES[self.dtype]
        if chosen is not None:
            return chosen
        return torch.bfloat16 if packed else model_dtype

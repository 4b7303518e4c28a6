"""`LoRARequest`: which adapter a request runs with, as vLLM spells it (`LoRARequest(name, id, path)`)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` (what a server request names in `model`), `lora_int_id` (>= 1, unique per adapter: the key of
    its slot, its host copy and its prefix-cache blocks), `lora_path` (a PEFT adapter directory)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ConfigError("LoRARequest: lora_name is empty")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ConfigError(f"LoRARequest {self.lora_name}: lora_int_id {self.lora_int_id!r}, expected 1 or more")

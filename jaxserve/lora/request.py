"""`LoRARequest`: which adapter a request runs under (vLLM's fields and meaning)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

    lora_int_id: a positive id, unique per adapter (vLLM's; 0 would mean the base model).
    Two requests name the same adapter when name, id and path are all equal: that triple
    is the key of its device slot and of its prefix-cache entries.
    """
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.lora_name, self.lora_int_id, self.lora_path)

"""Multi-LoRA serving: PEFT adapters loaded at runtime and batched in one compiled step.

  request.py      LoRARequest (vLLM's fields)
  peft_loader.py  a PEFT directory -> per-target A/B stacks, validated against the base model
  registry.py     named adapters and the host-memory LRU of loaded ones (max_cpu_loras)
  slots.py        which adapter holds which device slot (scheduler side, pure Python)
  stacks.py       the device-resident slot arrays and their donated in-place update
  layers.py       the batched LoRA delta inside the step
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]

"""Random PEFT LoRA adapters for tests and benchmarks, built on the fly with peft on torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_peft_adapter(base: Any, directory: Path, *, rank: int, alpha: float,
                      targets: Sequence[str] = ALL_TARGETS, seed: int = 0,
                      use_rslora: bool = False, std: float = 0.05) -> Any:
    """Wrap ``base`` (an HF model, or its directory) in a LoRA adapter whose A and B are both
    random (PEFT initialises B to zero, which would make any parity test vacuous), save it
    under ``directory`` and return the PEFT model (its forward is the unmerged reference)."""
    import peft
    import torch
    import transformers

    if not isinstance(base, torch.nn.Module):
        base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                             lora_dropout=0.0, use_rslora=use_rslora, bias="none")
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(std * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return model.eval()

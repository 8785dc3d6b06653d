"""Read a PEFT LoRA adapter directory into per-target A/B stacks for one base model.

PEFT stores, per adapted linear layer ``W [out, in]`` (torch orientation),
``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]``, and its forward adds
``scaling * B(A(x))`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``). Here every tensor is turned to our ``x @ kernel`` orientation, zero-padded
to ``max_lora_rank`` and stacked over layers, with the scaling folded into B:

    a[target]: [L, in, max_rank]     b[target]: [L, max_rank, out] * scaling

so a slot holds any rank <= max_lora_rank and the step needs no per-adapter constant.
Layers an adapter does not touch (``layers_to_transform``) stay zero. Which targets an
adapter has is read from its tensors (``target_modules`` may be a regex, or name modules
that matched nothing).

Everything that would make the adapter compute something else than PEFT's forward is a
ValueError naming the field: unknown or unsupported target modules, rank above the
maximum, shapes that do not match the base model, DoRA, trained biases, per-module rank or
alpha patterns, modules_to_save.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.models.arch import ModelArch
from jaxserve.models.family import ModelFamily

# The projections LoRA may target, in our (and HF's) module names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_TENSOR = re.compile(r"\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class TargetShape:
    hf_module: str          # the module path under model.layers.N ("self_attn.q_proj")
    in_features: int
    out_features: int


def supported_targets(family: ModelFamily, arch: ModelArch) -> dict[str, TargetShape]:
    """The targets a family can adapt (those with a plain per-layer kernel; a mixture of
    experts' MLP is not one) with their base shapes (the checkpoint's, before any sharding)."""
    shapes = family.weight_shapes(arch)
    targets = {}
    for target in LORA_TARGETS:
        names = family.layer_tensors.get(f"{target}.kernel")
        shape = shapes.get(f"layers.{target}.kernel")
        if names is None or shape is None:
            continue
        targets[target] = TargetShape(names[0].removesuffix(".weight"), shape[1], shape[2])
    return targets


@dataclass
class LoRAWeights:
    """One adapter, ready for a device slot: scaled, padded, stacked over layers (float32)."""
    rank: int
    scaling: float
    a: dict[str, np.ndarray]     # target -> [L, in, max_rank]
    b: dict[str, np.ndarray]     # target -> [L, max_rank, out], scaling folded in

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def load_peft_adapter(path: str, family: ModelFamily, arch: ModelArch,
                      max_lora_rank: int, hub: Any = None) -> LoRAWeights:
    """Read and check the adapter at ``path`` (a PEFT directory, or a Hub repo id: fetched
    with `hub`, a HubOptions) against the base model (its checkpoint arch)."""
    path = adapter_directory(path, hub)
    config = _read_config(path)
    rank = int(config.get("r", 0))
    if not 1 <= rank <= max_lora_rank:
        raise ValueError(f"LoRA adapter {path}: rank r={rank} is outside [1, max_lora_rank="
                         f"{max_lora_rank}]; raise --max-lora-rank to serve it")
    targets = supported_targets(family, arch)
    by_module = {t.hf_module: name for name, t in targets.items()}
    supported = ", ".join(targets)
    if config.get("target_parameters"):   # PEFT's LoRA on raw parameters: fused experts
        raise ValueError(f"LoRA adapter {path}: target_parameters "
                         f"{config['target_parameters']} (expert MLP adapters) are not "
                         f"supported; supported targets: {supported}")
    parsed = []
    for name, value in _read_tensors(path).items():   # which modules, before anything else
        match = _TENSOR.search(name)
        if match is None:
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} is not a LoRA A/B weight of "
                             f"a decoder layer (embedding and lm_head adapters are not supported)")
        layer, module, which = int(match[1]), match[2], match[3]
        target = by_module.get(module)
        if target is None:
            short = module.rsplit(".", 1)[-1]
            hint = " (expert MLP adapters are not supported)" if "expert" in module else ""
            raise ValueError(f"LoRA adapter {path}: target module {short!r} ({module}) is not "
                             f"supported for {arch.architecture}{hint}; supported targets: "
                             f"{supported}")
        parsed.append((name, layer, target, which, value))
    for field, ok in (("use_dora", not config.get("use_dora")),
                      ("bias", config.get("bias", "none") == "none"),
                      ("modules_to_save", not config.get("modules_to_save")),
                      ("rank_pattern", not config.get("rank_pattern")),
                      ("alpha_pattern", not config.get("alpha_pattern")),
                      ("fan_in_fan_out", not config.get("fan_in_fan_out"))):
        if not ok:
            raise ValueError(f"LoRA adapter {path}: adapter_config.json field {field}="
                             f"{config.get(field)!r} is not supported")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    L = arch.num_layers
    a = {}
    b = {}
    for name, layer, target, which, value in parsed:
        if layer >= L:
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} is for layer {layer}, but "
                             f"the base model has {L} layers")
        shape = targets[target]
        expected = (rank, shape.in_features) if which == "A" else (shape.out_features, rank)
        if tuple(value.shape) != expected:
            raise ValueError(f"LoRA adapter {path}: {name} has shape {tuple(value.shape)}, "
                             f"expected {expected} for the base model's {target} "
                             f"({shape.in_features} -> {shape.out_features}, r={rank}); was it "
                             f"trained on another model?")
        value = value.astype(np.float32)
        if which == "A":
            stack = a.setdefault(target, np.zeros((L, shape.in_features, max_lora_rank),
                                                  np.float32))
            stack[layer, :, :rank] = value.T
        else:
            stack = b.setdefault(target, np.zeros((L, max_lora_rank, shape.out_features),
                                                  np.float32))
            stack[layer, :rank, :] = value.T * scaling
    if set(a) != set(b):
        raise ValueError(f"LoRA adapter {path}: targets {sorted(set(a) ^ set(b))} have only "
                         f"one of lora_A / lora_B")
    if not a:
        raise ValueError(f"LoRA adapter {path}: adapter_model.safetensors holds no LoRA weights")
    return LoRAWeights(rank, scaling, a, b)


def adapter_directory(path: str, hub: Any = None) -> str:
    """`path` if it is a directory; a Hub repo id's adapter files, from the cache or
    downloaded (adapter_config.json + adapter_model.safetensors only)."""
    from jaxserve.loader.resolve import is_repo_id

    if os.path.isdir(path) or not is_repo_id(path):
        return path
    from jaxserve.loader.hub_download import fetch_from_hub

    return str(fetch_from_hub(path, "adapter", hub))


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path}: adapter_config.json is missing")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path}: cannot read adapter_config.json: {e}") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {peft_type!r} is not LORA")
    return config


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the adapter (the loader's reader: bfloat16 adapters too)."""
    from jaxserve.loader.safetensors_loader import SafetensorsFile

    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        extra = " (adapter_model.bin is not read: save with safe_serialization)" if \
            os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {path}: adapter_model.safetensors is missing{extra}")
    try:
        file = SafetensorsFile(weights_path)
        return {name: file.get(name) for name in file.names()}
    except ValueError as e:   # a truncated or foreign file: say which
        raise ValueError(f"LoRA adapter {path}: cannot read adapter_model.safetensors: "
                         f"{e}") from None

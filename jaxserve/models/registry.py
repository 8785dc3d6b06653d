"""The model registry: Hugging Face `architectures[0]` → the model module that serves it.

Adding an architecture is one module (a `ModelFamily`, see models/family.py), one line
in `_FAMILIES`, and its parity test. Everything else (runner, loaders, dummy weights,
memory plan, parallel/) asks this registry and the family it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxserve.models import gemma, llama, mixtral, qwen3_moe
from jaxserve.models.arch import ModelArch
from jaxserve.models.family import ArchitectureInfo, ModelFamily

_FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, gemma.FAMILY, mixtral.FAMILY,
                                      qwen3_moe.FAMILY)

REGISTRY: dict[str, ModelFamily] = {
    architecture: family for family in _FAMILIES for architecture in family.architectures}
_BY_MODEL_TYPE = {t: a for family in _FAMILIES for t, a in family.model_types.items()}
# GGUF architecture -> the families that write files under it (llama.cpp names Mixtral
# "llama" too; each family's `reads_gguf` tells its files apart by their metadata)
_BY_GGUF: dict[str, list[ModelFamily]] = {}
for _family in _FAMILIES:
    for _g in _family.gguf_architectures:
        _BY_GGUF.setdefault(_g, []).append(_family)


def supported_architectures() -> tuple[str, ...]:
    return tuple(REGISTRY)


def architecture_table() -> dict[str, ArchitectureInfo]:
    """Every supported architecture with its README row, in registry order."""
    return {a: family.architectures[a] for a, family in REGISTRY.items()}


def architecture_table_markdown() -> str:
    """The README's supported-architecture table (tests/test_registry.py keeps them equal)."""
    rows = ["| architecture | example models | sliding window | soft-cap | MoE | EP |",
            "|---|---|---|---|---|---|"]
    for architecture, info in architecture_table().items():
        rows.append(f"| `{architecture}` | {info.examples} | {info.sliding_window} | "
                    f"{info.soft_cap} | {info.moe} | {info.expert_parallel} |")
    return "\n".join(rows)


def resolve_architecture(architectures: list[str] | None, model_type: str | None,
                         source: str) -> str:
    """The one supported architecture a config names; ValueError listing the supported ones."""
    names = list(architectures or [])
    if not names and model_type in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[model_type]]
    for name in names:
        if name in REGISTRY:
            return name
    found = names or f"model_type {model_type!r}"
    raise ValueError(f"{source}: unsupported architecture {found}; supported architectures: "
                     f"{', '.join(REGISTRY)}")


def family_for(architecture: str) -> ModelFamily:
    try:
        return REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported architectures: "
                         f"{', '.join(REGISTRY)}") from None


def read_arch(hf_config: Any) -> ModelArch:
    """The ModelArch of an HF config, read by the family that owns its architecture."""
    architecture = resolve_architecture(getattr(hf_config, "architectures", None),
                                        getattr(hf_config, "model_type", None), "model config")
    return family_for(architecture).read_config(hf_config, architecture)


def gguf_family(gguf_arch: str | None, source: str,
                value: Callable[..., Any] | None = None) -> ModelFamily:
    """The family that reads a GGUF file of `general.architecture` gguf_arch.

    value(key, default): the file's metadata value ``{gguf_arch}.{key}``; families sharing
    an architecture name (Llama, Mixtral) choose by it (`ModelFamily.reads_gguf`)."""
    if gguf_arch not in _BY_GGUF:
        supported = ", ".join(f"{g} ({hf})" for family in _FAMILIES
                              for g, (hf, _) in family.gguf_architectures.items())
        raise ValueError(f"{source}: GGUF architecture {gguf_arch!r} is not supported; supported "
                         f"architectures: {supported}")
    value = value or (lambda key, default=None: default)
    readers = [f for f in _BY_GGUF[gguf_arch] if f.reads_gguf(gguf_arch, value)]
    if len(readers) != 1:
        raise ValueError(f"{source}: {len(readers)} model families read GGUF architecture "
                         f"{gguf_arch!r} with this metadata: {[f.name for f in readers]}")
    return readers[0]

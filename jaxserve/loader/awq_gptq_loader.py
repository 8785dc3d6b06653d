"""The packed projections of an AWQ / GPTQ safetensors checkpoint, in our stacked layout.

A quantized projection ``model.layers.N.self_attn.q_proj`` has ``.qweight``, ``.qzeros``,
``.scales`` (and GPTQ's ``.g_idx``) instead of ``.weight``; each layer's set is repacked
(quantization/awq_gptq.py) and stacked on L, as ``layers.q_proj.qweight`` [L, in / p, out],
``layers.q_proj.scales`` / ``.zeros`` [L, G, out] and, for act-order, ``layers.q_proj.g_idx``
[L, in]. Everything else in the checkpoint (embeddings, norms, biases, unquantized modules)
is read by the float path as usual.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.loader.weights import parse_name
from jaxserve.quantization.awq_gptq import PackedIntConfig, repack

PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _split(name: str) -> tuple[str, str] | None:
    """'model.layers.0.mlp.up_proj.qzeros' -> ('model.layers.0.mlp.up_proj', 'qzeros')."""
    base, _, part = name.rpartition(".")
    return (base, part) if part in PARTS else None


def quantized_projections(names: list[str], family: Any) -> dict[str, str]:
    """Our kernel names the checkpoint holds packed (they have a `.qweight`) -> one checkpoint
    module name of each, for messages. Quantized experts or output heads are refused."""
    found: dict[str, str] = {}
    for name in names:
        split = _split(name)
        if split is None or split[1] != "qweight":
            continue
        parsed = parse_name(split[0] + ".weight", "hf", family)
        if parsed is None or not parsed[0].endswith(".kernel") or parsed[1] is None:
            raise ValueError(f"{name}: a quantized tensor this loader cannot use (only the "
                             "decoder layers' projections may be AWQ/GPTQ-packed)")
        if isinstance(parsed[1], tuple):
            raise ValueError(f"{name}: AWQ/GPTQ-packed mixture-of-experts experts are not "
                             "supported")
        found.setdefault(parsed[0], split[0])
    return found


class PackedProjections:
    """Collects each quantized projection's checkpoint parts, then repacks and stacks them."""

    def __init__(self, cfg: PackedIntConfig, family: Any, shapes: dict[str, tuple[int, ...]],
                 kernels: dict[str, str], source: str):
        self.cfg, self.family, self.source = cfg, family, source
        self.shapes = {k: shapes[k] for k in kernels}          # [L, in, out]
        self.has_bias = {k for k in shapes if k.endswith(".bias")}
        self.parts: dict[tuple[str, int], dict[str, np.ndarray]] = {}

    def take(self, name: str, read: Any) -> bool:
        """Keep `name` if it is a part of a quantized projection; read() gives its array."""
        split = _split(name)
        if split is None:
            return self._zero_bias(name, read)
        parsed = parse_name(split[0] + ".weight", "hf", self.family)
        if parsed is None or parsed[0] not in self.shapes:
            return False
        self.parts.setdefault((parsed[0], parsed[1]), {})[split[1]] = read()
        return True

    def _zero_bias(self, name: str, read: Any) -> bool:
        """AutoGPTQ / GPTQ-for-LLaMa write a `.bias` for every packed projection, zeros where
        the model has none: skip those; a nonzero one the config has no place for is an
        error (dropping it would change the model)."""
        if not name.endswith(".bias"):
            return False
        parsed = parse_name(name.removesuffix(".bias") + ".weight", "hf", self.family)
        if parsed is None or parsed[0] not in self.shapes:
            return False
        bias = parsed[0].removesuffix(".kernel") + ".bias"
        if bias in self.has_bias:
            return False                 # a real bias: the float path reads it
        if np.any(read()):
            raise ValueError(f"{self.source}: {name} is nonzero, but the model config has no "
                             f"bias on {bias.removesuffix('.bias')}")
        return True

    def finish(self) -> dict[str, np.ndarray]:
        """Our stacked internal arrays (``layers.q_proj.qweight`` ...)."""
        out: dict[str, np.ndarray] = {}
        for kernel, (layers, n_in, n_out) in self.shapes.items():
            base = kernel.removesuffix(".kernel")
            per_layer = []
            for layer in range(layers):
                parts = self.parts.get((kernel, layer))
                if parts is None:
                    raise ValueError(f"{self.source}: checkpoint is missing the packed "
                                     f"{base} of layer {layer}")
                per_layer.append(repack(parts, self.cfg, n_in, n_out,
                                        f"{self.source}: layer {layer} {base}"))
            leaves = set(per_layer[0])
            if any(set(p) != leaves for p in per_layer):
                # some layers act-order, some not: give every layer its g_idx
                leaves.add("g_idx")
                group = n_in // per_layer[0]["scales"].shape[0]
                for p in per_layer:
                    p.setdefault("g_idx", np.arange(n_in, dtype=np.int32) // group)
            for leaf in sorted(leaves):
                out[f"{base}.{leaf}"] = np.stack([p[leaf] for p in per_layer])
        return out

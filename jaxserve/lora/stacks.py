"""The device-resident adapter slots: per target, A [L, S, in, r] and B [L, S, r, out].

S = max_loras + 1 slots (slot 0 stays zero: the base model), r = max_lora_rank (smaller
ranks zero-padded), so the arrays' shapes never change and the step compiles once per
bucket whatever is loaded. They join the step's params inside the jit (`with_lora`), where
the layer scan slices them per layer like every other weight.

Under tensor parallelism a stack is split like its base kernel: column-parallel layers
(q/k/v/gate/up, kernel split on `out`) split B on `out`; row-parallel ones (o/down, split
on `in`) split A on `in` (the [T, S, r] partial sums are all-reduced: small).

`write` replaces one slot with a jitted, donated dynamic_update_slice (compiled once at
start-up for every slot, since the slot index is traced): an in-place device update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.lora.peft_loader import LoRAWeights, TargetShape


def _write_slot(stacks: dict, slot: jax.Array, new: dict) -> dict:
    return {target: {name: jax.lax.dynamic_update_slice_in_dim(
        stack, new[target][name][:, None].astype(stack.dtype), slot, axis=1)
        for name, stack in pair.items()} for target, pair in stacks.items()}


def with_lora(params: Any, stacks: dict) -> Any:
    """params with each target's ``lora_a`` / ``lora_b`` beside its kernel (inside the jit:
    a dict merge, no copy)."""
    inner = params["params"]
    layers = dict(inner["layers"])
    for target, pair in stacks.items():
        layers[target] = {**layers[target], **pair}
    return {**params, "params": {**inner, "layers": layers}}


class LoRAStacks:
    def __init__(self, targets: dict[str, TargetShape], num_layers: int, max_loras: int,
                 max_lora_rank: int, dtype: Any, mesh: Any = None,
                 kernel_specs: dict[str, P] | None = None, abstract: bool = False) -> None:
        """targets: the (sharded model's) target shapes; kernel_specs: each target's base
        kernel PartitionSpec [L, in, out] (None: one device). abstract: ``arrays`` are the
        stacks' ShapeDtypeStructs (an ahead-of-time compile for devices not here); such
        stacks cannot be written."""
        self.targets, self.num_layers = targets, num_layers
        self.max_loras, self.max_lora_rank, self.dtype = max_loras, max_lora_rank, dtype
        L, S, R = num_layers, max_loras + 1, max_lora_rank
        shapes, shardings, self._new_shardings = {}, {}, {}
        for target, t in targets.items():
            shapes[target] = {"lora_a": (L, S, t.in_features, R),
                              "lora_b": (L, S, R, t.out_features)}
            if mesh is not None:
                _, split_in, split_out = kernel_specs[target]
                specs = {"lora_a": P(None, None, split_in, None),
                         "lora_b": P(None, None, None, split_out)}
                shardings[target] = {k: NamedSharding(mesh, s) for k, s in specs.items()}
                self._new_shardings[target] = {
                    k: NamedSharding(mesh, P(s[0], *s[2:])) for k, s in specs.items()}
        out_shardings = shardings or None
        zeros = jax.jit(lambda: {t: {k: jnp.zeros(s, dtype) for k, s in pair.items()}
                                 for t, pair in shapes.items()}, out_shardings=out_shardings)
        if abstract:
            default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            self.arrays = {t: {k: jax.ShapeDtypeStruct(
                s, dtype, sharding=shardings[t][k] if shardings else default)
                for k, s in pair.items()} for t, pair in shapes.items()}
            return
        self.arrays = zeros()
        self._write = jax.jit(_write_slot, donate_argnums=0, out_shardings=out_shardings)
        self._zeros = {name: {"lora_a": np.zeros((L, t.in_features, R), np.float32),
                              "lora_b": np.zeros((L, R, t.out_features), np.float32)}
                       for name, t in targets.items()}
        self.write(0, None)   # compiles the writer now (warm-up), leaves slot 0 zero

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree.leaves(self.arrays))

    def write(self, slot: int, weights: LoRAWeights | None) -> None:
        """Put an adapter's weights (None: zeros) into ``slot`` of every target."""
        if not 0 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} outside [0, {self.max_loras}]")
        new = {}
        for target in self.targets:
            pair = dict(self._zeros[target])
            if weights is not None and target in weights.a:
                pair = {"lora_a": weights.a[target], "lora_b": weights.b[target]}
            if self._new_shardings:
                pair = {k: jax.device_put(v, self._new_shardings[target][k])
                        for k, v in pair.items()}
            new[target] = pair
        self.arrays = self._write(self.arrays, np.int32(slot), new)

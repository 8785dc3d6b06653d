"""Projection weights packed at startup into oneDNN's blocked layout, where that is faster.

A decoder layer's float projections, stacked ``kernel`` [L, in, out], are read in place by
the CPU matmul library (models/layer_matmul.py). Handed that plain layout, oneDNN 3.2 runs
its older gemm kernel, which reorganises the weights on every call; packed once into the
layout its brgemm kernels read (kernels/cpu/packed_matmul.py), the same projections take
0.88x the time at 64 rows, 0.72x at 16, and ~0.9x the streaming GEMV's at one (SmolLM2-135M's
seven bfloat16 projections, AVX512-BF16 EPYC, 2 cores:
benchmarks/results/prepacked-matmul-bf16-epyc-avx512bf16-packed.json); a served step 0.91x
at 64 rows, 0.84x at 16 (prepacked-weights-step-epyc-avx512bf16.md).

The rule: bfloat16 weights, a CPU whose matrix units compute bf16 (``--matrix-units``:
AVX512-BF16, AMX; oneDNN natively), the plan that reads weights in place (one CPU device,
the library loads: runner/execution_plan.py), and no executables compiled ahead of time
(`jaxserve compile` builds the plain layout). float32 stays plain: packed it won at a few
rows and lost 14 % at 64 (brg:avx512_core against gemm:jit), and on an AVX2 CPU oneDNN keeps
it plain anyway. Each packed ``kernel`` becomes ``packed_kernel`` uint8 [L, bytes]
(models/linear_method.PackedDenseMethod reads it; the GGUF float copy's too), and a GGUF
embedding table's float copy, which only the tied LM head's steps of many rows read, becomes
``packed_head`` [1, bytes] (models/layers.Embedding; its lookups read the blocks). The layout is
this CPU's and this process's thread count's, so packing happens here, after loading, on
the serving machine, and is never saved (`jaxserve convert` writes the plain layout).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.linear_method import PACKED_HEAD_LEAF, PACKED_LEAF
from jaxserve.models.sibling_fusion import SIBLING_GROUPS
from jaxserve.quantization.gguf_packed import packed_format_of

logger = logging.getLogger(__name__)

# The layer projections the models build as layers.Linear (a raw `kernel` elsewhere, a MoE
# router or expert stack, is read by other code and stays plain).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj")


def why_not_packed(dtype: Any, bf16_units: bool, in_place: bool, aot: bool) -> str | None:
    """None when the rule above packs a model computing in ``dtype``, else why not."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"{jnp.dtype(dtype).name} weights stay plain"
    if not bf16_units:
        return "no bf16 matrix units (--matrix-units)"
    if not in_place:
        return "the step does not read weights in place (not one CPU device with the library)"
    if aot:
        return "--aot-dir executables read the plain layout"
    from jaxserve.kernels.cpu.matmul import onednn_native_bf16

    if not onednn_native_bf16():
        return "oneDNN has no bf16 kernel on this CPU"
    return None


@dataclass(frozen=True)
class Target:
    """One array to pack: ``params["params"][scope][module][leaf]`` (scope "" for a
    top-level module), stacked [L, in, out] (or a table [V, H] read transposed), replaced by
    ``packed_leaf``."""
    scope: str
    module: str
    leaf: str
    packed_leaf: str
    transposed: bool = False

    @property
    def name(self) -> str:
        return f"{self.scope}.{self.module}" if self.scope else self.module

    def get(self, params: Any) -> Any:
        tree = params["params"]
        tree = tree.get(self.scope, {}) if self.scope else tree
        leaves = tree.get(self.module)
        return leaves.get(self.leaf) if isinstance(leaves, dict) else None

    def stacked_shape(self, array: Any) -> tuple[int, int, int]:
        """(L, in, out) of the product the packed array serves."""
        if self.transposed:            # a table [V, H]: logits = x @ table^T
            return 1, array.shape[1], array.shape[0]
        return tuple(array.shape)


def _targets(params: Any) -> list[Target]:
    """The layer projections, and a GGUF table's float copy (which then serves only the tied
    LM head's rows above the block kernel's: lookups read the blocks, the same numbers)."""
    targets = [Target("layers", name, "kernel", PACKED_LEAF) for name in PROJECTIONS]
    embed = params["params"].get("embed_tokens", {})
    if isinstance(embed, dict) and packed_format_of(embed) is not None:
        targets.append(Target("", "embed_tokens", "embedding", PACKED_HEAD_LEAF,
                              transposed=True))
    return targets


def _packable(params: Any, dtype: Any) -> dict[Target, int]:
    """{target: packed bytes per layer} of ``params``'s (arrays or ShapeDtypeStructs)
    ``dtype`` targets that oneDNN lays out blocked here."""
    from jaxserve.kernels.cpu.packed_matmul import packed_bytes

    found = {}
    for target in _targets(params):
        array = target.get(params)
        if array is None or array.dtype != jnp.dtype(dtype) \
                or len(array.shape) != (2 if target.transposed else 3):
            continue
        _, n_in, n_out = target.stacked_shape(array)
        size = packed_bytes(n_in, n_out, array.dtype)
        if size:
            found[target] = size
    return found


def _replaced(params: Any, new: dict[Target, Any]) -> Any:
    """params with each target's plain leaf replaced by its packed one in ``new``."""
    inner = dict(params["params"])
    for target, packed in new.items():
        tree = dict(inner[target.scope]) if target.scope else inner
        tree[target.module] = {**{k: v for k, v in tree[target.module].items()
                                  if k != target.leaf}, target.packed_leaf: packed}
        if target.scope:
            inner[target.scope] = tree
    return {**params, "params": inner}


def packed_spec(spec: Any, dtype: Any, plan: Any = None) -> Any:
    """The ShapeDtypeStructs `pack_layer_weights` (with the same ``plan``) turns ``spec``'s
    arrays into."""
    groups, targets, _ = plan or _planned(spec, dtype)
    spec = _fused(spec, groups, _fuse_specs)
    return _replaced(spec, {
        target: jax.ShapeDtypeStruct((target.stacked_shape(target.get(spec))[0], size),
                                     jnp.uint8,
                                     sharding=getattr(target.get(spec), "sharding", None))
        for target, size in targets.items()})


def _fusable(params: Any, dtype: Any) -> list[str]:
    """Sibling groups (q|k|v, gate|up: models/sibling_fusion.py) whose members all hold a
    plain stacked ``dtype`` kernel of one input size and nothing quantized: stored side by
    side they take one packed call where they took one each (a step's calls each pay a
    thread-pool wake-up; the narrow k and v run far under the units' rate alone)."""
    layers = params["params"].get("layers", {})
    groups = []
    for group, members in SIBLING_GROUPS.items():
        leaves = [layers.get(name) for name in members]
        if group in layers or not all(isinstance(leaf, dict) for leaf in leaves):
            continue
        kernels = [leaf.get("kernel") for leaf in leaves]
        if any(k is None or len(k.shape) != 3 or k.dtype != jnp.dtype(dtype) for k in kernels) \
                or any(packed_format_of(leaf) is not None for leaf in leaves) \
                or len({tuple(k.shape[:2]) for k in kernels}) != 1:
            continue
        groups.append(group)
    return groups


def _fused(params: Any, groups: list[str], concatenate: Any) -> Any:
    """params with each group's members' kernels concatenated (``concatenate(kernels)``)
    into the group's ``kernel``; the members keep their other leaves (bias, LoRA)."""
    inner = params["params"]
    layers = dict(inner["layers"])
    for group in groups:
        members = SIBLING_GROUPS[group]
        layers[group] = {"kernel": concatenate([layers[name]["kernel"] for name in members])}
        for name in members:
            layers[name] = {k: v for k, v in layers[name].items() if k != "kernel"}
    return {**params, "params": {**inner, "layers": layers}}


class _LazyConcat:
    """Sibling kernels [L, in, out_i] seen as their concatenation [L, in, sum out_i], read a
    layer at a time and never materialized: a fused gate|up of a 7B model is 7.5 GB, which
    a whole concatenation would add to the peak on top of its packed copy."""

    def __init__(self, kernels: list[Any]) -> None:
        self.kernels = kernels
        first = kernels[0]
        self.shape = (*first.shape[:2], sum(k.shape[2] for k in kernels))
        self.dtype = first.dtype
        self.sharding = getattr(first, "sharding", None)
        self.nbytes = sum(k.nbytes for k in kernels)

    def layer(self, i: int) -> np.ndarray:
        """Layer i's [in, sum out_i] (the members on a CPU device: host views, not copies)."""
        return np.concatenate([np.asarray(k)[i] for k in self.kernels], axis=1)

    def delete(self) -> None:
        for kernel in self.kernels:
            if isinstance(kernel, jax.Array):
                kernel.delete()


def _fuse_specs(kernels: list[Any]) -> Any:
    first = kernels[0]
    return jax.ShapeDtypeStruct((*first.shape[:2], sum(k.shape[2] for k in kernels)),
                                first.dtype, sharding=getattr(first, "sharding", None))


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _planned(params: Any, dtype: Any, still_to_arrive: int = 0
             ) -> tuple[list[str], dict[Target, int], list[str]]:
    """(sibling groups to fuse, targets to pack: packed bytes per layer, what stays plain for
    lack of memory). Packing a target holds its plain array, the packed one on the host and
    its device copy at once: one whose two packed copies do not fit the host's available
    memory (less ``still_to_arrive`` bytes a restore has yet to fill) stays plain, and a
    group whose fused packing does not fit keeps its members."""
    groups = _fusable(params, dtype)
    fused = _fused(params, groups, _fuse_specs)
    targets = _packable(fused, dtype)
    free = available_host_bytes()
    if free is None:
        return groups, targets, []
    free -= still_to_arrive
    kept_plain = []
    for target, size in list(targets.items()):
        if 2 * size * target.stacked_shape(target.get(fused))[0] <= free:
            continue
        del targets[target]
        kept_plain.append(target.name)
        if target.scope == "layers" and target.module in groups:
            groups.remove(target.module)
    return groups, targets, kept_plain


def pack_layer_weights(params: Any, dtype: Any,
                       plan: tuple[list[str], dict[Target, int], list[str]] | None = None
                       ) -> tuple[Any, list[str], int]:
    """(params with every ``dtype`` target packed, the targets' names, bytes before minus
    after). The plain arrays are freed as each is replaced; one oneDNN would read plain here
    stays. ``plan``: `_planned`'s, made earlier (a restore's spec was compiled on it)."""
    from jaxserve.kernels.cpu.packed_matmul import pack_layers, pack_stacked

    groups, targets, kept_plain = plan or _planned(params, dtype)
    if kept_plain:
        logger.warning("projection weights kept plain (packing them needs twice their size "
                       "free in host memory): %s", ", ".join(kept_plain))
    params = _fused(params, groups, _LazyConcat)
    new, saved = {}, 0
    for target in targets:
        plain = target.get(params)
        if isinstance(plain, _LazyConcat):
            packed = pack_layers(plain.layer, *plain.shape, plain.dtype)
        else:
            host = np.asarray(plain)
            packed = pack_stacked(host[None] if target.transposed else host,
                                  transposed=target.transposed)
        new[target] = jax.device_put(packed, getattr(plain, "sharding", None))
        saved += plain.nbytes - packed.nbytes
        del packed
        if isinstance(plain, (jax.Array, _LazyConcat)):
            plain.delete()
    return _replaced(params, new), [t.name for t in new], saved


class PackedOnArrival:
    """Parameters still being restored (engine/model_source.RestoringParams), packed when
    they arrive: the packed ``spec`` now (the runner compiles on it meanwhile)."""

    def __init__(self, restoring: Any, dtype: Any) -> None:
        self._restoring, self._dtype = restoring, dtype
        arriving = sum(leaf.nbytes if hasattr(leaf, "nbytes") else
                       int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
                       for leaf in jax.tree.leaves(restoring.spec))
        self._plan = _planned(restoring.spec, dtype, still_to_arrive=arriving)
        self.spec = packed_spec(restoring.spec, dtype, self._plan)

    @property
    def targets(self) -> list[Target]:
        return list(self._plan[1])

    def result(self) -> Any:
        return pack_layer_weights(self._restoring.result(), self._dtype, self._plan)[0]


def pack_for_serving(config: Any, placed: Any, in_place: bool) -> None:
    """Pack ``placed.params`` (engine/model_source.PlacedModel) in place where the rule says
    so, logging what was packed or why not; `resident_bytes` follows."""
    from jaxserve.kernels.cpu.matmul import matrix_units_for

    mc = config.model_config
    pc = config.parallel_config
    why = why_not_packed(placed.dtype, matrix_units_for(mc.matrix_units).bf16,
                         in_place and pc.pipeline_parallel_size == 1,
                         bool(config.runner_config.aot_dir))
    if why is not None:
        logger.debug("projection weights plain: %s", why)
        return
    start = time.perf_counter()
    if hasattr(placed.params, "result"):      # being restored: packed on arrival
        placed.params = PackedOnArrival(placed.params, placed.dtype)
        names, when = [t.name for t in placed.params.targets], "as the restore delivers them"
    else:
        placed.params, names, saved = pack_layer_weights(placed.params, placed.dtype)
        placed.resident_bytes -= saved
        when = f"in {time.perf_counter() - start:.2f} s"
    if names:
        logger.info("projection weights packed into oneDNN's blocked layout (%s) %s: %s",
                    jnp.dtype(placed.dtype).name, when, ", ".join(names))

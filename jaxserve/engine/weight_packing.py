"""Projection weights packed at startup into oneDNN's blocked layout, where that is faster.

A decoder layer's float projections, stacked ``kernel`` [L, in, out], are read in place by
the CPU matmul library (models/layer_matmul.py). Handed that plain layout, oneDNN 3.2 runs
its older gemm kernel, which reorganises the weights on every call; packed once into the
layout its brgemm kernels read (kernels/cpu/packed_matmul.py), the same projections take
0.86x the time at 64 rows, 0.69x at 16, and 0.87x the streaming GEMV's at one (SmolLM2-135M's
seven bfloat16 projections, AVX512-BF16 EPYC, 2 cores:
benchmarks/results/prepacked-matmul-bf16-epyc-avx512bf16-packed.json).

The rule: bfloat16 weights, a CPU whose matrix units compute bf16 (``--matrix-units``:
AVX512-BF16, AMX; oneDNN natively), the plan that reads weights in place (one CPU device,
the library loads: runner/execution_plan.py), and no executables compiled ahead of time
(`jaxserve compile` builds the plain layout). float32 stays plain: packed it won at a few
rows and lost 14 % at 64 (brg:avx512_core against gemm:jit), and on an AVX2 CPU oneDNN keeps
it plain anyway. Each packed ``kernel`` becomes ``packed_kernel`` uint8 [L, bytes]
(models/linear_method.PackedDenseMethod reads it; the GGUF float copy's too). The layout is
this CPU's and this process's thread count's, so packing happens here, after loading, on
the serving machine, and is never saved (`jaxserve convert` writes the plain layout).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.linear_method import PACKED_LEAF

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


def _packable(params: Any, dtype: Any) -> dict[str, int]:
    """{projection: packed bytes per layer} of the stacked ``dtype`` kernels of
    ``params["params"]["layers"]`` (arrays or ShapeDtypeStructs) that oneDNN blocks here."""
    from jaxserve.kernels.cpu.packed_matmul import packed_bytes

    layers = params["params"].get("layers", {})
    found = {}
    for name in PROJECTIONS:
        leaves = layers.get(name)
        kernel = leaves.get("kernel") if isinstance(leaves, dict) else None
        if kernel is None or len(kernel.shape) != 3 or kernel.dtype != jnp.dtype(dtype):
            continue
        size = packed_bytes(kernel.shape[1], kernel.shape[2], kernel.dtype)
        if size:
            found[name] = size
    return found


def _replaced(params: Any, new: dict[str, Any]) -> Any:
    """params with each projection's ``kernel`` replaced by its packed leaf in ``new``."""
    inner = params["params"]
    layers = dict(inner["layers"])
    for name, leaf in new.items():
        layers[name] = {**{k: v for k, v in layers[name].items() if k != "kernel"},
                        PACKED_LEAF: leaf}
    return {**params, "params": {**inner, "layers": layers}}


def packed_spec(spec: Any, dtype: Any) -> Any:
    """The ShapeDtypeStructs `pack_layer_weights` turns ``spec``'s arrays into."""
    layers = spec["params"].get("layers", {})
    return _replaced(spec, {
        name: jax.ShapeDtypeStruct((layers[name]["kernel"].shape[0], size), jnp.uint8,
                                   sharding=getattr(layers[name]["kernel"], "sharding", None))
        for name, size in _packable(spec, dtype).items()})


def pack_layer_weights(params: Any, dtype: Any) -> tuple[Any, list[str], int]:
    """(params with every stacked ``dtype`` projection kernel of ``params["params"]["layers"]``
    packed, the projections packed, bytes before minus after). The plain arrays are freed
    as each is replaced; a kernel oneDNN would read plain here stays."""
    from jaxserve.kernels.cpu.packed_matmul import pack_stacked

    layers = params["params"].get("layers", {})
    new, saved = {}, 0
    for name in _packable(params, dtype):
        kernel = layers[name]["kernel"]
        packed = pack_stacked(np.asarray(kernel))
        new[name] = jax.device_put(packed, getattr(kernel, "sharding", None))
        saved += kernel.nbytes - packed.nbytes
        if isinstance(kernel, jax.Array):
            kernel.delete()
    return _replaced(params, new), list(new), saved


class PackedOnArrival:
    """Parameters still being restored (engine/model_source.RestoringParams), packed when
    they arrive: the packed ``spec`` now (the runner compiles on it meanwhile)."""

    def __init__(self, restoring: Any, dtype: Any) -> None:
        self._restoring, self._dtype = restoring, dtype
        self.spec = packed_spec(restoring.spec, dtype)

    def result(self) -> Any:
        return pack_layer_weights(self._restoring.result(), self._dtype)[0]


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
    if hasattr(placed.params, "result"):      # being restored: packed on arrival
        names = list(_packable(placed.params.spec, placed.dtype))
        placed.params = PackedOnArrival(placed.params, placed.dtype)
    else:
        placed.params, names, saved = pack_layer_weights(placed.params, placed.dtype)
        placed.resident_bytes -= saved
    if names:
        logger.info("projection weights packed into oneDNN's blocked layout (%s): %s",
                    jnp.dtype(placed.dtype).name, ", ".join(names))

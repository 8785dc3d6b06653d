"""KV-cache sizing: how many blocks fit the memory budget, decided before any request."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.config import CacheConfig
from jaxserve.models.arch import ModelArch
from jaxserve.platforms import platform_of_device
from jaxserve.quantization.kv import bytes_per_head_token

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CAP = 4 << 30   # like vLLM's CPU backend default of 4 GiB of KV cache
JAX_DEFAULT_POOL_FRACTION = 0.75   # XLA_PYTHON_CLIENT_MEM_FRACTION when unset
# Workspaces beyond the GEMM operands a GPU compile or step takes: cuBLAS(Lt) and Triton
# scratch, the autotuner's redzones around every buffer it times, XLA's own bookkeeping.
GPU_COMPILE_SLACK = 256 << 20
# What XLA's GPU compiler assumes it may use (gpu_hlo_schedule.cc GetSchedulerMemoryLimit):
# the module's device_memory_size, which JAX never sets, else 80 % of the device's memory
# ("base limit"). From it XLA takes the step's arguments + outputs - aliased outputs; what is
# left, times xla_gpu_memory_limit_slop_factor (95 %), is the scheduler's memory limit for
# the step's temporaries. Arguments beyond the base make the limit 0 and XLA logs "exceeds
# the base limit": the latency-hiding scheduler then schedules for a 0-byte budget.
XLA_GPU_BASE_FRACTION_PERCENT = 80
XLA_GPU_SLOP_PERCENT = 95
# The step's arguments and outputs beside the weights and the (aliased) KV cache: packed
# inputs, sampling tensors, sampled ids and logprobs (KBs to a few MiB); generous.
XLA_STEP_IO_SLACK = 64 << 20


def compile_headroom_bytes(arch: ModelArch, compute_itemsize: int, activation_bytes: int,
                           tp_size: int = 1) -> int:
    """Device memory a GPU plan keeps free for a compile after the KV cache exists (a
    bucket compiled in the background or outside warm-up), beside the running step's
    activations: XLA's GEMM autotuner times each GEMM on fresh copies of its operands and
    output, so it needs the largest weight matrix this device holds (the LM head, or an MLP
    projection of a small-vocabulary model) plus the GEMM's input and output rows (at most
    the step's activations) plus GPU_COMPILE_SLACK."""
    largest_matrix = max(arch.vocab_size * arch.hidden_size,
                         arch.hidden_size * arch.intermediate_size)
    return -(-largest_matrix // tp_size) * compute_itemsize + activation_bytes + \
        GPU_COMPILE_SLACK


def xla_base_limit_bytes(device_memory_bytes: int) -> int:
    """XLA's base memory limit for a GPU of this much memory (no device_memory_size set)."""
    return int(device_memory_bytes) * XLA_GPU_BASE_FRACTION_PERCENT // 100


def xla_kv_budget_bytes(device_memory_bytes: int, weight_bytes: int,
                        activation_bytes: int) -> int:
    """The largest KV cache (bytes per device) with which the step's arguments (weights, KV
    cache, inputs) plus its temporaries over XLA's slop factor stay inside XLA's base limit:
    base - weights - step I/O - activations / 0.95. The KV cache is donated and aliased to
    the step's output, so XLA counts it once among the arguments."""
    temporaries = -(-int(activation_bytes) * 100 // XLA_GPU_SLOP_PERCENT)
    return xla_base_limit_bytes(device_memory_bytes) - int(weight_bytes) - \
        XLA_STEP_IO_SLACK - temporaries


def size_gpu_pool(gpu_memory_utilization: float) -> bool:
    """Size JAX's GPU allocator pool to --gpu-memory-utilization before any backend starts.

    --gpu-memory-utilization 0.9 means 90 % of the GPU, as in vLLM (and as `jaxserve compile`
    plans it from the target's memory). JAX's own pool is 75 % of the GPU unless
    XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise, so without this a server would plan its
    KV cache in 0.9 x 0.75 of the GPU, and AOT executables planned for 90 % would not fit.
    A fraction the user set explicitly wins (the plan stays inside that pool). Returns
    whether the pool was sized here. No effect on CPU."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return False
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{gpu_memory_utilization:.4f}"
    return True


def gpu_pool_fraction() -> float | None:
    """The fraction of the GPU JAX's pool (memory_stats' bytes_limit) was sized to; None when
    JAX allocates from the platform directly (its bytes_limit is then the device's)."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return None
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_POOL_FRACTION))


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int          # blocks per layer
    block_size: int
    bytes_per_block: int     # all layers, K and V
    budget_bytes: int        # KV bytes per device
    source: str              # how the budget was chosen, for the startup log
    weight_bytes: int = 0        # per device, as placed (quantized as stored)
    activation_bytes: int = 0    # per device: the largest step's estimate
    pool_devices: int = 1        # this engine's devices drawing on one memory pool
    pool_bytes: int = 0          # the pool the plan was made from (0: not measured)
    compile_headroom_bytes: int = 0   # per device, kept free for a late GPU compile

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        """The startup log's memory plan: per device, and what the shared pool keeps free."""
        mib = 2**20
        per_device = self.weight_bytes + self.activation_bytes + self.total_bytes + \
            self.compile_headroom_bytes
        text = (f"memory plan per device: weights {self.weight_bytes / mib:.1f} MiB + "
                f"activations {self.activation_bytes / mib:.1f} MiB + "
                + (f"compile headroom {self.compile_headroom_bytes / mib:.1f} MiB + "
                   if self.compile_headroom_bytes else "")
                + f"KV cache {self.total_bytes / mib:.1f} MiB = {per_device / mib:.1f} MiB")
        if self.pool_devices > 1:
            text += f"; {self.pool_devices} devices share one memory pool (host RAM)"
        if self.pool_bytes:
            headroom = self.pool_bytes - per_device * self.pool_devices
            text += (f"; headroom {headroom / mib:.1f} MiB of the pool's "
                     f"{self.pool_bytes / mib:.1f} MiB")
        return text


def devices_per_pool(device: jax.Device, tp_size: int) -> int:
    """How many of one engine's devices draw on the same memory: on CPU every (simulated)
    device is host RAM, so all tp of them share one budget; a GPU has its own memory."""
    return tp_size if platform_of_device(device).memory_is_host_ram else 1


def bytes_per_block(arch: ModelArch, block_size: int, dtype, tp_size: int = 1) -> int:
    """Bytes one block costs on one device: K and V, every layer, this device's KV heads."""
    kv_heads = max(1, arch.num_kv_heads // tp_size) if arch.num_kv_heads >= tp_size else 1
    # int8 / fp8 add a 1-byte scale per head-token (jaxserve/quantization/kv.py)
    return 2 * arch.num_layers * block_size * kv_heads * bytes_per_head_token(dtype, arch.head_dim)


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _gpu_memory(device: jax.Device, device_memory_bytes: int | None,
                weight_bytes: int) -> tuple[int, int, int]:
    """(the whole GPU's memory, JAX's pool, bytes in use) for a plan: a target's memory with
    only the weights in use, or the device's own figures."""
    if device_memory_bytes:
        return int(device_memory_bytes), int(device_memory_bytes), int(weight_bytes)
    stats = device.memory_stats() or {}
    pool_bytes = int(stats.get("bytes_limit", 0))
    fraction = gpu_pool_fraction()
    total = int(pool_bytes / fraction) if fraction else pool_bytes
    return total, pool_bytes, int(stats.get("bytes_in_use", 0))


class KVCacheDoesNotFit(ValueError):
    """Not even one sequence of max_model_len fits the memory left for the KV cache."""

    def __init__(self, message: str, shortfall_bytes: int) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


def plan_kv_cache(cache: CacheConfig, arch: ModelArch, dtype, weight_bytes: int,
                  activation_bytes: int, max_model_len: int, tp_size: int = 1,
                  device: jax.Device | None = None,
                  device_memory_bytes: int | None = None,
                  compute_dtype=None) -> KVCachePlan:
    """Size the cache from --kv-cache-memory-bytes, or a utilization fraction of memory.

    Planned per memory pool: weight_bytes and activation_bytes are per device, and where
    the engine's devices share one pool (simulated CPU devices: host RAM) the pool's budget
    (kv_cache_memory_bytes, or the RAM fraction with its cap) is split among them, so
    tp=3 holds the tokens tp=1 holds, in the same RAM, not 3x.

    device_memory_bytes: plan for a GPU that is not here (`jaxserve compile --target`): the
    device rule below with that much memory, of which only the weights are in use.

    On a GPU, from a utilization fraction, the cache is the smaller of two bounds: the
    utilization share (less weights, activations and compile headroom) and the compiler's
    (`xla_kv_budget_bytes`: XLA plans every GPU step within 80 % of the device, arguments
    included), so the compiler never finds the step over its limit. The source names the
    bound that decided.

    The utilization share keeps `compile_headroom_bytes` free
    (compute_dtype: the weights' dtype; default `dtype`): the cache is allocated after
    warm-up compiled its buckets, and a bucket compiled later must still find room to
    autotune. An explicit kv_cache_memory_bytes / num_gpu_blocks_override is taken as
    given."""
    device = device or jax.devices()[0]
    # A target's memory (`jaxserve compile`) is a GPU's, whatever the devices here are.
    host_ram = platform_of_device(device).memory_is_host_ram and not device_memory_bytes
    per_block = bytes_per_block(arch, cache.block_size, dtype, tp_size)
    pool_devices = 1 if device_memory_bytes else devices_per_pool(device, tp_size)
    split = f", split over {pool_devices} devices sharing host RAM" if pool_devices > 1 else ""
    pool_bytes = headroom = 0
    if cache.num_gpu_blocks_override:
        budget, source = cache.num_gpu_blocks_override * per_block, "num_gpu_blocks_override"
    elif cache.kv_cache_memory_bytes:
        budget = int(cache.kv_cache_memory_bytes) // pool_devices
        source = "kv_cache_memory_bytes" + split
    elif host_ram:
        avail = pool_bytes = available_host_memory()
        budget = int(cache.gpu_memory_utilization * avail) - \
            (weight_bytes + activation_bytes) * pool_devices
        budget = min(budget, CPU_DEFAULT_KV_CAP) // pool_devices
        source = (f"{cache.gpu_memory_utilization:.0%} of available RAM "
                  f"({avail / 2**30:.1f} GiB), capped at {CPU_DEFAULT_KV_CAP >> 30} GiB" + split)
    else:
        total, pool_bytes, in_use = _gpu_memory(device, device_memory_bytes, weight_bytes)
        # A share of the whole device (vLLM's meaning), never more than JAX's pool holds.
        usable = min(int(cache.gpu_memory_utilization * total), pool_bytes)
        itemsize = jnp.dtype(compute_dtype if compute_dtype is not None else dtype).itemsize
        headroom = compile_headroom_bytes(arch, itemsize, activation_bytes, tp_size)
        share = usable - in_use - activation_bytes - headroom
        # The compiler's own bound (xla_kv_budget_bytes): a cache past it leaves XLA's
        # scheduler no memory for the step and it says so at every compile.
        compiler = xla_kv_budget_bytes(total, weight_bytes, activation_bytes)
        budget = min(share, compiler)
        bound = (f"XLA's limit ({XLA_GPU_BASE_FRACTION_PERCENT}% of {total / 2**30:.1f} GiB "
                 f"- weights - step I/O - activations / 0.{XLA_GPU_SLOP_PERCENT}; "
                 f"{share / 2**30:.2f} GiB by --gpu-memory-utilization)")
        if share <= compiler:
            bound = (f"{cache.gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB device "
                     "memory" if usable < pool_bytes else "JAX's pool") + \
                f"; XLA's limit allows {compiler / 2**30:.2f} GiB"
        source = (f"bound by {bound}; JAX pool {pool_bytes / 2**30:.1f} GiB, "
                  f"{in_use / 2**30:.2f} GiB in use, {headroom / 2**30:.2f} GiB kept for "
                  "compiles")
    if source.startswith(("num_gpu_blocks_override", "kv_cache_memory_bytes")) and \
            not host_ram:
        over = budget - xla_kv_budget_bytes(_gpu_memory(device, device_memory_bytes,
                                                        weight_bytes)[0],
                                            weight_bytes, activation_bytes)
        if over > 0:     # taken as given, but the compiler will say so at every bucket
            logger.warning("the KV cache of %s is %.2f GiB over what XLA's memory limit for "
                           "a GPU step leaves (80%% of the device - weights - activations); "
                           "XLA will log 'exceeds the base limit' compiling each bucket",
                           source, over / 2**30)
    num_blocks = cache.num_gpu_blocks_override or budget // per_block
    min_blocks = -(-max_model_len // cache.block_size)
    if num_blocks < min_blocks:
        shortfall = min_blocks * per_block - budget
        raise KVCacheDoesNotFit(
            f"does not fit: KV cache budget {budget / 2**20:.1f} MiB ({source}; weights "
            f"{weight_bytes / 2**30:.2f} GiB, activations {activation_bytes / 2**30:.2f} GiB and "
            f"compile headroom {headroom / 2**30:.2f} GiB per device) holds "
            f"{max(num_blocks, 0)} blocks of {cache.block_size} tokens, "
            f"fewer than one sequence of max_model_len={max_model_len} needs ({min_blocks}): "
            f"{shortfall / 2**30:.2f} GiB short per device; raise --kv-cache-memory-bytes / "
            "--gpu-memory-utilization or lower --max-model-len, or use more "
            "--tensor-parallel-size, a quantized KV cache (--kv-cache-dtype fp8) or int8 "
            "weights (--quantization int8)", int(shortfall))
    return KVCachePlan(int(num_blocks), cache.block_size, per_block, int(budget), source,
                       weight_bytes=int(weight_bytes), activation_bytes=int(activation_bytes),
                       pool_devices=pool_devices, pool_bytes=int(pool_bytes),
                       compile_headroom_bytes=int(headroom))

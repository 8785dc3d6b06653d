"""KV-cache sizing: how many blocks fit the memory budget, decided before any request."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.config import CacheConfig
from jaxserve.models.arch import ModelArch

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CAP = 4 << 30   # like vLLM's CPU backend default of 4 GiB of KV cache


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int          # blocks per layer
    block_size: int
    bytes_per_block: int     # all layers, K and V
    budget_bytes: int
    source: str              # how the budget was chosen, for the startup log

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def bytes_per_block(arch: ModelArch, block_size: int, dtype, tp_size: int = 1) -> int:
    """Bytes one block costs on one device: K and V, every layer, this device's KV heads."""
    kv_heads = max(1, arch.num_kv_heads // tp_size) if arch.num_kv_heads >= tp_size else 1
    return 2 * arch.num_layers * block_size * kv_heads * arch.head_dim * np.dtype(dtype).itemsize


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def plan_kv_cache(cache: CacheConfig, arch: ModelArch, dtype, weight_bytes: int,
                  activation_bytes: int, max_model_len: int, tp_size: int = 1,
                  device: jax.Device | None = None) -> KVCachePlan:
    """Size the cache from --kv-cache-memory-bytes, or a utilization fraction of memory."""
    device = device or jax.devices()[0]
    per_block = bytes_per_block(arch, cache.block_size, dtype, tp_size)
    if cache.num_gpu_blocks_override:
        budget, source = cache.num_gpu_blocks_override * per_block, "num_gpu_blocks_override"
    elif cache.kv_cache_memory_bytes:
        budget, source = int(cache.kv_cache_memory_bytes), "kv_cache_memory_bytes"
    elif device.platform == "cpu":
        avail = available_host_memory()
        budget = int(cache.gpu_memory_utilization * avail) - weight_bytes - activation_bytes
        budget = min(budget, CPU_DEFAULT_KV_CAP)
        source = (f"{cache.gpu_memory_utilization:.0%} of available RAM "
                  f"({avail / 2**30:.1f} GiB), capped at {CPU_DEFAULT_KV_CAP >> 30} GiB")
    else:
        stats = device.memory_stats() or {}
        total = int(stats.get("bytes_limit", 0))
        in_use = int(stats.get("bytes_in_use", 0))
        budget = int(cache.gpu_memory_utilization * total) - in_use - activation_bytes
        source = (f"{cache.gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB device memory, "
                  f"{in_use / 2**30:.2f} GiB in use")
    num_blocks = cache.num_gpu_blocks_override or budget // per_block
    min_blocks = -(-max_model_len // cache.block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV cache budget {budget / 2**20:.1f} MiB ({source}) holds {num_blocks} blocks of "
            f"{cache.block_size} tokens, fewer than one sequence of max_model_len={max_model_len} "
            f"needs ({min_blocks}); raise --kv-cache-memory-bytes / --gpu-memory-utilization or "
            "lower --max-model-len")
    return KVCachePlan(int(num_blocks), cache.block_size, per_block, int(budget), source)

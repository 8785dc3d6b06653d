"""The KV-cache plan is made per memory pool (jaxserve/runner/memory.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.config import CacheConfig
from jaxserve.models.arch import ModelArch
from jaxserve.runner import memory

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

ARCH = ModelArch("LlamaForCausalLM", vocab_size=1000, hidden_size=192, intermediate_size=512,
                 num_layers=5, num_heads=6, num_kv_heads=3, head_dim=64,
                 max_position_embeddings=2048, tie_word_embeddings=True)
CPU = SimpleNamespace(platform="cpu")


@pytest.mark.parametrize("cache", [CacheConfig(), CacheConfig(kv_cache_memory_bytes=96 << 20)])
def test_tp3_on_shared_host_ram_holds_tp1s_tokens_not_three_times(monkeypatch, cache):
    monkeypatch.setattr(memory, "available_host_memory", lambda: 24 << 30)
    weights, activations = 300 << 20, 50 << 20
    one = memory.plan_kv_cache(cache, ARCH, "float32", weights, activations, 2048,
                               tp_size=1, device=CPU)
    three = memory.plan_kv_cache(cache, ARCH, "float32", weights // 3, activations, 2048,
                                 tp_size=3, device=CPU)
    assert three.pool_devices == 3 and one.pool_devices == 1
    # each of the 3 devices holds a third of the KV heads of every token ...
    assert three.bytes_per_block * 3 == one.bytes_per_block
    # ... so the same number of tokens costs the same host RAM in total
    assert abs(three.capacity_tokens - one.capacity_tokens) <= 3 * cache.block_size
    assert three.total_bytes * 3 <= one.budget_bytes + 3 * three.bytes_per_block
    assert "3 devices share one memory pool" in three.describe()


def test_gpu_devices_each_plan_from_their_own_memory(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")   # as size_gpu_pool sets it
    gpu = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 9 << 30,
                                                                "bytes_in_use": 1 << 30})
    plan = memory.plan_kv_cache(CacheConfig(), ARCH, "float32", 0, 100 << 20, 2048,
                                tp_size=3, device=gpu)
    assert plan.pool_devices == 1
    # 90 % of a 10 GiB GPU is the 9 GiB pool: all of it, less what is in use
    assert plan.budget_bytes == (9 << 30) - (1 << 30) - (100 << 20)
    assert "headroom" in plan.describe()


def test_gpu_memory_utilization_is_a_share_of_the_device_not_of_jax_pool(monkeypatch):
    """vLLM's meaning: 0.9 is 90 % of the GPU. With JAX's default 75 % pool (a user who set
    nothing before jax started) the plan is capped by the pool; with the pool sized by
    size_gpu_pool it is the same plan `jaxserve compile` makes for that device."""
    stats = {"bytes_limit": 0, "bytes_in_use": 0}
    gpu = SimpleNamespace(platform="gpu", memory_stats=lambda: stats)
    device_bytes, cache = 100 << 30, CacheConfig(gpu_memory_utilization=0.9)

    def plan():
        return memory.plan_kv_cache(cache, ARCH, "float32", 0, 0, 2048, device=gpu)

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert memory.size_gpu_pool(0.9) is True
    stats["bytes_limit"] = int(0.9 * device_bytes)
    aot = memory.plan_kv_cache(cache, ARCH, "float32", 0, 0, 2048, device=gpu,
                               device_memory_bytes=device_bytes)
    assert plan().num_blocks == aot.num_blocks
    assert memory.size_gpu_pool(0.5) is False       # an explicit (or earlier) fraction wins

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")   # JAX's default pool: 75 %
    stats["bytes_limit"] = int(0.75 * device_bytes)
    assert plan().budget_bytes == int(0.75 * device_bytes)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    stats["bytes_limit"] = int(0.95 * device_bytes)
    assert abs(plan().budget_bytes - 0.9 * device_bytes) < 2

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
    # 90 % of a 10 GiB GPU is the 9 GiB pool: all of it, less what is in use and the room
    # kept for compiles
    assert plan.budget_bytes == (9 << 30) - (1 << 30) - (100 << 20) - plan.compile_headroom_bytes
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
    headroom = plan().compile_headroom_bytes
    assert plan().budget_bytes == int(0.75 * device_bytes) - headroom
    assert plan().source.startswith("bound by JAX's pool")
    # a pool larger than XLA's limit: the compiler's bound decides (80 % of the device)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    stats["bytes_limit"] = int(0.95 * device_bytes)
    assert plan().budget_bytes == memory.xla_kv_budget_bytes(device_bytes, 0, 0)
    assert plan().source.startswith("bound by XLA's limit")


LLAMA_8B = ModelArch("LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                     intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                     head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)


def test_a_gpu_plan_keeps_room_for_the_autotuner_of_a_late_compile():
    """The cache is allocated after warm-up's compiles; a bucket compiled later autotunes
    its GEMMs on fresh operand copies, the largest the LM head (128256 x 4096 bf16, about
    1 GiB), beside a running step's activations: an H200 plan keeps that free."""
    from jaxserve.platforms.gpu_targets import load_target

    device_bytes = load_target("h200").device_memory_bytes
    weights, peak = 16 << 30, 805 << 20
    plan = memory.plan_kv_cache(CacheConfig(), LLAMA_8B, "bfloat16", weights, peak, 8192,
                                device_memory_bytes=device_bytes)
    lm_head = 128256 * 4096 * 2
    assert plan.compile_headroom_bytes == lm_head + peak + memory.GPU_COMPILE_SLACK
    share = int(0.9 * device_bytes) - weights - peak - plan.compile_headroom_bytes
    assert plan.budget_bytes == min(share, memory.xla_kv_budget_bytes(device_bytes, weights, peak))
    assert plan.total_bytes <= plan.budget_bytes
    assert "compile headroom" in plan.describe()
    # the weights' dtype sizes the copy, not an fp8 cache's
    fp8 = memory.plan_kv_cache(CacheConfig(), LLAMA_8B, "float8_e4m3fn", weights, peak, 8192,
                               device_memory_bytes=device_bytes, compute_dtype="bfloat16")
    assert fp8.compile_headroom_bytes == plan.compile_headroom_bytes
    # tensor parallel: each device holds 1/tp of the LM head
    tp2 = memory.plan_kv_cache(CacheConfig(), LLAMA_8B, "bfloat16", weights // 2, peak, 8192,
                               tp_size=2, device_memory_bytes=device_bytes)
    assert tp2.compile_headroom_bytes == lm_head // 2 + peak + memory.GPU_COMPILE_SLACK


def test_cpu_plans_and_explicit_budgets_keep_no_compile_headroom(monkeypatch):
    monkeypatch.setattr(memory, "available_host_memory", lambda: 24 << 30)
    cpu = memory.plan_kv_cache(CacheConfig(), ARCH, "float32", 0, 0, 2048, device=CPU)
    explicit = memory.plan_kv_cache(CacheConfig(kv_cache_memory_bytes=1 << 30), LLAMA_8B,
                                    "bfloat16", 0, 0, 8192, device_memory_bytes=150 << 30)
    assert cpu.compile_headroom_bytes == 0 == explicit.compile_headroom_bytes
    assert explicit.budget_bytes == 1 << 30


def test_a_gpu_plan_stays_inside_the_limit_xla_compiles_the_step_for():
    """XLA plans a GPU step within 80 % of the device (its base limit; JAX sets no
    device_memory_size): the step's arguments (weights, the aliased KV cache, its inputs) plus
    its temporaries over the 95 % slop factor. On an H200 at 90 % utilization that bound is
    the tighter one and decides; at 70 % the utilization share does. The source says which."""
    from jaxserve.platforms.gpu_targets import load_target

    device_bytes = load_target("h200").device_memory_bytes
    weights, peak = 16 << 30, 805 << 20
    base = device_bytes * 80 // 100
    assert base == 120259084288          # what XLA logs as the H200's base limit

    plan = memory.plan_kv_cache(CacheConfig(), LLAMA_8B, "bfloat16", weights, peak, 8192,
                                device_memory_bytes=device_bytes)
    arguments = weights + plan.total_bytes + memory.XLA_STEP_IO_SLACK
    assert arguments + -(-peak * 100 // 95) <= base
    assert base - (arguments + peak * 100 // 95) < plan.bytes_per_block    # and fills it
    assert plan.source.startswith("bound by XLA's limit (80% of 140.0 GiB")
    assert plan.budget_bytes < int(0.9 * device_bytes) - weights - peak - \
        plan.compile_headroom_bytes

    low = memory.plan_kv_cache(CacheConfig(gpu_memory_utilization=0.7), LLAMA_8B, "bfloat16",
                               weights, peak, 8192, device_memory_bytes=device_bytes)
    assert low.budget_bytes == int(0.7 * device_bytes) - weights - peak - \
        low.compile_headroom_bytes
    assert low.source.startswith("bound by 70% of 140.0 GiB device memory")


def test_an_explicit_kv_budget_over_xlas_limit_is_kept_and_warned_about(caplog):
    """--kv-cache-memory-bytes is taken as given, as in vLLM; past the compiler's limit the
    plan says so once, before XLA says it at every bucket."""
    device_bytes = 150 << 30
    limit = memory.xla_kv_budget_bytes(device_bytes, 16 << 30, 0)
    with caplog.at_level("WARNING", logger=memory.__name__):
        within = memory.plan_kv_cache(CacheConfig(kv_cache_memory_bytes=limit), LLAMA_8B,
                                      "bfloat16", 16 << 30, 0, 8192,
                                      device_memory_bytes=device_bytes)
        assert caplog.records == []
        over = memory.plan_kv_cache(CacheConfig(kv_cache_memory_bytes=limit + (1 << 30)),
                                    LLAMA_8B, "bfloat16", 16 << 30, 0, 8192,
                                    device_memory_bytes=device_bytes)
    assert within.budget_bytes == limit and over.budget_bytes == limit + (1 << 30)
    (record,) = caplog.records
    assert "1.00 GiB over what XLA's memory limit" in record.getMessage()

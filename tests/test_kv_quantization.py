"""fp8 (e4m3) KV cache: write_kv quantizes, the reference and the Pallas kernel read it
(jaxserve/quantization/kv.py), and the memory plan counts its blocks at 1 byte a value."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import CacheConfig, EngineConfig
from jaxserve.runner.memory import plan_kv_cache
from pallas_kernels import ragged_paged_attention, write_kv
from tests.test_kernels import (
    INTERPRET,
    REFERENCE_KNOBS,
    assert_close_on_valid_rows,
    naive_attention,
    reference,
    sweep_batches,
)
from tests.test_memory_plan import ARCH, CPU
from tests.test_quantization import compile_events

FP8 = jnp.float8_e4m3fn


def _fp8_args(batch):
    args = list(batch.args())
    args[1], args[2] = args[1].astype(FP8), args[2].astype(FP8)
    dequantized = dataclasses.replace(
        batch, k_cache=np.asarray(args[1], np.float32), v_cache=np.asarray(args[2], np.float32))
    return args, dequantized


@pytest.mark.parametrize("name", ["gqa8to1_d64_bs16", "mha_d64_bs16"])
def test_reference_reads_fp8_kv_as_dense_attention_on_the_dequantized_values(name):
    for batch in sweep_batches(name):
        args, dequantized = _fp8_args(batch)
        out = reference(*args, **REFERENCE_KNOBS[name])
        assert out.dtype == jnp.float32
        assert_close_on_valid_rows(out, naive_attention(dequantized), batch, atol=1e-5)


def test_kernel_reads_fp8_kv_as_dense_attention_on_the_dequantized_values():
    for batch in sweep_batches("gqa8to1_d64_bs16", 2):
        args, dequantized = _fp8_args(batch)
        out = ragged_paged_attention(*args, interpret=INTERPRET)
        assert_close_on_valid_rows(out, naive_attention(dequantized), batch, atol=1e-5)


def test_write_kv_fp8_round_trips_within_half_a_step_and_saturates():
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((40, 2, 16)) * np.exp(rng.uniform(-6, 5, (40, 2, 16))))
    k = k.astype(np.float32)
    k[0, 0, 0], k[0, 0, 1] = 1000.0, -3000.0          # beyond e4m3's 448
    cache = jnp.zeros((8, 8, 2, 16), FP8)
    slots = jnp.asarray(rng.permutation(64)[:40], jnp.int32)
    new_k, _ = write_kv(cache, cache, jnp.asarray(k), jnp.asarray(k), slots)
    stored = np.asarray(new_k.astype(jnp.float32)).reshape(64, 2, 16)[np.asarray(slots)]
    assert np.isfinite(stored).all()
    assert stored[0, 0, 0] == 448.0 and stored[0, 0, 1] == -448.0
    x = np.abs(np.clip(k, -448, 448))
    exponent = np.floor(np.log2(np.maximum(x, 2.0**-6)))
    step = 2.0 ** (exponent - 3)                       # e4m3: 3 mantissa bits
    assert np.all(np.abs(stored - np.clip(k, -448, 448)) <= step / 2 + 1e-12)
    assert np.dtype(ml_dtypes.float8_e4m3fn).itemsize == 1


def test_fp8_kv_budget_holds_four_times_the_tokens_of_float32():
    cache = CacheConfig(kv_cache_memory_bytes=64 << 20)
    f32 = plan_kv_cache(cache, ARCH, jnp.float32, 0, 0, 2048, device=CPU)
    fp8 = plan_kv_cache(cache, ARCH, FP8, 0, 0, 2048, device=CPU)
    assert fp8.capacity_tokens >= 3.9 * f32.capacity_tokens


def test_fp8_kv_engine_uses_reference_on_cpu_and_refuses_the_cpp_kernel(make_tiny_model):
    with pytest.raises(ValueError, match="reads float32/bfloat16/float16 KV caches only"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8", attention_backend="cpu").finalize("cpu")
    with pytest.raises(ValueError, match="int8"):
        LLM(str(make_tiny_model("llama")), kv_cache_dtype="int8", max_model_len=64)
    kwargs = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                  kv_cache_memory_bytes=2 << 20)
    llm = LLM(str(make_tiny_model("llama")), kv_cache_dtype="fp8", **kwargs)
    setup = llm.llm_engine.setup
    assert setup.runner.k_cache.dtype == FP8
    assert setup.runner.model.backend.name == "reference"
    f32_tokens = (2 << 20) // (2 * ARCH_TINY_BYTES_PER_TOKEN_F32)
    assert setup.kv_plan.capacity_tokens >= 3.9 * f32_tokens - 16
    with compile_events() as compiles:
        out = llm.generate(["Hello, world!", "A longer prompt " * 5], SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert compiles == [] and len(out[1].outputs[0].token_ids) == 8


# tiny llama (tests/conftest.py): 2 layers, 2 KV heads, head_dim 16, float32 -> K or V bytes
ARCH_TINY_BYTES_PER_TOKEN_F32 = 2 * 2 * 16 * 4

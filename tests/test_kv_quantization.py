"""Quantized KV caches (int8, fp8 e4m3) with per-token-per-head scales: write_kv quantizes
each (token, head) row with its own 1-byte scale code, and every reader (reference, Pallas
kernel, C++ CPU kernel) dequantizes tile by tile (jaxserve/quantization/kv.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import CacheConfig, EngineConfig
from jaxserve.platforms import CpuPlatform
from jaxserve.quantization.kv import (
    FP8_SCALE_SEARCH,
    QuantizedKV,
    dequantize_np,
    empty_cache,
    head_rotation,
    quantize_rows,
    rotate_heads,
)
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
KV_DTYPES = {"int8": jnp.int8, "fp8": FP8}


def _quantized_args(batch, dtype, rng):
    """The batch's caches quantized (rows of widely varying magnitude, so scale codes
    differ row to row), and the same batch with the dequantized values as its caches."""
    args = list(batch.args())
    dequantized = {}
    for i, name in ((1, "k_cache"), (2, "v_cache")):
        x = np.asarray(args[i]) * np.exp(rng.uniform(-3, 1, args[i].shape[:-1] + (1,)))
        values, codes = quantize_rows(jnp.asarray(x, jnp.float32), dtype)
        args[i] = QuantizedKV(values, codes)
        dequantized[name] = dequantize_np(np.asarray(values.astype(jnp.float32)), codes)
        assert len(np.unique(np.asarray(codes))) > 10
    return args, dataclasses.replace(batch, **dequantized)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("name", ["gqa8to1_d64_bs16", "mha_d64_bs16"])
def test_reference_reads_quantized_kv_as_dense_attention_on_the_dequantized_values(name, kv):
    rng = np.random.default_rng(1)
    for batch in sweep_batches(name, 2):
        args, dequantized = _quantized_args(batch, KV_DTYPES[kv], rng)
        out = reference(*args, **REFERENCE_KNOBS[name])
        assert out.dtype == jnp.float32
        assert_close_on_valid_rows(out, naive_attention(dequantized), batch, atol=1e-5)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_kernel_reads_quantized_kv_as_dense_attention_on_the_dequantized_values(kv):
    rng = np.random.default_rng(2)
    for batch in sweep_batches("gqa8to1_d64_bs16", 2):
        args, dequantized = _quantized_args(batch, KV_DTYPES[kv], rng)
        out = ragged_paged_attention(*args, interpret=INTERPRET)
        assert_close_on_valid_rows(out, naive_attention(dequantized), batch, atol=1e-5)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_cpu_kernel_reads_quantized_kv_as_dense_attention_on_the_dequantized_values(kv):
    from jaxserve.attention.cpu import loader, paged_attention

    if jax.default_backend() != "cpu" or loader.find_compiler() is None:
        pytest.skip("the C++ kernel needs the CPU platform and a C++ compiler")
    rng = np.random.default_rng(3)
    for name in ("gqa8to1_d64_bs16", "mha_d64_bs16"):
        for batch in sweep_batches(name, 2):
            args, dequantized = _quantized_args(batch, KV_DTYPES[kv], rng)
            out = jax.jit(paged_attention)(*args)
            assert_close_on_valid_rows(out, naive_attention(dequantized), batch, atol=1e-5)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_write_kv_round_trips_within_one_quantization_step(kv):
    dtype = KV_DTYPES[kv]
    rng = np.random.default_rng(0)
    # rows spanning 2^-9 .. 2^7 in magnitude: a static scale could not serve them all
    k = (rng.standard_normal((40, 2, 16)) * np.exp(rng.uniform(-6, 5, (40, 2, 1))))
    k = k.astype(np.float32)
    k[0, 0, 0] = 1e6                                     # beyond e4m3's 448 unscaled
    cache = empty_cache((8, 8, 2, 16), dtype)
    slots = rng.permutation(64)[:40].astype(np.int32)
    slots[5] = -1                                        # -1: not written
    new_k, new_v = write_kv(cache, cache, jnp.asarray(k), jnp.asarray(-k), jnp.asarray(slots))
    assert isinstance(new_k, QuantizedKV) and new_k.data.dtype == dtype
    values = np.asarray(new_k.data.astype(jnp.float32)).reshape(64, 2, 16)
    codes = np.asarray(new_k.scale).reshape(64, 2, 1)
    stored = dequantize_np(values, codes)
    written = slots >= 0
    got, want = stored[slots[written]], k[written]
    scale = np.exp2(codes[slots[written]] / 8.0)
    amax = np.abs(want).max(-1, keepdims=True)
    # each row's scale: its max|x| at the dtype's top, rounded up to the 2^(1/8) grid
    # (codes stop at 2^-16: tinier rows are stored on that finer-than-needed grid); fp8
    # rows may take any of the octave's 8 codes from there, the one with least error
    top = float(jnp.finfo(dtype).max) if kv == "fp8" else 127.0
    ideal = np.maximum(amax / top, 2.0**-16)
    octaves = FP8_SCALE_SEARCH / 8 if kv == "fp8" else 0
    assert np.all(scale >= ideal * 0.9999) and np.all(scale < ideal * 1.091 * 2**octaves)
    if kv == "int8":
        step = scale                                     # uniform grid of the row's scale
        assert np.all(np.abs(got - want) <= step / 2 * 1.0001)
    else:
        y = np.abs(want) / scale                         # e4m3: 3 mantissa bits, scaled
        step = 2.0 ** (np.floor(np.log2(np.maximum(y, 2.0**-6))) - 3) * scale
        assert np.all(np.abs(got - want) <= step / 2 * 1.0001)
    # the slot skipped (and never written) keeps zeros; V is stored alike (negated)
    untouched = np.setdiff1d(np.arange(64), slots[written])
    assert not values[untouched].any() and not codes[untouched].any()
    v_stored = dequantize_np(np.asarray(new_v.data.astype(jnp.float32)).reshape(64, 2, 16),
                             np.asarray(new_v.scale).reshape(64, 2, 1))
    np.testing.assert_array_equal(v_stored[slots[written]], -got)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_quantized_kv_budget_holds_at_least_3_9x_the_tokens_of_float32(kv):
    cache = CacheConfig(kv_cache_memory_bytes=64 << 20)
    f32 = plan_kv_cache(cache, ARCH, jnp.float32, 0, 0, 2048, device=CPU)
    quantized = plan_kv_cache(cache, ARCH, KV_DTYPES[kv], 0, 0, 2048, device=CPU)
    # head_dim 64: 256 bytes a head-token in float32, 64 + 1 (the scale code) quantized
    assert quantized.bytes_per_block * 256 == f32.bytes_per_block * 65
    assert quantized.capacity_tokens >= 3.9 * f32.capacity_tokens


def test_quantized_kv_engines_serve_on_the_cpu_kernel_close_to_float32(make_tiny_model):
    kwargs = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                  kv_cache_memory_bytes=1 << 20)
    model = str(make_tiny_model("llama"))
    ref = LLM(model, **kwargs)
    tok = ref.get_tokenizer()
    prompts = ["Hello, world!", "A longer prompt " * 5]
    ids = [tok.encode(p) for p in prompts]
    ref_logits = np.concatenate([ref.llm_engine.prompt_logits(p) for p in ids])
    # tiny llama (tests/conftest.py): 2 layers, 2 KV heads, head_dim 16 -> K+V bytes/token
    f32_tokens = (1 << 20) // (2 * 2 * 2 * 16 * 4)
    del ref
    for kv in sorted(KV_DTYPES):
        CpuPlatform().resolve_config(
            EngineConfig.from_kwargs(kv_cache_dtype=kv, attention_backend="cpu"))
        llm = LLM(model, kv_cache_dtype=kv, **kwargs)
        setup = llm.llm_engine.engine_core.setup
        assert isinstance(setup.runner.k_cache, QuantizedKV)
        assert setup.runner.k_cache.dtype == KV_DTYPES[kv]
        assert setup.runner.model.backend.name == "cpu"          # auto: the C++ kernel
        assert setup.kv_plan.capacity_tokens >= 3.7 * f32_tokens - 16   # 64 / 17 at D = 16
        with compile_events() as compiles:
            out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True), use_tqdm=False)
        assert compiles == [] and len(out[1].outputs[0].token_ids) == 8
        logits = np.concatenate([llm.llm_engine.prompt_logits(p) for p in ids])
        # e4m3 keeps 3 mantissa bits, int8 ~7 over each row's range
        diff = np.abs(logits - ref_logits).max() / ref_logits.std()
        print(f"{kv} KV, tiny model: max logit diff / spread {diff:.3f}")
        assert diff < {"int8": 0.1, "fp8": 0.4}[kv]
        assert not np.array_equal(logits, ref_logits)        # the cache really is quantized
        del llm, setup


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_cpu_kernel_quantized_rows_off_the_simd_width_match_the_reference(kv):
    """head_dim 20: the C++ kernel's scalar path and its conversion tails (not a multiple of
    the SIMD width), on rows spanning 2^-11 .. 2^4 (fp8 subnormals inside scaled rows)."""
    from jaxserve.attention.cpu import loader, paged_attention

    if jax.default_backend() != "cpu" or loader.find_compiler() is None:
        pytest.skip("the C++ kernel needs the CPU platform and a C++ compiler")
    rng = np.random.default_rng(4)
    seqs, heads, kv_heads, dim, block = 3, 4, 2, 20, 8
    shape = (seqs * 5, block, kv_heads, dim)

    def cache(spread):
        x = rng.standard_normal(shape) * np.exp(rng.uniform(-spread, 3, shape[:-1] + (1,)))
        return QuantizedKV(*quantize_rows(jnp.asarray(x, jnp.float32), KV_DTYPES[kv]))

    q = jnp.asarray(rng.standard_normal((seqs, heads, dim)), jnp.float32)
    k, v = cache(8), cache(2)
    tables = jnp.asarray(rng.permutation(seqs * 5).reshape(seqs, 5), jnp.int32)
    args = (q, k, v, jnp.asarray([37, 20, 5], jnp.int32), tables,
            jnp.arange(seqs + 1, dtype=jnp.int32), seqs)
    out = paged_attention(*args)
    np.testing.assert_allclose(out, reference(*args), atol=1e-5)


def test_fp8_rows_take_the_code_of_least_error_and_never_saturate():
    """fp8's scale search: each row's squared error is at most that of the smallest code
    covering its max |x| (and of every other code of the octave); no value clips."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 64)) * np.exp(rng.uniform(-4, 4, (256, 1)))
    x[:, 3] += 20 * np.exp(rng.uniform(-1, 1, 256))             # an outlier channel
    x = jnp.asarray(x, jnp.float32)
    values, codes = quantize_rows(x, FP8)
    got = dequantize_np(np.asarray(values.astype(jnp.float32)), np.asarray(codes))
    err = ((got - np.asarray(x)) ** 2).sum(-1)
    amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    first = np.ceil(np.log2(amax / 448.0) * 8)
    for step in range(FP8_SCALE_SEARCH):
        scale = np.exp2((first + step) / 8)
        other = np.clip(np.asarray(x) / scale, -448, 448).astype(FP8).astype(np.float32)
        assert np.all(err <= ((other * scale - np.asarray(x)) ** 2).sum(-1) * (1 + 1e-6))
    assert np.all(np.abs(np.asarray(values.astype(jnp.float32))) <= 448)
    assert len(np.unique(np.asarray(codes) - first[:, 0])) > 1     # the search does pick


@pytest.mark.parametrize("head_dim", [64, 128, 80, 20])
def test_head_rotation_is_orthogonal_and_symmetric(head_dim):
    r = head_rotation(head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    np.testing.assert_array_equal(r, r.T)
    if head_dim in (64, 128):   # a full Hadamard: every entry +-1/sqrt(D)
        np.testing.assert_allclose(np.abs(r), head_dim ** -0.5, rtol=1e-6)


@pytest.mark.parametrize("name", ["gqa8to1_d64_bs16", "mha_d64_bs16"])
def test_rotated_qkv_leave_paged_attention_unchanged(name):
    """What paged_self_attention does for quantized caches, on float32 caches: q, K and V
    rotated over the head dim, the output rotated back, equals plain attention (f32)."""
    rot = head_rotation(64)
    for batch in sweep_batches(name, 2):
        q, k_cache, v_cache, *rest = batch.args()
        plain = reference(q, k_cache, v_cache, *rest, **REFERENCE_KNOBS[name])
        rotated = reference(rotate_heads(q, rot), rotate_heads(k_cache, rot),
                            rotate_heads(v_cache, rot), *rest, **REFERENCE_KNOBS[name])
        assert_close_on_valid_rows(rotate_heads(rotated, rot.T), plain, batch, atol=1e-5)

"""The C++ CPU attention kernel (jaxserve.attention.cpu) against the jnp reference and a dense
float64 oracle, the two optional attributes (sliding window, logits soft cap), the engine
with the `cpu` backend, and the build's failure path."""

from __future__ import annotations

import functools
import logging
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention.cpu import loader, paged_attention
from pallas_kernels import ragged_paged_attention_reference, write_kv
from tests import precision
from tests.test_kernels import SWEEPS, Batch, make_batch, random_batch


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    """Build once; skip (not fail) only where no C++ compiler exists at all."""
    try:
        return loader.register()
    except loader.CpuAttentionBuildError:
        if loader.find_compiler() is None:
            pytest.skip("no C++ compiler: the cpu attention backend cannot be built here")
        raise


STATIC = ("sm_scale", "sliding_window", "logits_soft_cap")
kernel = jax.jit(paged_attention, static_argnames=STATIC)
reference = jax.jit(ragged_paged_attention_reference,
                    static_argnames=STATIC + ("block_q", "kv_chunk_blocks"))


def naive(batch: Batch, sliding_window: int = 0, logits_soft_cap: float = 0.0) -> np.ndarray:
    """Dense per-token causal attention in float64, with the optional window and soft cap."""
    q = batch.q.astype(np.float64)
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for i in range(batch.num_seqs):
        start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        kv_len = int(batch.kv_lens[i])
        keys = np.arange(kv_len)
        pages = batch.block_tables[i, keys // block_size]
        k = np.repeat(batch.k_cache[pages, keys % block_size].astype(np.float64), group, axis=1)
        v = np.repeat(batch.v_cache[pages, keys % block_size].astype(np.float64), group, axis=1)
        for j, t in enumerate(range(start, end)):
            pos = kv_len - (end - start) + j
            logits = np.einsum("hd,lhd->hl", q[t], k) * head_dim**-0.5
            if logits_soft_cap:
                logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
            visible = keys <= pos
            if sliding_window:
                visible &= pos - keys < sliding_window
            logits = np.where(visible, logits, -np.inf)
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            out[t] = np.einsum("hl,lhd->hd", p / p.sum(axis=-1, keepdims=True), v)
    return out


def to_f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32))


def check(actual, expected, batch: Batch, rtol: float = 1e-5, atol: float = 1e-6):
    """Close on the live tokens' rows; every other row exactly 0; everything finite."""
    actual, expected = to_f32(actual), np.asarray(expected, np.float64)
    n = batch.num_valid_tokens
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual[:n], expected[:n], rtol=rtol, atol=atol)
    assert not actual[n:].any(), "padding tokens must give zero rows"


def decode_batch(rng, *, num_q_heads, num_kv_heads, block_size, head_dim=64,
                 num_seqs=10) -> Batch:
    """Decodes. From 8 sequences on, the kernel gives each task all kv heads of one."""
    kv_lens = [1, 5, block_size, block_size + 1, 37, 64, 90, 2, 130, 33][:num_seqs]
    return make_batch(rng, [1] * len(kv_lens), kv_lens, num_q_heads=num_q_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                      pad_seqs=2, pad_tokens=3)


def mixed_batch(rng, *, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16) -> Batch:
    """Decodes, a prefill from scratch longer than one query block, chunked prefills."""
    q_lens = [1, 70, 1, 9, 33, 1]
    kv_lens = [50, 70, 3, 40, 150, 17]
    return make_batch(rng, q_lens, kv_lens, num_q_heads=num_q_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                      pad_seqs=2, pad_tokens=5)


@pytest.mark.parametrize("heads,block_size,dtype,num_seqs", [
    ((4, 4), 16, "float32", 10), ((9, 3), 16, "float32", 10), ((9, 3), 8, "float32", 4),
    ((8, 2), 8, "float32", 10), ((9, 3), 8, "bfloat16", 10), ((8, 2), 16, "bfloat16", 5),
    ((4, 4), 8, "bfloat16", 9)])
def test_decode_matches_reference(heads, block_size, dtype, num_seqs):
    rng = np.random.default_rng(zlib.crc32(f"{heads}{block_size}".encode()))
    batch = decode_batch(rng, num_q_heads=heads[0], num_kv_heads=heads[1], block_size=block_size,
                         num_seqs=num_seqs)
    args = batch.args(jnp.dtype(dtype))
    out = kernel(*args)
    assert out.dtype == jnp.dtype(dtype) and out.shape == batch.q.shape
    if dtype == "float32":
        check(out, reference(*args), batch)
        check(out, naive(batch), batch, atol=1e-5)
    else:  # both round float32 rows to bfloat16: at most one bf16 ulp apart
        check(out, to_f32(reference(*args)), batch, rtol=2**-7, atol=2**-9)


@pytest.mark.parametrize("name", list(SWEEPS))
def test_ragged_prefill_decode_mixes_match_reference_and_oracle(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for _ in range(3):
        batch = random_batch(rng, **SWEEPS[name])
        out = kernel(*batch.args())
        check(out, reference(*batch.args()), batch)
        check(out, naive(batch), batch, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 8])
def test_long_prefill_chunks_and_gqa_mix(block_size):
    batch = mixed_batch(np.random.default_rng(block_size), block_size=block_size)
    out = kernel(*batch.args())
    check(out, reference(*batch.args()), batch)
    check(out, naive(batch), batch, atol=1e-5)


@pytest.mark.parametrize("window,cap", [(1, 0.0), (40, 0.0), (0, 2.0), (0, 30.0), (23, 5.0)])
def test_sliding_window_and_soft_cap_match_reference_and_oracle(window, cap):
    rng = np.random.default_rng(window * 100 + int(cap * 10))
    batch = mixed_batch(rng, block_size=8)
    attrs = {"sliding_window": window, "logits_soft_cap": cap}
    out = kernel(*batch.args(), **attrs)
    expected = naive(batch, **attrs)
    # Reference chunks of 2 pages: windows straddle its chunk edges too.
    ref = reference(*batch.args(), kv_chunk_blocks=2, **attrs)
    check(ref, expected, batch, atol=1e-5)
    check(out, ref, batch)
    check(out, expected, batch, atol=1e-5)
    # They change the result: the attributes are really applied.
    assert np.abs(to_f32(out) - naive(batch)).max() > 1e-3


def test_sliding_window_is_a_traced_operand_one_compile_for_every_window():
    # A per-layer window scanned over layers reaches the kernel as a traced int32.
    batch = mixed_batch(np.random.default_rng(5), block_size=8)
    # A function of our own: jit caches are per function, and other tests jit paged_attention.
    traced = jax.jit(lambda *args: paged_attention(*args[:7], sliding_window=args[7]))
    for window in (23, 0, 1):
        check(traced(*batch.args(), jnp.int32(window)),
              naive(batch, sliding_window=window), batch, atol=1e-5)
    assert traced._cache_size() == 1


@pytest.mark.parametrize("head_dim,block_size,window,cap", [
    (64, 16, 0, 0.0), (64, 8, 23, 5.0), (128, 16, 40, 0.0), (32, 8, 0, 30.0), (48, 16, 0, 0.0)])
def test_bf16_prefill_and_decode_mixes_match_the_float32_path_on_the_same_values(
        head_dim, block_size, window, cap):
    """bf16 q and cache (the bf16 engine's call). Where the CPU has AVX512-BF16 and head_dim
    is a multiple of 32 the kernel reads the rows in place with bf16 dot products
    (paged_attention.cc Bf16Rows); elsewhere it converts them to float32 first. Either way:
    the float32 kernel on the same bf16-rounded values, rounded once to bf16, and the
    reference, within one bf16 ulp."""
    batch = mixed_batch(np.random.default_rng(head_dim + block_size), head_dim=head_dim,
                        block_size=block_size)
    attrs = {"sliding_window": window, "logits_soft_cap": cap}
    args = batch.args(jnp.bfloat16)
    out = kernel(*args, **attrs)
    assert out.dtype == jnp.bfloat16
    same_values = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    exact = to_f32(kernel(*same_values, **attrs))
    check(out, exact, batch, rtol=2**-7, atol=2**-9)
    check(out, to_f32(reference(*args, **attrs)), batch, rtol=2**-7, atol=2**-9)
    # ~all rows land on the bf16 rounding of the float32 result (not merely near it)
    live = to_f32(out)[:batch.num_valid_tokens]
    rounded = to_f32(jnp.asarray(exact[:batch.num_valid_tokens], jnp.bfloat16))
    assert np.mean(live == rounded) > 0.97


@pytest.mark.parametrize("head_dim", [16, 32, 48, 80, 128, 256])
def test_head_dims_on_simd_and_scalar_paths(head_dim):
    batch = mixed_batch(np.random.default_rng(head_dim), num_q_heads=4, num_kv_heads=2,
                        head_dim=head_dim)
    check(kernel(*batch.args()), reference(*batch.args()), batch)


@pytest.mark.parametrize("q_dtype,cache_dtype", [("float32", "bfloat16"), ("float32", "float16"),
                                                 ("float16", "float16"), ("bfloat16", "float32")])
def test_mixed_and_half_dtypes_accumulate_in_float32(q_dtype, cache_dtype):
    batch = mixed_batch(np.random.default_rng(7))
    q, k, v, *meta = batch.args()
    args = (q.astype(q_dtype), k.astype(cache_dtype), v.astype(cache_dtype), *meta)
    out = kernel(*args)
    assert out.dtype == jnp.dtype(q_dtype)
    if q_dtype == "float32":  # no output rounding: as tight as float32
        check(out, reference(*args), batch)
    else:
        check(out, to_f32(reference(*args)), batch, rtol=2**-7, atol=2**-9)


def test_num_seqs_is_traced_and_padding_rows_are_zero():
    batch = mixed_batch(np.random.default_rng(11))
    traces = []

    @jax.jit
    def run(num_seqs, *args):
        traces.append(1)
        return paged_attention(*args, num_seqs)

    q, k, v, kv_lens, tables, qsl, _ = batch.args()
    for num_seqs in (batch.num_seqs, 3, 1, 0):
        out = run(jnp.int32(num_seqs), q, k, v, kv_lens, tables, qsl)
        ref = reference(q, k, v, kv_lens, tables, qsl, jnp.int32(num_seqs))
        live = int(batch.query_start_loc[num_seqs])
        np.testing.assert_allclose(to_f32(out), to_f32(ref), rtol=1e-5, atol=1e-6)
        assert not to_f32(out)[live:].any()
    assert len(traces) == 1


def test_never_reads_cache_rows_past_kv_lens_or_unnamed_pages():
    # Every cache row no sequence owns below its kv_len is NaN (block tables also hold
    # garbage ids past each sequence's pages): one stray read turns the output NaN.
    rng = np.random.default_rng(3)
    for name in ("gqa3to1_d128_bs32", "gqa8to1_d64_bs16"):
        batch = random_batch(rng, garbage=np.nan, **SWEEPS[name])
        check(kernel(*batch.args()), naive(batch), batch, atol=1e-5)
    kv_lens = [1, 17, 30, 5, 64, 3, 47, 16, 100]  # decodes: tasks take all kv heads
    batch = make_batch(rng, [1] * len(kv_lens), kv_lens, num_q_heads=9, num_kv_heads=3,
                       head_dim=64, block_size=16, pad_seqs=1, pad_tokens=2, garbage=np.nan)
    check(kernel(*batch.args()), naive(batch), batch, atol=1e-5)


def test_whole_multi_layer_cache_with_offset_tables():
    num_layers = 3
    batch = mixed_batch(np.random.default_rng(5))
    q, k, v, kv_lens, tables, qsl, num_seqs = batch.args()
    num_blocks = k.shape[0]
    # Other layers' blocks are NaN, this layer's are the batch's: only named pages may be read.
    for layer in range(num_layers):
        def stack(cache):
            layers = [np.full(cache.shape, np.nan, np.float32)] * num_layers
            layers[layer] = np.asarray(cache)
            return jnp.asarray(np.concatenate(layers))

        offset = tables + layer * num_blocks
        out = kernel(q, stack(k), stack(v), kv_lens, offset, qsl, num_seqs)
        check(out, reference(q, k, v, kv_lens, tables, qsl, num_seqs), batch)


def test_inside_lax_scan_over_layers_with_the_whole_cache_as_carry():
    """As the model calls it: per layer write_kv then attention on the multi-layer cache."""
    num_layers, num_blocks, block_size, hkv, hq, d = 3, 24, 16, 3, 9, 64
    rng = np.random.default_rng(8)
    q_lens, kv_lens = [1, 12, 1, 5], [40, 12, 77, 30]
    base = make_batch(rng, q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                      block_size=block_size, num_blocks=num_blocks, pad_seqs=1, pad_tokens=2)
    num_tokens = base.q.shape[0]
    # Slots of this step's tokens: their positions in their sequence's pages; -1 for padding.
    slots = np.full(num_tokens, -1, np.int32)
    for i in range(base.num_seqs):
        start, end = base.query_start_loc[i], base.query_start_loc[i + 1]
        for j, t in enumerate(range(start, end)):
            pos = kv_lens[i] - (end - start) + j
            slots[t] = base.block_tables[i, pos // block_size] * block_size + pos % block_size
    shape = (num_layers * num_blocks, block_size, hkv, d)
    caches = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)]
    xs = [jnp.asarray(rng.standard_normal((num_layers, num_tokens, h, d)), jnp.float32)
          for h in (hq, hkv, hkv)]
    meta = (jnp.asarray(base.kv_lens), jnp.asarray(base.block_tables),
            jnp.asarray(base.query_start_loc), jnp.int32(base.num_seqs), jnp.asarray(slots))

    def model(attention):
        @functools.partial(jax.jit, donate_argnums=(0, 1))  # as the runner donates the caches
        def run(k_cache, v_cache, qs, ks, vs, kv_lens, tables, qsl, num_seqs, slots):
            def layer(carry, inputs):
                k_cache, v_cache = carry
                i, q, k, v = inputs
                offset = i * num_blocks
                layer_slots = jnp.where(slots >= 0, slots + offset * block_size, -1)
                k_cache, v_cache = write_kv(k_cache, v_cache, k, v, layer_slots)
                out = attention(q, k_cache, v_cache, kv_lens, tables + offset, qsl, num_seqs)
                return (k_cache, v_cache), out

            layers = jnp.arange(num_layers, dtype=jnp.int32)
            return jax.lax.scan(layer, (k_cache, v_cache), (layers, qs, ks, vs))
        return run

    args = (*xs, *meta)
    hlo = model(paged_attention).lower(*caches, *args).compile().as_text()
    (k_out, v_out), out = model(paged_attention)(*[c.copy() for c in caches], *args)
    (k_ref, v_ref), ref = model(ragged_paged_attention_reference)(*caches, *args)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_ref))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    n = base.num_valid_tokens
    assert not np.asarray(out)[:, n:].any()
    # The kernel reads the cache where it is: no copy of it in the compiled step.
    cache_type = f"f32[{','.join(map(str, shape))}]"
    copies = [line for line in hlo.splitlines() if " copy(" in line and cache_type in line]
    assert not copies, copies


def test_engine_cpu_backend_gives_the_reference_backends_greedy_tokens(make_tiny_model):
    from jaxserve import LLM, SamplingParams

    model = str(make_tiny_model("qwen3"))
    prompts = [[11, 23, 98, 421, 77], list(range(5, 27)), [300, 301]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "cpu"):
        llm = LLM(model, attention_backend=backend, max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20, **precision.EXACT)
        runner = llm.llm_engine.engine_core.runner
        assert runner.model.backend.name == backend
        # The CPU backend's steps (all of them here: <= the plan's max_library_rows) also
        # read each layer's projection weights in place through the oneDNN library
        # (models/layer_matmul.py); the reference keeps XLA's dot.
        assert runner.plan.cpu_matmul == (backend == "cpu")
        outputs[backend] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "cpu":
            q_kernel = runner.params["params"]["layers"]["self_attn"]["q_proj"]["kernel"] \
                if "self_attn" in runner.params["params"]["layers"] \
                else runner.params["params"]["layers"]["q_proj"]["kernel"]
            sliced = "f32[1,%d,%d]" % q_kernel.shape[1:]
            runner.wait_until_compiled()
            small, big = runner._steps[(1, 1)].as_text(), runner._steps[(16, 4)].as_text()
            for text in (small, big):
                assert "jaxserve_matmul" in text and sliced not in text   # no weight copy
            # Tied logits of >= 2 rows (the (16, 4) bucket samples 4): the library, not
            # XNNPACK (layer_matmul.small_logits); one f32 row keeps XLA's GEMV.
            # (the logits appear once per branch of the step's cond: more calls, not one more)
            assert (big.count("jaxserve_matmul") > small.count("jaxserve_matmul")) == \
                runner.arch.tie_word_embeddings
    assert outputs["cpu"] == outputs["reference"]
    assert all(len(tokens) == 16 for tokens in outputs["cpu"])


def test_missing_compiler_raises_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(tmp_path / "cache"))
    with pytest.raises(loader.CpuAttentionBuildError) as info:
        loader.build()
    message = str(info.value)
    assert "no-such-g++" in message and "--attention-backend reference" in message


def test_broken_compiler_raises_a_clear_error(monkeypatch, tmp_path):
    fake = tmp_path / "fake-g++"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake 1.0 && exit 0\n"
                    "echo 'fatal: out of cheese' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(tmp_path / "cache"))
    with pytest.raises(loader.CpuAttentionBuildError) as info:
        loader.build()
    message = str(info.value)
    assert "out of cheese" in message and "--attention-backend reference" in message
    assert not list((tmp_path / "cache").glob("*.so")), "no half-built library left behind"


def test_auto_backend_is_cpu_when_it_builds_else_reference_with_one_warning(monkeypatch,
                                                                            caplog):
    from jaxserve.platforms import CpuPlatform, GpuPlatform

    assert CpuPlatform().attention_backend_name("auto") == "cpu"
    assert GpuPlatform().attention_backend_name("auto") == "pallas"

    def fail():
        raise loader.CpuAttentionBuildError("no C++ compiler found (test)")

    monkeypatch.setattr(loader, "register", fail)
    monkeypatch.setattr(loader, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        for _ in range(2):
            assert CpuPlatform().attention_backend_name("auto") == "reference"
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_cpu_write_kv_equals_the_xla_scatter_and_writes_bf16_caches_in_place(dtype):
    """XLA:CPU's bf16 / f16 scatter rewrites the whole cache on every write (2 s per SmolLM2
    step with a 256 MiB cache); the CPU backend's write goes through the library instead,
    its results aliasing the donated caches: same values, same buffers."""
    from jaxserve.attention.cpu import write_kv as cpu_write_kv

    rng = np.random.default_rng(5)
    shape, hkv, d = (6, 4, 2, 8), 2, 8
    k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32) for _ in range(2))
    slots = jnp.asarray([7, -1, 0, 23, 40], jnp.int32)    # -1 and out of range: skipped
    expected = jax.jit(write_kv)(k_cache, v_cache, k, v, slots)
    pointers = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    got = jax.jit(cpu_write_kv, donate_argnums=(0, 1))(k_cache, v_cache, k, v, slots)
    for g, e in zip(got, expected):
        assert g.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    assert tuple(g.unsafe_buffer_pointer() for g in got) == pointers
    if dtype != jnp.float32:      # the library checks what it is given
        with pytest.raises(Exception, match="write_kv"):
            cpu_write_kv(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                         jnp.zeros((2, 3, d)), jnp.zeros((2, 3, d)), jnp.zeros((2,), jnp.int32))


def _without_a_compiler(monkeypatch, tmp_path):
    """PATH with no C++ compiler and no $CXX: what a container image's runtime has (and a
    HOME and temp dir of its own, so no library built by another test is found)."""
    import tempfile

    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.mark.fast
def test_a_library_built_for_this_cpu_loads_without_a_compiler(monkeypatch, tmp_path):
    """An image's build stage compiles the kernels and its runtime has no g++: the library
    with this machine's build key is found in $JAXSERVE_FFI_CACHE whichever compiler made it;
    one whose key differs (another CPU, other sources) is not, and the error names both."""
    from jaxserve.kernels.cpu import build as kernel_build

    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(prebuilt))
    key = kernel_build.build_key(loader.LIBRARY)
    (prebuilt / f"paged_attention-{'0' * 20}-deadbeef.so").write_bytes(b"another CPU's")
    _without_a_compiler(monkeypatch, tmp_path)
    with pytest.raises(loader.CpuAttentionBuildError) as info:
        loader.build()
    assert "no C++ compiler" in str(info.value) and str(prebuilt) in str(info.value)
    ours = prebuilt / f"paged_attention-{key}-0123abcd.so"
    ours.write_bytes(b"built in the image's build stage")
    (prebuilt / f"paged_attention-{key}-0123abcd.77.tmp.so").write_bytes(b"half-built")
    assert loader.build() == ours

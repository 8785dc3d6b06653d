"""The GGUF block kernels (jaxserve/kernels/cpu/gemv_gguf.h) against a plain reference:
gguf-py's numpy dequantization (gguf.quants.dequantize) and a float64 matmul, on random
blocks, for every instruction-set build: this CPU's (AVX512-VNNI here), AVX2-only (what CI
boxes may have) and no SIMD at all (the portable fallback build).

The kernel quantizes x to 8 bits per 32-block (as llama.cpp's vec_dot does), so its products
are checked twice: against x quantized the same way in numpy (equal to float rounding) and
against float x within the rounding's worst case, sum_j |w_j| * (x's step / 2) per output.
Formats: Q8_0, Q4_0, Q4_1 and the K-quants Q4_K, Q5_K, Q6_K (what Q4_K_M / Q5_K_M / Q6_K
downloads hold)."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.cpu import build, matmul

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not matmul.available(),
                                reason="needs the CPU backend and oneDNN (onednn-cpu-gomp)")

# weights and bytes per block, where its float16 scales sit (d; m or dmin)
FORMATS = {"q8_0": (32, 34, (0,)), "q4_0": (32, 18, (0,)), "q4_1": (32, 20, (0, 2)),
           "q4_k": (256, 144, (0, 2)), "q5_k": (256, 176, (0, 2)), "q6_k": (256, 210, (208,))}
# the size of d: a weight is d times a quant (and a K-quant's sub-block scale: 6 bits in
# q4_k / q5_k, int8 in q6_k), weights around 0.01-0.1 either way
D_SIZE = {"q4_k": 0.01 / 32, "q5_k": 0.01 / 32, "q6_k": 0.01 / 32}
SHAPES = {32: [(1, 576, 192), (3, 96, 37), (8, 576, 1536), (5, 64, 50), (13, 160, 71)],
          256: [(1, 512, 192), (3, 256, 37), (8, 768, 300), (13, 256, 71)]}   # T, in, out


def random_blocks(rng: np.random.Generator, fmt: str, out: int, n_in: int,
                  layers: int | None = None) -> np.ndarray:
    """uint8 [(layers,) out, n_in / block * bytes] for n_in weights a row: random quants and
    sub-block scales (every bit pattern), random nonzero float16 scales of both signs,
    random mins (q4_1, the K-quants' dmin)."""
    per_block, nbytes, scales = FORMATS[fmt]
    lead = (out, n_in // per_block) if layers is None else (layers, out, n_in // per_block)
    raw = rng.integers(0, 256, (*lead, nbytes), dtype=np.uint8)
    size = D_SIZE.get(fmt, 0.01)
    d = (rng.uniform(0.5, 2.0, lead) * rng.choice([-1.0, 1.0], lead) * size).astype(np.float16)
    raw[..., scales[0]:scales[0] + 2] = d[..., None].view(np.uint8)
    if len(scales) > 1:
        m = rng.uniform(-0.05, 0.05, lead) / (32 if per_block == 256 else 1)
        raw[..., scales[1]:scales[1] + 2] = m.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(*lead[:-1], lead[-1] * nbytes)


def reference(x: np.ndarray, packed: np.ndarray, fmt: str) -> tuple[np.ndarray, ...]:
    """(x @ W^T in float64, the same with x 8-bit quantized per 32-block as the kernel does,
    the bound of that quantization's error per output) with W gguf-py's dequantization."""
    from gguf.quants import GGMLQuantizationType, dequantize

    w = dequantize(packed, GGMLQuantizationType[fmt.upper()]).astype(np.float64)
    T, n_in = x.shape
    xb = x.reshape(T, n_in // 32, 32)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    xq = (np.rint(xb * inv) * d).reshape(T, n_in).astype(np.float64)
    step = np.repeat(d.reshape(T, -1), 32, axis=1).astype(np.float64)
    bound = (step / 2) @ np.abs(w).T
    return x.astype(np.float64) @ w.T, xq @ w.T, bound


def check(got: np.ndarray, x: np.ndarray, packed: np.ndarray, fmt: str) -> None:
    exact, quantized_x, bound = reference(x, packed, fmt)
    scale = np.sqrt(np.mean(exact ** 2))
    # x quantized as the kernel does: equal up to float32 accumulation
    assert np.abs(got - quantized_x).max() < 1e-5 * scale, np.abs(got - quantized_x).max() / scale
    # float x: within the 8-bit rounding's worst case (every rounding of one sign), and the
    # typical error far below it
    assert np.all(np.abs(got - exact) <= bound + 1e-5 * scale)
    # (numpy's own quantized x lands at 0.3-2.4 % of the outputs' RMS on these blocks)
    assert np.sqrt(np.mean((got - exact) ** 2)) < 0.03 * scale


def entry_library(flags: tuple[str, ...], name: str) -> ctypes.CDLL:
    """The kernels' plain C entry (gemv_gguf_entry.cc) compiled alone with these flags."""
    lib = build.KernelLibrary(name=name, sources=(
        build.HERE / "gemv_gguf_entry.cc", build.HERE / "gemv_gguf.h", build.HERE / "gemv.h",
        build.HERE / "parallel_for.h"), extra_key=flags)
    real = build.flag_sets
    build.flag_sets = lambda: [build.BASE_FLAGS + flags]
    try:
        path = build.build(lib)
    finally:
        build.flag_sets = real
    return ctypes.CDLL(str(path))


def _has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and flag in line.split() for line in f)


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def kernel(request):
    """(C entry, the instruction set it must report) for each build of the kernels."""
    if request.param == "native":
        handle = ctypes.CDLL(str(matmul.register()))
        want = "avx512vnni" if _has("avx512_vnni") and _has("avx512vl") else \
            "avx2" if _has("avx2") else "scalar"
    elif request.param == "avx2":
        if not (_has("avx2") and _has("fma") and _has("f16c")):
            pytest.skip("this CPU has no AVX2 + FMA + F16C")
        handle = entry_library(("-mavx2", "-mfma", "-mf16c"), "gguf_gemv_avx2")
        want = "avx2"
    else:
        handle = entry_library((), "gguf_gemv_scalar")
        want = "scalar"
    handle.jaxserve_gguf_isa.restype = ctypes.c_char_p
    assert handle.jaxserve_gguf_isa().decode() == want
    if request.param == "native":
        assert matmul.gguf_isa() == want
    return handle


def run_entry(handle: ctypes.CDLL, fmt: str, x: np.ndarray, packed: np.ndarray,
              parts: int) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    packed = np.ascontiguousarray(packed)
    y = np.full((x.shape[0], packed.shape[0]), np.nan, np.float32)
    rc = handle.jaxserve_gguf_matmul(
        ctypes.c_int(matmul.GGUF_FORMAT_CODES[fmt]), x.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
        packed.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(packed.shape[0]),
        y.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(parts))
    assert rc == 0
    return y


@pytest.mark.fast
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_build_of_the_block_kernel_equals_gguf_py_dequantized_matmul(kernel, fmt):
    """Every format, 1..13 rows of x (13: an 8-row tile and a 5-row one), several blocks a
    row, weight rows not divisible by the part count (each part a row range, as the pool
    splits them)."""
    rng = np.random.default_rng(len(fmt))
    for T, n_in, out in SHAPES[FORMATS[fmt][0]]:
        packed = random_blocks(rng, fmt, out, n_in)
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        x[0, :32] *= 50.0                      # blocks of x of very different scales
        for parts in (1, 7):
            check(run_entry(kernel, fmt, x, packed, parts).astype(np.float64), x, packed, fmt)


@pytest.mark.fast
def test_the_entry_refuses_a_bad_format_or_ragged_blocks(kernel):
    y = np.zeros((1, 4), np.float32)
    x = np.zeros((1, 40), np.float32)
    w = np.zeros((4, 40), np.uint8)
    ptr = [a.ctypes.data_as(ctypes.c_void_p) for a in (x, w, y)]
    assert kernel.jaxserve_gguf_matmul(7, ptr[0], 1, 32, ptr[1], 4, ptr[2], 1) == -1
    assert kernel.jaxserve_gguf_matmul(6, ptr[0], 1, 32, ptr[1], 4, ptr[2], 1) == -1
    assert kernel.jaxserve_gguf_matmul(0, ptr[0], 1, 40, ptr[1], 4, ptr[2], 1) == -1
    assert kernel.jaxserve_gguf_matmul(3, ptr[0], 1, 32, ptr[1], 4, ptr[2], 1) == -1  # q4_k: 256


@pytest.mark.fast
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_xla_call_reads_the_named_layer_of_stacked_siblings(fmt):
    """matmul.gguf_matmul: several stacked [L, out_i, bytes] weights of one x in one call,
    layer `layer` read in place; each the C entry's numbers (the same code, split over the
    pool's workers; to float rounding: each .cc compiles its own copy), any row count."""
    rng = np.random.default_rng(11)
    n_in = 768
    stacked = tuple(random_blocks(rng, fmt, out, n_in, layers=3) for out in (576, 192, 47))
    handle = ctypes.CDLL(str(matmul.register()))
    fn = jax.jit(matmul.gguf_matmul, static_argnums=3)
    for T in (1, 19):
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        for layer in (2, 0):
            ys = fn(jnp.asarray(x), tuple(jnp.asarray(w) for w in stacked), layer, fmt)
            assert [y.shape for y in ys] == [(T, w.shape[1]) for w in stacked]
            for w, y in zip(stacked, ys):
                assert y.dtype == jnp.float32
                np.testing.assert_allclose(np.asarray(y), run_entry(handle, fmt, x, w[layer], 1),
                                           rtol=1e-5, atol=1e-5)
                check(np.asarray(y, np.float64), x, w[layer], fmt)


@pytest.mark.fast
def test_the_xla_call_refuses_what_it_cannot_read():
    x = jnp.zeros((1, 40), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        matmul.gguf_matmul(x, (jnp.zeros((1, 2, 40), jnp.uint8),), 0, "q8_0")
    with pytest.raises(ValueError, match="multiple of 256"):
        matmul.gguf_matmul(jnp.zeros((1, 32)), (jnp.zeros((1, 2, 144), jnp.uint8),), 0, "q4_k")
    with pytest.raises(ValueError, match="format"):
        matmul.gguf_matmul(jnp.zeros((1, 32)), (jnp.zeros((1, 2, 34), jnp.uint8),), 0, "q2_k")


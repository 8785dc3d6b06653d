"""Ragged paged attention: reference vs a dense naive oracle, kernel vs reference."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference, write_kv
from tests import precision

ATOL, ATOL_BF16 = precision.KERNEL_ATOL_F32, precision.KERNEL_ATOL_BF16

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

# Jitted once per shape: eager op-by-op dispatch of the loop is far slower on CPU.
reference = jax.jit(
    ragged_paged_attention_reference, static_argnames=("sm_scale", "block_q", "kv_chunk_blocks")
)


@dataclasses.dataclass
class Batch:
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    kv_lens: np.ndarray
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: int

    def args(self, dtype=jnp.float32):
        return (
            jnp.asarray(self.q, dtype),
            jnp.asarray(self.k_cache, dtype),
            jnp.asarray(self.v_cache, dtype),
            jnp.asarray(self.kv_lens),
            jnp.asarray(self.block_tables),
            jnp.asarray(self.query_start_loc),
            jnp.int32(self.num_seqs),
        )

    @property
    def num_valid_tokens(self) -> int:
        return int(self.query_start_loc[self.num_seqs])


def make_batch(
    rng: np.random.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int | None = None,
    pad_seqs: int = 0,
    pad_tokens: int = 0,
    num_blocks: int | None = None,
    garbage: float = 0.0,
) -> Batch:
    """A random ragged batch with shuffled block tables.

    Unused block-table slots hold garbage ids (including out-of-range ones).
    With `garbage` != 0, every cache row a sequence does not own below its
    kv_len (unowned blocks, and rows past kv_len in a last page) holds that
    value, so any read past kv_lens shows up in the output.
    """
    assert all(0 < q <= k for q, k in zip(q_lens, kv_lens))
    num_seqs = len(q_lens)
    pages = [-(-k // block_size) for k in kv_lens]
    if max_blocks is None:
        max_blocks = max(pages) + 2
    if num_blocks is None:
        num_blocks = sum(pages) + 3
    assert num_blocks >= sum(pages) and max_blocks >= max(pages)
    order = rng.permutation(num_blocks)
    num_padded_seqs = num_seqs + pad_seqs
    block_tables = rng.integers(-5, num_blocks + 1000, (num_padded_seqs, max_blocks))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    owned = np.zeros((num_blocks, block_size), bool)
    used = 0
    for i, (n, kv_len) in enumerate(zip(pages, kv_lens)):
        block_tables[i, :n] = order[used : used + n]
        positions = np.arange(kv_len)
        owned[block_tables[i, positions // block_size], positions % block_size] = True
        used += n
    if garbage:
        k_cache[~owned] = garbage
        v_cache[~owned] = garbage
    query_start_loc = np.zeros(num_padded_seqs + 1, np.int32)
    query_start_loc[1 : num_seqs + 1] = np.cumsum(q_lens)
    query_start_loc[num_seqs + 1 :] = query_start_loc[num_seqs]
    num_tokens = int(query_start_loc[-1]) + pad_tokens
    return Batch(
        q=rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32),
        k_cache=k_cache,
        v_cache=v_cache,
        kv_lens=np.array(list(kv_lens) + [0] * pad_seqs, np.int32),
        block_tables=block_tables.astype(np.int32),
        query_start_loc=query_start_loc,
        num_seqs=num_seqs,
    )


def random_batch(
    rng: np.random.Generator,
    *,
    num_tokens: int,
    num_padded_seqs: int,
    max_kv_len: int,
    block_size: int,
    max_blocks: int,
    num_blocks: int,
    **heads,
) -> Batch:
    """A random mix of decodes and prefill chunks with fixed padded shapes (one compile)."""
    while True:
        num_seqs = int(rng.integers(1, num_padded_seqs + 1))
        q_lens, kv_lens = [], []
        for _ in range(num_seqs):
            kind = rng.integers(3)
            kv_len = int(rng.integers(1, max_kv_len + 1))
            if kind == 0:  # decode
                q_len = 1
            elif kind == 1:  # prefill from scratch
                q_len = kv_len
            else:  # prefill chunk on top of cached context
                q_len = int(rng.integers(1, kv_len + 1))
            if rng.random() < 0.2:  # an exact block multiple
                kv_len = max(block_size, kv_len // block_size * block_size)
                q_len = min(q_len, kv_len)
            q_lens.append(q_len)
            kv_lens.append(kv_len)
        pages = sum(-(-k // block_size) for k in kv_lens)
        if sum(q_lens) <= num_tokens and pages <= num_blocks:
            break
    return make_batch(
        rng,
        q_lens,
        kv_lens,
        block_size=block_size,
        max_blocks=max_blocks,
        num_blocks=num_blocks,
        pad_seqs=num_padded_seqs - num_seqs,
        pad_tokens=num_tokens - sum(q_lens),
        **heads,
    )


def naive_attention(batch: Batch, sm_scale: float | None = None, sliding_window: int = 0,
                    logits_soft_cap: float = 0.0) -> np.ndarray:
    """Dense per-sequence causal attention in float64; padding rows are left 0.

    sliding_window > 0: position p sees keys k with p - sliding_window < k <= p;
    logits_soft_cap > 0: logits = cap * tanh(logits / cap) after the scale."""
    q = batch.q.astype(np.float64)
    _num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    for i in range(batch.num_seqs):
        start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        kv_len = int(batch.kv_lens[i])
        positions = np.arange(kv_len)
        blocks = batch.block_tables[i, positions // block_size]
        k = batch.k_cache[blocks, positions % block_size].astype(np.float64)  # [L, Hkv, D]
        v = batch.v_cache[blocks, positions % block_size].astype(np.float64)
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        for j, t in enumerate(range(start, end)):
            pos = kv_len - (end - start) + j
            logits = np.einsum("hd,lhd->hl", q[t], k[: pos + 1]) * scale
            if logits_soft_cap:
                logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
            if sliding_window:
                logits[:, : max(0, pos + 1 - sliding_window)] = -np.inf
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[t] = np.einsum("hl,lhd->hd", p, v[: pos + 1])
    return out


def assert_close_on_valid_rows(actual, expected, batch: Batch, atol: float):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    assert np.isfinite(actual).all(), "padding or valid rows are not finite"
    n = batch.num_valid_tokens
    diff = np.abs(actual[:n] - np.asarray(expected, np.float64)[:n]).max(initial=0.0)
    assert diff <= atol, f"max abs diff {diff} > {atol}"
    return diff


# Fixed padded shapes per configuration, so each configuration compiles once and
# many random batches run through it.
SWEEPS = {
    "mha_d64_bs16": {
        "num_q_heads": 2,
        "num_kv_heads": 2,
        "head_dim": 64,
        "block_size": 16,
        "num_tokens": 40,
        "num_padded_seqs": 5,
        "max_kv_len": 70,
        "max_blocks": 6,
        "num_blocks": 40,
    },
    "gqa3to1_d128_bs32": {
        "num_q_heads": 6,
        "num_kv_heads": 2,
        "head_dim": 128,
        "block_size": 32,
        "num_tokens": 48,
        "num_padded_seqs": 6,
        "max_kv_len": 100,
        "max_blocks": 5,
        "num_blocks": 24,
    },
    "gqa8to1_d64_bs16": {
        "num_q_heads": 8,
        "num_kv_heads": 1,
        "head_dim": 64,
        "block_size": 16,
        "num_tokens": 32,
        "num_padded_seqs": 4,
        "max_kv_len": 150,
        "max_blocks": 12,
        "num_blocks": 48,
    },
    "gqa4to1_d128_bs16_long": {
        "num_q_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 128,
        "block_size": 16,
        "num_tokens": 24,
        "num_padded_seqs": 3,
        "max_kv_len": 300,
        "max_blocks": 24,
        "num_blocks": 64,
    },
}
BATCHES_PER_SWEEP = 5
# Reference knobs per sweep: small chunks (several loop trips, chunk edges inside
# sequences) and every query-block size: per token (decode buckets), 2, 16, default.
REFERENCE_KNOBS = {
    "mha_d64_bs16": {"kv_chunk_blocks": 2, "block_q": 1},
    "gqa3to1_d128_bs32": {"kv_chunk_blocks": 2, "block_q": 16},
    "gqa8to1_d64_bs16": {"kv_chunk_blocks": 2},
    "gqa4to1_d128_bs16_long": {"kv_chunk_blocks": 2, "block_q": 2},
}


def sweep_batches(name: str, count: int = BATCHES_PER_SWEEP):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return [random_batch(rng, **SWEEPS[name]) for _ in range(count)]


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_reference_matches_naive_dense_attention_on_random_ragged_batches(name):
    for batch in sweep_batches(name):
        out = reference(*batch.args(), **REFERENCE_KNOBS[name])
        assert_close_on_valid_rows(out, naive_attention(batch), batch, atol=ATOL)


def test_reference_takes_num_seqs_as_a_traced_value_and_zeroes_padding_rows():
    rng = np.random.default_rng(0)
    batch = make_batch(
        rng,
        [3, 1],
        [20, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        pad_seqs=2,
        pad_tokens=6,
    )
    out = reference(*batch.args())
    assert_close_on_valid_rows(out, naive_attention(batch), batch, atol=ATOL)
    # Fewer live sequences under the same compiled function: sequence 1 turns into padding.
    args = list(batch.args())
    args[-1] = jnp.int32(1)
    out = np.asarray(reference(*args))
    batch.num_seqs = 1
    assert_close_on_valid_rows(out, naive_attention(batch), batch, atol=ATOL)
    assert not out[batch.num_valid_tokens :].any(), "padding rows must be 0"


def round_to_bfloat16(batch: Batch) -> Batch:
    """The same batch with q and caches rounded to bf16 (kept as f32 for the oracle)."""
    rounded = dataclasses.replace(batch)
    for name in ("q", "k_cache", "v_cache"):
        value = np.asarray(jnp.asarray(getattr(batch, name), jnp.bfloat16), np.float32)
        setattr(rounded, name, value)
    return rounded


def test_reference_bfloat16_close_to_float64_oracle():
    batch = sweep_batches("gqa3to1_d128_bs32", 1)[0]
    out = reference(*batch.args(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    assert_close_on_valid_rows(out, naive_attention(round_to_bfloat16(batch)), batch, atol=ATOL_BF16)


# ---- the Pallas kernel: interpret mode on CPU, compiled (Triton) on a GPU ------------------
INTERPRET = jax.default_backend() not in ("gpu", "cuda")


def kernel(batch: Batch, dtype=jnp.float32, **knobs):
    return ragged_paged_attention(*batch.args(dtype), interpret=INTERPRET, **knobs)


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_kernel_matches_reference_on_random_ragged_batches(name):
    for batch in sweep_batches(name):
        out = kernel(batch)
        assert out.shape == batch.q.shape and out.dtype == jnp.float32
        expected = reference(*batch.args(), **REFERENCE_KNOBS[name])  # compiled above
        assert_close_on_valid_rows(out, expected, batch, atol=ATOL)
        assert_close_on_valid_rows(out, naive_attention(batch), batch, atol=ATOL)


@pytest.mark.parametrize(
    "name, knobs",
    [
        # Several query blocks per prefill sequence, keys in steps of two pages.
        ("mha_d64_bs16", {"block_q": 16, "block_kv": 32, "sm_scale": 0.3}),
        # Split-K merge (contexts spread over 3 splits, some empty) with one-page steps.
        ("gqa4to1_d128_bs16_long", {"num_kv_splits": 3, "block_kv": 16}),
    ],
)
def test_kernel_tuning_knobs_do_not_change_results(name, knobs):
    for batch in sweep_batches(name, 3):
        expected = naive_attention(batch, knobs.get("sm_scale"))
        assert_close_on_valid_rows(kernel(batch, **knobs), expected, batch, atol=ATOL)


def test_reference_applies_custom_sm_scale():
    batch = sweep_batches("mha_d64_bs16", 1)[0]
    out = reference(*batch.args(), sm_scale=0.3, **REFERENCE_KNOBS["mha_d64_bs16"])
    assert_close_on_valid_rows(out, naive_attention(batch, 0.3), batch, atol=ATOL)


def test_kernel_never_reads_cache_rows_past_kv_lens():
    # Every cache row no sequence owns below its kv_len is NaN: one stray read
    # (past kv_len, through a garbage block-table slot, or of a padding
    # sequence) turns the output NaN.
    rng = np.random.default_rng(3)
    for _ in range(3):
        batch = random_batch(rng, garbage=np.nan, **SWEEPS["gqa3to1_d128_bs32"])
        assert_close_on_valid_rows(kernel(batch), naive_attention(batch), batch, atol=ATOL)


def test_reference_ignores_finite_garbage_past_kv_lens():
    # The reference gathers whole pages and masks, so it needs finite garbage;
    # 1e4 would dominate any softmax it leaked into.
    rng = np.random.default_rng(4)
    batch = random_batch(rng, garbage=1e4, **SWEEPS["gqa3to1_d128_bs32"])
    out = reference(*batch.args(), **REFERENCE_KNOBS["gqa3to1_d128_bs32"])
    assert_close_on_valid_rows(out, naive_attention(batch), batch, atol=ATOL)


def test_kernel_takes_num_seqs_as_a_traced_value():
    batch = sweep_batches("gqa3to1_d128_bs32", 1)[0]
    assert_close_on_valid_rows(kernel(batch), naive_attention(batch), batch, atol=ATOL)
    # Same compiled kernel, one live sequence fewer: it becomes padding.
    batch.num_seqs -= 1
    out = kernel(batch)
    assert_close_on_valid_rows(out, naive_attention(batch), batch, atol=ATOL)
    assert not np.asarray(out)[batch.num_valid_tokens :].any(), "padding rows must be 0"


def test_kernel_bfloat16_close_to_float64_oracle():
    for batch in sweep_batches("gqa8to1_d64_bs16", 2):
        out = kernel(batch, jnp.bfloat16)
        assert out.dtype == jnp.bfloat16
        assert_close_on_valid_rows(out, naive_attention(round_to_bfloat16(batch)), batch, atol=ATOL_BF16)


def test_kernel_pads_non_power_of_two_head_dim():
    rng = np.random.default_rng(5)
    batch = make_batch(
        rng,
        [1, 7, 1],
        [40, 23, 3],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=80,
        block_size=16,
        pad_seqs=1,
        pad_tokens=3,
    )
    assert_close_on_valid_rows(kernel(batch), naive_attention(batch), batch, atol=ATOL)


@pytest.mark.parametrize(
    "dtype, head_dim, num_kv_splits, soft_cap",
    [(jnp.bfloat16, 128, 1, 0.0), (jnp.bfloat16, 128, 4, 50.0), (jnp.float32, 80, None, 0.0)],
)
def test_kernel_lowers_through_pallas_triton_for_cuda(dtype, head_dim, num_kv_splits, soft_cap):
    # No GPU here: exporting for the cuda platform runs the Pallas -> Triton IR
    # lowering, which rejects unsupported ops and non-power-of-two tiles.
    # An engine-sized multi-layer cache (> 4 GiB: 64-bit offsets) and a 512-wide table.
    num_tokens, num_seqs, num_blocks, block_size, max_blocks = 64, 8, 30 * 5000, 16, 512
    shapes = (
        ((num_tokens, 32, head_dim), dtype),
        ((num_blocks, block_size, 8, head_dim), dtype),
        ((num_blocks, block_size, 8, head_dim), dtype),
        ((num_seqs,), jnp.int32),
        ((num_seqs, max_blocks), jnp.int32),
        ((num_seqs + 1,), jnp.int32),
        ((), jnp.int32),
        ((), jnp.int32),   # a traced sliding window
    )
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    fn = jax.jit(lambda *a: ragged_paged_attention(
        *a[:-1], sliding_window=a[-1], num_kv_splits=num_kv_splits, logits_soft_cap=soft_cap))
    exported = export.export(
        fn,
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


# ---- sliding window and soft cap: reference and kernel against the dense oracle -----------


def windowed_batch(rng, window: int, garbage_before_window: float = 0.0) -> Batch:
    """Ragged batch around a window of `window` keys (block_size 16): a chunk whose window
    starts mid-block, a long decode, a prefill from scratch longer than the window, a chunk
    straddling the window edge (first query inside it, last past it), a short decode.
    garbage_before_window: value for every cache row older than any query of its sequence
    can see (rows a windowed kernel must never read)."""
    q_lens, kv_lens = [10, 1, 50, 5, 1], [40, 100, 50, max(window + 3, 8), 3]
    batch = make_batch(rng, q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, pad_seqs=1, pad_tokens=4)
    if garbage_before_window:
        for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            for key in range(max(0, kv_len - q_len - window + 1)):
                page = batch.block_tables[i, key // 16]
                batch.k_cache[page, key % 16] = garbage_before_window
                batch.v_cache[page, key % 16] = garbage_before_window
    return batch


@pytest.mark.parametrize("window", [1, 7, 24, 33])
def test_sliding_window_reference_and_kernel_match_dense_oracle(window):
    # The window is a traced value: one compile serves every window (a per-layer window
    # scanned over layers); chunk sizes of one page put window edges on chunk edges too.
    batch = windowed_batch(np.random.default_rng(window), window)
    expected = naive_attention(batch, sliding_window=window)
    assert np.abs(expected - naive_attention(batch)).max() > 1e-3   # the window matters
    w = jnp.int32(window)
    # kv_chunk_blocks 4: whole chunks of 4 pages, then tail chunks of 1 page
    for knobs in ({}, {"kv_chunk_blocks": 1, "block_q": 2}, {"kv_chunk_blocks": 4}):
        out = reference(*batch.args(), sliding_window=w, **knobs)
        assert_close_on_valid_rows(out, expected, batch, atol=ATOL)
    assert_close_on_valid_rows(kernel(batch, sliding_window=w), expected, batch, atol=ATOL)
    assert_close_on_valid_rows(kernel(batch, sliding_window=w, num_kv_splits=3, block_kv=16),
                               expected, batch, atol=ATOL)


@pytest.mark.parametrize("name", ["mha_d64_bs16", "gqa4to1_d128_bs16_long"])
def test_sliding_window_on_random_ragged_batches(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    for batch in sweep_batches(name, 3):
        window = int(rng.integers(1, 60))
        expected = naive_attention(batch, sliding_window=window)
        out = reference(*batch.args(), sliding_window=jnp.int32(window), **REFERENCE_KNOBS[name])
        assert_close_on_valid_rows(out, expected, batch, atol=ATOL)
        assert_close_on_valid_rows(kernel(batch, sliding_window=jnp.int32(window)), expected,
                                   batch, atol=ATOL)


def test_kernel_never_reads_keys_before_the_window():
    # Every row older than its sequence's window is NaN: the kernel must skip them (so its
    # cost follows the window), not read and mask them.
    expected = naive_attention(windowed_batch(np.random.default_rng(9), 24), sliding_window=24)
    batch = windowed_batch(np.random.default_rng(9), 24, garbage_before_window=np.nan)
    assert_close_on_valid_rows(kernel(batch, sliding_window=24), expected, batch, atol=ATOL)
    # The reference reads whole pages and masks: finite garbage must not leak into it.
    batch = windowed_batch(np.random.default_rng(9), 24, garbage_before_window=1e4)
    out = reference(*batch.args(), sliding_window=24, kv_chunk_blocks=1)
    assert_close_on_valid_rows(out, expected, batch, atol=ATOL)


@pytest.mark.parametrize("window, cap", [(0, 5.0), (24, 30.0)])
def test_logits_soft_cap_reference_and_kernel_match_dense_oracle(window, cap):
    batch = windowed_batch(np.random.default_rng(11), 24)
    batch.q *= 4.0   # logits large enough for the cap to bite
    expected = naive_attention(batch, sliding_window=window, logits_soft_cap=cap)
    assert np.abs(expected - naive_attention(batch, sliding_window=window)).max() > 1e-3
    out = ragged_paged_attention_reference(*batch.args(), sliding_window=window,
                                           logits_soft_cap=cap)
    assert_close_on_valid_rows(out, expected, batch, atol=ATOL)
    out = kernel(batch, sliding_window=window, logits_soft_cap=cap)
    assert_close_on_valid_rows(out, expected, batch, atol=ATOL)


# ---- write_kv ---------------------------------------------------------------------------


def test_write_kv_writes_exact_slots_and_skips_minus_one():
    rng = np.random.default_rng(2)
    num_blocks, block_size, hkv, d = 5, 4, 2, 8
    k_cache = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    k = rng.standard_normal((6, hkv, d)).astype(np.float32)
    v = rng.standard_normal((6, hkv, d)).astype(np.float32)
    slot_mapping = np.array([7, -1, 0, 18, -1, 12], np.int32)
    new_k, new_v = jax.jit(write_kv, donate_argnums=(0, 1))(
        jnp.asarray(k_cache),
        jnp.asarray(v_cache),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(slot_mapping),
    )
    expected_k = k_cache.reshape(-1, hkv, d).copy()
    expected_v = v_cache.reshape(-1, hkv, d).copy()
    for t, slot in enumerate(slot_mapping):
        if slot >= 0:
            expected_k[slot] = k[t]
            expected_v[slot] = v[t]
    np.testing.assert_array_equal(np.asarray(new_k).reshape(-1, hkv, d), expected_k)
    np.testing.assert_array_equal(np.asarray(new_v).reshape(-1, hkv, d), expected_v)
    # The last slot (where a wrapped -1 would land) is untouched.
    np.testing.assert_array_equal(np.asarray(new_k)[-1, -1], k_cache[-1, -1])


def test_write_kv_updates_donated_caches_in_place():
    k_cache = jnp.zeros((64, 16, 2, 8))
    v_cache = jnp.ones((64, 16, 2, 8))
    pointers = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    new = jnp.full((3, 2, 8), 2.0)
    slots = jnp.array([1, -1, 500], jnp.int32)
    new_k, new_v = jax.jit(write_kv, donate_argnums=(0, 1))(k_cache, v_cache, new, new, slots)
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
    assert float(new_k[31, 4, 1, 7]) == 2.0 and float(new_v[0, 1, 0, 0]) == 2.0


def test_write_kv_casts_to_cache_dtype():
    k_cache = jnp.ones((2, 4, 1, 8), jnp.bfloat16)
    k = jnp.full((1, 1, 8), 0.5, jnp.float32)
    new_k, _ = write_kv(k_cache, k_cache, k, k, jnp.array([5], jnp.int32))
    assert new_k.dtype == jnp.bfloat16
    assert float(new_k[1, 1, 0, 0]) == 0.5 and float(new_k[1, 2, 0, 0]) == 1.0

"""The oneDNN matmul library (jaxserve/kernels/cpu/matmul.cc) against float64 numpy on random
ragged shapes, float32 and bfloat16; the CPU-feature dispatch; the build with clang."""

from __future__ import annotations

import re
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.cpu import matmul

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not matmul.available(),
                                reason="needs the CPU backend and oneDNN (onednn-cpu-gomp)")

# Relative to the output's scale: f32 accumulates in f32; bf16 rounds each operand (2^-8)
# and, for a bf16 result, the output.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _check(got, x, w, dtype):
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    scale = np.sqrt(np.mean(want ** 2)) + 1e-9
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / scale
    assert err < TOLERANCE[dtype] * (4 if dtype == jnp.bfloat16 else 1), err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fan_in,fan_out", [(576, 1536), (257, 47), (5, 129)])
@pytest.mark.parametrize("gemv_rows", [0, -1])   # 0: oneDNN at every row count
def test_layer_matmul_reads_the_named_layer_in_place(dtype, fan_in, fan_out, gemv_rows):
    rng = np.random.default_rng(fan_in * 1000 + fan_out)
    stacked = jnp.asarray(rng.standard_normal((3, fan_in, fan_out), np.float32), dtype)
    fn = jax.jit(matmul.layer_matmul, static_argnums=3, static_argnames="gemv_rows")
    for rows in (1, 3, 9, 130):
        x = jnp.asarray(rng.standard_normal((rows, fan_in), np.float32), dtype)
        for layer in (2, 0):
            for out_dtype in (jnp.float32, dtype):
                got = fn(x, stacked, jnp.int32(layer), out_dtype, gemv_rows=gemv_rows)
                assert got.dtype == out_dtype and got.shape == (rows, fan_out)
                _check(got.astype(jnp.float32), x.astype(jnp.float32),
                       stacked[layer].astype(jnp.float32), out_dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,hidden,vocab", [(1, 576, 4099), (8, 70, 777), (3, 47, 300),
                                               (40, 15, 64)])
@pytest.mark.parametrize("gemv_rows", [0, 8])
def test_transposed_weights_give_logits_against_a_tied_table(dtype, rows, hidden, vocab,
                                                             gemv_rows):
    """A tied table's logits, through oneDNN (gemv_rows 0, x in the table's dtype) or the
    transposed GEMV (rows <= gemv_rows: x taken in float32, so a bf16 table's logits are
    those of the unrounded rows)."""
    from jaxserve.models.layer_matmul import small_logits

    rng = np.random.default_rng(rows * hidden + vocab)
    table = jnp.asarray(rng.standard_normal((vocab, hidden), np.float32), dtype)
    x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))
    got = jax.jit(small_logits, static_argnums=2)(x, table, gemv_rows)
    assert got.dtype == jnp.float32
    on_gemv = rows <= gemv_rows
    x_used = x if on_gemv else x.astype(dtype).astype(jnp.float32)
    _check(got, x_used, table.astype(jnp.float32).T, jnp.float32 if on_gemv else dtype)
    if on_gemv and dtype == jnp.bfloat16:   # f32 rows: closer than rounding them first
        rounded = small_logits(x, table, 0)
        want = np.asarray(x, np.float64) @ np.asarray(table.astype(jnp.float32), np.float64).T
        assert np.abs(np.asarray(got) - want).max() < np.abs(np.asarray(rounded) - want).max()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("fan_in", [576, 257, 5])
def test_grouped_gemv_gives_each_projection_its_own_product(dtype, fan_in):
    """One call over several weights of one x (q/k/v; gate/up) returns what each weight's own
    GEMV call returns (to f32 rounding: the split over rows adds partial sums in another
    order), against float64 too; the same bits call after call (partials added in part
    order, whichever thread ran them)."""
    rng = np.random.default_rng(fan_in)
    scale = 30.0 if dtype == jnp.int8 else 1.0
    stacked = tuple(jnp.asarray(rng.standard_normal((3, fan_in, out)) * scale, np.float32)
                    .astype(dtype) for out in (576, 47, 129, 1536))
    group = jax.jit(matmul.layer_matmul_group, static_argnums=3)
    single = jax.jit(matmul.layer_matmul, static_argnums=3, static_argnames="gemv_rows")
    for rows in (1, 3, 8):
        x = jnp.asarray(rng.standard_normal((rows, fan_in), np.float32))
        for out_dtype in (jnp.float32, jnp.bfloat16):
            ys = group(x, stacked, 2, out_dtype)
            assert [y.shape for y in ys] == [(rows, w.shape[2]) for w in stacked]
            assert all(y.dtype == out_dtype for y in ys)
            for w, y in zip(stacked, ys):
                own = single(x, w, 2, out_dtype, gemv_rows=8)
                tol = 1e-5 if out_dtype == jnp.float32 else 1e-2
                np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(own, np.float32),
                                           rtol=tol, atol=tol * scale * np.sqrt(fan_in))
                _check(y, x, np.asarray(w[2], np.float32),
                       jnp.bfloat16 if jnp.bfloat16 in (dtype, out_dtype) else jnp.float32)
            again = group(x, stacked, 2, out_dtype)
            assert all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                       for a, b in zip(ys, again))


@pytest.mark.parametrize("fan_in,group", [(576, 32), (64, 32), (96, 8), (257, 257)])
def test_int8_group_scales_are_applied_inside_the_gemv(fan_in, group):
    """int8 weights quantized group-wise (quantization/int8.py): each group of input rows
    summed, then times its scale, inside the GEMV -- the dequantized product's numbers."""
    from jaxserve.quantization.int8 import quantize_int8

    rng = np.random.default_rng(fan_in + group)
    floats = [rng.standard_normal((3, fan_in, out)).astype(np.float32) for out in (576, 47, 129)]
    quantized = [quantize_int8(w, group) for w in floats]
    weights = tuple(jnp.asarray(q) for q, _ in quantized)
    scales = tuple(jnp.asarray(sc) for _, sc in quantized)
    assert all(sc.shape[1] == fan_in // group for sc in scales)
    fn = jax.jit(matmul.layer_matmul_group, static_argnums=3)
    for rows in (1, 5, 8):
        x = jnp.asarray(rng.standard_normal((rows, fan_in), np.float32))
        ys = fn(x, weights, 1, jnp.float32, scales)
        for (q, sc), y in zip(quantized, ys):
            dequantized = (q[1].astype(np.float32).reshape(fan_in // group, group, -1)
                           * sc[1][:, None, :]).reshape(fan_in, -1)
            _check(y, x, dequantized, jnp.float32)


def test_the_grouped_gemv_refuses_what_it_does_not_take():
    w = jnp.ones((2, 16, 8), jnp.float32)
    with pytest.raises(ValueError, match="at most 8 rows"):
        matmul.layer_matmul_group(jnp.ones((9, 16)), (w, w), 0)
    with pytest.raises(ValueError, match="one dtype"):
        matmul.layer_matmul_group(jnp.ones((1, 16)), (w, w.astype(jnp.bfloat16)), 0)
    with pytest.raises(ValueError, match="weights"):
        matmul.layer_matmul_group(jnp.ones((1, 15)), (w,), 0)
    q = jnp.ones((2, 16, 8), jnp.int8)
    with pytest.raises(ValueError, match="group scales go with int8"):
        matmul.layer_matmul_group(jnp.ones((1, 16)), (w,), 0, scales=(jnp.ones((2, 2, 8)),))
    with pytest.raises(ValueError, match="multiple of 8"):
        matmul.layer_matmul_group(jnp.ones((1, 16)), (q,), 0, scales=(jnp.ones((2, 4, 8)),))


def test_bad_shapes_and_dtypes_raise():
    w = jnp.ones((2, 8, 4))
    with pytest.raises(ValueError, match="wants"):
        matmul.layer_matmul(jnp.ones((3, 9)), w, 0)
    with pytest.raises(ValueError, match="float32 / bfloat16"):
        matmul.layer_matmul(jnp.ones((3, 8), jnp.float16), w.astype(jnp.float16), 0)


def test_matrix_units_come_from_the_cpu_flags():
    intel = "processor: 0\nflags\t: fpu avx512f avx512_bf16 amx_bf16 amx_int8 avx512_vnni\n"
    amd = "flags : fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    old = "flags : fpu sse4_2 avx2 fma\n"
    assert matmul.detect_matrix_units(intel).bf16 and matmul.detect_matrix_units(intel).amx_bf16
    assert matmul.detect_matrix_units(amd).bf16 and not matmul.detect_matrix_units(amd).amx_bf16
    assert matmul.detect_matrix_units(amd).int8
    assert not matmul.detect_matrix_units(old).bf16
    assert matmul.detect_matrix_units(old).describe() == "none"


def test_dtype_auto_follows_the_matrix_units_and_the_config_forces_float32(monkeypatch):
    from jaxserve.engine import compute_dtype as model_setup

    monkeypatch.setattr(matmul, "detect_matrix_units",
                        lambda: matmul.MatrixUnits(amx_bf16=True, avx512_bf16=True))
    dtype, why = model_setup.auto_compute_dtype("cpu")
    assert dtype == jnp.bfloat16 and "amx_bf16" in why
    dtype, why = model_setup.auto_compute_dtype("cpu", "none")
    assert dtype == jnp.float32 and "matrix_units=none" in why
    monkeypatch.setattr(matmul, "detect_matrix_units", lambda: matmul.MatrixUnits())
    dtype, why = model_setup.auto_compute_dtype("cpu")
    assert dtype == jnp.float32 and "no bf16 matrix units" in why
    assert model_setup.resolve_dtype("bfloat16", "cpu", "none") == jnp.bfloat16   # asked for


# -- dtype=auto timed on this CPU (engine/dtype_step_timing.py, compute_dtype.py) ------------
def _regret(choice, timings) -> float:
    """The chosen dtype's worst time over the faster dtype's, across the row counts."""
    pick = 0 if choice.dtype == "float32" else 1
    return max(t[pick] / min(t) for t in timings.values())


@pytest.mark.fast
def test_dtype_auto_takes_the_dtype_that_loses_least_at_its_worst_row_count():
    from jaxserve.engine.compute_dtype import choose_by_step_times
    from jaxserve.engine.dtype_step_timing import step_row_counts

    assert step_row_counts(256) == (1, 4, 16, 64) and step_row_counts(48) == (1, 4, 16, 48)
    assert step_row_counts(16) == (1, 4, 16) and step_row_counts(4) == (1, 4)
    assert step_row_counts(2) == (1, 2) and step_row_counts(1) == (1,)
    # (float32 ms, bfloat16 ms) per whole step
    # an AMX Xeon's shape: bfloat16 faster everywhere (a 0.8 margin on a 0.81 score had kept
    # float32, 1.4x slower served)
    amx = {1: (10.0, 8.4), 4: (12.0, 9.5), 16: (30.0, 21.0), 64: (100.0, 66.0)}
    assert choose_by_step_times(amx).dtype == "bfloat16"
    # an AVX2 EPYC's end-to-end shape: bfloat16 1.41x faster at one stream, float32 1.35x
    # faster at 64: bfloat16 loses less at its worst ...
    avx2 = {1: (14.1, 10.0), 4: (16.0, 14.0), 64: (100.0, 135.0)}
    assert choose_by_step_times(avx2).dtype == "bfloat16"
    # ... unless the mid rows cost it more (1.47x at 16) than float32 loses at one stream
    assert choose_by_step_times({**avx2, 16: (30.0, 44.1)}).dtype == "float32"
    # ties keep float32 (bfloat16 rounds the weights): within FLOAT32_TIE everywhere
    assert choose_by_step_times({1: (10.2, 10.0), 64: (100.0, 99.0)}).dtype == "float32"
    assert choose_by_step_times({1: (10.0, 10.0)}).dtype == "float32"
    assert choose_by_step_times({1: (10.4, 10.0), 64: (100.0, 99.0)}).dtype == "bfloat16"
    why = choose_by_step_times(avx2).describe()
    assert "1 row 14.1/10.0 ms" in why and "64 rows 100.0/135.0 ms" in why and "1.41x" in why
    with pytest.raises(ValueError):
        choose_by_step_times({})


@pytest.mark.fast
def test_dtype_auto_has_no_cliff_a_small_timing_change_costs_little():
    """Sweeping bfloat16's one-stream speed in 1 % steps past the point where the choice
    flips: the chosen dtype's worst loss against the better one never exceeds the other
    dtype's by more than the float32 tie, and moves by about as much as the timing did --
    never by a dtype's whole difference (the old rule's 0.81 vs 0.8 cliff cost 1.4x)."""
    from jaxserve.engine.compute_dtype import FLOAT32_TIE, choose_by_step_times

    previous = None
    flips = 0
    for step in range(80):
        one_row = 1.6 - 0.01 * step          # float32's time over bfloat16's at one stream
        for batch in (1.35, 1.02, 0.9):      # bfloat16's over float32's at 64 rows
            timings = {1: (10.0 * one_row, 10.0), 64: (100.0, 100.0 * batch)}
            choice = choose_by_step_times(timings)
            other = "float32" if choice.dtype == "bfloat16" else "bfloat16"
            regret = _regret(choice, timings)
            alternative = _regret(type(choice)(other, 0, 0, timings), timings)
            assert regret <= max(alternative, 1.0 + FLOAT32_TIE) + 1e-9
            if batch == 1.35:
                if previous is not None:
                    assert abs(regret - previous[1]) <= 0.011 + 1e-9
                    flips += choice.dtype != previous[0]
                previous = (choice.dtype, regret)
    assert flips == 1


def _tiny_workload(tmp_path, **kw):
    from jaxserve.engine.compute_dtype import DtypeWorkload, StepShape

    shapes = ((48, 48), (48, 16), (48, 16), (48, 48), (48, 96), (48, 96), (96, 48))
    return DtypeWorkload(**{"shapes": shapes, "num_layers": 4, "max_num_seqs": 16,
                            "in_place_float": True, "cache_dir": str(tmp_path),
                            "step": StepShape(48, 96, 3, 1, 16, 256), **kw})


def test_dtype_auto_on_a_cpu_is_timed_once_then_read_back(tmp_path, monkeypatch):
    from jaxserve.engine import dtype_step_timing
    from jaxserve.engine.compute_dtype import auto_compute_dtype
    from jaxserve.kernels.cpu import timings

    monkeypatch.setattr(timings, "MEASURED_BYTES", 1 << 18)   # a quick timing
    monkeypatch.setattr(dtype_step_timing, "MEASURED_BYTES", 1 << 18)
    # what is timed: a CPU without bf16 units (with them bfloat16 is taken untimed)
    monkeypatch.setattr(matmul, "detect_matrix_units", lambda: matmul.MatrixUnits())
    measured = []
    real = dtype_step_timing._measure.__wrapped__
    monkeypatch.setattr(dtype_step_timing, "_measure",
                        lambda *a: measured.append(a) or real(*a))
    dtype, why = auto_compute_dtype("cpu", "auto", _tiny_workload(tmp_path))
    assert "whole decode step timed on this CPU" in why and "stored" not in why
    assert re.search(r"timed in [0-9.]+ s$", why)
    # one stream, a few, past the GEMV and the batch (max_num_seqs=16)
    assert len(measured) == 1 and measured[0][2] == (1, 4, 16)
    assert all(f"{r} row" in why for r in (1, 4, 16))
    assert dtype == jnp.dtype(why.split(":")[0])
    again, why_again = auto_compute_dtype("cpu", "auto", _tiny_workload(tmp_path))
    assert again == dtype and why_again.endswith("stored timing") and len(measured) == 1
    # a small max_num_seqs times only the row counts the engine runs
    _, why = auto_compute_dtype("cpu", "auto", _tiny_workload(tmp_path, max_num_seqs=2))
    assert measured[1][2] == (1, 2) and "4 rows" not in why


def test_dtype_auto_is_not_timed_where_a_timing_decides_nothing(tmp_path, monkeypatch):
    """Cache-resident weights, quantized or sharded projections, and a forced kind with bf16
    units take the rule by kind; a forced kind without them is timed (the timing measures
    the kernels this process runs)."""
    from jaxserve.engine import dtype_step_timing
    from jaxserve.engine.compute_dtype import auto_compute_dtype

    monkeypatch.setattr(dtype_step_timing, "load_or_measure",
                        lambda *a: pytest.fail("timed"))
    monkeypatch.setattr(matmul, "detect_matrix_units", lambda: matmul.MatrixUnits())
    monkeypatch.setattr(matmul, "available", lambda: True)
    for workload, kind in ((_tiny_workload(tmp_path), "auto"),       # 1 MiB of weights
                           (_tiny_workload(tmp_path, num_layers=10**4,
                                           in_place_float=False), "auto"),
                           (_tiny_workload(tmp_path, num_layers=10**4), "avx512")):
        dtype, why = auto_compute_dtype("cpu", kind, workload)
        assert "timed" not in why
        assert dtype == (jnp.bfloat16 if kind == "avx512" else jnp.float32)
    fed = {1: (14.0, 10.0), 64: (100.0, 101.0)}
    monkeypatch.setattr(dtype_step_timing, "load_or_measure", lambda *a: (fed, False))
    monkeypatch.setattr("jaxserve.kernels.cpu.gemv_choice.load_or_measure",
                        lambda *a: (SimpleNamespace(rows=8), False))
    monkeypatch.setattr(matmul, "detect_matrix_units",
                        lambda: matmul.MatrixUnits(avx512_bf16=True))
    dtype, why = auto_compute_dtype("cpu", "none", _tiny_workload(tmp_path, num_layers=10**4))
    assert dtype == jnp.bfloat16 and "timed on this CPU" in why and "units: none" in why


def test_dtype_auto_takes_bfloat16_untimed_on_a_cpu_with_bf16_units(tmp_path, monkeypatch):
    """With AMX or AVX512-BF16 bfloat16 wins at every row count: nothing to time."""
    from jaxserve.engine import dtype_step_timing
    from jaxserve.engine.compute_dtype import auto_compute_dtype

    monkeypatch.setattr(dtype_step_timing, "load_or_measure",
                        lambda *a: pytest.fail("timed"))
    monkeypatch.setattr(matmul, "available", lambda: True)
    large = _tiny_workload(tmp_path, num_layers=10**4)
    for units in (matmul.MatrixUnits(amx_bf16=True, avx512_bf16=True),
                  matmul.MatrixUnits(avx512_bf16=True)):
        monkeypatch.setattr(matmul, "detect_matrix_units", lambda units=units: units)
        dtype, why = auto_compute_dtype("cpu", "auto", large)
        assert dtype == jnp.bfloat16 and "nothing to time" in why


def test_a_dtype_timing_that_fails_takes_the_rule_by_kind(tmp_path, monkeypatch, caplog):
    import logging

    from jaxserve.engine import dtype_step_timing
    from jaxserve.engine.compute_dtype import auto_compute_dtype

    def broken(*args, **kwargs):
        raise RuntimeError("no timer here")

    monkeypatch.setattr(dtype_step_timing, "load_or_measure", broken)
    monkeypatch.setattr(matmul, "detect_matrix_units", lambda: matmul.MatrixUnits())
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.compute_dtype"):
        dtype, why = auto_compute_dtype("cpu", "auto", _tiny_workload(tmp_path,
                                                                      num_layers=10**4))
    assert dtype == jnp.float32 and "no bf16 matrix units" in why
    assert "could not time float32 against bfloat16" in caplog.text


def test_the_engine_loads_the_model_in_the_dtype_auto_timed(make_tiny_model, tmp_path,
                                                               monkeypatch):
    """place_model times the model's own step (here a tiny model made to count as large)
    and keeps why, for the startup log."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine import compute_dtype, dtype_step_timing
    from jaxserve.engine.model_source import place_model
    from jaxserve.kernels.cpu import timings

    monkeypatch.setattr(timings, "MEASURED_BYTES", 1 << 16)
    monkeypatch.setattr(dtype_step_timing, "MEASURED_BYTES", 1 << 16)
    monkeypatch.setattr(matmul, "detect_matrix_units", lambda: matmul.MatrixUnits())
    chosen = []
    real = compute_dtype.choose_by_step_times
    monkeypatch.setattr(compute_dtype, "choose_by_step_times",
                        lambda t: chosen.append(real(t)) or chosen[-1])
    # matrix_units pinned to auto: a suite run as a forced kind with bf16 units
    # ($JAXSERVE_MATRIX_UNITS) would otherwise take the rule by kind, untimed
    config = EngineConfig.from_kwargs(model=str(make_tiny_model("llama")), dtype="auto",
                                      max_num_seqs=4, max_model_len=64, matrix_units="auto")
    from jaxserve.platforms import CpuPlatform

    config = CpuPlatform().resolve_config(config)
    placed = place_model(config, None, CpuPlatform(), str(tmp_path))
    assert len(chosen) == 1 and sorted(chosen[0].timings) == [1, 4]
    assert placed.dtype == jnp.dtype(chosen[0].dtype)
    assert placed.dtype_reason.startswith(chosen[0].dtype + ": the whole decode step timed")
    assert {jnp.dtype(w.dtype) for w in jax.tree.leaves(placed.params)
            if jnp.issubdtype(w.dtype, jnp.floating)} == {jnp.dtype(placed.dtype)}


@pytest.mark.parametrize("compiler", ["g++", "clang++"])
def test_every_cpu_kernel_library_builds_with_gcc_and_clang(compiler, tmp_path, monkeypatch):
    from jaxserve.attention.cpu import loader
    from jaxserve.kernels.cpu import build

    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed (.ci/run installs clang)")
    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "flag_sets", lambda: [build.BASE_FLAGS + build.NATIVE_FLAGS])
    for lib in (loader.LIBRARY, matmul.library()):
        path = build.build(lib, compiler=shutil.which(compiler))
        assert path.exists() and path.stat().st_size > 0


def test_bf16_and_int8_engines_agree_with_float32_and_use_the_library(make_tiny_model):
    """dtype=auto with matrix_units=none is the float32 fallback; bfloat16 and int8 serve
    through the library (its call in every step bucket, no weight slice) with greedy tokens
    close to float32's (random tiny weights: near-ties may flip late tokens)."""
    from jaxserve import LLM, SamplingParams

    model = str(make_tiny_model("llama"))
    prompts = [[11, 23, 98, 421, 77], list(range(5, 27)), [300, 301], [7, 8, 9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens, runners = {}, {}
    for name, kwargs in (("float32", dict(matrix_units="none")),
                         ("bfloat16", dict(dtype="bfloat16")),
                         ("int8", dict(quantization="int8", matrix_units="none"))):
        llm = LLM(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                  kv_cache_memory_bytes=1 << 20, **kwargs)
        runner = llm.llm_engine.engine_core.runner
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
        runner.wait_until_compiled()
        runners[name] = runner
        for (tokens_in_step, _), step in runner._steps.items():
            # --quantization int8 writes group-wise scales (quantization/int8.py): the library
            # streams them at decode rows (<= 8, the GEMV applying each group's scale); above,
            # XLA dequantizes (no W8A8 path for group scales yet)
            # (bf16 on bf16 units: the call on weights packed at startup, weight_packing.py)
            if name != "int8" or tokens_in_step <= matmul.MAX_GEMV_ROWS:
                assert "jaxserve_matmul" in step.as_text() or \
                    matmul.PACKED_TARGET in step.as_text(), (name, tokens_in_step)
            if name == "int8" and tokens_in_step <= matmul.MAX_GEMV_ROWS:
                assert matmul.GROUP_TARGET in step.as_text(), tokens_in_step
    assert runners["float32"].model.dtype == jnp.float32
    assert runners["bfloat16"].model.dtype == jnp.bfloat16
    for name in ("bfloat16", "int8"):
        assert [t[0] for t in tokens[name]] == [t[0] for t in tokens["float32"]], name
        same = sum(a == b for x, y in zip(tokens[name], tokens["float32"]) for a, b in zip(x, y))
        assert same >= 0.75 * 8 * len(prompts), (name, tokens[name], tokens["float32"])


# -- the GEMV's row limit, measured (kernels/cpu/gemv_choice.py) ---------------------------------
def test_the_gemv_row_limit_is_the_one_that_saves_most():
    from jaxserve.kernels.cpu.gemv_choice import choose_rows

    # GEMV ms, oneDNN ms per row count
    assert choose_rows({1: (8, 10), 2: (9, 12), 4: (11, 12), 8: (15, 12)}) == 4
    assert choose_rows({1: (10, 10), 2: (8, 12), 4: (13, 12), 8: (16, 12)}) == 2  # a tie at 1
    assert choose_rows({1: (10, 10), 2: (12, 12), 4: (12, 12), 8: (12, 12)}) == 0  # ties only
    assert choose_rows({1: (9.9, 10), 2: (12, 12), 4: (12, 12), 8: (12, 12)}) == 0  # < 5 %
    assert choose_rows({1: (12, 10), 2: (12, 10), 4: (12, 10), 8: (12, 10)}) == 0
    assert choose_rows({1: (5, 10), 2: (5, 10), 4: (5, 10), 8: (5, 10)}) == 8


def test_only_models_that_outgrow_the_caches_are_timed():
    from types import SimpleNamespace

    from jaxserve.kernels.cpu.timings import projection_shapes, worth_measuring

    smollm2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9,
                              num_kv_heads=3, head_dim=64)
    assert worth_measuring(jnp.float32, projection_shapes(smollm2), 30)     # 425 MB
    assert worth_measuring(jnp.bfloat16, projection_shapes(smollm2), 30)    # 212 MB
    tiny = SimpleNamespace(hidden_size=64, intermediate_size=128, num_heads=4,
                           num_kv_heads=2, head_dim=16)
    assert not worth_measuring(jnp.float32, projection_shapes(tiny), 2)


def test_the_gemv_choice_is_measured_once_then_read_back(tmp_path, monkeypatch):
    from jaxserve.kernels.cpu import gemv_choice, timings

    shapes = ((48, 48), (48, 16), (48, 16), (48, 48), (48, 96), (48, 96), (96, 48))
    monkeypatch.setattr(timings, "MEASURED_BYTES", 1 << 20)   # a quick timing
    choice, stored = gemv_choice.load_or_measure(str(tmp_path), jnp.float32, shapes, 4)
    assert not stored and sorted(choice.timings) == list(gemv_choice.ROW_COUNTS)
    assert all(g > 0 and o > 0 for g, o in choice.timings.values())
    assert choice.rows == gemv_choice.choose_rows(choice.timings)
    again, stored = gemv_choice.load_or_measure(str(tmp_path), jnp.float32, shapes, 4)
    assert stored and again == choice
    # another dtype is another measurement, kept beside the first
    _, stored = gemv_choice.load_or_measure(str(tmp_path), jnp.bfloat16, shapes, 4)
    assert not stored
    assert len(__import__("json").loads((tmp_path / "jaxserve-gemv-rows.json").read_text())) == 2


def test_gemv_and_onednn_steps_give_the_same_greedy_tokens(make_tiny_model):
    """cpu_gemv_rows forces the kernel: 8 puts every decode step (<= 8 rows) on the GEMV, 0 on
    oneDNN; their float32 logits agree to rounding, so greedy tokens are the same, and each
    compiled step says which kernel it asked for."""
    from jaxserve import LLM, SamplingParams

    model = str(make_tiny_model("llama"))
    prompts = [[11, 23, 98, 421, 77], list(range(5, 27)), [300, 301]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = {}
    for rows in ("0", "8"):
        llm = LLM(model, dtype="float32", max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20, cpu_gemv_rows=rows)
        runner = llm.llm_engine.engine_core.runner
        assert runner.plan.gemv_rows == int(rows)
        outs[rows] = llm.generate(prompts, params, use_tqdm=False)
        runner.wait_until_compiled()
        step = runner._steps[min(runner._steps)].as_text()
        assert f"gemv_rows={rows}" in step.replace(" ", ""), rows
        # On the GEMV, q/k/v and gate/up stream in one call each (layers.sibling_projections)
        assert (matmul.GROUP_TARGET in step) == (rows == "8"), rows
    for a, b in zip(outs["0"], outs["8"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, lp in la.items():
                assert abs(lp.logprob - lb[token].logprob) < 1e-4


def test_a_gemv_timing_that_fails_leaves_onednn_and_the_engine_starts(make_tiny_model,
                                                                      monkeypatch, caplog):
    import logging

    from jaxserve import LLM
    from jaxserve.kernels.cpu import gemv_choice, timings

    def broken(*args, **kwargs):
        raise RuntimeError("no timer here")

    monkeypatch.setattr(gemv_choice, "load_or_measure", broken)
    monkeypatch.setattr(timings, "worth_measuring", lambda *args: True)
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.model_setup"):
        llm = LLM(str(make_tiny_model("llama")), dtype="float32", max_model_len=64,
                  max_num_seqs=2, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.engine_core.runner.plan.gemv_rows == 0
    assert "could not time the CPU GEMV" in caplog.text and "no timer here" in caplog.text

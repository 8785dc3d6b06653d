"""The whole jitted step lowers for platforms this machine does not have.

No GPU in CI: `ModelRunner.export_step` runs jax.export of a real engine's step (forward +
sampler, the Pallas/Triton attention kernels, donated caches) for `cuda`, so a change that
breaks GPU lowering fails here. tp = 2 is exported by the parallel worker
(tests/test_parallel.py), which has simulated devices.
"""

from __future__ import annotations

import pytest

from jaxserve.attention.backend import get_attention_backend
from jaxserve.config import EngineConfig
from jaxserve.engine.model_setup import setup_model
from jaxserve.platforms import platform_named

TRITON = "__gpu$xla.gpu.triton"


def cuda_runner(model_dir, **overrides):
    config = EngineConfig.from_kwargs(model=str(model_dir), max_model_len=256, max_num_seqs=8,
                                      max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20,
                                      load_format="dummy", **overrides)
    setup = setup_model(config, target_platform=platform_named("cuda"))
    return config, setup.runner


def test_auto_picks_pallas_and_bfloat16_for_cuda_and_exports_every_bucket(make_tiny_model):
    config, runner = cuda_runner(make_tiny_model("qwen3"))
    # the config keeps "auto" (an AOT manifest's fingerprint hashes the option as given)
    assert config.runner_config.attention_backend == "auto"
    assert runner.model.backend.name == "pallas" and runner.compiled_shapes == []
    assert runner.params["params"]["embed_tokens"]["embedding"].dtype.name == "bfloat16"
    for num_tokens, num_seqs in runner.buckets.all_shapes():     # decode and prefill buckets
        exported = runner.export_step(num_tokens, num_seqs, "cuda")
        assert exported.platforms == ("cuda",)
        mlir = exported.mlir_module()
        assert mlir.count(TRITON) >= 1          # the attention kernel, compiled by Triton
        assert "jax.buffer_donor" in mlir or "tf.aliasing_output" in mlir   # caches donated


def test_reference_backend_step_exports_for_cuda_and_tpu(make_tiny_model):
    _, runner = cuda_runner(make_tiny_model("llama"), attention_backend="reference")
    t, s = runner.buckets.all_shapes()[-1]
    for platform in ("cuda", "tpu"):
        assert TRITON not in runner.export_step(t, s, platform).mlir_module()


def test_pallas_needs_a_gpu_and_interpret_mode_is_only_on_request():
    with pytest.raises(ValueError, match="pallas-interpret"):
        platform_named("cpu").attention_backend("pallas")
    with pytest.raises(ValueError, match="GPU"):
        platform_named("tpu").attention_backend("pallas")
    assert platform_named("cpu").attention_backend("pallas-interpret").name == "pallas-interpret"
    assert get_attention_backend("pallas-interpret").name == "pallas-interpret"
    for platform, expected in (("cpu", "cpu"), ("tpu", "reference"),
                               ("cuda", "pallas"), ("gpu", "pallas")):
        assert platform_named(platform).attention_backend_name("auto") == expected, platform


def test_speculative_verification_step_exports_for_cuda(make_tiny_model):
    """With speculative decoding on, the step carries the draft verification (k+1 LM-head
    positions per row, the rejection rule) behind a cond: it must lower for cuda too."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    _, runner = cuda_runner(make_tiny_model("qwen3"), speculative_config=spec)
    assert runner.num_spec_tokens == 3
    for num_tokens, num_seqs in runner.buckets.all_shapes()[::3]:
        exported = runner.export_step(num_tokens, num_seqs, "cuda")
        assert exported.platforms == ("cuda",)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_int8_weights_and_quantized_kv_step_exports_for_cuda_with_the_pallas_kernel(
        make_tiny_model, kv):
    """The Pallas kernel's scaled tile loads (int8 / fp8 values + per-slot-head scale codes)
    lower through Triton: no GPU here, so exporting the step for cuda is the check."""
    _, runner = cuda_runner(make_tiny_model("llama"), quantization="int8", kv_cache_dtype=kv)
    assert runner.params["params"]["layers"]["q_proj"]["kernel"].dtype.name == "int8"
    assert runner.k_cache.dtype.name == {"fp8": "float8_e4m3fn", "int8": "int8"}[kv]
    assert runner.k_cache.scale.dtype.name == "int8"
    t, s = runner.buckets.all_shapes()[0]
    mlir = runner.export_step(t, s, "cuda").mlir_module()
    assert mlir.count(TRITON) >= 1
    if kv == "fp8":
        assert "f8E4M3FN" in mlir


def test_steps_traced_on_several_threads_never_build_flax_modules_at_once(make_tiny_model,
                                                                          monkeypatch):
    """flax's per-`setup` `nn.scan` class build edits the base Module's dataclass fields in
    place; two threads tracing at once failed with KeyError: 'parent' (CI, warmup's pool).
    The probe holds each scan build open until another thread enters one too, or 1 s
    passes: with tracing serialized (models/tracing.py) no two are ever inside together."""
    import threading

    import flax.linen as nn

    config = EngineConfig.from_kwargs(model=str(make_tiny_model("llama")), max_model_len=256,
                                      max_num_seqs=8, max_num_batched_tokens=64,
                                      kv_cache_memory_bytes=4 << 20, load_format="dummy")
    runner = setup_model(config, warmup=False).runner
    shapes = runner.buckets.all_shapes()[:3]
    real_scan, guard, inside, peak, entered = nn.scan, threading.Lock(), [0], [0], \
        threading.Event()

    def probe(*args, **kwargs):
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            if inside[0] > 1:
                entered.set()
        entered.wait(1.0)           # the overlap window: ends early once two are inside
        try:
            return real_scan(*args, **kwargs)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(nn, "scan", probe)
    errors: list[BaseException] = []

    def lower(shape):
        try:
            runner.lower_step(*shape)
        except BaseException as e:          # reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=lower, args=(s,)) for s in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and peak[0] == 1


def test_float32_means_float32_dots_on_a_gpu(make_tiny_model):
    """XLA's default precision for float32 dots on recent GPUs is TF32: a float32 model's
    step asks for full precision in every dot itself, whatever the process default is."""
    import re

    import jax

    _, runner = cuda_runner(make_tiny_model("llama"), dtype="float32",
                            attention_backend="reference")
    t, s = runner.buckets.all_shapes()[-1]
    with jax.default_matmul_precision("default"):     # the session's own default is highest
        mlir = runner.export_step(t, s, "cuda").mlir_module()
    dots = [line for line in mlir.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 7          # q, k, v, o, gate, up, down per layer at least
    lowered = [d for d in dots if not re.search(r"precision = \[HIGHEST, HIGHEST\]", d)]
    assert lowered == [], lowered[:2]

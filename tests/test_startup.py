"""Startup: warm-up compiles the largest and the one-token bucket, the rest in the background
(runner/model_runner.py `warmup(background=True)`, RunnerConfig.compile_in_background).

Until a step's own bucket is compiled it runs padded in the smallest compiled bucket that
holds it: the same greedy tokens as an engine that compiled everything first; once
`all_compiled` is set, serving compiles nothing.
"""

from __future__ import annotations

import re
import threading

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.model_runner import ModelRunner

# Buckets T = 1, 2, 4, 8 (S = min(T, 4)): (8, 4) and (1, 1) first, (2, 2) and (4, 4) later.
ENGINE_KWARGS = {"max_model_len": 64, "max_num_batched_tokens": 8, "max_num_seqs": 4,
                 "kv_cache_memory_bytes": 4 << 20, "compilation_cache_dir": "off"}
PROMPTS = [[11, 23, 98], [7] + list(range(40, 47)), [250], [5, 6]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(make_tiny_model) -> list[list[int]]:
    llm = LLM(str(make_tiny_model("llama")), compile_in_background=False, **ENGINE_KWARGS)
    runner = llm.llm_engine.engine_core.runner
    assert runner.all_compiled.is_set() and runner.compiled_shapes == \
        [(1, 1), (2, 2), (4, 4), (8, 4)]
    return _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


def test_steps_run_padded_until_their_bucket_compiles_then_nothing_compiles(
        make_tiny_model, reference, monkeypatch):
    release = threading.Event()
    background = ModelRunner._compile_in_background

    def held(self, shapes):            # the background compile waits until the test says go
        release.wait()
        background(self, shapes)

    monkeypatch.setattr(ModelRunner, "_compile_in_background", held)
    llm = LLM(str(make_tiny_model("llama")), **ENGINE_KWARGS)
    runner = llm.llm_engine.engine_core.runner
    assert runner.compiled_shapes == [(1, 1), (8, 4)] and not runner.all_compiled.is_set()
    assert runner.bucket_for(1, 1) == (1, 1)
    assert runner.bucket_for(3, 3) == (8, 4)       # (4, 4) is not compiled yet: padded
    used = []
    execute = runner.run_step

    def recording(inputs):
        used.append((inputs.num_tokens, inputs.num_seqs))
        return execute(inputs)

    monkeypatch.setattr(runner, "run_step", recording)
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
    assert set(used) <= {(1, 1), (8, 4)} and (8, 4) in used
    assert runner._wanted                            # the padded steps' own buckets

    release.set()
    assert runner.wait_until_compiled(timeout=300)
    assert runner.compiled_shapes == [(1, 1), (2, 2), (4, 4), (8, 4)]
    # the executable store's refill compiles after the buckets, in the background too
    assert runner.background_done.wait(300)
    compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        used.clear()
        assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert (4, 4) in used                            # exact buckets now


def test_the_kv_cache_is_allocated_only_after_every_warmup_bucket_compiled(make_tiny_model,
                                                                         monkeypatch):
    """On a GPU the compiler's autotuner needs free memory: no cache buffer may exist while
    any warm-up bucket compiles (runner warmup's order)."""
    events: list[tuple[str, object, bool]] = []
    compile_step, allocate = ModelRunner._compile, ModelRunner.allocate_kv_cache

    # An earlier test's engine may still be compiling in the background through the same
    # patched method (seen in CI: two extra compiles): only runners built here count.
    mine: list[ModelRunner] = []
    init = ModelRunner.__init__

    def building(self, *args, **kwargs):
        mine.append(self)
        init(self, *args, **kwargs)

    def compiling(self, num_tokens, num_seqs):
        if any(self is runner for runner in mine):
            events.append(("compile", (num_tokens, num_seqs), self.kv_cache_allocated))
        return compile_step(self, num_tokens, num_seqs)

    def allocating(self):
        if not self.kv_cache_allocated and any(self is runner for runner in mine):
            events.append(("allocate", tuple(self.compiled_shapes), False))
        allocate(self)

    monkeypatch.setattr(ModelRunner, "__init__", building)
    monkeypatch.setattr(ModelRunner, "_compile", compiling)
    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", allocating)
    llm = LLM(str(make_tiny_model("llama")), compile_in_background=False, **ENGINE_KWARGS)
    runner = llm.llm_engine.engine_core.runner
    assert [kind for kind, _, _ in events] == ["compile"] * 4 + ["allocate"]
    assert not any(allocated for _, _, allocated in events)
    assert events[-1][1] == ((1, 1), (2, 2), (4, 4), (8, 4))
    assert runner.kv_cache_allocated and set(runner.startup_timings) == {"kv_fill"}
    # Zeros, not uninitialized memory (no request has written a block yet).
    assert float(abs(runner.k_cache).max()) == 0.0 == float(abs(runner.v_cache).max())
    assert {"load", "runner", "warmup", "kv_fill"} <= set(llm.llm_engine.engine_core.setup.phases)


def test_steps_needing_more_than_the_planned_activations_shrink_the_cache_before_it_exists(
        make_tiny_model, monkeypatch, caplog):
    """The plan reserves an estimate of the step's activations; when the compiled steps
    report more (memory_analysis), the same rule plans again with their figure and the
    runner is rebuilt and compiled for the smaller cache, before any cache is allocated."""
    from jaxserve.runner import memory

    measured = 16 << 20                   # far above the tiny model's estimate
    monkeypatch.setattr(memory, "available_host_memory", lambda: 64 << 20)
    monkeypatch.setattr(ModelRunner, "compiled_temp_bytes", lambda self: measured)
    runners, allocate = [], ModelRunner.allocate_kv_cache

    def allocating(self):
        runners.append(self)
        allocate(self)

    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", allocating)
    kwargs = {k: v for k, v in ENGINE_KWARGS.items() if k != "kv_cache_memory_bytes"}
    with caplog.at_level("WARNING", logger="jaxserve.engine.model_setup"):
        llm = LLM(str(make_tiny_model("llama")), compile_in_background=False, **kwargs)
    setup = llm.llm_engine.engine_core.setup
    runner = llm.llm_engine.engine_core.runner
    warnings = [r.getMessage() for r in caplog.records if "compiling again" in r.getMessage()]
    assert len(warnings) == 1
    replanned, planned = map(int, re.search(r"(\d+) KV blocks, not (\d+)", warnings[0]).groups())
    assert replanned < planned and setup.kv_plan.num_blocks == replanned == runner.num_blocks
    assert setup.kv_plan.activation_bytes == measured
    assert set(runners) == {runner}       # only the rebuilt runner ever allocated a cache
    assert runner.k_cache.shape[0] == runner.arch.num_layers * replanned
    assert runner.compiled_shapes == [(1, 1), (2, 2), (4, 4), (8, 4)]
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)

"""The serialized-executable store refills after a code change that leaves the step's HLO
unchanged (runner/executable_cache.py, runner/step_compilation.py).

Such a change is a new key in the store (every source file is in it) but a hit in JAX's
persistent compilation cache, whose executables cannot be stored (XLA:CPU serializes them
without their kernels). The start that sees this compiles those buckets once more around
JAX's cache (runner/persistent_cache_bypass.py), in the background, and stores them; the
next start loads every bucket. Without that every later start compiled.
"""

from __future__ import annotations

import gc
import os

import jax
import pytest

from tests import precision

ENGINE_KWARGS = {"max_model_len": 64, "max_num_batched_tokens": 2, "max_num_seqs": 2,
                 "kv_cache_memory_bytes": 2 << 20, "compile_in_background": False,
                 **precision.EXACT}
PROMPTS = [[11, 23, 98], [7] + list(range(40, 52))]


@pytest.fixture
def jax_cache_restored():
    """Give the process its JAX compilation cache setting back after the test."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


def _start(model, cache_dir) -> dict:
    """A start as a fresh process makes it (nothing compiled in memory): its tokens and
    what the store did, once the background refill is done."""
    from jaxserve import LLM, SamplingParams

    jax.clear_caches()
    llm = LLM(str(model), compilation_cache_dir=str(cache_dir), **ENGINE_KWARGS)
    runner = llm.llm_engine.engine_core.runner
    assert runner.background_done.wait(600), "the background refill never finished"
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5,
                                                ignore_eos=True), use_tqdm=False)
    cache = runner.executable_cache
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "shapes": len(runner.compiled_shapes), "hits": cache.hits,
              "misses": cache.misses, "refilled": cache.refilled,
              "unstored": len(cache.unstored)}
    del llm, runner, cache
    gc.collect()
    return result


def test_a_change_keeping_the_step_hlo_refills_the_store_and_the_next_start_loads(
        make_tiny_model, tmp_path, monkeypatch, jax_cache_restored):
    from jaxserve.runner import executable_cache

    model = make_tiny_model("llama")
    first = _start(model, tmp_path)
    assert first["shapes"] >= 2
    assert (first["hits"], first["misses"], first["refilled"]) == (0, first["shapes"], 0)

    # A later tree whose step lowers to the same HLO: a miss here, a hit in JAX's cache.
    monkeypatch.setattr(executable_cache, "source_fingerprint",
                        lambda: "a later tree with the same step")
    second = _start(model, tmp_path)
    assert (second["hits"], second["misses"]) == (0, first["shapes"])
    assert (second["refilled"], second["unstored"]) == (first["shapes"], 0)

    third = _start(model, tmp_path)
    assert (third["hits"], third["misses"]) == (first["shapes"], 0)
    # the stored copies run (a copy of a served executable fails at its first call)
    assert third["tokens"] == second["tokens"] == first["tokens"]


@pytest.mark.fast
def test_a_bypassing_compile_neither_reads_nor_writes_jax_cache(tmp_path, jax_cache_restored):
    import jax.numpy as jnp

    from jaxserve.engine.model_setup import enable_compilation_cache
    from jaxserve.runner.executable_cache import ExecutableCache
    from jaxserve.runner.persistent_cache_bypass import bypassing_persistent_cache

    cache = ExecutableCache(tmp_path / "executables", "key")
    # A constant of its own: no earlier run can have put this function in any JAX cache.
    scale = 1.0 + int.from_bytes(os.urandom(4), "little") / 2**33
    enable_compilation_cache(str(tmp_path / "jax"))

    def compile_once(bypass: bool) -> bool:
        jax.clear_caches()
        with cache.compiling() as hit:
            if bypass:
                with bypassing_persistent_cache() as bypassing:
                    assert bypassing
                    jax.jit(lambda x: jnp.cos(x) * scale).lower(jnp.ones(5)).compile()
            else:
                jax.jit(lambda x: jnp.cos(x) * scale).lower(jnp.ones(5)).compile()
            return hit()

    def entries() -> set[str]:
        return set(os.listdir(tmp_path / "jax"))

    assert compile_once(bypass=True) is False
    assert not entries(), "a bypassing compile wrote JAX's cache"
    assert compile_once(bypass=False) is False           # a real miss, written
    written = entries()
    assert written
    assert compile_once(bypass=True) is False            # not read ...
    assert entries() == written                          # ... nor written
    assert compile_once(bypass=False) is True            # other compiles still hit it

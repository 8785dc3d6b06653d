"""Compiling the step: one ahead-of-time executable per bucket (T, S), at warm-up, in a
background thread, or loaded from the executable cache; and which bucket a step runs in
while some are still compiling.

`StepCompilation` is a mixin of `ModelRunner` (as vLLM's runner mixins): it uses the
runner's model, layout, shapes and device placement (`_layout`, `_constants`, `_put`,
`_params_platform`, `_param_specs`, `_state_specs`, `batch`, `buckets`), and owns `_steps`
((T, S) -> executable), `all_compiled`, `background_done`, `_wanted`, `_stop_compiling` and
`_compile_thread`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax

from jaxserve import load_progress
from jaxserve.runner.execution_plan import choose_execution_plan
from jaxserve.runner.step_function import step
from jaxserve.step_inputs import StepLayout

logger = logging.getLogger(__name__)

# Background compiles (ModelRunner.warmup(background=True)) still running; stopped at exit.
_BACKGROUND_COMPILES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_background_compiles() -> None:
    """At interpreter exit: start no new background compile, and wait for the ones in flight
    (a compile torn down mid-way by interpreter finalization can crash the process)."""
    for runner in list(_BACKGROUND_COMPILES):
        runner._stop_compiling.set()
    for runner in list(_BACKGROUND_COMPILES):
        thread = runner._compile_thread
        if thread is not None:
            thread.join()


def wait_for_background_compiles(timeout: float | None = None) -> bool:
    """Block until every runner of this process has compiled all its buckets and its
    background thread is done (the executable store's refill compiles too: tests that
    assert "no compile after warm-up" wait here first). False on timeout."""
    return all(runner.all_compiled.wait(timeout) and runner.background_done.wait(timeout)
               for runner in list(_BACKGROUND_COMPILES))


class StepCompilation:
    """The bucket executables of a `ModelRunner` (see the module docstring)."""

    def _init_compilation(self) -> None:
        self._steps: dict[tuple[int, int], Any] = {}   # (T, S) -> compiled executable
        # Set once every bucket is compiled (warmup); until then a step may run padded in the
        # smallest compiled bucket that fits (see warmup(background=True)).
        self.all_compiled = threading.Event()
        # Set when the background thread is done: the buckets compiled, and the executable
        # cache refilled with the ones JAX's persistent cache served (or nothing to do).
        self.background_done = threading.Event()
        self._stop_compiling = threading.Event()
        self._compile_thread: threading.Thread | None = None
        self._wanted: set[tuple[int, int]] = set()   # buckets steps ran padded for, meanwhile
        self.executable_cache: Any = None     # runner/executable_cache.py, when enabled

    def _jitted(self, layout: StepLayout, model: Any = None):
        return jax.jit(functools.partial(
            step, model=self.model if model is None else model,
            model_constants=self.model_constants, layout=layout,
            num_top_logprobs=self.num_top_logprobs, num_spec_tokens=self.num_spec_tokens,
            num_spec_rows=min(layout.num_seqs, self.max_spec_rows),
            logits_shardings=self.logits_shardings),
            donate_argnums=(1, 2, 3, 4))

    def enable_executable_cache(self, directory: str) -> None:
        """Load step executables serialized by an earlier start with the same key (no
        tracing), and save the ones compiled here (runner/executable_cache.py)."""
        from jaxserve.runner.executable_cache import ExecutableCache, executable_key

        # The devices this runner's arrays live on: a sharding's repr names its mesh axes, not
        # its devices, and data-parallel replicas differ only there.
        specs = (self._param_specs, self._state_specs[0])
        devices = sorted({d.id for x in jax.tree.leaves(specs) for d in x.sharding.device_set})
        key = executable_key({**self._settings, "placement_devices": devices,
                              "model_constants": jax.tree.map(
                                  lambda x: (x.shape, x.dtype), self.model_constants)},
                             self._param_specs)
        self.executable_cache = ExecutableCache(directory, key)

    def _compile(self, num_tokens: int, num_seqs: int):
        """Ahead-of-time compile one bucket; returns the executable (called directly later)."""
        cache = self.executable_cache
        if cache is not None:
            executable = cache.load((num_tokens, num_seqs))
            if executable is not None:
                return executable
        with (cache.compiling() if cache is not None else contextlib.nullcontext()) as hit:
            executable = self.lower_step(num_tokens, num_seqs).compile(
                self._params_platform().step_compiler_options())
            if cache is not None:
                cache.store_compiled((num_tokens, num_seqs), executable, hit())
        return executable

    def _store_served_from_jax_cache(self) -> None:
        """Compile once more, around JAX's persistent cache, each bucket that cache served
        this start, and store those executables (runner/executable_cache.py: what it served
        cannot be stored). The served ones keep running; this only fills the store, so the
        next start loads instead of compiling."""
        cache = self.executable_cache
        todo = sorted(getattr(cache, "unstored", ()))
        # Only where a compile's scratch is host RAM (XLA:CPU, whose served executables lose
        # their kernels): on an accelerator the KV cache now holds the memory a compile's
        # autotuning would take, and its served executables were not seen to need this.
        if not todo or not self._params_platform().memory_is_host_ram:
            return
        from jaxserve.runner import persistent_cache_bypass

        if not persistent_cache_bypass.available():
            logger.info("%d step executables came from JAX's compilation cache and cannot be "
                        "stored (this jax has no way around that cache)", len(todo))
            return
        start = time.perf_counter()
        for shape in todo:
            if self._stop_compiling.is_set():
                return
            with persistent_cache_bypass.bypassing_persistent_cache(), \
                    cache.compiling() as hit:
                executable = self.lower_step(*shape).compile(
                    self._params_platform().step_compiler_options())
                served = hit()
            if served:      # the bypass did not hold: storing this copy would break a start
                logger.warning("step %s still came from JAX's compilation cache; not stored",
                               shape)
                continue
            cache.store(shape, executable)
            cache.unstored.discard(shape)
            cache.refilled += 1
        logger.info("stored %d step executables that JAX's compilation cache had served "
                    "(compiled again around it in %.1f s): the next start loads them",
                    cache.refilled, time.perf_counter() - start)

    def lower_step(self, num_tokens: int, num_seqs: int) -> Any:
        """Bucket (T, S)'s step lowered against the shapes and shardings of its arguments
        (`jax.stages.Lowered`); ahead-of-time compiles (engine/aot_compile.py) compile it with
        their own options."""
        layout = self._layout(num_tokens, num_seqs)
        consts = self._constants(num_seqs)
        return self._jitted(layout).lower(
            self._param_specs, *self._state_specs,
            self._put(layout.empty(self.batch.padding_row)),
            consts["bias_token_ids"], consts["bias_values"],
            consts["grammar_bitmask"], self._lora_stacks())
    def warmup(self, progress: bool = True, max_workers: int | None = None,
               background: bool = False) -> float:
        """Compile every bucket before serving, several at once (XLA compiles release the GIL;
        tracing does not, but it is the small part), then allocate the KV cache. Returns
        seconds.

        The order is the point: every warm-up compile (and on a GPU, XLA's GEMM autotuning,
        which allocates scratch copies of each GEMM's operands) runs while device memory
        holds only the weights; the cache, sized by the memory plan, comes after
        (`compile_warmup_buckets` then `allocate_kv_cache`; engine/model_setup.py checks the
        plan against the compiled programs in between).

        background: compile (or load, runner/executable_cache.py) only the largest bucket,
        which serves any step by padding, and the one-token bucket (a lone decode) before
        returning; compile the others smallest first in a background thread, after the
        cache exists (the memory plan keeps a compile's headroom for them, runner/memory.py).
        Until a step's own bucket is ready it runs in the smallest compiled bucket that
        fits (execute): the same computation with more padding rows. ``all_compiled`` is set
        when every bucket is ready; from then on a step never compiles."""
        start = time.perf_counter()
        rest = self.compile_warmup_buckets(progress, max_workers, background)
        self.finish_warmup(rest, start)
        return time.perf_counter() - start

    def compile_warmup_buckets(self, progress: bool = True, max_workers: int | None = None,
                               background: bool = False) -> list[tuple[int, int]]:
        """Compile warm-up's buckets (all, or with `background` the largest and the smallest)
        without touching the KV cache; returns the buckets left for the background."""
        shapes = [s for s in self.buckets.all_shapes() if s not in self._steps]
        first, rest = shapes, []
        if background and len(shapes) > 2:
            first = [shapes[-1], shapes[0]]
            rest = shapes[1:-1]
        self._compile_all(first, progress, max_workers)
        self._compile_history_loader()
        return rest

    def finish_warmup(self, rest: list[tuple[int, int]], start: float) -> None:
        """After `compile_warmup_buckets`: allocate the KV cache, wait for the params (an
        orbax restore), and start compiling `rest` in the background."""
        self.allocate_kv_cache()
        self._wait_params()         # restored meanwhile, from an orbax checkpoint
        elapsed = time.perf_counter() - start
        cache = self.executable_cache
        loaded = f" ({cache.hits} loaded serialized, {cache.misses} compiled)" if cache else ""
        unstored = len(getattr(self.executable_cache, "unstored", ()) or ())
        logger.info("warm-up compiled %d step shapes in %.1f s%s%s%s", len(self._steps), elapsed,
                    loaded, f"; compiling {len(rest)} more in the background" if rest else "",
                    f"; {unstored} came from JAX's compilation cache, to be compiled again in "
                    "the background and stored" if unstored else "")
        if not rest:
            self.all_compiled.set()
        if not rest and not unstored:
            self.background_done.set()
            return
        self._compile_thread = threading.Thread(
            target=self._compile_in_background, args=(rest,), daemon=True,
            name="jaxserve-compile")
        _BACKGROUND_COMPILES.add(self)
        self._compile_thread.start()

    def compiled_temp_bytes(self) -> int:
        """The largest temporaries (scratch beyond arguments and outputs) of the compiled
        steps, from XLA's memory_analysis(); 0 where the backend does not report it."""
        peak = 0
        for executable in list(self._steps.values()):
            try:
                stats = executable.memory_analysis()
            except Exception:     # e.g. an executable kind without the analysis
                stats = None
            if stats is not None:
                peak = max(peak, int(stats.temp_size_in_bytes))
        return peak

    def _compile_all(self, shapes: list[tuple[int, int]], progress: bool,
                     max_workers: int | None) -> None:
        if not shapes:
            return
        workers = max_workers or min(len(shapes), os.cpu_count() or 1) or 1
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(shapes), desc="Compiling step buckets", unit="bucket")
        with ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(self._compile, t, s): (t, s) for t, s in shapes}
            for done, future in enumerate(as_completed(futures), 1):
                self._steps[futures[future]] = future.result()
                load_progress.report("compile", done / len(shapes))
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()

    def _compile_in_background(self, shapes: list[tuple[int, int]]) -> None:
        """The background thread: compile `shapes` (warm-up's rest), then store what JAX's
        persistent cache served (`_store_served_from_jax_cache`)."""
        try:
            self._compile_rest(shapes)
            if not self._stop_compiling.is_set():
                self._store_served_from_jax_cache()
        except Exception:   # the store is an optimisation: serving goes on without it
            logger.exception("storing the step executables failed; the next start compiles")
        finally:
            self._compile_thread = None
            self.background_done.set()

    def _compile_rest(self, shapes: list[tuple[int, int]]) -> None:
        if not shapes:
            return
        start = time.perf_counter()
        todo = list(shapes)
        try:
            while todo:
                if self._stop_compiling.is_set():
                    return
                # A bucket a step has asked for (and ran padded) first, then smallest first.
                wanted = [shape for shape in todo if shape in self._wanted]
                shape = min(wanted) if wanted else todo[0]
                todo.remove(shape)
                if shape not in self._steps:
                    self._steps[shape] = self._compile(*shape)
            logger.info("background compile of %d more step shapes done in %.1f s",
                        len(shapes), time.perf_counter() - start)
        except Exception:   # keep serving: a missing bucket compiles when a step needs it
            logger.exception("background compile failed; missing buckets compile on demand")
        finally:
            self.all_compiled.set()

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until warm-up has compiled every bucket (background compiles included)."""
        return self.all_compiled.wait(timeout)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The compiled bucket a step runs in: its own (buckets.py), or while a background
        warm-up is still compiling that one, the smallest compiled bucket that holds it."""
        t, s = self.buckets.shape_for(num_tokens, num_seqs)
        if self.all_compiled.is_set() or (t, s) in self._steps:
            return t, s
        fits = [shape for shape in list(self._steps) if shape[0] >= t and shape[1] >= s]
        if not fits:
            return t, s
        self._wanted.add((t, s))        # the background compile takes it next
        return min(fits)

    def export_step(self, num_tokens: int, num_seqs: int, platform: str) -> Any:
        """`jax.export` bucket (T, S) of the whole step (forward + sampler, donated caches,
        shardings included) for `platform`, without a device of that kind: proves the step
        lowers there (a CPU test exports it for cuda, so GPU lowering breakage fails CI)."""
        from jax import export

        layout = self._layout(num_tokens, num_seqs)
        consts = self._constants(num_seqs)
        args = (self.params, self.k_cache, self.v_cache, self.last_tokens, self.penalty_state,
                self._put(layout.empty(self.batch.padding_row)), consts["bias_token_ids"],
                consts["bias_values"], consts["grammar_bitmask"], self._lora_stacks())
        # Triton kernels are custom calls that jax.export does not vouch for by default.
        checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        # The model as that platform's runner builds it (its execution plan).
        model = self.model.with_plan(choose_execution_plan(
            platform, self.model.backend.name, 1, self.dtype, self.plan.gemv_rows))
        return export.export(self._jitted(layout, model), platforms=[platform],
                             disabled_checks=checks)(*args)

    @property
    def compiled_shapes(self) -> list[tuple[int, int]]:
        return sorted(self._steps)

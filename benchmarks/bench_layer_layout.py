"""Layer-weight layout on the CPU: stacked [L, ...] weights read in place by the scanned layer
loop (the CPU's execution plan) vs per-layer buffers under a static (unrolled) layer loop.

Builds the engine's runner (default: the embedded SmolLM2-135M, 30 layers) without warm-up,
then for each layout compiles the chosen buckets (trace + lower and XLA compile timed apart)
and times whole steps (forward + sampler) on padding inputs: the projections and the LM head
cost what a real step costs; attention sees no context, the same for both. Layouts are timed
alternately (A B A B ...), so a loaded machine slows them alike; medians and the ratio to
``stacked`` go to JSON.

  stacked     the scanned loop over [L, ...] weights; float projections call the CPU
              matmul library (oneDNN / the streaming GEMV) on the stack and the layer index
  per-layer   each layer's weights its own device buffer (the stack split once, at load),
              a Python loop over layers (straight-line HLO); the projections call the same
              library on their own buffer (as a [1, in, out] view, layer 0). A float32 KV
              cache is written by the attention library here too (as bf16 caches always
              are): in straight-line code XLA:CPU's f32 scatter is not in place -- the
              (1, 1) step copied the whole cache 176 times (SmolLM2, 30 layers) -- while
              under the scan it is

    PYTHONPATH=. python benchmarks/bench_layer_layout.py --dtype bfloat16 --tokens 1,8,64 \\
        --json benchmarks/results/layer-layout-cpu-bf16.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_layer_loop import step_ms  # noqa: E402 - a sibling script (benchmarks/ on sys.path)

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.model_setup import setup_model  # noqa: E402
from jaxserve.models.decoder import per_layer_weights  # noqa: E402
from jaxserve.models.execution_plan import LayerLoop  # noqa: E402


def cpu_flags() -> list[str]:
    """This CPU's AVX-512 / AMX flags (lscpu), the matrix units the library may use."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return sorted({f for f in flags if f.startswith(("avx512", "amx"))})


@contextlib.contextmanager
def library_kv_writes():
    """While tracing: every float KV cache written by the attention library (in place)."""
    import jaxserve.attention.cpu as cpu_attention

    saved = cpu_attention._WRITTEN_BY_THE_LIBRARY
    cpu_attention._WRITTEN_BY_THE_LIBRARY = (jnp.dtype(jnp.float32), *saved)
    try:
        yield
    finally:
        cpu_attention._WRITTEN_BY_THE_LIBRARY = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="1,8,64", help="token buckets to compile and time")
    ap.add_argument("--compile-tokens", default="",
                    help="token buckets only compiled, not timed (512: a cold start's largest)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10, help="steps per layout per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    config = EngineConfig.from_kwargs(model=args.model, dtype=args.dtype, max_model_len=512,
                                      max_num_seqs=64, max_num_batched_tokens=512,
                                      kv_cache_memory_bytes=128 << 20,
                                      compilation_cache_dir="off")
    runner = setup_model(config, warmup=False).runner
    stacked_model, stacked_params = runner.model, runner.params
    if stacked_model.plan.layer_loop is not LayerLoop.SCANNED:
        sys.exit("the runner's plan is not the scanned loop here (not the CPU?)")
    layouts = {
        "stacked": (stacked_model, stacked_params),
        "per-layer": (stacked_model.with_plan(replace(stacked_model.plan, layer_loop=LayerLoop.PER_LAYER)),
                      jax.block_until_ready({"params": per_layer_weights(stacked_params["params"])})),
    }
    del stacked_params
    wanted = [int(t) for t in args.tokens.split(",")]
    shapes = [s for s in runner.buckets.all_shapes() if s[0] in wanted]
    compile_only = [int(t) for t in args.compile_tokens.split(",") if t]
    compiled = shapes + [s for s in runner.buckets.all_shapes() if s[0] in compile_only]

    def use(name: str) -> None:
        runner.model, runner.params = layouts[name]
        runner._param_specs = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), runner.params)

    steps: dict[str, dict] = {}
    lower_s: dict[str, dict] = {}
    compile_s: dict[str, dict] = {}
    for name in layouts:
        use(name)
        steps[name], lower_s[name], compile_s[name] = {}, {}, {}
        for shape in compiled:
            t0 = time.perf_counter()
            with library_kv_writes() if name == "per-layer" else contextlib.nullcontext():
                lowered = runner.lower_step(*shape)
            t1 = time.perf_counter()
            executable = lowered.compile()
            if shape in shapes:
                steps[name][shape] = executable
            t2 = time.perf_counter()
            lower_s[name][str(shape)] = round(t1 - t0, 2)
            compile_s[name][str(shape)] = round(t2 - t1, 2)
            print(f"{name} {shape}: lowered in {t1 - t0:.2f} s, compiled in {t2 - t1:.2f} s",
                  flush=True)

    times: dict[str, dict[str, list[float]]] = {n: {str(s): [] for s in shapes} for n in layouts}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name in layouts:
            use(name)
            runner._steps = steps[name]
            for shape in shapes:
                times[name][str(shape)].append(step_ms(runner, shape, args.iters))
        loads.append(os.getloadavg()[0])

    result = {"model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
              "num_layers": runner.arch.num_layers, "dtype": args.dtype,
              "jax": jax.__version__,
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
                          "loadavg_1min_per_round": [round(x, 2) for x in loads]},
              "rounds": args.rounds, "iters": args.iters, "lower_s": lower_s,
              "compile_s": compile_s, "step_ms_median": {}, "step_ratio_to_stacked": {}}
    for name in layouts:
        med = {k: round(statistics.median(v), 3) for k, v in times[name].items()}
        result["step_ms_median"][name] = med
        result["step_ratio_to_stacked"][name] = {
            k: round(med[k] / statistics.median(times["stacked"][k]), 3) for k in med}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    jnp.zeros(1)   # start the backend before timing anything
    main()

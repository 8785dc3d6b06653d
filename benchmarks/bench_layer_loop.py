"""The layer loop, rolled vs unrolled, on this machine: compile time and step time per bucket.

Builds the engine's runner for a model (default: the embedded SmolLM2-135M, 30 layers) without
warm-up, then for each variant of the decoder's layer loop (models/decoder.py) compiles the
chosen buckets (seconds per bucket: trace + lower + XLA compile) and times steps on padding
inputs (the projections and the LM head cost what a real step costs; attention sees no
context, the same for every variant). Variants are timed alternately, round after round, so a
loaded machine slows them alike; the medians and the ratios to the first variant go to JSON.

  rolled+layer_matmul    the CPU default: a scan; projections read the stacked weights in
                         place through oneDNN (models/layer_matmul.py)
  rolled                 the scan with XLA's dots (each layer's weight slice copied)
  unrolled               nn.scan(unroll=num_layers), XLA's dots (the GPU default)
  unrolled+layer_matmul  both
  unrolled-untuned       GPU: unrolled, Triton GEMMs with the tiles a compile without a device
                         gets (autotuning off): what `jaxserve compile` ships. They read every
                         weight in place, but their tiles are XLA's defaults
  unrolled-cublas        GPU: unrolled, cuBLAS GEMMs (`jaxserve compile`'s choice until it
                         was found to copy each weight slice for cuBLAS, every step: the
                         gpu_compile tier's HLO) -- what those copies cost

    PYTHONPATH=. python benchmarks/bench_layer_loop.py --dtype bfloat16 --tokens 1,64 \\
        --json benchmarks/results/layer-loop-cpu-bf16.json
    python benchmarks/bench_layer_loop.py --model configs/models/llama-3-8b \\
        --load-format dummy --variants unrolled,rolled,unrolled-untuned,unrolled-cublas \\
        --tokens 1,64,256   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.model_setup import setup_model  # noqa: E402
from jaxserve.models.execution_plan import LayerLoop  # noqa: E402
from jaxserve.platforms.gpu_targets import (  # noqa: E402
    CUBLAS_COMPILER_OPTIONS,
    GPU_COMPILER_OPTIONS,
)


def step_ms(runner, shape: tuple[int, int], iters: int) -> float:
    """Milliseconds per step of bucket `shape` (empty inputs), after one untimed step."""
    inputs = runner.empty_inputs(*shape)
    jax.block_until_ready(runner.run_step(inputs))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = runner.run_step(inputs)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


# name -> (the plan's layer loop, its cpu_matmul, compiler options; None: the runner's own)
VARIANTS = {
    "rolled+layer_matmul": (LayerLoop.SCANNED, True, None),
    "rolled": (LayerLoop.SCANNED, False, None),
    "unrolled": (LayerLoop.UNROLLED, False, None),
    "unrolled+layer_matmul": (LayerLoop.UNROLLED, True, None),
    "unrolled-untuned": (LayerLoop.UNROLLED, False,
                         {**GPU_COMPILER_OPTIONS, "xla_gpu_autotune_level": 0}),
    "unrolled-cublas": (LayerLoop.UNROLLED, False, CUBLAS_COMPILER_OPTIONS),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights (GPU runs)")
    ap.add_argument("--tokenizer", default=None, help="for a config-only model directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="1,64", help="token buckets to compile and time")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    config = EngineConfig.from_kwargs(model=args.model, dtype=args.dtype, max_model_len=512,
                                      max_num_seqs=64, max_num_batched_tokens=512,
                                      kv_cache_memory_bytes=128 << 20,
                                      load_format=args.load_format, tokenizer=args.tokenizer,
                                      compilation_cache_dir="off")
    runner = setup_model(config, warmup=False).runner
    base = runner.model
    wanted = [int(t) for t in args.tokens.split(",")]
    shapes = [s for s in runner.buckets.all_shapes() if s[0] in wanted]
    names = args.variants.split(",")
    if "+layer_matmul" in args.variants and not base.plan.cpu_matmul:
        sys.exit("the oneDNN layer matmul is off here (not the CPU backend, or no library)")

    steps: dict[str, dict] = {}
    compile_s: dict[str, dict] = {}
    for name in names:
        loop, in_place, options = VARIANTS[name]
        runner.model = base.with_plan(replace(base.plan, layer_loop=loop, cpu_matmul=in_place))
        steps[name], compile_s[name] = {}, {}
        for shape in shapes:
            t0 = time.perf_counter()    # the runner's own compile (GPU: its step options)
            steps[name][shape] = runner.lower_step(*shape).compile(dict(options)) \
                if options is not None else runner._compile(*shape)
            compile_s[name][str(shape)] = round(time.perf_counter() - t0, 2)
            print(f"{name} {shape}: compiled in {compile_s[name][str(shape)]} s", flush=True)

    times: dict[str, dict[str, list[float]]] = {n: {str(s): [] for s in shapes} for n in names}
    for _ in range(args.rounds):
        for name in names:
            runner._steps = steps[name]
            for shape in shapes:
                times[name][str(shape)].append(step_ms(runner, shape, args.iters))

    first = names[0]
    result = {"model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
              "num_layers": runner.arch.num_layers, "dtype": args.dtype,
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "loadavg": os.getloadavg()},
              "rounds": args.rounds, "iters": args.iters, "compile_s": compile_s,
              "step_ms_median": {}, "step_ratio_to_" + first: {}}
    for name in names:
        med = {k: round(statistics.median(v), 3) for k, v in times[name].items()}
        result["step_ms_median"][name] = med
        result["step_ratio_to_" + first][name] = {
            k: round(med[k] / statistics.median(times[first][k]), 3) for k in med}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

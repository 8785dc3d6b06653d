"""What dtype=auto's timing costs a cold first start, and what it chooses, on a CPU without
bf16 units (engine/dtype_step_timing.py, kernels/cpu/gemv_choice.py).

Each run is a fresh process with an empty timing store that does what `auto_compute_dtype`
does for SmolLM2-135M's shapes (30 layers, max_num_seqs 256) with --matrix-units none: both
dtypes' GEMV limits, then the whole-step timing, then reads both back from the store (a warm
start). The oneDNN library is loaded before the clock starts (its build is cached apart).
Runs alternate between the trees given (--tree, default this one), so a shared box's load
drifts over both alike.

    # an AVX2 CPU's oneDNN on this box, this tree against main, 3 cold runs each
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_dtype_timing_cost.py \\
        --tree before=/work/main --tree after=. --runs 3 --out dtype-timing-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# SmolLM2-135M's decode step (the embedded default model)
ARCH = {"hidden_size": 576, "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "num_layers": 30}
MAX_NUM_SEQS = 256


def child(cache_dir: str) -> None:
    """One cold start's timing in this process; prints one JSON line."""
    from types import SimpleNamespace

    from jaxserve.engine import dtype_step_timing
    from jaxserve.engine.compute_dtype import StepShape, choose_by_step_times
    from jaxserve.kernels.cpu import gemv_choice, matmul
    from jaxserve.kernels.cpu.timings import projection_shapes

    arch = SimpleNamespace(**ARCH)
    shapes = projection_shapes(arch)
    step = StepShape(arch.hidden_size, arch.intermediate_size, arch.num_heads,
                     arch.num_kv_heads, arch.head_dim, arch.vocab_size)
    assert matmul.available() and not matmul.matrix_units_for("none").bf16
    matmul.onednn_isa()
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    gemv_rows = {name: gemv_choice.load_or_measure(cache_dir, name, shapes,
                                                   arch.num_layers)[0].rows
                 for name in dtype_step_timing.DTYPES}
    gemv_s = time.perf_counter() - start
    start = time.perf_counter()
    timings, stored = dtype_step_timing.load_or_measure(cache_dir, step, arch.num_layers,
                                                        MAX_NUM_SEQS, gemv_rows)
    step_s = time.perf_counter() - start
    assert not stored, "the store was not empty"
    start = time.perf_counter()
    again, stored = dtype_step_timing.load_or_measure(cache_dir, step, arch.num_layers,
                                                      MAX_NUM_SEQS, gemv_rows)
    warm_s = time.perf_counter() - start
    assert stored and again == timings
    choice = choose_by_step_times(timings)
    print(json.dumps({"gemv_rows": gemv_rows, "gemv_limits_s": gemv_s, "step_timing_s": step_s,
                      "warm_read_s": warm_s, "choice": choice.dtype,
                      "float32_worst": choice.float32_worst,
                      "bfloat16_worst": choice.bfloat16_worst,
                      "timings": {str(r): t for r, t in sorted(timings.items())},
                      "load_before": load_before, "load_after": os.getloadavg()[0]}))


def run_once(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory(prefix="dtype-timing-") as cache_dir:
        out = subprocess.run([sys.executable, __file__, "--child", cache_dir], env=env,
                             capture_output=True, text=True, timeout=900, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"run in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=PATH of a jaxserve checkout (repeatable; default: this one)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="", help="file under benchmarks/results/")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import machine_info

    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, path in (trees.items() if i % 2 == 0 else list(trees.items())[::-1]):
            run = run_once(Path(path).resolve())
            runs[name].append(run)
            print(f"{name} run {i}: {run['choice']} (f32 worst {run['float32_worst']:.2f}x, "
                  f"bf16 worst {run['bfloat16_worst']:.2f}x); GEMV limits "
                  f"{run['gemv_limits_s']:.1f} s, step timing {run['step_timing_s']:.1f} s, "
                  f"warm read {run['warm_read_s']:.2f} s; load {run['load_before']:.1f}",
                  flush=True)
    summary = {name: {key: statistics.median(r[key] for r in rs)
                      for key in ("gemv_limits_s", "step_timing_s", "warm_read_s")}
               | {"choices": [r["choice"] for r in rs]} for name, rs in runs.items()}
    for name, s in summary.items():
        print(f"{name}: median GEMV limits {s['gemv_limits_s']:.1f} s, step timing "
              f"{s['step_timing_s']:.1f} s, warm {s['warm_read_s']:.2f} s; chose "
              f"{', '.join(s['choices'])}")
    if args.out:
        record = {"command": " ".join(sys.argv), "machine": machine_info(),
                  "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                  "model": "SmolLM2-135M shapes", "arch": ARCH, "max_num_seqs": MAX_NUM_SEQS,
                  "trees": trees, "summary": summary, "runs": runs}
        path = ROOT / "benchmarks" / "results" / args.out
        path.write_text(json.dumps(record, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()

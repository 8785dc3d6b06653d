"""Where the time of a batched decode step goes (16 and 64 rows), op by op, against floors.

    python benchmarks/profile_batch_step.py --dtype bfloat16 --rows 16 64 \\
        --out benchmarks/results/profile-batch-step-bf16-epyc-avx512.md

The sibling of profile_one_row_step.py --ops for the batch: the engine (embedded SmolLM2-135M)
decodes `rows` streams whose contexts are about --context tokens; one pure-decode step of
exactly (rows tokens, rows sequences) is captured and replayed under jax.profiler, and each
XLA thunk is grouped by what it runs, each group's time the union of its thunks' intervals
in one traced step (the median of 7 by length; thunks on several threads at once count once):

  projections   the q/k/v/o/gate/up/down matmuls (the kernel library's custom calls)
  attention     the paged attention custom call (reads every row's KV cache)
  lm head       the logits matmul
  cache writes  the new K and V rows into the cache
  sampler       what runs on the logits (greedy here)
  norms/rope/adds/act  XLA fusions of the rest
  copies        copy / dynamic-update-slice / slice thunks
  gaps          the traced step's span minus the time some thunk covers (dispatch, threads
                waking, the host between thunks)

Each group's floor: its bytes at this run's measured read speed (an XLA sum over 512 MiB)
and, for the matmuls, its FLOPs at this run's measured bf16 (or f32) matmul rate (oneDNN on
a [256, 2048] x [2048, 2048] product in the step's dtype); the floor is the larger.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GROUPS = (  # (group, regex on the thunk's label), first match wins
    ("norms/rope/adds/act", r"layernorm|norm\b|rotary|rope"),
    ("attention", r"paged_attention|attention"),
    ("cache writes", r"write_kv|scatter"),
    ("lm head", r"lm_head|logits|embed"),
    ("projections", r"jaxserve_(layer_|packed_)?matmul|_proj|mlp"),
    ("sampler", r"sampl|argmax|reduce|sort|top"),
    ("copies", r"^(copy|dynamic-update-slice|dynamic-slice|slice|concatenate|bitcast)"),
    ("norms/rope/adds/act", r"fusion|add|multiply|convert|rsqrt|exp"),
)


def group_of(label: str) -> str:
    for name, pattern in GROUPS:
        if re.search(pattern, label):
            return name
    return "other"


def rates(dtype) -> tuple[float, float]:
    """(read GB/s, matmul GFLOP/s in `dtype`) measured now, best of a few."""
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.cpu.matmul import layer_matmul

    def best(fn, *args, repeats=10):
        jax.block_until_ready(fn(*args))
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out.append(time.perf_counter() - t)
        return min(out)

    block = jnp.full((128 << 20,), 1.0, jnp.float32)
    read_gbs = 512 * 2**20 / best(jax.jit(jnp.sum), block) / 1e9
    del block
    m, k, n = 256, 2048, 2048
    x = jnp.full((m, k), 0.5, dtype)
    w = jnp.full((1, k, n), 0.01, dtype)
    mm = jax.jit(lambda x, w: layer_matmul(x, w, 0, dtype, gemv_rows=0))
    gflops = 2 * m * k * n / best(mm, x, w) / 1e9
    return read_gbs, gflops


def capture_step(llm, rows: int, context: int, tokens_before: int):
    """The inputs of the last decode step of exactly `rows` rows (contexts near `context`).
    `tokens_before` must outlast the prefill: the scheduler admits prompts by a measured
    step-time bound, so under load the last prompt can start decoding many steps after the
    first (with 32, no step of all `rows` ran on a loaded box)."""
    from jaxserve import SamplingParams

    runner = llm.llm_engine.engine_core.runner
    runner.wait_until_compiled()     # else a step runs in a larger bucket compiled already
    run_step = runner.run_step
    seen = []

    def capturing(inputs):
        if (inputs.num_tokens, inputs.num_seqs) == (rows, rows):
            seen.append(inputs)
        return run_step(inputs)

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, context - tokens_before).tolist()}
               for _ in range(rows)]
    runner.run_step = capturing
    try:
        llm.generate(prompts, SamplingParams(max_tokens=tokens_before, ignore_eos=True,
                                             temperature=0.0), use_tqdm=False)
    finally:
        runner.run_step = run_step
    if not seen:
        raise RuntimeError(f"no ({rows}, {rows}) decode step was run")
    return seen[-1]


def union_ms(intervals: list[tuple[int, int]]) -> float:
    """The time covered by (start_ns, end_ns) intervals, overlaps counted once (thunks of
    one step may run at once on several threads)."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6


def traced_step(run, labels: dict[str, str]) -> tuple[dict[str, list], float, float]:
    """One traced call of run(): ({label: [(start, end)]}, span ms first thunk to last,
    ms covered by some thunk)."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            run()
        [path] = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(path)
    by_label: dict[str, list] = {}
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                label = labels.get(event.name)
                if label is not None and label.split(" ")[0] not in CONTAINER_OPS:
                    by_label.setdefault(label, []).append((event.start_ns, event.end_ns))
    every = [iv for ivs in by_label.values() for iv in ivs]
    span = (max(e for _, e in every) - min(s for s, _ in every)) / 1e6 if every else 0.0
    return by_label, span, union_ms(every)


CONTAINER_OPS = ("while", "conditional", "call")   # their time is their thunks' (nested)


def profile_rows(llm, rows: int, context: int, traces: int = 7) -> dict:
    """The (rows, rows) decode step: best blocked wall time, and per op group the median
    over `traces` traced steps of the time its thunks cover."""
    import jax
    from profile_one_row_step import instruction_labels

    runner = llm.llm_engine.engine_core.runner
    inputs = capture_step(llm, rows, context, 96)
    run = lambda: jax.block_until_ready(runner.run_step(inputs))  # noqa: E731
    run()
    walls = []
    for _ in range(20):
        t = time.perf_counter()
        run()
        walls.append((time.perf_counter() - t) * 1e3)
    executable = runner._steps[(rows, rows)]
    labels = instruction_labels(executable.as_text() if hasattr(executable, "as_text") else "")
    per_trace = []
    for _ in range(traces):
        by_label, span, covered = traced_step(run, labels)
        groups: dict[str, list] = {}
        for label, ivs in by_label.items():
            groups.setdefault(group_of(label), []).append((label, ivs))
        per_trace.append({
            "span": span, "covered": covered,
            "groups": {g: (union_ms([iv for _, ivs in items for iv in ivs]),
                           sum(len(ivs) for _, ivs in items),
                           sorted({label for label, _ in items}))
                       for g, items in groups.items()}})
    # the trace whose span is the median: one consistent step, not a mix of medians
    per_trace.sort(key=lambda t: t["span"])
    mid = per_trace[len(per_trace) // 2]
    return {"rows": rows, "step_ms_best": min(walls), "step_ms_median": statistics.median(walls),
            "traced_span_ms": mid["span"], "covered_ms": mid["covered"],
            "traced_spans_ms": [round(t["span"], 2) for t in per_trace],
            "groups": {g: {"ms": ms, "thunks": n, "labels": labels}
                       for g, (ms, n, labels) in mid["groups"].items()}}


def floors(arch, dtype_bytes: int, rows: int, context: int, read_gbs: float,
           gflops: float) -> dict:
    """Each group's floor in ms: max(bytes / read speed, FLOPs / matmul rate)."""
    h, i, L = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    proj_params = L * (h * q + 2 * h * kv + q * h + 3 * h * i)
    head_params = arch.vocab_size * h
    kv_bytes = rows * context * L * 2 * kv * dtype_bytes
    attn_flops = rows * context * L * 2 * 2 * q      # q.k and p.v per query head
    ms = lambda b, f: 1e3 * max(b / (read_gbs * 1e9), f / (gflops * 1e9))  # noqa: E731
    return {
        "projections": ms(proj_params * dtype_bytes, 2 * rows * proj_params),
        "lm head": ms(head_params * dtype_bytes, 2 * rows * head_params),
        "attention": ms(kv_bytes, attn_flops),
        "projections_bytes_ms": 1e3 * proj_params * dtype_bytes / (read_gbs * 1e9),
        "projections_flops_ms": 1e3 * 2 * rows * proj_params / (gflops * 1e9),
    }


def table(results: list[dict], floor_by_rows: dict, meta: dict) -> str:
    names = ["projections", "attention", "lm head", "norms/rope/adds/act", "cache writes",
             "copies", "sampler", "other"]
    lines = [f"# Batched decode step by op ({meta['dtype']}), {meta['model']}", "",
             f"Command: `{meta['command']}`", "",
             f"CPU: {meta['cpu']}; flags: `{meta['flags']}`", "",
             f"Load average before / after: {meta['load']}. Measured now: read "
             f"{meta['read_gbs']:.1f} GB/s, {meta['dtype']} matmul {meta['gflops']:.0f} GFLOP/s "
             f"(oneDNN, 256x2048x2048). Context ~{meta['context']} tokens per row.", ""]
    head = "| op group |" + "".join(f" {r['rows']} rows ms | floor | thunks |"
                                     for r in results)
    lines += [head, "|---|" + "---|---|---|" * len(results)]
    for name in names:
        if not any(name in r["groups"] for r in results):
            continue
        row = f"| {name} |"
        for r in results:
            g = r["groups"].get(name, {"ms": 0.0, "thunks": 0})
            f = floor_by_rows[r["rows"]].get(name)
            row += f" {g['ms']:.2f} | {f:.2f} |" if f is not None else f" {g['ms']:.2f} | |"
            row += f" {g['thunks']:.0f} |"
        lines.append(row)
    for label, key in (("covered by some thunk", "covered"),
                       ("gaps (traced step - covered)", "gap"),
                       ("traced step (median of 7)", "traced_span_ms"),
                       ("blocked step, best of 20 (untraced)", "step_ms_best")):
        row = f"| {label} |"
        for r in results:
            value = r["traced_span_ms"] - r["covered_ms"] if key == "gap" else \
                r["covered_ms"] if key == "covered" else r[key]
            row += f" {value:.2f} | | |"
        lines.append(row)
    lines += ["", "Projection floor parts (ms): " + "; ".join(
        f"{r['rows']} rows: bytes {floor_by_rows[r['rows']]['projections_bytes_ms']:.2f}, "
        f"FLOPs {floor_by_rows[r['rows']]['projections_flops_ms']:.2f}" for r in results), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--matrix-units", default="auto")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", default=None, help=".md table (a .json beside it)")
    args = p.parse_args()

    import jax.numpy as jnp
    from machine import machine_info

    from jaxserve import LLM

    load = [round(os.getloadavg()[0], 2)]
    llm = LLM(None, dtype=args.dtype, matrix_units=args.matrix_units,
              max_num_seqs=max(args.rows), max_model_len=args.context + 64,
              skip_tokenizer_init=True, compile_in_background=False)
    dtype = jnp.dtype(llm.llm_engine.engine_core.runner.dtype)
    read_gbs, gflops = rates(dtype)
    results, floor_by_rows = [], {}
    arch = llm.llm_engine.engine_core.runner.arch
    for rows in args.rows:
        results.append(profile_rows(llm, rows, args.context))
        floor_by_rows[rows] = floors(arch, dtype.itemsize, rows, args.context, read_gbs,
                                     gflops)
    load.append(round(os.getloadavg()[0], 2))
    info = machine_info()
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0] \
        .strip(" \t:") if Path("/proc/cpuinfo").exists() else "?"
    meta = {"dtype": dtype.name, "model": str(llm.llm_engine.model_path),
            "command": "python " + " ".join(sys.argv), "cpu": info.get("cpu", info),
            "flags": flags, "load": load, "read_gbs": read_gbs, "gflops": gflops,
            "context": args.context}
    text = table(results, floor_by_rows, meta)
    print(text)
    for r in results:
        for name, g in sorted(r["groups"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  {r['rows']:3d} rows {name:22s} {g['ms']:7.2f} ms  {g['labels'][:6]}")
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "results": results, "floors": floor_by_rows}, indent=1,
            default=str))
        print("wrote", args.out)


if __name__ == "__main__":
    main()

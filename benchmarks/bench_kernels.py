"""Time the ragged paged attention kernel against the jnp reference.

Decode batches (q_len 1) and prefill chunks (with or without earlier context)
on 8B-class shapes by default (Hq 32, Hkv 8, D 128, bf16), each timed under
jax.jit with block_until_ready, median of --iters runs, next to a plain copy
baseline for the device's achievable bandwidth. GB/s counts the bytes
attention must move: the live K/V once, plus q and the output.

  python benchmarks/bench_kernels.py                      # GPU, full sweep
  python benchmarks/bench_kernels.py --batch 1,64 --context 2048 --mode decode
  python benchmarks/bench_kernels.py --interpret          # CPU: tiny config, proves it runs
  python benchmarks/bench_kernels.py --save               # also JSON in benchmarks/results/

Without a GPU (or with --cpu) it times the CPU attention backends instead: the C++
FFI kernel (`cpu`, with XLA's thread pool and with one thread) against the jnp
`reference`, on SmolLM2-135M's shapes (Hq 9, Hkv 3, D 64, block 16, f32), decode
(q_len 1) at 1/16/64/256 sequences x 256/1024/4096 context, skipping caches over
--max-cache-gib. ms are per layer (one attention call); GB/s counts the K and V
rows the step must read once (live context only). Results and the machine
(CPU, cores, load average) go to benchmarks/results/kernels-cpu.json.

  python benchmarks/bench_kernels.py                      # no GPU: the CPU sweep
  python benchmarks/bench_kernels.py --cpu --batch 64 --context 256 --json /tmp/k.json

--sliding-window 0,256 crosses every case with those windows (0 = full attention), passed
as a traced int32 as the model's layer scan does; with a window the cost should follow the
window, not the context (the CPU JSON then gets a `sliding_window_cost` summary).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str  # "decode" or "prefill"
    num_seqs: int
    q_len: int  # per sequence
    context: int  # kv_len per sequence, this step's tokens included

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.q_len


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def kernel_knobs(text: str) -> dict:
    knobs = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        knobs[key] = None if value == "None" else int(value)
    return knobs


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default=None,
                        help="decode,prefill (default both; decode in CPU mode)")
    parser.add_argument("--batch", type=int_list, default=None, help="decode batch sizes")
    parser.add_argument("--context", type=int_list, default=None, help="decode context lengths")
    parser.add_argument("--prefill-chunk", type=int_list, default=None, help="prefill q_len")
    parser.add_argument(
        "--prefill-context",
        type=int_list,
        default=None,
        help="cached tokens before the chunk",
    )
    parser.add_argument("--prefill-seqs", type=int, default=1, help="sequences per prefill batch")
    parser.add_argument("--num-q-heads", type=int, default=None)
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None, help="block table width")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--kernel-knobs", type=kernel_knobs, default={}, help="e.g. block_kv=64,num_kv_splits=4"
    )
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--sliding-window", type=int_list, default=[0],
                        help="CPU mode: windows to cross every case with (0 = none)")
    parser.add_argument(
        "--interpret", action="store_true", help="Pallas interpret mode (CPU); implies --tiny"
    )
    parser.add_argument("--tiny", action="store_true", help="small shapes that run anywhere")
    parser.add_argument("--cpu", action="store_true",
                        help="time the CPU backends (default when there is no GPU)")
    parser.add_argument("--max-cache-gib", type=float, default=4.0,
                        help="CPU mode: skip cases whose K+V cache is larger")
    parser.add_argument("--no-json", action="store_true", help="CPU mode: do not write JSON")
    parser.add_argument("--save", action="store_true", help="write JSON to benchmarks/results/")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write JSON here")
    args = parser.parse_args(argv)
    tiny = args.tiny or args.interpret
    args.cpu = args.cpu or (not args.interpret and jax.default_backend() == "cpu")
    if args.cpu and not tiny:
        # SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, float32 on CPU.
        cpu_defaults = {"mode": "decode", "batch": [1, 16, 64, 256], "context": [256, 1024, 4096],
                        "num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64, "dtype": "float32"}
        for name, value in cpu_defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    defaults = {
        "mode": "decode,prefill",
        "batch": [2] if tiny else [1, 8, 32, 64, 128, 256],
        "context": [48] if tiny else [512, 2048, 8192],
        "prefill_chunk": [16] if tiny else [512, 2048],
        "prefill_context": [32] if tiny else [0, 4096],
        "num_q_heads": 4 if tiny else 32,
        "num_kv_heads": 2 if tiny else 8,
        "head_dim": 64 if tiny else 128,
        "dtype": "float32" if tiny else "bfloat16",
        "iters": 2 if tiny else 20,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def cases(args) -> list[Case]:
    out = []
    modes = args.mode.split(",")
    if "decode" in modes:
        out += [Case("decode", b, 1, c) for c in args.context for b in args.batch]
    if "prefill" in modes:
        out += [
            Case("prefill", args.prefill_seqs, chunk, ctx + chunk)
            for ctx in args.prefill_context
            for chunk in args.prefill_chunk
        ]
    return out


def make_inputs(case: Case, args, max_blocks: int, key: jax.Array, num_blocks: int = 0):
    """Random q and caches holding exactly the pages this case needs (or num_blocks pages),
    shuffled."""
    dtype = jnp.dtype(args.dtype)
    block_size = args.block_size
    pages_per_seq = -(-case.context // block_size)
    num_blocks = max(num_blocks, case.num_seqs * pages_per_seq + 1)
    k_q, k_k, k_v = jax.random.split(key, 3)
    cache_shape = (num_blocks, block_size, args.num_kv_heads, args.head_dim)
    k_cache = jax.random.normal(k_k, cache_shape, dtype)
    v_cache = jax.random.normal(k_v, cache_shape, dtype)
    q = jax.random.normal(k_q, (case.num_tokens, args.num_q_heads, args.head_dim), dtype)
    rng = np.random.default_rng(0)
    order = rng.permutation(num_blocks)
    block_tables = np.zeros((case.num_seqs, max_blocks), np.int32)
    block_tables[:, :pages_per_seq] = order[: case.num_seqs * pages_per_seq].reshape(
        case.num_seqs, pages_per_seq
    )
    kv_lens = np.full(case.num_seqs, case.context, np.int32)
    query_start_loc = np.arange(case.num_seqs + 1, dtype=np.int32) * case.q_len
    return (
        q,
        k_cache,
        v_cache,
        jnp.asarray(kv_lens),
        jnp.asarray(block_tables),
        jnp.asarray(query_start_loc),
        jnp.int32(case.num_seqs),
    )


def attention_bytes(case: Case, args) -> int:
    itemsize = jnp.dtype(args.dtype).itemsize
    kv = 2 * case.num_seqs * case.context * args.num_kv_heads * args.head_dim
    q_and_out = 2 * case.num_tokens * args.num_q_heads * args.head_dim
    return (kv + q_and_out) * itemsize


def time_fn(fn, args_tuple, iters: int, warmup: int) -> float:
    """Median wall seconds of fn(*args) under jit, synchronised with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args_tuple))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args_tuple))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, iters: int, warmup: int) -> float:
    """GB/s of a jitted elementwise copy (bytes read + written)."""
    x = jnp.ones((max(1, num_bytes // 4),), jnp.float32)
    seconds = time_fn(jax.jit(lambda a: a + 1.0), (x,), iters, warmup)
    return 2 * x.nbytes / seconds / 1e9


def time_adaptive(fn, args_tuple, budget_s: float = 0.6, min_iters: int = 3,
                  max_iters: int = 50) -> float:
    """Median seconds of fn(*args) after one warm-up, iterating for about budget_s."""
    jax.block_until_ready(fn(*args_tuple))
    times = []
    while len(times) < min_iters or (sum(times) < budget_s and len(times) < max_iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args_tuple))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_paired(fn, a_args, b_args, budget_s: float = 1.0, min_pairs: int = 20,
                max_pairs: int = 400) -> tuple[float, float]:
    """Median seconds of fn(*a_args) and fn(*b_args), run alternately (a, b, a, b, ...) so
    both see the same box: a ratio of two separately timed cases at tens of microseconds
    is mostly the box's mood at the time (it read 1.42x for equal work on an idle box)."""
    jax.block_until_ready(fn(*a_args))
    jax.block_until_ready(fn(*b_args))
    ta, tb = [], []
    while len(ta) < min_pairs or (sum(ta) + sum(tb) < budget_s and len(ta) < max_pairs):
        for args_tuple, times in ((a_args, ta), (b_args, tb)):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args_tuple))
            times.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def machine_info() -> dict:
    from machine import cpu_info

    info = {**cpu_info(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax_version": jax.__version__}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["loadavg_start"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def kv_read_bytes(case: Case, args) -> int:
    """K and V rows of the live context, each read once."""
    return 2 * case.num_seqs * case.context * args.num_kv_heads * args.head_dim * \
        jnp.dtype(args.dtype).itemsize


def cpu_main(args) -> list[dict]:
    """Time the `cpu` FFI kernel (pool threads and 1 thread) and the jnp reference on CPU."""
    from jaxserve.attention.cpu import paged_attention, register

    lib = register()
    all_cases = cases(args)
    if not all_cases:
        raise SystemExit(f"no cases for --mode {args.mode!r}")
    info = machine_info()
    print(f"CPU: {info.get('cpu', '?')} x {info['cpu_count']}, jax {jax.__version__}, "
          f"load average {info.get('loadavg_start')}")
    print(f"Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block_size={args.block_size} dtype={args.dtype}; kernel {lib.name}")
    copy_gbs = copy_bandwidth(1 << 28, 5, 2)
    print(f"copy baseline (256 MiB, read + write): {copy_gbs:.1f} GB/s")
    # The window is the last input, traced (as a per-layer window under the layer scan).
    def windowed(fn, **kw):
        return jax.jit(lambda *a: fn(*a[:7], sliding_window=a[7], **kw))

    kernel = windowed(paged_attention)
    kernel_1t = windowed(paged_attention, max_threads=1)
    reference = windowed(ragged_paged_attention_reference)
    header = (f"{'mode':7} {'seqs':>5} {'context':>8} {'window':>6} {'cpu ms':>8} {'cpu 1t ms':>10} "
              f"{'ref ms':>8} {'speedup':>8} {'cpu GB/s':>9} {'1t GB/s':>8} {'ref GB/s':>9} "
              f"{'max diff':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    key = jax.random.key(0)
    for case, window in [(c, w) for c in all_cases for w in args.sliding_window]:
        pages = -(-case.context // args.block_size)
        cache_bytes = 2 * (case.num_seqs * pages + 1) * args.block_size * args.num_kv_heads * \
            args.head_dim * jnp.dtype(args.dtype).itemsize
        if cache_bytes > args.max_cache_gib * 2**30:
            print(f"{case.mode:7} {case.num_seqs:>5} {case.context:>8}  skipped: cache "
                  f"{cache_bytes / 2**30:.1f} GiB > {args.max_cache_gib} GiB")
            continue
        max_blocks = -(-(args.max_model_len or case.context) // args.block_size)
        key, sub = jax.random.split(key)
        inputs = make_inputs(case, args, max_blocks, sub) + (jnp.int32(window),)
        num_bytes = kv_read_bytes(case, args)
        cpu_s = time_adaptive(kernel, inputs)
        cpu_1t_s = time_adaptive(kernel_1t, inputs)
        ref_s = diff = None
        if not args.skip_reference:
            ref_s = time_adaptive(reference, inputs, min_iters=2, budget_s=1.0)
            diff = float(jnp.max(jnp.abs(kernel(*inputs).astype(jnp.float32)
                                         - reference(*inputs).astype(jnp.float32))))
        row = {**dataclasses.asdict(case), "num_tokens": case.num_tokens,
               "sliding_window": window, "cpu_ms": cpu_s * 1e3, "cpu_1thread_ms": cpu_1t_s * 1e3,
               "reference_ms": None if ref_s is None else ref_s * 1e3,
               "cpu_gbs": num_bytes / cpu_s / 1e9, "cpu_1thread_gbs": num_bytes / cpu_1t_s / 1e9,
               "reference_gbs": None if ref_s is None else num_bytes / ref_s / 1e9,
               "kv_bytes_read": num_bytes, "cache_bytes": cache_bytes, "max_abs_diff": diff}
        if window and case.context > window:
            # The cost question -- does a window of w at context c cost what context w costs?
            # -- timed as a pair, alternating with the no-window case at context w, whose
            # pages lie in a pool of the same size (an engine's pool does not shrink with
            # the context; a pool that fits in L2 would flatter the base case).
            base_case = dataclasses.replace(case, context=window)
            key, sub = jax.random.split(key)
            base = make_inputs(base_case, args, max_blocks, sub,
                               num_blocks=inputs[1].shape[0]) + (jnp.int32(0),)
            fns = {"cpu": kernel, "cpu_1thread": kernel_1t}
            if not args.skip_reference:
                fns["reference"] = reference
            row["paired_with_no_window_at_context_window"] = {
                name: dict(zip(("window_ms", "base_ms"),
                               (t * 1e3 for t in time_paired(fn, inputs, base))))
                for name, fn in fns.items()}
            del base
        rows.append(row)
        del inputs
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        print(f"{case.mode:7} {case.num_seqs:>5} {case.context:>8} {window:>6} "
              f"{cpu_s * 1e3:>8.3f} "
              f"{cpu_1t_s * 1e3:>10.3f} {fmt(row['reference_ms'], '>8.3f')} "
              f"{fmt(ref_s and ref_s / cpu_s, '>8.1f')} {row['cpu_gbs']:>9.1f} "
              f"{row['cpu_1thread_gbs']:>8.1f} {fmt(row['reference_gbs'], '>9.1f')} "
              f"{fmt(diff, '>9.2e')}", flush=True)
    try:
        info["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    result = {"machine": info, "backend": jax.default_backend(), "kernel_library": lib.name,
              "config": {k: v for k, v in vars(args).items() if k not in ("json", "save")},
              "copy_gbs": copy_gbs, "rows": rows}
    summary = sliding_window_cost(rows)
    if summary:
        result["sliding_window_cost"] = summary
        for line in summary:
            print(f"window {line['sliding_window']} at context {line['context']} vs no window at "
                  f"context {line['sliding_window']} ({line['num_seqs']} seqs): cpu "
                  f"{line['cpu_ratio']:.2f}x, cpu 1 thread {line['cpu_1thread_ratio']:.2f}x, "
                  f"reference {line['reference_ratio'] or float('nan'):.2f}x")
    path = args.json or (None if args.no_json else RESULTS_DIR / "kernels-cpu.json")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    return rows


def sliding_window_cost(rows: list[dict]) -> list[dict]:
    """For each windowed row: its time over the time of the unwindowed case whose context
    equals the window (same batch), i.e. how far cost follows the window, not the context --
    from the paired (alternating) timing."""
    out = []
    for r in rows:
        paired = r.get("paired_with_no_window_at_context_window")
        if not paired:
            continue

        def ratio(name):
            p = paired.get(name)
            return None if p is None else p["window_ms"] / p["base_ms"]

        out.append({"mode": r["mode"], "num_seqs": r["num_seqs"], "context": r["context"],
                    "sliding_window": r["sliding_window"], "cpu_ratio": ratio("cpu"),
                    "cpu_1thread_ratio": ratio("cpu_1thread"),
                    "reference_ratio": ratio("reference")})
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.cpu:
        return cpu_main(args)
    all_cases = cases(args)
    if not all_cases:
        raise SystemExit(f"no cases for --mode {args.mode!r}")
    max_len = args.max_model_len or max(c.context for c in all_cases)
    max_blocks = -(-max_len // args.block_size)
    kernel = jax.jit(
        functools.partial(ragged_paged_attention, interpret=args.interpret, **args.kernel_knobs)
    )
    reference = jax.jit(ragged_paged_attention_reference)
    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
        f"block_size={args.block_size} dtype={args.dtype} max_blocks={max_blocks} "
        f"interpret={args.interpret} knobs={args.kernel_knobs}"
    )
    largest = max(attention_bytes(c, args) for c in all_cases)
    copy_gbs = copy_bandwidth(min(largest, 1 << 30), args.iters, args.warmup)
    print(f"copy baseline: {copy_gbs:.1f} GB/s")

    header = (
        f"{'mode':8} {'seqs':>5} {'q_len':>6} {'context':>8} {'tokens':>7} "
        f"{'kernel ms':>10} {'ref ms':>9} {'speedup':>8} {'kern GB/s':>10} {'ref GB/s':>9} "
        f"{'% copy':>7} {'max diff':>9}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    key = jax.random.key(0)
    for case in all_cases:
        key, sub = jax.random.split(key)
        inputs = make_inputs(case, args, max_blocks, sub)
        num_bytes = attention_bytes(case, args)
        kernel_s = time_fn(kernel, inputs, args.iters, args.warmup)
        ref_s, diff = None, None
        if not args.skip_reference:
            ref_s = time_fn(reference, inputs, args.iters, args.warmup)
            diff = float(jnp.max(jnp.abs(kernel(*inputs).astype(jnp.float32) - reference(*inputs))))
        row = {
            **dataclasses.asdict(case),
            "num_tokens": case.num_tokens,
            "kernel_ms": kernel_s * 1e3,
            "reference_ms": None if ref_s is None else ref_s * 1e3,
            "kernel_gbs": num_bytes / kernel_s / 1e9,
            "reference_gbs": None if ref_s is None else num_bytes / ref_s / 1e9,
            "bytes": num_bytes,
            "max_abs_diff": diff,
        }
        rows.append(row)
        del inputs
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        print(
            f"{case.mode:8} {case.num_seqs:>5} {case.q_len:>6} {case.context:>8} "
            f"{case.num_tokens:>7} {row['kernel_ms']:>10.3f} {fmt(row['reference_ms'], '>9.3f')} "
            f"{fmt(ref_s and ref_s / kernel_s, '>8.2f')} {row['kernel_gbs']:>10.1f} "
            f"{fmt(row['reference_gbs'], '>9.1f')} {100 * row['kernel_gbs'] / copy_gbs:>7.1f} "
            f"{fmt(diff, '>9.2e')}",
            flush=True,
        )

    result = {
        "device": device.device_kind,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "save")},
        "copy_gbs": copy_gbs,
        "rows": rows,
    }
    path = args.json
    if args.save and path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        kind = device.device_kind.replace(" ", "_").lower()
        path = RESULTS_DIR / f"bench_kernels-{kind}-{stamp}.json"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()

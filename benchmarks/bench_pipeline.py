"""Pipeline parallel: offline throughput and the stage bubble at pp = 1, 2, 4.

Each configuration runs in its own subprocess on simulated CPU devices
(``--xla_force_host_platform_device_count``), on bench_parallel.py's synthetic 8-layer
Llama (float32). Two measurements per configuration:

* offline tok/s: `LLM.generate` of --num-prompts prompts, --max-tokens each, greedy;
* bubble: the stages' idle share of the timed run, 1 - busy / (P x wall). Each stage's
  busy seconds come from a second, traced run of the same prompts (the runner's step
  trace waits for each stage and records its start and end: runner/pipeline_runner.py;
  the schedule, and so each stage's work, is the same as the timed run's). With one batch
  in flight a stage idles while the others run, so the bubble tends to (P - 1) / P; with
  micro-batches in flight (--pipeline-micro-batches, vLLM's virtual engines) the stages
  overlap on different micro-batches.

Simulated devices share the host's cores, so pp > 1 cannot be faster here: the numbers
show the cost of the stage hand-offs and the bubble, not scaling.

    python benchmarks/bench_pipeline.py                    # pp 1, 2, 4; writes results/
    python benchmarks/bench_pipeline.py --configs 2:1 2:2 --num-prompts 8   # pp:micro-batches
    python benchmarks/bench_pipeline.py --configs 1:1 2:1 --num-processes 2 \
        --out pipeline-processes-cpu.json    # pp = 2 as two processes (a stage each)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import make_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENGINE = {"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 64,
          "dtype": "float32", "kv_cache_memory_bytes": 64 << 20}


def run_one(model: str, pp: int, micro: int, num_prompts: int, max_tokens: int,
            processes: dict | None = None) -> dict:
    """In the subprocess: build the engine, time generate, then trace one more run.
    processes: num_processes, process_id, coordinator_address of a multi-process run (a
    follower never returns from LLM(): it follows the leader's steps, then exits)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.model_runner import wait_for_background_compiles

    llm = LLM(model, pipeline_parallel_size=pp, pipeline_micro_batches=micro, **ENGINE,
              **(processes or {}))
    prompts = [[(7 * i + k) % 1000 + 3 for k in range(24 + i % 8)] for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    wait_for_background_compiles()                                # every bucket compiled
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    runner = llm.llm_engine.engine_core.runner
    result = {"pp": pp, "micro_batches": micro, "tok_s": tokens / seconds,
              "seconds": seconds, "tokens": tokens, "bubble": 0.0, "traced_stage_calls": 0}
    if pp > 1:
        runner.stage_trace = []
        llm.generate(prompts, params, use_tqdm=False)
        trace, runner.stage_trace = runner.stage_trace, None
        # Across processes the leader traces only its own stages: their idle share.
        traced = sorted({i for i, _, _ in trace})
        busy = [sum(e - s for i, s, e in trace if i == stage) for stage in traced]
        result["bubble"] = max(0.0, 1.0 - sum(busy) / (len(traced) * seconds))
        result["traced_stages"] = traced
        result["traced_stage_calls"] = len(trace)
        result["stage_busy_s"] = busy
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["1:1", "2:1", "2:2", "4:1", "4:4"],
                        help="pp:micro-batches")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "jaxserve-bench-parallel-model"))
    parser.add_argument("--num-processes", type=int, default=1,
                        help="run each pp > 1 configuration as this many processes on this "
                             "machine (jax.distributed, pp / N stages each; micro-batches 1)")
    parser.add_argument("--out", default="pipeline-cpu.json", help="file name in results/")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pp, micro = (int(x) for x in args.child.split(":"))
        processes = None if args.rank is None else {
            "num_processes": args.num_processes, "process_id": args.rank,
            "coordinator_address": args.coordinator}
        result = run_one(args.model_dir, pp, micro, args.num_prompts, args.max_tokens,
                         processes)
        print("RESULT " + json.dumps({**result, "num_processes": args.num_processes}),
              flush=True)
        return
    model = make_model(Path(args.model_dir))
    rows = []
    devices = max(int(c.split(":")[0]) for c in args.configs)
    for config in args.configs:
        pp = int(config.split(":")[0])
        rows.append(_run_config(args, model, config, devices if pp == 1 or
                                args.num_processes == 1 else pp // args.num_processes))
        row = rows[-1]
        print(f"pp={pp} processes={row['num_processes']} "
              f"micro-batches={row['micro_batches']}: {row['tok_s']:.1f} tok/s "
              f"({row['tokens']} tokens in {row['seconds']:.1f} s), bubble "
              f"{row['bubble']:.1%} ({row['traced_stage_calls']} traced stage calls)",
              flush=True)
    RESULTS.mkdir(exist_ok=True)
    record = {"machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "engine": ENGINE, "num_prompts": args.num_prompts,
              "max_tokens": args.max_tokens, "rows": rows}
    (RESULTS / args.out).write_text(json.dumps(record, indent=1) + "\n")


def _run_config(args: argparse.Namespace, model: Path, config: str, devices: int) -> dict:
    """One configuration in its own process (pp = 1, or --num-processes 1), or in
    --num-processes processes with ``devices`` simulated devices each; the leader's row."""
    pp = int(config.split(":")[0])
    processes = 1 if pp == 1 else args.num_processes
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    command = [sys.executable, __file__, "--child", config, "--model-dir", str(model),
               "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
               "--num-processes", str(processes)]
    if processes == 1:
        procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)]
    else:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
        procs = [subprocess.Popen(command + ["--rank", str(rank), "--coordinator", coordinator],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for rank in range(processes)]
    outputs = [proc.communicate() for proc in procs]
    line = [x for x in outputs[0][0].splitlines() if x.startswith("RESULT ")]
    if not line:
        sys.exit(f"{config} failed:\n" + "\n".join(err[-3000:] for _, err in outputs))
    return json.loads(line[0][len("RESULT "):])


if __name__ == "__main__":
    main()

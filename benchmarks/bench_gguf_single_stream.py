"""One stream, 8 and 64 streams on the same GGUF, same client: jaxserve's default (quantization
unset: the blocks packed on a CPU, engine/gguf_packing.py; kernels/cpu/gemv_gguf.h) against
jaxserve `--quantization none` (dequantized: float32 / bfloat16), `--quantization gguf`
(blocks alone), int8, and llama.cpp's server, engines interleaved within each round.

    source ../shared/peers/llama_cpp.sh        # LLAMA_SERVER, GGUF (the embedded SmolLM2 Q4_1)
    python benchmarks/bench_gguf_single_stream.py --rounds 2 --tag epyc-avx512
    python benchmarks/bench_gguf_single_stream.py --streams 1,8,64 --tag serving \
        --engines llama.cpp,jaxserve-default,jaxserve-none,jaxserve-none-float32

Each (round, engine) starts a fresh server on loopback, runs benchmarks/bench_serving.py
(random 128-token prompts as token ids, 128 tokens out, EOS ignored, greedy, a connection per
request: llama.cpp's server drops idle keep-alive connections) at concurrency 1 and 8, and
stops it. Results: benchmarks/results/gguf-single-stream-<tag>.json, with the CPU's
flags (`lscpu`), the load average around each run, and each jaxserve engine's figures as a
ratio to llama.cpp's in the same round (a shared machine's load moves absolute figures; the
ratios of neighbouring runs move less).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_vs_vllm import stop_server, wait_ready  # noqa: E402 - a sibling script (benchmarks/ on sys.path)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine_info  # noqa: E402

JAXSERVE_ENGINES = {
    "jaxserve-default": [],
    "jaxserve-none": ["--quantization", "none"],                 # dtype auto
    "jaxserve-none-float32": ["--quantization", "none", "--dtype", "float32"],
    "jaxserve-none-bfloat16": ["--quantization", "none", "--dtype", "bfloat16"],
    "jaxserve-gguf-packed": ["--quantization", "gguf"],
    "jaxserve-float32": ["--dtype", "float32"],
    "jaxserve-bfloat16": ["--dtype", "bfloat16"],
    "jaxserve-int8": ["--quantization", "int8"],
}
KEEP = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "completed")




def server_command(engine: str, args, port: int) -> list[str]:
    if engine.startswith("llama.cpp"):
        # llama.cpp-t1: one thread. On a shared box its spinning thread barrier makes -t 2
        # collapse when another process holds a core (ggml waits for the slowest thread).
        threads = 1 if engine == "llama.cpp-t1" else os.cpu_count()
        slots = max(8, max(args.stream_counts))
        return [args.llama_server, "-m", args.gguf, "--port", str(port), "--host", "127.0.0.1",
                "-t", str(threads), "-c", str(512 * slots), "-np", str(slots), "-cb"]
    # Every step bucket compiled before it serves: with background compilation a 128-token
    # prefill would run padded into the 512-token bucket while the others compile beside it.
    return [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "smol",
            "--max-num-seqs", str(max(8, max(args.stream_counts))),
            "--no-compile-in-background", *JAXSERVE_ENGINES[engine], args.gguf]


def run_engine(engine: str, args, port: int, out_dir: Path) -> dict:
    log = open(out_dir / f"{engine}-server.log", "w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(server_command(engine, args, port), stdout=log,
                              stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              start_new_session=True)
    result = {}
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, server, timeout=900)
        for streams in args.stream_counts:
            prompts = args.single_prompts if streams == 1 else max(16, streams)
            name = f"{engine}-c{streams}-{time.time():.0f}.json"
            load_before = os.getloadavg()[0]
            cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"),
                   "--base-url", url, "--num-prompts", str(prompts),
                   "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos",
                   "--no-keep-alive",
                   "--max-concurrency", str(streams), "--label", engine, "--save-result",
                   "--result-dir", str(out_dir), "--result-filename", name]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                raise RuntimeError(f"bench_serving against {engine} failed:\n"
                                   f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
            data = json.loads((out_dir / name).read_text())
            row = {k: data[k] for k in KEEP if k in data}
            row["load_average"] = [load_before, os.getloadavg()[0]]
            result[f"c{streams}"] = row
            print(f"  {engine} c={streams}: {row['output_throughput']:.1f} out tok/s, "
                  f"TPOT p50 {row['median_tpot_ms']:.1f} ms (load {load_before:.1f})",
                  flush=True)
    finally:
        stop_server(server, log)
    return result


def lscpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Flags")), "")


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # stop the server (finally) too
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--engines", default=",".join(["llama.cpp", "llama.cpp-t1",
                                                  *JAXSERVE_ENGINES]))
    p.add_argument("--single-prompts", type=int, default=4)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--gguf", default=os.environ.get("GGUF"))
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--streams", default="1,8", help="concurrencies, comma-separated")
    args = p.parse_args()
    args.stream_counts = [int(c) for c in args.streams.split(",")]
    engines = args.engines.split(",")
    if not args.gguf:
        raise SystemExit("no GGUF: source ../shared/peers/llama_cpp.sh or pass --gguf")
    if any(e.startswith("llama.cpp") for e in engines) \
            and not (args.llama_server and Path(args.llama_server).exists()):
        raise SystemExit("no llama-server: source ../shared/peers/llama_cpp.sh or drop "
                         "llama.cpp from --engines")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            rounds.append({e: run_engine(e, args, args.port, Path(tmp)) for e in engines})
    summary: dict = {}
    for e in engines:
        summary[e] = {}
        for c in (f"c{n}" for n in args.stream_counts):
            summary[e][c] = {k: float(np.median([rd[e][c][k] for rd in rounds]))
                             for k in ("output_throughput", "median_tpot_ms")}
            peers = [p for p in ("llama.cpp", "llama.cpp-t1") if p in engines]
            if "jaxserve-none" in engines and e != "jaxserve-none":   # against today's default
                summary[e][c]["tok_s_vs_jaxserve_none_same_round"] = float(np.median(
                    [rd[e][c]["output_throughput"] / rd["jaxserve-none"][c]["output_throughput"]
                     for rd in rounds]))
            if peers and not e.startswith("llama.cpp"):   # against llama.cpp's best here
                summary[e][c]["tok_s_vs_best_llama_cpp_same_round"] = float(np.median(
                    [rd[e][c]["output_throughput"]
                     / max(rd[p][c]["output_throughput"] for p in peers) for rd in rounds]))
    report = {"machine": machine_info(), "lscpu_flags": lscpu_flags(), "gguf": args.gguf,
              "command": " ".join(sys.argv), "engine_flags": {e: JAXSERVE_ENGINES.get(e)
                                                             for e in engines},
              "client": "benchmarks/bench_serving.py, random 128 in / 128 out, ignore_eos",
              "note": "a shared machine: other processes ran beside these; see load_average",
              "summary": summary, "rounds": rounds}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"gguf-single-stream-{args.tag}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

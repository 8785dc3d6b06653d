"""lm-evaluation-harness against `jaxserve serve`, end to end, offline.

Starts the server (default: the embedded SmolLM2-135M-Instruct GGUF), then runs lm-eval's
`local-completions` model on two tiny local tasks (tests/data/lm_eval/): a multiple-choice
task (loglikelihood: echo + logprobs, the prompt logprobs path) and a `generate_until`
task. lm-eval tokenizes with the server's own tokenizer: `--tokenizer remote` (the
default) reads /tokenizer_info, /tokenize and /detokenize; `--tokenizer export` writes it
with `jaxserve export-tokenizer` and loads that directory.

    pip install lm-eval            # once
    python benchmarks/lm_eval_smoke.py [--model PATH] [--limit N] [--tokenizer export]

Prints lm-eval's results table; exits non-zero if a task failed to run.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = ROOT / "tests" / "data" / "lm_eval"
TASKS = ["jaxserve_smoke_mc", "jaxserve_smoke_gen"]
# Small buckets: the smoke test's prompts are short, and fewer buckets compile faster.
ENGINE_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens",
                "128", "--kv-cache-memory-bytes", str(64 << 20)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smoke",
           "--enable-tokenizer-info-endpoint", "--uvicorn-log-level", "warning", *ENGINE_FLAGS]
    log = open(log_path, "w")  # noqa: SIM115 - the server's log for its lifetime
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not ready after {timeout:.0f} s:\n{log_path.read_text()}")


def export_tokenizer(model: str | None, out_dir: Path) -> str:
    subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "export-tokenizer",
                    str(out_dir), *(["--model", model] if model else [])], check=True, cwd=ROOT)
    return str(out_dir)


def run_lm_eval(url: str, tokenizer: str, limit: int | None, num_concurrent: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = {"base_url": url + "/v1/completions", "model": "smoke",
                  "num_concurrent": num_concurrent, "max_retries": 1, "timeout": 300,
                  "tokenized_requests": True}
    if tokenizer == "remote":
        model_args["tokenizer_backend"] = "remote"
    else:
        model_args.update(tokenizer_backend="huggingface", tokenizer=tokenizer)
    return lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASKS_DIR)), limit=limit,
        log_samples=True)


def print_generations(results: dict, task: str, count: int = 3) -> None:
    """The first few generate_until answers next to their targets (what exact_match saw)."""
    for sample in results.get("samples", {}).get(task, [])[:count]:
        print(f"  {task}: target {sample['target']!r} <- generated "
              f"{sample['filtered_resps'][0]!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to serve (default: embedded)")
    parser.add_argument("--limit", type=int, default=None, help="docs per task (default: all)")
    parser.add_argument("--tokenizer", choices=["remote", "export"], default="remote")
    parser.add_argument("--num-concurrent", type=int, default=4)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args()

    os.chdir(ROOT)                        # the task YAMLs name their data relative to it
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # local JSONL only, no hub lookups
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        start = time.perf_counter()
        proc = start_server(args.model, port, log_path)
        try:
            wait_ready(proc, url, log_path, args.startup_timeout)
            print(f"server ready in {time.perf_counter() - start:.1f} s", flush=True)
            tokenizer = "remote" if args.tokenizer == "remote" else \
                export_tokenizer(args.model, Path(tmp) / "tokenizer")
            start = time.perf_counter()
            results = run_lm_eval(url, tokenizer, args.limit, args.num_concurrent)
            elapsed = time.perf_counter() - start
        finally:
            proc.terminate()
            proc.wait(60)
    from lm_eval.utils import make_table

    print(make_table(results))
    print_generations(results, "jaxserve_smoke_gen")
    print(f"lm-eval ran {', '.join(TASKS)} in {elapsed:.1f} s (tokenizer: {args.tokenizer})")
    missing = [task for task in TASKS if task not in results.get("results", {})]
    if missing:
        print(f"no results for {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Soak with faults: a `jaxserve serve` (default model) under mixed traffic for a long time.

Workers send, in a fixed rotation: non-streaming and streaming completions and chats,
streams cut after the first chunk (the client goes away), and hostile requests (huge
top_k, bad logprobs, malformed JSON, a negative max_tokens, a huge n ...). Every
`--burst-every` seconds an overload burst fires `--burst-size` concurrent requests, well
above --max-queued-requests. The server runs with `--fault-injection-every-steps`
(a TESTING-ONLY flag: a step fault every N engine steps, which fails the requests of that
step and restarts the engine in-process).

Every request must end with a response: a 200 (done), a 503 (rejected: queue full,
shutting down; or failed: in a faulted step), a 4xx for hostile ones. "lost" counts
requests that ended without one (connection dropped by the server, a stream without its
[DONE] or final chunk), "hung" those past `--request-timeout`; both must be 0. RSS of the
server process is read at the start (after `--warmup` s of traffic), at the warm point
(the first overload burst and the first step fault are behind it: the heap has seen its
high-water mark) and at the end; the flatness target is warm point to end.

    python benchmarks/soak.py                         # 30 minutes, 2 workers
    python benchmarks/soak.py --duration 120 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"

WORDS = ("the quick brown fox jumps over a lazy dog while language models predict the next "
         "token from paged attention caches and continuous batches").split()

# (name, kind, body or raw bytes): hostile requests and the status classes they may get.
HOSTILE = [
    ("huge_top_k", {"prompt": "hi", "temperature": 1, "top_k": 2147483648, "max_tokens": 4}),
    ("huge_top_k_2", {"prompt": "hi", "top_k": 2 ** 63, "max_tokens": 4}),
    ("bad_logprobs", {"prompt": "hi", "logprobs": 10 ** 6, "max_tokens": 4}),
    ("negative_logprobs", {"prompt": "hi", "logprobs": -5, "max_tokens": 4}),
    ("negative_max_tokens", {"prompt": "hi", "max_tokens": -1}),
    ("huge_n", {"prompt": "hi", "n": 100000, "max_tokens": 4}),
    ("nan_temperature", b'{"prompt": "hi", "temperature": NaN, "max_tokens": 4}'),
    ("malformed_json", b'{"prompt": "hi", "max_tokens": '),
    ("deep_json", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("bad_token_ids", {"prompt": [10 ** 9, -3], "max_tokens": 4}),
    ("unknown_model", {"model": "nope", "prompt": "hi", "max_tokens": 4}),
    ("bad_logit_bias", {"prompt": "hi", "logit_bias": {"99999999": 5}, "max_tokens": 4}),
    ("many_stops", {"prompt": "hi", "stop": ["x" * 64] * 4, "max_tokens": 4}),
    ("huge_penalty", {"prompt": "hi", "presence_penalty": 1e308, "max_tokens": 4}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def prompt_of(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


class Tally:
    """Outcomes by class, plus latencies of completed normal requests."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.details: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.examples: dict[str, str] = {}

    def add(self, outcome: str, detail: str, example: str = "") -> None:
        self.outcomes[outcome] += 1
        self.details[f"{outcome}:{detail}"] += 1
        if outcome in ("lost", "hung", "unexpected") and detail not in self.examples:
            self.examples[detail] = example[:300]


def classify_status(r: httpx.Response) -> tuple[str, str]:
    """A non-200 response: rejected (queue / shutdown), failed (a faulted step), or other."""
    try:
        code = r.json()["error"].get("code")
    except Exception:
        return "unexpected", f"{r.status_code}-not-openai-shape"
    if r.status_code == 503:
        if code in ("queue_full", "queue_timeout", "shutting_down"):
            return "rejected", str(code)
        return "failed", str(code)
    return "unexpected", f"{r.status_code}-{code}"


async def plain(client: httpx.AsyncClient, tally: Tally, rng: random.Random, chat: bool) -> None:
    body = {"max_tokens": rng.randint(4, 32), "temperature": rng.choice([0.0, 0.8])}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if chat:
        body["messages"] = [{"role": "user", "content": prompt_of(rng)}]
    else:
        body["prompt"] = prompt_of(rng)
    start = time.monotonic()
    r = await client.post(path, json=body)
    if r.status_code == 200:
        finish = r.json()["choices"][0]["finish_reason"]
        tally.latencies.append(time.monotonic() - start)
        tally.add("done", f"{'chat' if chat else 'completion'}-{finish}")
    else:
        tally.add(*classify_status(r), r.text)


async def streamed(client: httpx.AsyncClient, tally: Tally, rng: random.Random,
                   cut: bool) -> None:
    body = {"prompt": prompt_of(rng), "max_tokens": rng.randint(8, 32), "stream": True}
    start = time.monotonic()
    finish, done, error = None, False, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            tally.add(*classify_status(r), r.text)
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if cut:                       # the client goes away after the first chunk
                tally.add("done", "cut-connection")
                return
            if line == "data: [DONE]":
                done = True
                continue
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"].get("code")
            for choice in data.get("choices", []):
                finish = choice.get("finish_reason") or finish
    if not done:
        tally.add("lost", "stream-without-done", f"finish={finish} error={error}")
    elif error is not None:                # the server's 503 codes, sent after the 200 headers
        outcome = ("failed" if error == "engine_step_failed" else
                   "rejected" if error in ("queue_timeout", "shutting_down") else "unexpected")
        tally.add(outcome, f"stream-{error}")
    elif finish is None:
        tally.add("lost", "stream-without-finish")
    else:
        tally.latencies.append(time.monotonic() - start)
        tally.add("done", f"stream-{finish}")


async def hostile(client: httpx.AsyncClient, tally: Tally, index: int) -> None:
    name, body = HOSTILE[index % len(HOSTILE)]
    if isinstance(body, bytes):
        r = await client.post("/v1/completions", content=body,
                              headers={"content-type": "application/json"})
    else:
        r = await client.post("/v1/completions", json=body)
    if r.status_code >= 500 and r.status_code != 503:
        tally.add("unexpected", f"hostile-{name}-{r.status_code}", r.text)
    elif r.status_code == 503:
        tally.add(*classify_status(r), r.text)
    else:
        tally.add("hostile", f"{name}-{r.status_code}")


async def one(client: httpx.AsyncClient, tally: Tally, rng: random.Random, index: int,
              timeout: float) -> None:
    kind = index % 8
    try:
        async with asyncio.timeout(timeout):
            if kind in (0, 1):
                await plain(client, tally, rng, chat=False)
            elif kind == 2:
                await plain(client, tally, rng, chat=True)
            elif kind in (3, 4):
                await streamed(client, tally, rng, cut=False)
            elif kind == 5:
                await streamed(client, tally, rng, cut=True)
            else:
                await hostile(client, tally, index // 8 * 2 + kind - 6)
    except TimeoutError:
        tally.add("hung", f"kind-{kind}", f"no answer in {timeout} s")
    except httpx.HTTPError as exc:
        tally.add("lost", f"kind-{kind}-{type(exc).__name__}", repr(exc))


async def worker(url: str, tally: Tally, seed: int, stop_at: float, timeout: float) -> None:
    rng = random.Random(seed)
    index = seed
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        while time.monotonic() < stop_at:
            await one(client, tally, rng, index, timeout)
            index += 1


async def bursts(url: str, tally: Tally, every: float, size: int, stop_at: float,
                 timeout: float, first_done: asyncio.Event) -> None:
    limits = httpx.Limits(max_connections=size + 10)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        rng = random.Random(7)
        while time.monotonic() + every < stop_at:
            await asyncio.sleep(every)
            tally.add("burst", "started")
            await asyncio.gather(*[one(client, tally, rng, 8 * i, timeout)    # plain ones
                                   for i in range(size)])
            first_done.set()


async def engine_restarts(url: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return metric((await client.get("/metrics")).text, "jaxserve:engine_restarts_total")


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict:
    tally = Tally()
    start = time.monotonic()
    stop_at = start + args.duration
    tasks = [asyncio.ensure_future(worker(url, tally, i, stop_at, args.request_timeout))
             for i in range(args.concurrency)]
    first_burst_done = asyncio.Event()
    tasks.append(asyncio.ensure_future(bursts(url, tally, args.burst_every, args.burst_size,
                                              stop_at, args.request_timeout, first_burst_done)))
    await asyncio.sleep(min(args.warmup, args.duration / 4))
    rss_start = rss_bytes(pid)
    # The warm point: every kind of traffic has reached its peak once (an overload burst
    # filled max_num_seqs and the queue; a step fault rebuilt the engine), so the heap
    # has seen its high-water mark; growth after it is what a leak would show.
    rss_warm, warm_at = None, None
    rss_series: list[tuple[float, float]] = []
    last_report = last_sample = time.monotonic()
    server_died = False
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1.0)
        now = time.monotonic()
        if now - last_sample >= 10:
            last_sample = now
            rss_series.append((round(now - start), round(rss_bytes(pid) / 2**20, 1)))
            if rss_warm is None and first_burst_done.is_set() and await engine_restarts(url):
                rss_warm, warm_at = rss_bytes(pid), round(now - start)
                print(f"[{now - start:6.0f} s] warm point: rss {rss_warm / 2**20:.0f} MiB",
                      flush=True)
        if not Path(f"/proc/{pid}").exists() or rss_bytes(pid) == 0:
            server_died = True            # killed from outside (e.g. the OOM killer)
            print("the server process is gone: stopping", flush=True)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return {"tally": tally, "rss_start": rss_start, "rss_end": 0, "metrics": "",
                    "health_at_end": None, "seconds": time.monotonic() - start,
                    "server_died": True, "rss_warm": rss_warm, "warm_at": warm_at,
                    "rss_series": rss_series}
        if time.monotonic() - last_report > 60:
            last_report = time.monotonic()
            print(f"[{time.monotonic() - start:6.0f} s] {dict(tally.outcomes)} "
                  f"rss {rss_bytes(pid) / 2**20:.0f} MiB", flush=True)
    await asyncio.gather(*tasks)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).status_code
    rss_end = rss_bytes(pid)
    return {"tally": tally, "rss_start": rss_start, "rss_end": rss_end, "metrics": metrics,
            "health_at_end": health, "seconds": time.monotonic() - start,
            "server_died": server_died, "rss_warm": rss_warm, "warm_at": warm_at,
            "rss_series": rss_series}


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    probe = ([str(ROOT / "benchmarks" / "memory_probe.py"), str(args.memory_probe), "60"]
             if args.memory_probe else [])
    cmd = [sys.executable, *probe, "-m", "jaxserve.entrypoints.cli", "serve", *args.model,
           "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning",
           "--disable-uvicorn-access-log", "--disable-log-requests",
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-queued-requests", str(args.max_queued_requests),
           "--fault-injection-every-steps", str(args.fault_every_steps),
           "--max-queue-time", str(args.max_queue_time),
           "--shutdown-timeout", "10",
           "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    log = open(log_path, "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not ready in 600 s; see {log_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=2, help="request workers")
    parser.add_argument("--model", nargs="*", default=[], help="model (default: embedded)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--max-queue-time", type=float, default=60.0,
                        help="server's --max-queue-time: past it a queued request gets 503")
    parser.add_argument("--fault-every-steps", type=int, default=300,
                        help="server's --fault-injection-every-steps (minutes apart on a "
                        "loaded 2-core box, where a step of 16 rows takes ~0.3-1 s)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20,
                        help="server's KV cache (default 512 MiB, room for ~11k tokens: the "
                        "box is shared, and 4 GiB got the server OOM-killed)")
    parser.add_argument("--burst-every", type=float, default=180.0)
    parser.add_argument("--burst-size", type=int, default=60)
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="a request with no complete answer after this is 'hung'")
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="seconds of traffic before the start RSS is read")
    parser.add_argument("--log", type=Path, default=Path("/tmp/jaxserve-soak-server.log"))
    parser.add_argument("--out", type=Path, default=RESULTS / "soak-cpu.json")
    parser.add_argument("--memory-probe", type=Path, default=None,
                        help="run the server under benchmarks/memory_probe.py, writing its "
                        "per-minute RSS / malloc / tracemalloc / gc lines here (diagnosis: "
                        "slows the server)")
    args = parser.parse_args()

    port = free_port()
    proc = start_server(args, port, args.log)
    print(f"server pid {proc.pid} on port {port}; soaking {args.duration:.0f} s", flush=True)
    try:
        run = asyncio.run(soak(args, f"http://127.0.0.1:{port}", proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()
    tally: Tally = run["tally"]
    lat = sorted(tally.latencies)
    p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None)
    rss_growth_from_start = run["rss_end"] / run["rss_start"] - 1 if run["rss_start"] else None
    rss_growth = run["rss_end"] / run["rss_warm"] - 1 if run["rss_warm"] else None
    result = {
        "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "duration_s": round(run["seconds"], 1), "concurrency": args.concurrency,
        "server_flags": {"max_num_seqs": args.max_num_seqs,
                         "max_queued_requests": args.max_queued_requests,
                         "max_queue_time": args.max_queue_time,
                         "fault_injection_every_steps": args.fault_every_steps},
        "bursts": {"every_s": args.burst_every, "size": args.burst_size},
        "requests": sum(v for k, v in tally.outcomes.items() if k != "burst"),
        "done": tally.outcomes["done"], "rejected": tally.outcomes["rejected"],
        "failed": tally.outcomes["failed"], "hostile_answered_4xx": tally.outcomes["hostile"],
        "lost": tally.outcomes["lost"], "hung": tally.outcomes["hung"],
        "unexpected": tally.outcomes["unexpected"], "bursts_fired": tally.outcomes["burst"],
        "outcome_details": dict(sorted(tally.details.items())),
        "examples": tally.examples,
        "latency_s": {"p50": p(0.5), "p90": p(0.9), "p99": p(0.99), "n": len(lat)},
        "engine_restarts": metric(run["metrics"], "jaxserve:engine_restarts_total"),
        "rejected_by_server": {
            reason: metric(run["metrics"], "jaxserve:num_requests_rejected_total",
                           reason=reason) for reason in ("queue_full", "queue_timeout")},
        "rss_start_mib": round(run["rss_start"] / 2**20, 1),
        "rss_warm_mib": run["rss_warm"] and round(run["rss_warm"] / 2**20, 1),
        "warm_at_s": run["warm_at"],
        "rss_end_mib": round(run["rss_end"] / 2**20, 1),
        "rss_growth": None if rss_growth is None else round(rss_growth, 4),
        "rss_growth_from_start": (None if rss_growth_from_start is None
                                  else round(rss_growth_from_start, 4)),
        "rss_series_mib": run["rss_series"],
        "health_at_end": run["health_at_end"], "server_exit_code": exit_code,
        "server_died": run["server_died"],
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
    }
    ok = (not run["server_died"] and result["lost"] == 0 and result["hung"] == 0 and result["unexpected"] == 0
          and rss_growth is not None and abs(rss_growth) <= 0.10 and exit_code == 0)
    result["pass"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in (
        "requests", "done", "rejected", "failed", "hostile_answered_4xx", "lost", "hung",
        "unexpected", "engine_restarts", "latency_s", "rss_start_mib", "rss_warm_mib",
        "rss_end_mib", "rss_growth", "rss_growth_from_start", "server_exit_code", "pass")},
        indent=2))
    print(f"wrote {args.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Online serving benchmark against any OpenAI-compatible server, like `vllm bench serve`.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 64 --random-input-len 128 --random-output-len 128 --ignore-eos \\
        --max-concurrency 16 --save-result

Sends `--num-prompts` streamed requests, arriving as a Poisson process at
`--request-rate` req/s (inf: all at once), at most `--max-concurrency` in
flight. Reports request throughput, output tok/s, TTFT, TPOT, ITL and E2E
latency (mean / median / p99) and saves them as JSON.

Prompts: `--dataset random` makes prompts of exactly `--random-input-len`
tokens as token-id lists (completions endpoint) or random words (chat);
`--dataset fixed` sends `--prompt` every time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np

_WORDS = ["time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand",
          "part", "child", "eye", "woman", "place", "work", "week", "case", "point",
          "government", "company", "number", "group", "problem", "fact"]


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                  # seconds to the first chunk carrying text
    latency: float = 0.0               # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)   # gaps between text chunks
    error: str = ""


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[tuple[object, int, int]]:
    """(prompt, prompt length in tokens (approximate for text), max_tokens) per request."""
    out = []
    for _ in range(args.num_prompts):
        low = 1 - args.random_range_ratio
        high = 1 + args.random_range_ratio
        input_len = max(1, int(args.random_input_len * rng.uniform(low, high)))
        output_len = max(1, int(args.random_output_len * rng.uniform(low, high)))
        if args.dataset == "fixed":
            prompt: object = args.prompt
            input_len = len(args.prompt.split())
        elif args.endpoint.endswith("/chat/completions"):
            prompt = " ".join(rng.choice(_WORDS) for _ in range(input_len))
        else:
            prompt = [rng.randrange(args.token_id_low, args.token_id_high)
                      for _ in range(input_len)]
        out.append((prompt, input_len, output_len))
    return out


def request_body(args: argparse.Namespace, model: str, prompt: object, max_tokens: int) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send_request(session: aiohttp.ClientSession, url: str, headers: dict, body: dict,
                       prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            buffer = b""
            async for data in response.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    message = json.loads(payload)
                    if "error" in message:
                        result.error = str(message["error"])
                        return result
                    if message.get("usage"):
                        result.output_tokens = message["usage"]["completion_tokens"]
                    for choice in message.get("choices", []):
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if not text:
                            continue
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.success = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        result.error = repr(exc)
    return result


async def run(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # --no-keep-alive: a connection per request (llama.cpp's server closes idle keep-alive
    # connections, and a request sent on one it just closed fails to write its body).
    connector = aiohttp.TCPConnector(limit=0, force_close=not args.keep_alive)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model
        if model is None:
            async with session.get(base + "/v1/models", headers=headers) as response:
                model = (await response.json())["data"][0]["id"]
        rng = random.Random(args.seed)
        prompts = make_prompts(args, rng)
        url = base + args.endpoint

        print(f"model {model}; {len(prompts)} requests to {url}; rate {args.request_rate}/s; "
              f"max concurrency {args.max_concurrency}", file=sys.stderr)
        for _ in range(args.num_warmups):
            prompt, input_len, _ = prompts[0]
            warm = await send_request(session, url, headers,
                                      request_body(args, model, prompt, 8), input_len)
            if not warm.success:
                raise SystemExit(f"warm-up request failed: {warm.error}")

        semaphore = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def limited(prompt: object, input_len: int, output_len: int) -> RequestResult:
            async with semaphore:
                return await send_request(session, url, headers,
                                          request_body(args, model, prompt, output_len),
                                          input_len)

        tasks = []
        arrivals = np.random.default_rng(args.seed)
        start = time.perf_counter()
        for prompt, input_len, output_len in prompts:
            tasks.append(asyncio.create_task(limited(prompt, input_len, output_len)))
            if args.request_rate != float("inf"):
                # Poisson arrivals (gamma with shape `burstiness`; 1 = Poisson).
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(float(arrivals.gamma(args.burstiness, theta)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def _stats(name: str, values: list[float], out: dict) -> None:
    data = np.asarray(values, dtype=np.float64) * 1000.0 if values else np.zeros(1)
    out[f"mean_{name}_ms"] = float(data.mean())
    out[f"median_{name}_ms"] = float(np.median(data))
    out[f"std_{name}_ms"] = float(data.std())
    out[f"p99_{name}_ms"] = float(np.percentile(data, 99))


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult],
              duration: float) -> dict:
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict = {
        "date": datetime.now().isoformat(timespec="seconds"), "label": args.label,
        "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "dataset": args.dataset, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "ignore_eos": args.ignore_eos,
        "request_rate": str(args.request_rate), "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "num_prompts": len(results),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    _stats("ttft", [r.ttft for r in ok], summary)
    _stats("tpot", tpots, summary)
    _stats("itl", [gap for r in ok for gap in r.itl], summary)
    _stats("e2el", [r.latency for r in ok], summary)
    return summary


def print_summary(s: dict) -> None:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {label} --", ""))
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)",
                         f"{s[f'{stat}_{name}_ms']:.2f}"))
    print("=" * 50)
    for name, value in rows:
        print(f"{name:<40}{value:>10}")
    print("=" * 50)
    for error in s["errors"]:
        print("error:", error)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", default="random", choices=["random", "fixed"])
    p.add_argument("--prompt", default="Write a long story about a dragon who learns to cook.")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths vary uniformly within +-ratio")
    p.add_argument("--token-id-low", type=int, default=1000,
                   help="random prompt token ids are drawn from [low, high)")
    p.add_argument("--token-id-high", type=int, default=20000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--keep-alive", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse connections between requests (--no-keep-alive: one per request)")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=6 * 3600)
    p.add_argument("--label", default="jaxserve")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=str(Path(__file__).parent / "results"))
    p.add_argument("--result-filename", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    sys.path.insert(0, str(Path(__file__).resolve().parent))     # benchmarks/machine.py
    from machine import machine_info

    summary["client_machine"] = machine_info()     # the server's too when on this machine
    print_summary(summary)
    if args.save_result:
        name = args.result_filename or (
            f"{args.label}-c{args.max_concurrency or 'inf'}-in{args.random_input_len}"
            f"-out{args.random_output_len}.json")
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"saved {path}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()

"""Startup with shipped executables (`jaxserve compile --target cpu` + `--aot-dir`) against a
cold compile, on this CPU: fresh processes, alternating, same engine flags.

    PYTHONPATH=. python benchmarks/bench_aot_cpu.py [--model M] [--rounds 2]

Prints per process: ready seconds (LLM(...) constructed), step buckets loaded/compiled,
compiles while serving, and whether the greedy tokens equal the cold (JIT) engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPTS = [[11, 23, 98, 7, 5], [7] + list(range(40, 60))]


def worker(model: str | None, kwargs: dict) -> None:
    import jax

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(secs)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    from jaxserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    ready = time.perf_counter() - start
    before = len(compiles)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    cache = llm.llm_engine.engine_core.runner.executable_cache
    print(json.dumps({"ready_seconds": round(ready, 2),
                      "loaded": getattr(cache, "hits", 0), "compiled": getattr(cache, "misses", 0),
                      "compiles_at_startup": before, "compiles_while_serving": len(compiles) - before,
                      "tokens": [list(o.outputs[0].token_ids) for o in outs]}))


def run(model: str | None, kwargs: dict) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps([model, kwargs])],
                         env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    engine = {"compilation_cache_dir": "off", "compile_in_background": False,
              "kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    from jaxserve.config import EngineConfig
    from jaxserve.engine.aot_compile import compile_for_target

    out = tempfile.mkdtemp(prefix="jaxserve-aot-")
    start = time.perf_counter()
    summary = compile_for_target(EngineConfig.from_kwargs(model=args.model, **engine), None, out)
    print(f"jaxserve compile --target cpu: {len(summary['buckets'])} buckets in "
          f"{time.perf_counter() - start:.1f} s -> {out}")
    cold_tokens = None
    for r in range(args.rounds):
        for name, kwargs in (("cold", engine), ("aot", {**engine, "aot_dir": out})):
            result = run(args.model, kwargs)
            tokens = result.pop("tokens")
            cold_tokens = cold_tokens or (tokens if name == "cold" else None)
            print(f"round {r} {name:>4}: {json.dumps(result)} tokens_equal_cold="
                  f"{tokens == cold_tokens}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(*json.loads(sys.argv[2]))
    else:
        main()

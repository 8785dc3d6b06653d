"""On a GPU: the executables `jaxserve compile --target h200` built without one, loaded
(`--aot-dir`) and run, against the same engine compiled just in time.

    python benchmarks/bench_aot_gpu.py --aot-dir DIR [--batch 1 8]

DIR's manifest fixes the model and engine flags (they must match for the executables to
load); the engine uses --load-format dummy weights. Prints one JSON line per engine: ready
seconds, buckets loaded, greedy tokens equal to the JIT engine's, decode tok/s per batch
size, and the HBM bandwidth that decode speed implies (weights per device + the KV cache
each step reads, per second).
"""

from __future__ import annotations

import argparse
import json
import time

MANIFEST_FLAGS = ("max_model_len",)


def decode_rate(llm, batch: int, output_len: int) -> float:
    from jaxserve import SamplingParams

    prompts = [[11 + i, 23, 98] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * output_len / (time.perf_counter() - start)


def engine(manifest: dict, aot_dir: str | None, batches: list[int], output_len: int) -> dict:
    from jaxserve import LLM, SamplingParams

    kwargs = dict(manifest["engine_flags"])
    start = time.perf_counter()
    llm = LLM(manifest["model"], load_format="dummy", aot_dir=aot_dir, **kwargs)
    ready = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(
        [[11, 23, 98], [7, 8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=32,
                                                     ignore_eos=True), use_tqdm=False)]
    cache = llm.llm_engine.engine_core.runner.executable_cache
    rates = {b: decode_rate(llm, b, output_len) for b in batches}
    weights = manifest["weights_bytes_per_device"]
    kv_per_token = manifest["kv_cache_bytes_per_device"] / max(1, manifest["kv_cache_tokens"])
    bandwidth = {b: r / b * (weights + b * (3 + output_len / 2) * kv_per_token) / 1e9
                 for b, r in rates.items()}
    del llm
    return {"aot": aot_dir is not None, "ready_seconds": round(ready, 1),
            "loaded": getattr(cache, "hits", None), "tokens": tokens,
            "decode_tok_s": {b: round(r, 1) for b, r in rates.items()},
            "hbm_gb_s": {b: round(g, 1) for b, g in bandwidth.items()}}


def main() -> None:
    from jaxserve.runner.aot_executables import read_manifest

    parser = argparse.ArgumentParser()
    parser.add_argument("--aot-dir", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    manifest = read_manifest(args.aot_dir)
    aot = engine(manifest, args.aot_dir, args.batch, args.output_len)
    jit = engine(manifest, None, args.batch, args.output_len)
    aot["tokens_equal_jit"] = aot.pop("tokens") == jit.pop("tokens")
    print(json.dumps(aot))
    print(json.dumps(jit))


if __name__ == "__main__":
    main()

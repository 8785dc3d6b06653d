"""Multi-LoRA decode cost on the default model, one run.

    PYTHONPATH=. python benchmarks/bench_lora.py [--out benchmarks/results/lora-cpu.json]

On the embedded SmolLM2-135M-Instruct (`LLM()`), with random rank-16 adapters on all 7
targets written on the fly in PEFT's format:
  * batch-64 decode tok/s: an engine without LoRA, and one with --enable-lora
    (max_loras 4, max_lora_rank 16) running 0, 1 and 4 distinct adapters (16 rows each);
    decode time = wall time of 64 prompts x 17 new tokens minus that of 64 x 1 (prefill),
    prefix caching off so both runs prefill the same; the four cases interleaved, 3 runs
    each, the fastest kept (the box is shared: see decode_tok_s);
  * the three ways to compute the per-token delta (jaxserve/models/lora.py) on one
    SmolLM2-sized projection (576 -> 1536), at decode (T=64) and prefill (T=512) sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, LoRARequest, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
BATCH, NEW_TOKENS, RANK = 64, 17, 16


def write_adapter(directory: Path, shapes: dict[str, tuple[int, int, int]], seed: int) -> None:
    """A PEFT LoRA directory: A [r, in] and B [out, r] random (B non-zero) for every layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for target, (layers, fan_in, fan_out) in shapes.items():
        for i in range(layers):
            prefix = f"base_model.model.model.layers.{i}.{TARGETS[target]}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (0.02 * rng.standard_normal((RANK, fan_in))
                                                 ).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (0.02 * rng.standard_normal((fan_out, RANK))
                                                 ).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(TARGETS),
        "bias": "none", "lora_dropout": 0.0}))


def timed_generate(llm: LLM, prompts: list[list[int]], loras: list, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start


def decode_tok_s(cases: dict[str, tuple[LLM, list]], prompts: list[list[int]],
                 reps: int = 3) -> dict[str, float]:
    """Batch-64 decode tok/s per case. The cases are interleaved, rep after rep, and each
    keeps its fastest run: on a shared box the load drifts, and interleaving spreads it over
    every case instead of charging it to whichever ran last."""
    for llm, loras in cases.values():                   # touch every path once
        timed_generate(llm, prompts, loras, 2)
    prefill = {name: [] for name in cases}
    total = {name: [] for name in cases}
    for _ in range(reps):
        for name, (llm, loras) in cases.items():
            prefill[name].append(timed_generate(llm, prompts, loras, 1))
            total[name].append(timed_generate(llm, prompts, loras, NEW_TOKENS))
    return {name: round(BATCH * (NEW_TOKENS - 1) / (min(total[name]) - min(prefill[name])), 1)
            for name in cases}


def delta_methods() -> dict:
    from jaxserve.models.lora import METHODS, lora_delta

    rng = np.random.default_rng(0)
    fan_in, fan_out, slots = 576, 1536, 5
    a = jnp.asarray(rng.standard_normal((slots, fan_in, RANK)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((slots, RANK, fan_out)), jnp.float32)
    results = {}
    for tokens in (64, 512):
        x = jnp.asarray(rng.standard_normal((tokens, fan_in)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, slots, tokens), jnp.int32)
        ref = None
        for method in METHODS:
            fn = jax.jit(lambda x, a, b, s, m=method: lora_delta(x, a, b, s, m))
            out = fn(x, a, b, ids).block_until_ready()
            ref = out if ref is None else ref
            assert np.allclose(out, ref, atol=1e-2 * float(jnp.abs(ref).max()))
            times = []
            for _ in range(20):
                start = time.perf_counter()
                fn(x, a, b, ids).block_until_ready()
                times.append(time.perf_counter() - start)
            results[f"T={tokens} {method}"] = round(1e6 * min(times), 1)   # least disturbed
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/lora-cpu.json"))
    args = parser.parse_args()
    engine_kwargs = dict(compile_in_background=False, max_model_len=256, max_num_seqs=BATCH,
                         max_num_batched_tokens=128,
                         kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    result: dict = {"model": "SmolLM2-135M-Instruct (embedded GGUF, float32)",
                    "batch": BATCH, "new_tokens": NEW_TOKENS, "rank": RANK,
                    "targets": list(TARGETS), "load_average_at_start": os.getloadavg(),
                    "note": "one run on a 2-core box shared with other jobs: timings are noisy"}
    result["delta_method_us_per_projection"] = delta_methods()

    base = LLM(None, **engine_kwargs)
    tok = base.get_tokenizer()
    prompts = [tok.encode(f"Request {i}: tell me about the number {i * 7}.") for i in range(BATCH)]
    llm = LLM(None, enable_lora=True, max_loras=4, max_lora_rank=RANK, **engine_kwargs)
    setup = llm.llm_engine.engine_core.setup
    from jaxserve.lora.peft_loader import supported_targets
    from jaxserve.models.registry import family_for

    shapes = {t: (setup.arch.num_layers, s.in_features, s.out_features) for t, s in
              supported_targets(family_for(setup.arch.architecture), setup.arch).items()}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(4):
            write_adapter(Path(tmp) / f"a{i}", shapes, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        cases = {"lora_off": (base, None), "lora_on_0_adapters": (llm, [None] * BATCH),
                 "lora_on_1_adapter": (llm, [adapters[0]] * BATCH),
                 "lora_on_4_adapters": (llm, [adapters[i % 4] for i in range(BATCH)])}
        for name, tok_s in decode_tok_s(cases, prompts).items():
            result[f"{name}_tok_s"] = tok_s
    r = result
    r["step_time_ratio_4_adapters_vs_lora_off"] = round(
        r["lora_off_tok_s"] / r["lora_on_4_adapters_tok_s"], 3)
    r["step_time_ratio_4_adapters_vs_0_adapters"] = round(
        r["lora_on_0_adapters_tok_s"] / r["lora_on_4_adapters_tok_s"], 3)
    r["load_average_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

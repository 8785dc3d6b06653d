"""Tensor- and data-parallel throughput and step time, one configuration per subprocess.

On CPU the devices are simulated (``--xla_force_host_platform_device_count``) and
share the machine's cores, so tp = 4 cannot be faster than tp = 1 here: the
numbers bound the cost of the collectives and the sharded step, nothing more.
On a machine with several GPUs pass ``--platform gpu`` and the same script
measures real scaling.

The model is a synthetic Llama (random weights, 8 query / 4 KV heads, so tp =
1, 2, 4 and 8 all divide it), written once to a cache directory.

    python benchmarks/bench_parallel.py                           # tp 1,2,4 and dp 1,2 on CPU
    python benchmarks/bench_parallel.py --configs tp1 tp2 dp2 --num-prompts 64
    python benchmarks/bench_parallel.py --platform gpu --configs tp1 tp2 tp4 tp8
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

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
NOTE = ("CPU devices are simulated and share the host's cores: tp/dp numbers here only bound "
        "the overhead of collectives and sharding, they do not show scaling.")
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}


# -- the synthetic model ---------------------------------------------------------------------------
def make_model(directory: Path) -> Path:
    """A random Llama checkpoint (HF layout) with a small trained BPE tokenizer."""
    if (directory / "model.safetensors").exists():
        return directory
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([NOTE, __doc__ or ""] * 8, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", unk_token="<|endoftext|>")
    tokenizer.save_pretrained(directory)
    vocab = len(tokenizer)

    h, i, n = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    d = h // MODEL["num_attention_heads"]
    kv = MODEL["num_key_value_heads"] * d
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h),
               "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i)})
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **MODEL,
              "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


# -- one configuration (runs in its own process) ---------------------------------------------------
def run_config(args: argparse.Namespace) -> dict:
    from jaxserve import LLM, SamplingParams

    tp, dp = args.tp, args.dp
    start = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=tp, data_parallel_size=dp,
              max_model_len=args.input_len + args.output_len + 16,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              kv_cache_memory_bytes=args.kv_cache_mib << 20, disable_log_stats=True,
              compile_in_background=False)
    build_seconds = time.perf_counter() - start
    engine = llm.llm_engine.engine_core
    replicas = getattr(engine, "replicas", [engine])
    rng = np.random.default_rng(0)
    vocab = replicas[0].setup.arch.vocab_size

    def random_prompts(count: int) -> list[list[int]]:   # fresh ones: no prefix-cache hits
        return [rng.integers(3, vocab, size=args.input_len).tolist() for _ in range(count)]

    llm.generate(random_prompts(4), SamplingParams(max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    best = None
    for _ in range(args.repeats):      # best of N: the CPU is shared with other work
        prompts = random_prompts(args.num_prompts)
        before = [(r.stats.num_steps, r.stats.step_time_total) for r in replicas]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if best is None or elapsed < best[0]:
            best = (elapsed, [r.stats.num_steps - s for r, (s, _) in zip(replicas, before)],
                    [r.stats.step_time_total - t for r, (_, t) in zip(replicas, before)])
    elapsed, steps, step_time = best
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"config": f"tp{tp}" if dp == 1 else f"tp{tp}-dp{dp}", "tp": tp, "dp": dp,
            "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "repeats": args.repeats, "seconds": elapsed,
            "output_tok_s": generated / elapsed,
            "total_tok_s": (generated + args.num_prompts * args.input_len) / elapsed,
            "steps_per_replica": steps,
            "mean_step_ms": 1000 * sum(step_time) / max(sum(steps), 1),
            "build_seconds": build_seconds, "warmup_seconds": [r.setup.warmup_seconds
                                                               for r in replicas]}


# -- the driver ------------------------------------------------------------------------------------
def parse_config(name: str) -> tuple[int, int]:
    """'tp2' -> (2, 1); 'dp2' -> (1, 2); 'tp2-dp2' -> (2, 2)."""
    tp = dp = 1
    for part in name.split("-"):
        if part.startswith("tp"):
            tp = int(part[2:])
        elif part.startswith("dp"):
            dp = int(part[2:])
        else:
            raise ValueError(f"bad config {name!r}: use tpN, dpN or tpN-dpM")
    return tp, dp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["tp1", "tp2", "tp4", "dp2"])
    parser.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--model", default=None, help="model dir (default: synthetic Llama)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best counts")
    parser.add_argument("--tag", default=None, help="results file suffix (default: platform)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_config(args)), flush=True)
        return

    model = args.model or str(make_model(Path(tempfile.gettempdir()) / "jaxserve-bench-llama"))
    rows = []
    for name in args.configs:
        tp, dp = parse_config(name)
        env = dict(os.environ)
        if args.platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                                f"device_count={max(tp * dp, 1)}").strip()
        command = [sys.executable, __file__, "--worker", "--model", model, "--tp", str(tp),
                   "--dp", str(dp)] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
                       "num_prompts", "input_len", "output_len", "max_num_batched_tokens",
                       "max_num_seqs", "kv_cache_mib", "repeats")]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stderr[-3000:])
            raise SystemExit(f"{name} failed (exit {proc.returncode})")
        row = json.loads(lines[-1][len("RESULT "):])
        rows.append(row)
        print(f"{row['config']:>8}: {row['output_tok_s']:8.1f} output tok/s  "
              f"{row['total_tok_s']:8.1f} total tok/s  mean step {row['mean_step_ms']:7.1f} ms  "
              f"(warm-up {max(row['warmup_seconds']):.0f} s)", flush=True)
    base = next((r for r in rows if r["tp"] == 1 and r["dp"] == 1), None)
    if base:
        for row in rows:
            row["throughput_vs_tp1"] = row["output_tok_s"] / base["output_tok_s"]
            row["step_time_vs_tp1"] = row["mean_step_ms"] / base["mean_step_ms"]
    if args.platform == "cpu":
        print("note: " + NOTE)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"parallel-{args.tag or args.platform}.json"
    path.write_text(json.dumps({
        "note": NOTE if args.platform == "cpu" else "", "model": MODEL if not args.model
        else args.model, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": " ".join(sys.argv), "results": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Where the time of a single stream's decode step goes (1 row), on this CPU.

    python benchmarks/profile_one_row_step.py                      # dtype auto
    python benchmarks/profile_one_row_step.py --dtype bfloat16 --matrix-units avx512
    python benchmarks/profile_one_row_step.py --quantization int8 --out benchmarks/results/x.json

Measured on the default model (SmolLM2-135M), one stream, greedy:
  per token        the engine's steady decode, as `LLM.generate` sees it (two steps in flight)
  device step      the compiled (1, 1) step alone: the runner's dispatch blocked until its
                   outputs are ready, timed per call (forward + sampler + cache writes)
  host             per token with every step blocked, minus the device step: scheduling,
                   input packing, transfers, output processing (what two steps in flight hide)
  lm head          the [1, hidden] x [hidden, vocab] product alone, same dtype and weights
  sampler          jaxserve's sampler alone on [1, vocab] float32 logits (greedy)
  layers           device step - lm head - sampler: the decoder layers (projections,
                   attention, norms), the embedding gather and the cache writes
and the compiled step's op count (XLA thunks a 1-row step pays a dispatch for each).
The CPU kind (benchmarks/machine.py) is written beside the figures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def per_token_ms(llm, prompt: list[int], tokens: int, rounds: int) -> float:
    """Steady decode ms per token: (time for `tokens` outputs - time for 1) / (tokens - 1)."""
    from jaxserve import SamplingParams

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
                     use_tqdm=False)
        return time.perf_counter() - start

    samples = []
    for _ in range(rounds):
        one, full = run(1), run(tokens)
        samples.append((full - one) / (tokens - 1) * 1e3)
    return statistics.median(samples)


def timed(fn, *args, repeats: int = 50) -> float:
    """Median ms of fn(*args) blocked until ready."""
    import jax

    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def lm_head_weight(params, vocab: int, hidden: int):
    """The [vocab, hidden] (or [hidden, vocab]) table the logits come from: the untied head if
    there is one, else the embedding."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(params)
    found = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path).lower()
        if getattr(leaf, "shape", None) in ((vocab, hidden), (hidden, vocab)):
            found["head" if "head" in name else "embed"] = leaf
    return found.get("head", found.get("embed"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--matrix-units", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from machine import machine_info

    from jaxserve import LLM

    kwargs = dict(dtype=args.dtype, matrix_units=args.matrix_units, max_model_len=512,
                  max_num_seqs=8)
    if args.quantization:
        kwargs["quantization"] = args.quantization
    llm = LLM(args.model, **kwargs)
    engine = llm.llm_engine
    runner = engine.runner
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 20000, 32).tolist()
    per_token_ms(llm, prompt, 16, 1)                         # warm every path once

    per_token = per_token_ms(llm, prompt, args.tokens, args.rounds)

    # Every step blocked and timed: the device step alone, and per token with nothing hidden.
    step_ms: dict[tuple[int, int], list[float]] = {}
    run_step = runner.run_step

    def blocking_run_step(inputs):
        start = time.perf_counter()
        out = run_step(inputs)
        jax.block_until_ready(out)
        step_ms.setdefault((inputs.num_tokens, inputs.num_seqs), []).append(
            (time.perf_counter() - start) * 1e3)
        return out

    runner.run_step = blocking_run_step
    try:
        per_token_sync = per_token_ms(llm, prompt, args.tokens, args.rounds)
    finally:
        runner.run_step = run_step
    device = statistics.median(step_ms[(1, 1)])

    arch = runner.arch
    vocab, hidden = arch.vocab_size, arch.hidden_size
    dtype = engine.setup.dtype if hasattr(engine.setup, "dtype") else jnp.float32
    table = lm_head_weight(runner.params, vocab, hidden)
    x = jnp.asarray(rng.standard_normal((1, hidden)), dtype=getattr(table, "dtype", dtype))
    lm_head = None
    if table is not None and hasattr(table, "dtype") and table.ndim == 2:
        if table.shape == (vocab, hidden):
            head = jax.jit(lambda h, w: jnp.einsum("th,vh->tv", h, w,
                                                   preferred_element_type=jnp.float32))
        else:
            head = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))
        lm_head = timed(head, x, table)
    logits = jnp.asarray(rng.standard_normal((1, vocab)), jnp.float32)
    greedy = timed(jax.jit(lambda z: jnp.argmax(z, axis=-1)), logits)

    text = runner._steps[(1, 1)].as_text() if hasattr(runner._steps[(1, 1)], "as_text") else ""
    ops = len(re.findall(r"^\s+\S+ = \S+ (fusion|custom-call|dot|convolution|copy|"
                         r"dynamic-update-slice|dynamic-slice|gather|scatter)\(", text, re.M))
    if lm_head is not None and lm_head >= device:
        # A standalone XLA dot is not the path the step's LM head takes (the CPU step uses
        # oneDNN for bf16; emulated bf16 in XLA is far slower): no figure beats none.
        print(f"lm head alone ({lm_head:.1f} ms) >= the whole step: not the step's path; "
              "left out", file=sys.stderr)
        lm_head = None
    dtype_name = jnp.dtype(getattr(runner, "dtype", jnp.float32)).name
    out = {
        "machine": machine_info(),
        "model": str(engine.model_path), "dtype": dtype_name, "matrix_units": args.matrix_units,
        "quantization": args.quantization,
        "per_token_ms": per_token, "per_token_all_steps_blocked_ms": per_token_sync,
        "device_step_ms": device, "host_ms": per_token_sync - device,
        "lm_head_ms": lm_head, "sampler_greedy_ms": greedy,
        "layers_and_rest_ms": None if lm_head is None else device - lm_head - greedy,
        "tokens_per_s": 1e3 / per_token, "compiled_step_ops": ops,
    }
    for key, value in out.items():
        print(f"{key:32s} {value:.2f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

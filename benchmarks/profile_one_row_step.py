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
  lm head          the [1, hidden] x [hidden, vocab] product alone, same dtype and weights,
                   the step's own path (the library's transposed GEMV where the step takes it)
  read floor       this run's read speed (an XLA sum over 512 MiB of float32), and the device
                   step over the time that speed takes to read the model's weights once
  sampler          jaxserve's sampler alone on [1, vocab] float32 logits (greedy)
  layers           device step - lm head - sampler: the decoder layers (projections,
                   attention, norms), the embedding gather and the cache writes
and the compiled step's op count (XLA thunks a 1-row step pays a dispatch for each).
With --ops, the (1, 1) step's time by op kind, from a jax.profiler trace of the blocked
steps: each XLA thunk's own time, grouped by what it runs (a custom call by its target: the
oneDNN projections, the paged attention; a fusion or dot by its kind), and the gap between
thunks (dispatch, threads waking).
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


CONTAINERS = ("while", "conditional", "call")   # their time is their thunks' (nested)


def instruction_labels(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> what it runs: a custom call's target and the module that
    called it (`jaxserve_matmul q_proj`), else its opcode and that module."""
    labels = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?(\S+) = .*? ([\w-]+)\((.*)$", hlo_text, re.M):
        name, opcode, rest = m.groups()
        op_name = re.search(r'op_name="([^"]+)"', rest)
        where = op_name.group(1).split("/")[-2] if op_name and "/" in op_name.group(1) else ""
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            labels[name] = f"{target.group(1) if target else '?'} {where}"
        else:
            labels[name] = f"{opcode} {where}"
    return labels


def op_breakdown(run, steps: int, labels: dict[str, str]) -> dict:
    """Trace `steps` calls of run(); each XLA thunk's time per step, by label."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                run()
        [path] = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(path)
    by_label: dict[str, list[float]] = {}
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                label = labels.get(event.name)
                if label is None:
                    continue
                entry = by_label.setdefault(label, [0.0, 0])
                entry[0] += event.duration_ns / 1e6 / steps
                entry[1] += 1 / steps
    return {label: {"ms_per_step": round(ms, 3), "thunks_per_step": round(count, 1)}
            for label, (ms, count) in sorted(by_label.items(), key=lambda kv: -kv[1][0])}


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
    p.add_argument("--ops", action="store_true",
                   help="also trace the (1, 1) step and break its time down by op kind")
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
    engine = llm.llm_engine.engine_core
    runner = engine.runner
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 20000, 32).tolist()
    per_token_ms(llm, prompt, 16, 1)                         # warm every path once

    per_token = per_token_ms(llm, prompt, args.tokens, args.rounds)

    # Every step blocked and timed: the device step alone, and per token with nothing hidden.
    step_ms: dict[tuple[int, int], list[float]] = {}
    run_step = runner.run_step

    one_row_inputs = []

    def blocking_run_step(inputs):
        if (inputs.num_tokens, inputs.num_seqs) == (1, 1):
            one_row_inputs[:] = [inputs]
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
    plan = runner.plan
    if table is not None and hasattr(table, "dtype") and table.ndim == 2 \
            and table.shape == (vocab, hidden) and plan.gemv_rows >= 1 and plan.cpu_matmul:
        # The step's own path: the library's transposed GEMV on float32 rows
        from jaxserve.models.layer_matmul import small_logits

        rows = plan.gemv_rows
        lm_head = timed(jax.jit(lambda h, w: small_logits(h, w, rows)),
                        x.astype(jnp.float32), table)
    elif table is not None and hasattr(table, "dtype") and table.ndim == 2:
        if table.shape == (vocab, hidden):
            head = jax.jit(lambda h, w: jnp.einsum("th,vh->tv", h, w,
                                                   preferred_element_type=jnp.float32))
        else:
            head = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))
        lm_head = timed(head, x, table)
    logits = jnp.asarray(rng.standard_normal((1, vocab)), jnp.float32)
    greedy = timed(jax.jit(lambda z: jnp.argmax(z, axis=-1)), logits)
    # The memory's read speed in this run (a shared box's varies by the minute): an XLA sum
    # over 512 MiB of float32 -- the floor of a step that streams that many bytes.
    block = jnp.full((128 << 20,), 1.0, jnp.float32)
    read_floor = timed(jax.jit(jnp.sum), block, repeats=10)
    del block
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(runner.params))

    text = runner._steps[(1, 1)].as_text() if hasattr(runner._steps[(1, 1)], "as_text") else ""
    ops = len(re.findall(r"^\s+\S+ = \S+ (fusion|custom-call|dot|convolution|copy|"
                         r"dynamic-update-slice|dynamic-slice|gather|scatter)\(", text, re.M))
    if lm_head is not None and lm_head >= device:
        # A standalone XLA dot is not the path the step's LM head takes (the CPU step uses
        # oneDNN for bf16; emulated bf16 in XLA is far slower): no figure beats none.
        print(f"lm head alone ({lm_head:.1f} ms) >= the whole step: not the step's path; "
              "left out", file=sys.stderr)
        lm_head = None
    ops_breakdown = None
    if args.ops:
        # The same (1, 1) inputs replayed: only that executable's thunks are in the trace.
        inputs = one_row_inputs[-1]
        ops_breakdown = op_breakdown(lambda: jax.block_until_ready(run_step(inputs)), 20,
                                     instruction_labels(text))
        accounted = sum(v["ms_per_step"] for label, v in ops_breakdown.items()
                        if label not in CONTAINERS)
        for label, v in ops_breakdown.items():
            print(f"  {label:48s} {v['ms_per_step']:7.3f} ms  x{v['thunks_per_step']}")
        print(f"  {'(thunks, total; the rest of the device step is gaps)':48s} "
              f"{accounted:7.3f} ms of {device:.3f}")
    dtype_name = jnp.dtype(getattr(runner, "dtype", jnp.float32)).name
    out = {
        "machine": machine_info(),
        "model": str(engine.model_path), "dtype": dtype_name, "matrix_units": args.matrix_units,
        "quantization": args.quantization,
        "per_token_ms": per_token, "per_token_all_steps_blocked_ms": per_token_sync,
        "device_step_ms": device, "host_ms": per_token_sync - device,
        "lm_head_ms": lm_head, "sampler_greedy_ms": greedy,
        "read_gb_per_s": 512 * 2**20 / read_floor / 1e6, "weight_bytes": weight_bytes,
        "step_over_read_floor": device / (read_floor * weight_bytes / (512 * 2**20)),
        "layers_and_rest_ms": None if lm_head is None else device - lm_head - greedy,
        "tokens_per_s": 1e3 / per_token, "compiled_step_ops": ops,
        "ops_by_kind": ops_breakdown,
    }
    for key, value in out.items():
        print(f"{key:32s} {value:.2f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

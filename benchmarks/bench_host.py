"""Host time per engine step, with the device step replaced by a no-op that returns tokens.

What a fast accelerator would expose: with the model's executables swapped for a function
that hands back ready-made sampled tokens, the engine loop's own cost per step is all that
is left — scheduling, the persistent batch's input packing and host->device puts, and
output processing on the engine thread (token append, stop tokens, token deltas). The front
end's share (detokenization, stop strings, RequestOutputs: the server runs it on its asyncio
side, LLM.generate on the same thread) is timed separately. Printed per component (p50 and
mean over the measured steps) at several batch sizes, in steady decode, and written to
benchmarks/results/host-<tag>.json. "engine thread" is `EngineCore.step` (what the
server's engine thread runs; its key keeps the name `step_core` the earlier results used);
"total" adds the front end. The CPU-time line is the engine thread's CPU time: on a busy
box (other processes on the cores) it is the figure that still means something.

    python benchmarks/bench_host.py                       # 1, 64 and 256 running sequences
    python benchmarks/bench_host.py --sizes 64 --steps 400 --sync
    python benchmarks/bench_host.py --by-position --sizes 16 --output-kind delta
        # engine-thread output processing per step at 100 and 1,000 tokens produced
    python benchmarks/bench_host.py --by-position --sizes 16 --output-kind delta --penalties
        # the same with repetition / frequency / presence penalties on every request
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"


class Timed:
    """Wraps a bound method and accumulates the time of each call in the current step."""

    def __init__(self, obj, name: str, cpu: bool = False) -> None:
        self.obj, self.name = obj, name
        self.fn = getattr(obj, name)
        self.clock = time.thread_time if cpu else time.perf_counter
        self.total = 0.0
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        start = self.clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += self.clock() - start


def no_op_device(runner, vocab: int, rng: np.random.Generator) -> None:
    """Replace every bucket's executable by a function returning random tokens (device
    arrays made ahead of time, so the fake costs nothing itself)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.runner.sampler import SamplerOutput

    k = runner.num_top_logprobs
    outs: dict[int, list] = {}

    def fake(params, k_cache, v_cache, last_tokens, penalty_state, packed, *tables):
        s = runner._fake_s
        pool = outs[s]
        out = pool[runner._fake_i % len(pool)]
        runner._fake_i += 1
        # (samples, emitted counts: None without speculative decoding), no prompt logprobs
        return k_cache, v_cache, last_tokens, penalty_state, (out, None), None

    for t, s in runner.buckets.all_shapes():
        outs[s] = [jax.device_put(SamplerOutput(
            jnp.asarray(rng.integers(100, vocab - 100, s), jnp.int32),
            jnp.zeros(s, jnp.float32), jnp.ones(s, jnp.int32), jnp.zeros((s, k), jnp.int32),
            jnp.zeros((s, k), jnp.float32))) for _ in range(16)]
        runner._steps[(t, s)] = fake
    runner._fake_i = 0
    original = runner.run_step

    def run_step(inputs):
        runner._fake_s = inputs.num_seqs
        return original(inputs)

    runner.run_step = run_step


PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)


def measure(engine, num_seqs: int, steps: int, prompt_len: int, output_kind: str,
            profile: bool = False, penalties: bool = False) -> dict:
    from jaxserve import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True,
                            stop=["\n\nUser:", "<|im_end|>"],
                            output_kind=RequestOutputKind[output_kind.upper()],
                            **(PENALTIES if penalties else {}))
    rng = np.random.default_rng(num_seqs)
    for i in range(num_seqs):
        engine.add_request(f"host-{num_seqs}-{i}", None, params,
                           prompt_token_ids=rng.integers(100, 20000, prompt_len).tolist())
    scheduler = engine.engine_core.scheduler
    while scheduler.num_waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
        engine.step()                          # admit and prefill everything first
    for _ in range(4):
        engine.step()
    timers = start_timers(engine)
    per_step = {name: [] for name in [*timers, "engine thread (step_core)", "total",
                                      "engine thread CPU time"]}
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for _ in range(steps):
        timed_step(engine, timers, per_step)
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    stop_timers(timers)
    engine.abort_request([f"host-{num_seqs}-{i}" for i in range(num_seqs)])
    while engine.has_unfinished_requests():
        engine.step()
    return {name: {"p50_ms": 1000 * float(np.median(v)), "mean_ms": 1000 * float(np.mean(v))}
            for name, v in per_step.items()}


ENGINE_OUTPUT_PROCESSING = ["update_from_output (append tokens)",
                            "process_token (stop tokens, logprobs)", "drain (token deltas)"]


def start_timers(engine) -> dict:
    core, front = engine.engine_core, engine.output_processor
    return {"schedule": Timed(core.scheduler, "schedule"),
            "execute (apply diffs, pack, put, dispatch)": Timed(core.runner, "execute"),
            "collect (wait for the step, then the three below)": Timed(core, "_collect"),
            ENGINE_OUTPUT_PROCESSING[0]: Timed(core.scheduler, "update_from_output"),
            ENGINE_OUTPUT_PROCESSING[1]: Timed(core.requests, "process_token"),
            ENGINE_OUTPUT_PROCESSING[2]: Timed(core.requests, "drain"),
            "front end (text, stop strings, RequestOutputs)": Timed(front, "process_outputs"),
            "front end CPU time": Timed(front, "process_outputs", cpu=True)}


def stop_timers(timers: dict) -> None:
    for t in reversed(timers.values()):          # the last wrapper first
        setattr(t.obj, t.name, t.fn)


def timed_step(engine, timers: dict, per_step: dict) -> None:
    """One `engine.step()`; appends each component's time (and the totals) to per_step."""
    before = {name: t.total for name, t in timers.items()}
    core = Timed(engine.engine_core, "step")
    core_cpu = Timed(engine.engine_core, "step", cpu=True)      # wraps the wall-time wrapper
    start = time.perf_counter()
    engine.step()
    per_step["total"].append(time.perf_counter() - start)
    setattr(engine.engine_core, "step", core.fn)       # core_cpu wraps core: drop both
    per_step["engine thread (step_core)"].append(core.total)
    per_step["engine thread CPU time"].append(core_cpu.total)
    for name, t in timers.items():
        per_step[name].append(t.total - before[name])


def measure_by_position(engine, num_seqs: int, positions: list[int], window: int,
                        prompt_len: int, output_kind: str, penalties: bool = False) -> dict:
    """Per-step times while every sequence has produced about `position` tokens, for each
    position: the engine thread's output processing must not grow with it."""
    from jaxserve import RequestOutputKind, SamplingParams

    last = max(positions) + window
    params = SamplingParams(temperature=0.0, max_tokens=last + 64, ignore_eos=True,
                            stop=["\n\nUser:", "<|im_end|>"],
                            output_kind=RequestOutputKind[output_kind.upper()],
                            **(PENALTIES if penalties else {}))
    rng = np.random.default_rng(num_seqs)
    ids = [f"pos-{num_seqs}-{i}" for i in range(num_seqs)]
    for request_id in ids:
        engine.add_request(request_id, None, params,
                           prompt_token_ids=rng.integers(100, 20000, prompt_len).tolist())
    timers = start_timers(engine)
    names = [*timers, "engine thread (step_core)", "total", "engine thread CPU time"]
    results = {}
    for position in sorted(positions):
        while engine.engine_core.scheduler.num_waiting or min(
                s.num_output_tokens for s in engine.engine_core.scheduler.running) < position:
            engine.step()
        per_step = {name: [] for name in names}
        for _ in range(window):
            timed_step(engine, timers, per_step)
        results[str(position)] = {name: {"p50_ms": 1000 * float(np.median(v)),
                                         "mean_ms": 1000 * float(np.mean(v))}
                                  for name, v in per_step.items()}
    stop_timers(timers)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--sync", action="store_true", help="async scheduling off")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--output-kind", default="final_only",
                        choices=["final_only", "delta", "cumulative"],
                        help="final_only is LLM.generate's; the server streams")
    parser.add_argument("--by-position", action="store_true",
                        help="time steps at 100 and 1,000 tokens produced (--positions)")
    parser.add_argument("--positions", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--window", type=int, default=50, help="steps timed per position")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="0: just enough for the steps")
    parser.add_argument("--penalties", action="store_true",
                        help="every request uses repetition, frequency and presence penalties")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of the measured steps (timings then include it)")
    args = parser.parse_args()

    from jaxserve.config import EngineConfig
    from jaxserve.engine.core import EngineCore
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.runner.model_runner import ModelRunner

    ModelRunner.warmup = lambda self, *a, **k: 0.0   # the executables are replaced anyway
    max_seqs = max(args.sizes)
    steps = max(args.positions) + args.window if args.by_position else args.steps
    config = EngineConfig.from_kwargs(
        max_num_seqs=max_seqs, max_num_batched_tokens=max(512, max_seqs),
        max_model_len=args.max_model_len or args.prompt_len + steps + 128,
        disable_log_stats=True,
        kv_cache_memory_bytes=(max_seqs * (args.prompt_len + steps + 96)) * 30 * 1536,
        async_scheduling=not args.sync)
    engine = LLMEngine(EngineCore(config))
    no_op_device(engine.engine_core.runner, len(engine.tokenizer), np.random.default_rng(0))
    results = {"machine": {"platform": platform.platform(), "python": platform.python_version()},
               "async_scheduling": not args.sync, "steps": args.steps,
               "output_kind": args.output_kind, "penalties": args.penalties, "sizes": {}}
    if args.by_position:
        print_by_position(engine, args)
        return
    for size in args.sizes:
        stats = measure(engine, size, args.steps, args.prompt_len, args.output_kind, args.profile,
                        args.penalties)
        results["sizes"][str(size)] = stats
        print(f"\n{size} running sequences ({'sync' if args.sync else 'async'}, "
              f"{args.output_kind} outputs), ms per step:")
        for name, value in stats.items():
            print(f"  {name:44s} p50 {value['p50_ms']:7.3f}   mean {value['mean_ms']:7.3f}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / (f"host-{args.tag}-{args.output_kind}{'-sync' if args.sync else ''}"
                      f"{'-penalties' if args.penalties else ''}.json")
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {path}")


def print_by_position(engine, args) -> None:
    for size in args.sizes:
        results = measure_by_position(engine, size, args.positions, args.window,
                                      args.prompt_len, args.output_kind, args.penalties)
        print(f"\n{size} running sequences ({args.output_kind} outputs"
              f"{', penalties' if args.penalties else ''}), p50 ms per step, by tokens produced:")
        print(f"  {'':48s}" + "".join(f"{p:>10d}" for p in args.positions))
        for name in results[str(args.positions[0])]:
            print(f"  {name:48s}" + "".join(
                f"{results[str(p)][name]['p50_ms']:10.3f}" for p in args.positions))
        base, top = (sum(results[str(p)][name]["p50_ms"] for name in ENGINE_OUTPUT_PROCESSING)
                     for p in (min(args.positions), max(args.positions)))
        print(f"  engine-thread output processing (the three above) at {max(args.positions)} / at "
              f"{min(args.positions)} tokens: {top / base:.3f}")
        for name in ("execute (apply diffs, pack, put, dispatch)", "engine thread (step_core)"):
            low, high = (results[str(p)][name]["p50_ms"]
                         for p in (min(args.positions), max(args.positions)))
            print(f"  {name} at {max(args.positions)} / at {min(args.positions)} tokens: "
                  f"{high / low:.3f}")
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / (f"host-by-position-{args.tag}-{args.output_kind}-s{size}"
                          f"{'-penalties' if args.penalties else ''}.json")
        path.write_text(json.dumps({
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "max_model_len": engine.engine_core.runner.max_model_len,
            "penalties": args.penalties, "output_kind": args.output_kind, "window": args.window,
            "positions": results}, indent=2) + "\n")
        print(f"  wrote {path}")


if __name__ == "__main__":
    main()

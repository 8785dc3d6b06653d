"""The served benchmark's schedule, simulated: the real Scheduler, a step-cost model, a client.

`vllm bench serve --max-concurrency C` against a server is a closed loop: C requests in
flight, a new one sent the moment one finishes. What its throughput, TTFT and TPOT come out
as depends on the machine (what a step of T tokens costs) and on the scheduler (how prompt
chunks mix with decodes). This script keeps the second and models the first, so prefill
policies can be compared in seconds and without the noise of a shared 2-core box: the
scheduler is jaxserve's own (engine/scheduler.py, with its time-bound prefill cap fed by the
modelled costs through StepCosts), one step at a time, each costing `cost_ms(T)`.

The cost model is piecewise linear in the step's token bucket between measured points
(--costs "tokens:ms,..."); the default points were measured on the 2-core AVX512-BF16 EPYC
(SmolLM2-135M, bf16, quiet box): 1 row 8.7 ms, 64 rows 120 ms, 512 tokens 362 ms.

    python benchmarks/sim_served_schedule.py                        # default policy
    python benchmarks/sim_served_schedule.py --prefill-budget 0     # never capped
    python benchmarks/sim_served_schedule.py --compare              # a table of policies

Numbers are a model's, for comparing policies; the served benchmark is the measurement.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.config import SchedulerConfig  # noqa: E402
from jaxserve.engine.block_manager import BlockManager  # noqa: E402
from jaxserve.engine.scheduler import Scheduler  # noqa: E402
from jaxserve.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from jaxserve.engine.step_costs import StepCosts  # noqa: E402
from jaxserve.runner.buckets import next_power_of_2  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

DEFAULT_COSTS = "1:8.7,64:120,512:362"


@dataclass
class StepCostModel:
    """Milliseconds of a step by its token bucket, linear between measured points."""
    points: list[tuple[int, float]]

    @classmethod
    def parse(cls, text: str) -> StepCostModel:
        points = sorted((int(t), float(ms)) for t, ms in
                        (item.split(":") for item in text.split(",")))
        return cls(points)

    def cost_ms(self, num_tokens: int) -> float:
        bucket = next_power_of_2(num_tokens)
        xs = [t for t, _ in self.points]
        i = bisect.bisect_left(xs, bucket)
        if i < len(xs) and xs[i] == bucket:
            return self.points[i][1]
        if i == 0:
            return self.points[0][1]
        if i == len(xs):      # above the last point: proportional to tokens
            t, ms = self.points[-1]
            return ms * bucket / t
        (t0, c0), (t1, c1) = self.points[i - 1], self.points[i]
        return c0 + (c1 - c0) * (bucket - t0) / (t1 - t0)


def simulate(costs: StepCostModel, *, num_prompts: int = 256, concurrency: int = 64,
             input_len: int = 128, output_len: int = 128, max_num_seqs: int = 64,
             max_num_batched_tokens: int = 512, prefill_budget: int | None = None,
             block_size: int = 16) -> dict:
    """Run the closed loop to the end; returns throughput and latency percentiles (ms)."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             prefill_budget_while_decoding=prefill_budget)
    blocks = (concurrency + 1) * ((input_len + output_len) // block_size + 2)
    scheduler = Scheduler(config, BlockManager(blocks, block_size, False),
                          input_len + output_len + 1)
    scheduler.step_costs = step_costs = StepCosts()
    rng = np.random.default_rng(0)
    now = 0.0
    sent = 0
    arrival: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}

    def send() -> None:
        nonlocal sent
        request_id = f"r{sent}"
        sent += 1
        prompt = rng.integers(100, 20000, input_len).tolist()
        scheduler.add_seq(Sequence(request_id, prompt, SamplingParams(max_tokens=output_len)))
        arrival[request_id] = now
        token_times[request_id] = []

    for _ in range(min(concurrency, num_prompts)):
        send()
    num_steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        seconds = costs.cost_ms(out.total_num_scheduled_tokens) / 1000
        step_costs.record(out.total_num_scheduled_tokens, seconds)
        now += seconds
        num_steps += 1
        for _, seq in scheduler.update_from_output(out, [0] * out.num_rows):
            token_times[seq.request_id].append(now)
            if seq.num_tokens - seq.num_prompt_tokens >= output_len:
                scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                if sent < num_prompts:
                    send()
    ttft = [times[0] - arrival[r] for r, times in token_times.items()]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times.values()]
    itl = np.concatenate([np.diff(times) for times in token_times.values()])
    pct = lambda xs, q: float(np.percentile(xs, q) * 1000)   # noqa: E731
    return {"output_throughput": num_prompts * output_len / now, "duration_s": now,
            "steps": num_steps,
            "median_ttft_ms": pct(ttft, 50), "p99_ttft_ms": pct(ttft, 99),
            "median_tpot_ms": pct(tpot, 50), "p99_tpot_ms": pct(tpot, 99),
            "median_itl_ms": pct(itl, 50), "p99_itl_ms": pct(itl, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--costs", default=DEFAULT_COSTS, help="tokens:ms,... measured step costs")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="prefill_budget_while_decoding (default: the time-bound auto cap)")
    p.add_argument("--compare", action="store_true", help="a table of prefill policies")
    args = p.parse_args()
    costs = StepCostModel.parse(args.costs)
    common = dict(num_prompts=args.num_prompts, concurrency=args.concurrency,
                  input_len=args.input_len, output_len=args.output_len,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    if not args.compare:
        print(json.dumps(simulate(costs, prefill_budget=args.prefill_budget, **common),
                         indent=1))
        return
    print(f"{'policy':<22}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>6}"
          f"{'ITL p50':>9}{'p99':>6}")
    for name, budget in [("auto (time bound)", None), ("uncapped (0)", 0), ("64", 64),
                         ("128", 128), ("256", 256)]:
        r = simulate(costs, prefill_budget=budget, **common)
        print(f"{name:<22}{r['output_throughput']:>8.0f}{r['median_ttft_ms']:>10.0f}"
              f"{r['p99_ttft_ms']:>8.0f}{r['median_tpot_ms']:>10.0f}{r['p99_tpot_ms']:>6.0f}"
              f"{r['median_itl_ms']:>9.0f}{r['p99_itl_ms']:>6.0f}")


if __name__ == "__main__":
    main()

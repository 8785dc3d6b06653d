"""What a step costs, measured, and the auto prefill cap built on it.

A stream's inter-token latency is the time between the steps that carry its tokens, so
a step that also prefills a prompt stalls every running stream for as long as it takes.
How long a step of T tokens takes depends on the machine far more than on T: on a CPU a
step costs about its token count (compute bound), so a 512-token prefill step is ~10 decode
steps of a few rows; on a GPU anything up to a few hundred tokens costs about one decode
step (weight reads bound). A cap in tokens is therefore wrong on one of them: too loose
on a CPU (p99 ITL 4-8x the median with prompts arriving among streams), too tight on a GPU
(prefill trickles in while the matrix units idle).

So the auto cap (``prefill_budget_while_decoding=None``) is a bound on *time*: while
decodes run, a step may hold as many tokens as the largest token bucket whose measured
cost is at most ``STEP_COST_RATIO`` x the cost of a decode-only step of the rows that
will run once the waiting prompts are in (min(decodes + waiting, max_num_seqs)). Measured
against those rows, not today's few decodes, because that is the step the streams will
see from now on: a wave of 64 prompts arriving behind 4 streams is admitted in steps near
2.5 decode steps of 64 rows, not trickled in at 2.5 steps of 4 (a wave's last first
token waited 60 s that way; benchmarks/results/vs-vllm-probe-policy.json).

`StepCosts` learns costs from the steps themselves (`EngineCore._collect`: the time
between consecutive step results, which is what a stream's client sees), a short median
per bucket, the first sample of each dropped (cold caches, a late compile). A bucket not
measured yet is estimated from its measured neighbours. Before anything is measured the
rule is the token one it replaced: the bucket of max(2 x decodes, 32), or the whole budget
when several prompts wait.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

from jaxserve.runner.buckets import next_power_of_2, token_buckets

# A step with prefill may cost this many decode-only steps: the p99 inter-token latency of
# streams with prompts arriving among them stays under 3x the median (issue 29's bound),
# with room for the timing noise of a shared host.
STEP_COST_RATIO = 2.5
_WINDOW = 5     # recent samples per bucket; the median shrugs off a GC pause or a compile


class StepCosts:
    """Recent wall time of a step per token bucket (seconds)."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}     # bucket -> median of its window
        self._buckets: list[int] = []            # measured buckets, ascending
        self._last_result = 0.0                  # perf_counter of the previous step's result

    def record_result(self, num_tokens: int, dispatched: float, ready: float) -> None:
        """A step's result arrived at `ready` (perf_counter): its cost as the streams see it
        runs from its dispatch, or from the previous result if it was queued behind that
        step (two in flight), to its result."""
        self.record(num_tokens, ready - max(dispatched, self._last_result))
        self._last_result = ready

    def record(self, num_tokens: int, seconds: float) -> None:
        bucket = next_power_of_2(num_tokens)
        window = self._samples.get(bucket)
        if window is None:            # the first sample of a bucket only opens its window
            self._samples[bucket] = deque(maxlen=_WINDOW)
            return
        window.append(seconds)
        if bucket not in self._medians:
            bisect.insort(self._buckets, bucket)
        self._medians[bucket] = statistics.median(window)

    def estimate(self, bucket: int) -> float | None:
        """Seconds a step of this token bucket takes: measured, else from its measured
        neighbours (linear in tokens between two, proportional to tokens above the largest,
        the smallest's cost below it); None before anything is measured."""
        buckets = self._buckets
        if not buckets:
            return None
        cost = self._medians.get(bucket)
        if cost is not None:
            return cost
        i = bisect.bisect_left(buckets, bucket)
        if i == 0:
            return self._medians[buckets[0]]
        lo = buckets[i - 1]
        if i == len(buckets):
            return self._medians[lo] * bucket / lo
        hi = buckets[i]
        c_lo, c_hi = self._medians[lo], self._medians[hi]
        return c_lo + (c_hi - c_lo) * (bucket - lo) / (hi - lo)

    def largest_bucket_within(self, seconds: float, max_tokens: int) -> int:
        """The largest power-of-two bucket (at most max_tokens rounded up) estimated to take
        at most `seconds`; 1 if none is."""
        best = 1
        for bucket in token_buckets(max_tokens):     # the runner's buckets, ascending
            cost = self.estimate(bucket)
            if cost is None or cost > seconds:
                break
            best = bucket
        return best

    def snapshot(self) -> dict[int, float]:
        """bucket -> measured median seconds (for logs and benchmarks)."""
        return dict(self._medians)


def auto_step_tokens(costs: StepCosts | None, num_decodes: int, num_waiting: int,
                     max_num_seqs: int, budget: int) -> int:
    """Most tokens (decodes included) a step may hold while `num_decodes` decodes run and
    `num_waiting` prompts wait: see the module docstring."""
    token_rule = next_power_of_2(max(2 * num_decodes, 32))
    rows = min(num_decodes + num_waiting, max_num_seqs)
    decode_cost = costs.estimate(next_power_of_2(rows)) if costs is not None else None
    if decode_cost is None:
        return budget if num_waiting > 1 else token_rule
    # A long step is paid by the streams and buys first tokens for the waiting prompts: when
    # these outnumber the streams, it may be that many times longer.
    ratio = STEP_COST_RATIO * max(1.0, num_waiting / num_decodes)
    return max(token_rule, costs.largest_bucket_within(ratio * decode_cost, budget))

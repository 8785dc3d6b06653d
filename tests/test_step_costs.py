"""The auto prefill cap is a bound on time: what steps cost is learned from the steps, and
a step with prefill may cost about 2.5 decode steps of the rows that will run (more when
waiting prompts outnumber the streams). Checked on a CPU-like cost curve (a step costs
about its tokens) and a GPU-like one (flat up to hundreds of tokens)."""

from __future__ import annotations

import pytest

from jaxserve.engine.step_costs import STEP_COST_RATIO, StepCosts, auto_step_tokens
from tests.test_scheduler import make_scheduler, make_seq, planned, step

pytestmark = pytest.mark.fast


def learned(cost_of, buckets) -> StepCosts:
    """StepCosts that have seen three steps of each bucket cost cost_of(bucket)."""
    costs = StepCosts()
    for bucket in buckets:
        for _ in range(3):
            costs.record(bucket, cost_of(bucket))
    return costs


def cpu_cost(tokens: int) -> float:       # 50 ms of weight reads + 2 ms per token
    return 0.050 + 0.002 * tokens


def gpu_cost(tokens: int) -> float:       # flat until 1024 tokens fill the matrix units
    return 0.010 * max(1.0, tokens / 1024)


def test_costs_are_a_median_of_recent_steps_without_the_first():
    costs = StepCosts()
    assert costs.estimate(64) is None
    costs.record(60, 9.0)                          # bucket 64's first step: a late compile
    assert costs.estimate(64) is None and costs.snapshot() == {}
    for seconds in (0.10, 0.30, 0.12):             # one GC pause among them
        costs.record(64, seconds)
    assert costs.estimate(64) == pytest.approx(0.12)
    for seconds in (0.2, 0.2, 0.2):                # the window moves on
        costs.record(33, seconds)
    assert costs.estimate(64) == pytest.approx(0.2)


def test_unmeasured_buckets_are_estimated_from_measured_neighbours():
    costs = learned(cpu_cost, [16, 64, 512])
    assert costs.estimate(32) == pytest.approx(cpu_cost(16) + (cpu_cost(64) - cpu_cost(16)) / 3)
    assert costs.estimate(1024) == pytest.approx(cpu_cost(512) * 2)   # above: by tokens
    assert costs.estimate(4) == pytest.approx(cpu_cost(16))           # below: no cheaper
    assert costs.largest_bucket_within(cpu_cost(64) * 2.5, 512) == 128
    assert costs.largest_bucket_within(0.001, 512) == 1


@pytest.mark.parametrize("cost_of, bucket", [(cpu_cost, 128), (gpu_cost, 512)])
def test_a_prompt_arriving_among_63_streams_gets_what_fits_in_the_time_bound(cost_of, bucket):
    """The rows that will run: 64. CPU: 2.5 decode steps of 64 rows (445 ms) hold a
    128-token step (306 ms; 256 would be 562 ms); GPU: the whole budget costs one decode step.
    """
    scheduler = make_scheduler(num_blocks=2048, max_num_seqs=128, max_num_batched_tokens=512,
                               max_model_len=1024)
    scheduler.step_costs = learned(cost_of, [1, 64, 512])
    for i in range(63):
        scheduler.add_seq(make_seq([i], f"d{i}"))
    step(scheduler)                                # 63 one-token prompts: streams from now on
    scheduler.add_seq(make_seq(range(1000, 1800), "p"))
    plan = dict(planned(step(scheduler)))
    assert plan["p"] == bucket - 63
    assert cost_of(sum(plan.values())) <= STEP_COST_RATIO * cost_of(64)


def test_a_wave_behind_a_few_streams_is_admitted_in_larger_steps_than_one_prompt():
    """4 streams and 60 waiting prompts: the bound is against a step of 64 rows (the rows
    that will run), times 60/4 since the waiting outnumber the streams: the whole budget;
    one waiting prompt behind 4 streams gets 2.5 steps of 5 rows' bucket (8)."""
    budget = 512
    costs = learned(cpu_cost, [8, 64, 512])
    assert auto_step_tokens(costs, 4, 60, 256, budget) == budget
    alone = auto_step_tokens(costs, 4, 1, 256, budget)
    assert cpu_cost(alone) <= STEP_COST_RATIO * cpu_cost(8) < cpu_cost(2 * alone)
    assert alone == 32                             # the token rule's floor: max(2 x 4, 32)
    # 32 streams and 32 waiting: no weighting, 2.5 decode steps of 64 rows.
    assert auto_step_tokens(costs, 32, 32, 256, budget) == 128


def test_before_any_step_is_measured_the_token_rule_holds():
    assert auto_step_tokens(StepCosts(), 16, 1, 256, 512) == 32
    assert auto_step_tokens(None, 40, 1, 256, 512) == 128
    assert auto_step_tokens(StepCosts(), 16, 5, 256, 512) == 512    # a burst: the budget


def test_a_step_queued_behind_another_costs_from_that_ones_result():
    """Two in flight: the second step waits for the first; its cost starts at the first's
    result, not at its own dispatch (that would count the first step twice)."""
    costs = StepCosts()
    for i in range(3):      # (dispatch, result) in seconds: both dispatched at t, in order
        t = 10.0 * i
        costs.record_result(1, t, t + 0.030)           # one row
        costs.record_result(64, t, t + 0.030 + 0.170)  # queued behind it: 170 ms of its own
    assert costs.estimate(1) == pytest.approx(0.030)
    assert costs.estimate(64) == pytest.approx(0.170)

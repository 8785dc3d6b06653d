"""How many calls dtype=auto's whole-step timing makes (engine/dtype_step_timing.py
`fastest_until_decided`): few where the choice is clear, every round near the flip, and only
the row counts that can decide it after the first rounds. A fake clock stands in for the
CPU: each call advances it by its program's time in that round."""

from __future__ import annotations

import pytest

from jaxserve.engine import dtype_step_timing
from jaxserve.engine.compute_dtype import choose_by_step_times, decision_margin


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.calls: list[tuple[int, str]] = []

    def perf_counter(self) -> float:
        return self.now

    def call(self, key: tuple[int, str], ms_by_round: list[float]):
        def run():
            made = sum(1 for k in self.calls if k == key)
            self.calls.append(key)
            # the first (untimed) call is slow; then the listed times, the last repeated
            timed = made - 1
            self.now += 1.0 if timed < 0 else ms_by_round[min(timed, len(ms_by_round) - 1)] / 1e3
            return 0
        return run


def _timed(per_call: dict[tuple[int, str], list[float]]):
    clock = FakeClock()
    calls = {key: clock.call(key, ms) for key, ms in per_call.items()}
    best = dtype_step_timing.fastest_until_decided(calls, {"float32": 1.0, "bfloat16": 1.0},
                                                   clock.perf_counter)
    rounds = {key: clock.calls.count(key) - 1 for key in per_call}
    return best, rounds


@pytest.mark.fast
def test_a_clear_choice_stops_after_the_first_rounds():
    # an AVX2 CPU's shape: float32 1.48x slower at one stream, bfloat16 1.19x at 16 rows
    per_call = {(1, "float32"): [34.0], (1, "bfloat16"): [23.0],
                (4, "float32"): [50.0], (4, "bfloat16"): [37.0],
                (16, "float32"): [111.0], (16, "bfloat16"): [132.0],
                (64, "float32"): [337.0], (64, "bfloat16"): [357.0]}
    best, rounds = _timed(per_call)
    assert set(rounds.values()) == {dtype_step_timing.MIN_ROUNDS}
    timings = {r: (t["float32"], t["bfloat16"]) for r, t in best.items()}
    assert timings[1] == pytest.approx((34.0, 23.0))
    assert choose_by_step_times(timings).dtype == "bfloat16"


@pytest.mark.fast
def test_a_clear_choice_on_calls_that_disagree_takes_more_rounds():
    # the same clear shape, but bfloat16's 16-row calls vary by 20 % (a busy neighbour):
    # only the row counts near a dtype's worst (1 and 16 rows) are called again, until two
    # calls agree within CONFIRMED
    per_call = {(1, "float32"): [34.0], (1, "bfloat16"): [23.0],
                (4, "float32"): [40.0], (4, "bfloat16"): [37.0],
                (16, "float32"): [111.0], (16, "bfloat16"): [160.0, 132.0, 150.0, 133.0],
                (64, "float32"): [337.0], (64, "bfloat16"): [357.0]}
    best, rounds = _timed(per_call)
    assert rounds[16, "bfloat16"] == rounds[1, "float32"] == 4
    assert rounds[4, "float32"] == rounds[64, "bfloat16"] == dtype_step_timing.MIN_ROUNDS
    assert best[16]["bfloat16"] == pytest.approx(132.0)


@pytest.mark.fast
def test_near_the_flip_the_deciding_row_counts_get_every_round():
    # float32 1.31-1.40x slower at one row, bfloat16 1.37x at 64 rows: within a few % of
    # the flip; 4 and 16 rows are far from either dtype's worst and are not timed again.
    # Later calls run faster (a neighbour's job ended): the fastest call is what is kept.
    per_call = {(1, "float32"): [30.0, 29.0, 28.0], (1, "bfloat16"): [21.4],
                (4, "float32"): [71.0], (4, "bfloat16"): [70.0],
                (16, "float32"): [120.0], (16, "bfloat16"): [118.0],
                (64, "float32"): [1239.0], (64, "bfloat16"): [1710.0, 1700.0]}
    best, rounds = _timed(per_call)
    assert rounds[1, "float32"] == rounds[64, "bfloat16"] == dtype_step_timing.MAX_ROUNDS
    assert rounds[4, "float32"] == rounds[16, "bfloat16"] == dtype_step_timing.MIN_ROUNDS
    assert best[1]["float32"] == pytest.approx(28.0)
    assert best[64]["bfloat16"] == pytest.approx(1700.0)
    timings = {r: (t["float32"], t["bfloat16"]) for r, t in best.items()}
    assert decision_margin(timings) < dtype_step_timing.DECISIVE


@pytest.mark.fast
def test_the_decision_margin_is_one_at_the_flip_and_symmetric():
    assert decision_margin({1: (10.0, 10.0)}) == pytest.approx(1.03)    # float32 tie
    flip = {1: (13.0, 10.0), 64: (100.0, 130.0)}      # both lose 1.3x at their worst
    assert decision_margin(flip) == pytest.approx(1.0)
    assert decision_margin({1: (15.0, 10.0), 64: (100.0, 130.0)}) == pytest.approx(15 / 13)
    assert decision_margin({1: (11.0, 10.0), 64: (100.0, 130.0)}) == pytest.approx(13 / 11)


@pytest.mark.fast
def test_one_compiled_program_runs_the_branch_each_call_names():
    """The timings' programs (kernels/cpu/timings.py `branch_calls`): one compile, a call
    per branch, each running its own branch on the shared arguments."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.cpu.timings import branch_calls, filled

    def branch(rows, x, scale):
        return jnp.sum(x[:rows]) * scale

    def switch(index, x, scale):
        return jax.lax.switch(index, [functools.partial(branch, r) for r in (1, 3, 4)],
                              x, scale)

    x = filled((4, 2), 0.5, jnp.float32)
    calls = branch_calls(switch, 3, (x, jnp.float32(2.0)), ["one", "three", "four"])
    assert {name: float(call()) for name, call in calls.items()} == \
        {"one": 2.0, "three": 6.0, "four": 8.0}

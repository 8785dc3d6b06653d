"""The served-benchmark tools: the schedule simulator (the real Scheduler under a step-cost
model and a closed-loop client) and the per-thread CPU accounting of bench_vs_vllm."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from cpu_accounting import ProcessGroupCpu, cpu_split  # noqa: E402
from sim_served_schedule import StepCostModel, simulate  # noqa: E402

pytestmark = pytest.mark.fast


def test_step_cost_model_interpolates_by_bucket_and_scales_above_the_last_point():
    costs = StepCostModel.parse("1:10,64:100,512:400")
    assert costs.cost_ms(1) == 10
    assert costs.cost_ms(40) == pytest.approx(10 + 90 * (64 - 1) / 63)   # bucket 64
    assert costs.cost_ms(128) == pytest.approx(100 + 300 * 64 / 448)
    assert costs.cost_ms(1024) == pytest.approx(800)


def test_simulated_closed_loop_finishes_every_request_within_the_step_cost_bounds():
    costs = StepCostModel.parse("1:10,64:100,512:400")
    result = simulate(costs, num_prompts=24, concurrency=8, input_len=32, output_len=16,
                      max_num_seqs=8, max_num_batched_tokens=64)
    # Every token of every request came out: no step can carry more than 8 decodes, each
    # step costs at least the 8-row bucket's time, so the rate is bounded by that.
    assert result["output_throughput"] * result["duration_s"] == pytest.approx(24 * 16)
    assert result["output_throughput"] <= 8 / (costs.cost_ms(8) / 1000) + 1e-6
    # The first wave's last prompt waits for all 8 x 32 prompt tokens: 4 full 64-token steps.
    assert result["p99_ttft_ms"] >= 3 * costs.cost_ms(64)
    assert result["median_itl_ms"] <= result["p99_itl_ms"]


def test_uncapped_prefill_never_lowers_simulated_throughput_below_a_tiny_cap():
    costs = StepCostModel.parse("1:8.7,64:110,512:362")
    common = dict(num_prompts=64, concurrency=16, input_len=128, output_len=32,
                  max_num_seqs=16)
    uncapped = simulate(costs, prefill_budget=0, **common)
    trickle = simulate(costs, prefill_budget=16, **common)
    assert uncapped["output_throughput"] > trickle["output_throughput"]
    assert uncapped["p99_ttft_ms"] < trickle["p99_ttft_ms"]


def test_process_group_cpu_counts_a_busy_child_and_its_share_of_the_box():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.process_time() + 0.4\n"
         "while time.process_time() < end: pass\ntime.sleep(30)"],
        start_new_session=True)
    try:
        cpu = ProcessGroupCpu(child.pid)
        before = {}        # from its start: all of its CPU time counts
        start = time.perf_counter()
        deadline = start + 20
        split = cpu_split(before, cpu.read(), 1.0)
        while split["server_cpu_s"] < 0.35 and time.perf_counter() < deadline:
            time.sleep(0.05)
            split = cpu_split(before, cpu.read(), 1.0)
        assert split["server_cpu_s"] >= 0.35
        assert split["server_cores"] == split["server_cpu_s"]     # over 1 s of wall time
        # /proc's thread name is the executable's, cut to 15 characters
        assert split["by_thread_name"][Path(sys.executable).name[:15]] >= 0.35
    finally:
        child.kill()
        child.wait()
    assert ProcessGroupCpu(child.pid).read() == {}     # gone: nothing left to read


def test_served_comparison_refuses_a_port_something_else_answers_on():
    import socket

    from bench_vs_vllm import port_in_use

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_in_use(port)
    assert not port_in_use(port)

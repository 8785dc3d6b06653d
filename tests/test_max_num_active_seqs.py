"""--max-num-active-seqs caps RUNNING sequences independently of --max-num-seqs, and
--enforce-eager compiles step buckets on first use instead of at start."""

from __future__ import annotations

import pytest

try:                                    # tests/ as a package or as a plain directory
    from tests import precision
    from tests.test_scheduler import make_scheduler, make_seq, planned, step
except ImportError:
    import precision
    from test_scheduler import make_scheduler, make_seq, planned, step

from jaxserve import LLM, SamplingParams
from jaxserve.engine.sequence import SequenceStatus


@pytest.mark.fast
def test_active_cap_admits_only_that_many_and_the_next_when_one_finishes():
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64,
                               max_num_active_seqs=2)
    for name in "abcde":
        scheduler.add_seq(make_seq(range(3), name))
    assert [name for name, _ in planned(step(scheduler))] == ["a", "b"]
    assert scheduler.num_running == 2 and scheduler.num_held_by_active_cap == 3
    scheduler.finish_seq(scheduler.running[0], SequenceStatus.FINISHED_STOPPED)
    assert planned(step(scheduler)) == [("b", 1), ("c", 3)]
    # Without the cap, max_num_seqs alone decides.
    uncapped = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    for name in "abcde":
        uncapped.add_seq(make_seq(range(3), name))
    step(uncapped)
    assert uncapped.num_running == 5 and uncapped.num_held_by_active_cap == 0
    assert uncapped.max_num_active_seqs == 8


@pytest.mark.fast
def test_a_preempted_sequence_is_readmitted_before_newer_ones_under_the_cap():
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_model_len=8,
                               max_num_batched_tokens=16, enable_prefix_caching=False,
                               max_num_active_seqs=2)
    a, b = make_seq([1, 2, 3, 4], "a"), make_seq([5, 6, 7, 8], "b")
    scheduler.add_seq(a)
    scheduler.add_seq(b)
    step(scheduler)
    scheduler.add_seq(make_seq([1], "c"))
    out = step(scheduler)                   # "a" grows: "b" is preempted
    assert out.preempted_seq_ids == [b.seq_id]
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"]
    scheduler.finish_seq(a, SequenceStatus.FINISHED_STOPPED)
    step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["b", "c"]


def test_engine_runs_at_most_the_cap_with_the_same_tokens_and_compiles_lazily(
        make_tiny_model):
    prompts = [[5 + i, 17, 23 + i, 42, 7] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=4 << 20, **precision.EXACT)
    capped = LLM(str(make_tiny_model("llama")), max_num_active_seqs=2, enforce_eager=True,
                 **common)
    engine = capped.llm_engine
    runner = engine.engine_core.runner
    # --enforce-eager: the largest and the one-token buckets only, the rest on first use.
    assert len(runner.buckets.all_shapes()) > 2
    assert runner.compiled_shapes == sorted({runner.buckets.all_shapes()[0],
                                             runner.buckets.all_shapes()[-1]})
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    finals, most_running, held = {}, 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        snapshot = engine.snapshot()
        most_running = max(most_running, snapshot.num_running)
        held.append(snapshot.num_held_by_active_cap)
    assert most_running == 2 and max(held) == 4
    assert runner.buckets.seq_cap == 8        # the batch window is still --max-num-seqs
    assert engine.snapshot().max_num_active_seqs == 2
    assert len(runner.compiled_shapes) > 2          # compiled as steps needed them
    reference = LLM(str(make_tiny_model("llama")), **common).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [finals[f"r{i}"] for i in range(6)] == [r.outputs[0].token_ids for r in reference]

"""Scheduler: continuous batching, chunked prefill, preemption, finishing and aborts; and
the scheduler -> runner contract (the runner's persistent batch) under async scheduling."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxserve.config import SchedulerConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.runner.buckets import BucketPolicy, next_power_of_2
from jaxserve.runner.input_batch import InputBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_contract import SchedulerOutput
from jaxserve.step_inputs import StepLayout

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

_NAMES: dict[int, str] = {}     # seq id -> request id, for readable plans


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                   max_model_len=32, enable_chunked_prefill=True, enable_prefix_caching=True,
                   **extra):
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=enable_chunked_prefill, **extra)
    block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(config, block_manager, max_model_len)


def make_seq(tokens, request_id="r", **kwargs) -> Sequence:
    seq = Sequence(request_id, list(tokens), sampling_params=SamplingParams(), **kwargs)
    _NAMES[seq.seq_id] = request_id
    return seq


def planned(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(_NAMES[seq_id], n) for seq_id, n in zip(out.seq_ids, out.num_scheduled_tokens)]


def step(scheduler: Scheduler, max_len: dict[str, int] | None = None,
         token: int = 0) -> SchedulerOutput:
    """One synchronous engine step: schedule, "run", append the token, finish at max_len."""
    out = scheduler.schedule()
    for _, seq in scheduler.update_from_output(out, [token] * out.num_rows):
        if max_len is not None and seq.num_tokens >= max_len[seq.request_id]:
            scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
    return out


@pytest.mark.parametrize("k,cut,max_num_seqs", [(4, 4, 8), (7, 8, 64), (2, 1, 4), (0, 0, 16)])
def test_bucket_shapes_cover_every_step_and_verify_steps_pay_for_their_own_rows(k, cut,
                                                                                max_num_seqs):
    buckets = BucketPolicy(256, max_num_seqs, num_spec_tokens=k, max_spec_rows=cut)
    shapes = buckets.all_shapes()
    assert shapes == sorted(set(shapes)) and shapes[-1] == (256, min(256, next_power_of_2(
        max_num_seqs)))
    for seqs in range(1, max_num_seqs + 1):
        for tokens in range(seqs, 257, max(1, seqs // 3)):
            t, s = buckets.shape_for(tokens, seqs)
            assert (t, s) in shapes and t >= tokens and s >= seqs
            if tokens == seqs:                               # a decode step: the (p, p) shape
                assert (t, s) == (next_power_of_2(seqs), next_power_of_2(seqs))
            elif k and seqs <= cut and tokens <= seqs * (k + 1):   # a verify step: its rows only
                assert s == next_power_of_2(seqs)
    assert len(shapes) == len(buckets.token_buckets) + len(buckets.spec_shapes)


def test_chunked_prefill_splits_long_prompt_under_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_model_len=32)
    seq = make_seq(range(20))
    scheduler.add_seq(seq)
    chunks = []
    for _ in range(3):
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= 8
        chunks.append(out.num_scheduled_tokens[0])
        received = scheduler.update_from_output(out, [0] * out.num_rows)
        assert [s for _, s in received] == ([seq] if sum(chunks) == 20 else [])
    assert chunks == [8, 8, 4]
    assert seq.num_computed_tokens == 20 and len(seq.block_table) == 5


def test_decodes_and_prefill_chunks_share_one_step():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    first = make_seq(range(4), "a")
    scheduler.add_seq(first)
    step(scheduler)                                  # "a" prefilled, now decoding
    scheduler.add_seq(make_seq(range(100, 120), "b"))
    out = step(scheduler)
    assert planned(out) == [("a", 1), ("b", 7)]      # running first, then admitted
    out = step(scheduler)
    assert planned(out) == [("a", 1), ("b", 7)]      # decode + continuing chunk
    assert out.total_num_scheduled_tokens == 8


def test_max_num_seqs_caps_running_seqs():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        scheduler.add_seq(make_seq(range(3), name))
    out = step(scheduler)
    assert [name for name, _ in planned(out)] == ["a", "b"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    scheduler.finish_seq(scheduler.running[0], SequenceStatus.FINISHED_STOPPED)
    out = step(scheduler)
    assert planned(out) == [("b", 1), ("c", 3)]


def test_waiting_seq_without_chunked_prefill_waits_for_whole_prompt_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32,
                               enable_chunked_prefill=False)
    scheduler.add_seq(make_seq(range(20), "a"))
    scheduler.add_seq(make_seq(range(100, 120), "b"))
    assert planned(step(scheduler)) == [("a", 20)]   # "b" does not fit the remaining 12
    assert planned(step(scheduler)) == [("a", 1), ("b", 20)]


def test_preemption_evicts_newest_seq_which_resumes_and_finishes():
    # 6 blocks of 2 tokens; each seq grows to 8 tokens (4 blocks), so both cannot fit.
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_model_len=12,
                               max_num_batched_tokens=16, enable_prefix_caching=False)
    old, new = make_seq([1, 2, 3, 4], "old"), make_seq([5, 6, 7, 8], "new")
    scheduler.add_seq(old)
    scheduler.add_seq(new)
    max_len = {"old": 8, "new": 8}
    preempted = []
    for _ in range(30):
        if not scheduler.has_unfinished():
            break
        out = step(scheduler, max_len, token=9)
        preempted += out.preempted_seq_ids
        assert not set(out.preempted_seq_ids) & set(out.seq_ids)
        scheduler.block_manager.check_invariants([*scheduler.running, *scheduler.waiting])
    assert not scheduler.has_unfinished()
    assert preempted and all(seq_id == new.seq_id for seq_id in preempted)
    assert new.num_preemptions == len(preempted) == scheduler.num_preemptions
    assert old.status == new.status == SequenceStatus.FINISHED_LENGTH
    assert new.token_ids == [5, 6, 7, 8, 9, 9, 9, 9]  # generated tokens survive preemption
    assert scheduler.block_manager.num_free_blocks == 6


def test_preempted_seq_goes_to_front_and_blocks_admission_that_step():
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_model_len=8,
                               max_num_batched_tokens=16, enable_prefix_caching=False)
    a, b = make_seq([1, 2, 3, 4], "a"), make_seq([5, 6, 7, 8], "b")
    scheduler.add_seq(a)
    scheduler.add_seq(b)
    step(scheduler)                              # both prefilled: all 4 blocks used
    scheduler.add_seq(make_seq([1], "c"))
    out = step(scheduler)                        # "a" needs a 3rd block: "b" is preempted
    assert planned(out) == [("a", 1)] and out.preempted_seq_ids == [b.seq_id]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_tokens == 5
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"]


def test_only_running_seq_preempts_itself_when_cache_is_held_elsewhere():
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_model_len=8,
                               max_num_batched_tokens=16, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3, 4], "a")
    scheduler.add_seq(seq)
    step(scheduler)
    hog = make_seq([0, 0, 0, 0], "hog")          # blocks taken outside the scheduler
    assert scheduler.block_manager.allocate_slots(hog, 4, [])
    out = scheduler.schedule()
    assert out.is_empty and out.preempted_seq_ids == [seq.seq_id]
    assert scheduler.waiting == (seq,) and scheduler.num_running == 0


def test_preempted_seq_is_recomputed_cheaply_from_prefix_cache():
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_model_len=12,
                               max_num_batched_tokens=16)
    old, new = make_seq([1, 2, 3, 4], "old"), make_seq([5, 6, 7, 8], "new")
    scheduler.add_seq(old)
    scheduler.add_seq(new)
    while not scheduler.num_preemptions:
        step(scheduler, {"old": 12, "new": 12})
    scheduler.finish_seq(old, SequenceStatus.FINISHED_STOPPED)
    out = scheduler.schedule()
    assert out.seq_ids[0] == new.seq_id and out.new_seqs[0].seq_id == new.seq_id
    assert new.num_cached_tokens > 0
    assert out.num_scheduled_tokens[0] == new.num_tokens - new.num_cached_tokens
    assert out.new_seqs[0].token_ids == new.token_ids      # resumed with its outputs


def test_only_rows_that_reach_the_newest_token_sample():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    short, long = make_seq(range(3), "short"), make_seq(range(20), "long")
    scheduler.add_seq(short)
    scheduler.add_seq(long)
    out = scheduler.schedule()
    assert planned(out) == [("short", 3), ("long", 7)]
    assert out.is_sampling == [True, False]
    assert [s for _, s in scheduler.update_from_output(out, [5, 6])] == [short]
    assert short.token_ids[-1] == 5 and long.num_tokens == 20


def test_abort_of_waiting_and_running_requests_frees_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    running = [make_seq(range(5), "run"), make_seq(range(5), "run")]
    scheduler.add_seq(running[0])
    scheduler.add_seq(make_seq(range(5), "wait"))
    scheduler.add_seq(running[1])
    step(scheduler)
    assert scheduler.running == (running[0],)
    assert scheduler.block_manager.num_free_blocks < 16
    aborted = scheduler.abort_request("run")
    assert set(map(id, aborted)) == set(map(id, running))
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in aborted)
    assert scheduler.block_manager.num_free_blocks == 16 and running[0].block_table == []
    [waiting] = scheduler.abort_request("wait")
    assert waiting.status == SequenceStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished() and scheduler.abort_request("wait") == []


def test_seq_aborted_during_step_gets_no_token_and_its_row_is_dropped_next_step():
    scheduler = make_scheduler()
    seq = make_seq(range(5))
    scheduler.add_seq(seq)
    out = scheduler.schedule()
    scheduler.abort_request("r")
    assert scheduler.update_from_output(out, [1]) == []
    assert seq.num_tokens == 5
    assert scheduler.schedule().finished_seq_ids == [seq.seq_id]


def test_async_scheduling_plans_the_next_decode_before_the_token_is_known():
    scheduler = make_scheduler()
    seq = make_seq(range(5), max_num_tokens=8)
    scheduler.add_seq(seq)
    first = scheduler.schedule()                 # prefill; its sample is pending
    assert seq.num_pending_tokens == 1 and seq.num_computed_tokens == 5
    second = scheduler.schedule()                # decode of the pending token, in flight
    assert planned(second) == [("r", 1)] and second.num_computed_tokens == [5]
    assert seq.num_pending_tokens == 2 and second.new_seqs == []
    scheduler.update_from_output(first, [40])
    scheduler.update_from_output(second, [41])
    assert seq.token_ids == [0, 1, 2, 3, 4, 40, 41] and seq.num_pending_tokens == 0


def test_a_pending_token_that_reaches_max_tokens_is_not_decoded_again():
    scheduler = make_scheduler()
    seq = make_seq(range(5), max_num_tokens=6)   # one output token
    scheduler.add_seq(seq)
    first = scheduler.schedule()
    assert scheduler.schedule().is_empty         # nothing to do until the token arrives
    scheduler.update_from_output(first, [9])
    assert seq.num_tokens == 6


def test_prefill_is_capped_while_decodes_run():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=128, num_blocks=64,
                               prefill_budget_while_decoding=8)
    scheduler.add_seq(make_seq(range(4), "a"))
    step(scheduler)                               # "a" decodes from now on
    scheduler.add_seq(make_seq(range(100, 140), "b"))
    assert planned(step(scheduler)) == [("a", 1), ("b", 8)]
    assert planned(step(scheduler)) == [("a", 1), ("b", 8)]
    scheduler.finish_seq(scheduler.running[0], SequenceStatus.FINISHED_STOPPED)
    assert planned(step(scheduler)) == [("b", 24)]    # alone, a prompt takes the budget


@pytest.mark.parametrize("num_decodes, expected_prefill", [(1, 31), (16, 16), (17, 47)])
def test_auto_prefill_budget_fills_the_step_to_a_token_bucket(num_decodes, expected_prefill):
    """Auto: decodes + prefill = next_pow2(max(2 x decodes, 32)), so a mixed step runs at most
    twice the decode step's bucket (16 decodes + 32 prompt tokens would be bucket 64: 4x)."""
    scheduler = make_scheduler(max_num_batched_tokens=256, max_model_len=256, num_blocks=256,
                               max_num_seqs=32)
    for i in range(num_decodes):
        scheduler.add_seq(make_seq([i], f"d{i}"))
    step(scheduler)                               # one-token prompts: all decode from now on
    scheduler.add_seq(make_seq(range(100, 200), "p"))
    plan = dict(planned(step(scheduler)))
    assert plan["p"] == expected_prefill
    assert sum(plan.values()) == next_power_of_2(max(2 * num_decodes, 32))


def test_auto_prefill_budget_steps_aside_while_several_prompts_wait():
    """A wave of clients waiting for their first token gets the whole step budget (vLLM's
    policy); the bucket cap comes back once at most one prompt waits."""
    scheduler = make_scheduler(max_num_batched_tokens=128, max_model_len=256, num_blocks=256,
                               max_num_seqs=32)
    for i in range(4):
        scheduler.add_seq(make_seq([i], f"d{i}"))
    step(scheduler)                               # four streams decode from now on
    for name in "abc":
        scheduler.add_seq(make_seq(range(100, 160), name))
    plan = dict(planned(step(scheduler)))         # three wait: a, b whole, c's first 4
    assert (plan["a"], plan["b"], plan["c"]) == (60, 60, 4) and sum(plan.values()) == 128
    scheduler.add_seq(make_seq(range(200, 300), "p"))  # only p waits (c is running)
    plan = dict(planned(step(scheduler)))
    assert sum(plan.values()) == 32 and "p" not in plan   # c's rest fills the capped step
    assert plan["c"] == 32 - 6                     # of its 56 left; 6 decodes: d0-d3, a, b


def test_long_prefill_threshold_and_partial_prefill_limit():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=128, num_blocks=64,
                               long_prefill_token_threshold=10, max_num_partial_prefills=1)
    scheduler.add_seq(make_seq(range(30), "a"))
    scheduler.add_seq(make_seq(range(100, 130), "b"))
    assert planned(step(scheduler)) == [("a", 10)]    # "b" would be a second partial prefill


def test_finish_seq_is_idempotent_and_keeps_first_status():
    scheduler = make_scheduler()
    seq = make_seq(range(5))
    scheduler.add_seq(seq)
    step(scheduler)
    scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
    scheduler.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert scheduler.block_manager.num_free_blocks == 16 and not scheduler.has_unfinished()


def test_config_that_could_never_schedule_a_max_length_seq_is_rejected():
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        make_scheduler(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="KV cache holds 8 tokens"):
        make_scheduler(num_blocks=2, block_size=4, max_model_len=32)


# --------------------------------------------------------------------------- property test
class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / finish / abort with a tiny KV cache, so preemption is common.

    A fake KV cache records which token was written to each slot; every computed position
    of every running sequence must still hold its own token, which catches wrong prefix
    hits and blocks shared or reused while live.
    """

    @initialize(max_model_len=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]),
                spare_blocks=st.integers(0, 2), max_num_seqs=st.integers(1, 4),
                budget=st.integers(1, 12), chunked=st.booleans(), prefix_caching=st.booleans(),
                steps_in_flight=st.sampled_from([1, 2]), prefill_cap=st.sampled_from([None, 0, 2]),
                speculate=st.booleans(), spec_seed=st.integers(0, 1 << 16))
    def setup(self, max_model_len, block_size, spare_blocks, max_num_seqs, budget, chunked,
              prefix_caching, steps_in_flight, prefill_cap, speculate, spec_seed):
        # Room for one max-length seq and hardly more, so preemption is common.
        num_blocks = -(-max_model_len // block_size) + spare_blocks
        self.max_model_len = max_model_len
        if not chunked:
            budget = max(budget, self.max_model_len)
        self.scheduler = make_scheduler(num_blocks, block_size, max_num_seqs, budget,
                                        self.max_model_len, chunked, prefix_caching,
                                        prefill_budget_while_decoding=prefill_cap)
        self.bm = self.scheduler.block_manager
        # The runner side: its persistent batch, bucket policy and a fake device that keeps
        # each row's last sample (what async decodes read) and a KV cache of token ids.
        self.width = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, self.width)
        self.buckets = BucketPolicy(budget, max_num_seqs)
        self.steps_in_flight = steps_in_flight
        self.in_flight: deque = deque()
        self.last_tokens: dict[int, int] = {}
        self.max_len: dict[str, int] = {}       # request id -> final length of its seqs
        self.live: list[Sequence] = []
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token id written
        self.num_requests = 0
        # Speculative decoding: with nothing in flight, candidates get 1-3 drafts, a random
        # prefix of them right (the fake model's true tokens), the rest wrong.
        self.speculate = speculate
        self.spec_rng = random.Random(spec_seed)

    @rule(data=st.data(), n=st.integers(1, 2))
    def add_request(self, data, n):
        # Shared prefixes make prefix-cache hits common.
        prefix = data.draw(st.sampled_from([[], [7] * 4, [7] * 4 + [8] * 4]))
        tail = data.draw(st.lists(st.integers(0, 2), max_size=self.max_model_len))
        prompt = (prefix + tail)[:self.max_model_len] or [0]
        request_id = f"req{self.num_requests}"
        self.num_requests += 1
        # Mostly long outputs: growing decodes are what run the cache dry.
        shortfall = data.draw(st.integers(0, self.max_model_len))
        self.max_len[request_id] = max(len(prompt), self.max_model_len - shortfall // 4)
        for index in range(n):
            seq = Sequence(request_id, prompt, SamplingParams(), index=index,
                           max_num_tokens=self.max_len[request_id])
            self.scheduler.add_seq(seq)
            self.live.append(seq)

    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def step(self, data, num_steps):
        for _ in range(num_steps):
            self._step(stop=lambda: data.draw(st.integers(0, 7)) == 0)

    # Finish and abort share one rule so that steps (and so preemptions) stay common.
    @rule(data=st.data(), abort=st.booleans())
    def finish_or_abort(self, data, abort):
        if not self.live:
            return
        seq = data.draw(st.sampled_from(self.live))
        if not abort:
            self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
            self.live.remove(seq)
            return
        request_id = seq.request_id
        aborted = self.scheduler.abort_request(request_id)
        assert aborted and all(seq.request_id == request_id for seq in aborted)
        if any(seq.num_computed_tokens for seq in aborted):
            event("abort of a running seq")
        self.live = [seq for seq in self.live if seq.request_id != request_id]

    def _step(self, stop) -> None:
        """One engine step: dispatch the next step if there is room in flight, and collect
        the oldest when the pipeline is full (or nothing new could be dispatched)."""
        dispatched = False
        if len(self.in_flight) < self.steps_in_flight and self.scheduler.has_unfinished():
            dispatched = self._dispatch()
        if self.in_flight and (len(self.in_flight) >= self.steps_in_flight or not dispatched):
            self._collect(stop)

    def _dispatch(self) -> bool:
        scheduler, bm = self.scheduler, self.bm
        running_before = scheduler.num_running
        proposed = {}
        if self.speculate and not self.in_flight:
            for seq in scheduler.draft_candidates(scheduler.max_num_seqs):
                length = self.spec_rng.randint(1, 3)
                right = self.spec_rng.randint(0, length)
                proposed[seq.seq_id] = [
                    self._true_token(seq, seq.num_tokens + j) + (0 if j < right else 10)
                    for j in range(length)]
        out = scheduler.schedule(proposed)
        for seq_id, drafts in out.draft_token_ids.items():
            assert drafts == proposed[seq_id][:len(drafts)] and drafts
            event("drafts scheduled")
        assert len(set(out.seq_ids)) == out.num_rows, "a seq scheduled twice"
        assert not set(out.seq_ids) & set(out.preempted_seq_ids)
        assert all(n > 0 for n in out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert out.num_rows <= scheduler.max_num_seqs
        assert scheduler.num_running <= scheduler.max_num_seqs
        if out.preempted_seq_ids:
            assert scheduler.num_running <= running_before, "admitted despite preemption"
            event("preemption")
        if scheduler.has_unfinished() and out.is_empty:
            assert self.in_flight, "no progress with nothing in flight"
        bm.check_invariants(self.live)
        if any(new.num_computed_tokens for new in out.new_seqs):
            event("prefix-cache hit used")
        rows = self.batch.apply(out)
        if out.is_empty:
            return False
        t, s = self.buckets.shape_for(out.total_num_scheduled_tokens, out.num_rows)
        inputs = self.batch.prepare(out, rows, t, s)
        v = StepLayout(t, s, self.width).views(inputs.packed)
        n, live = out.num_rows, out.total_num_scheduled_tokens
        assert v["num_seqs"][0] == n and v["query_start_loc"][n] == live
        assert np.all(v["slot_mapping"][live:] == -1) and np.all(v["kv_lens"][n:] == 0)
        # The fake device: resolve tokens, check the prefix's KV, write the new tokens' KV.
        sampled, emitted = [], []
        for i, seq_id in enumerate(out.seq_ids):
            seq = scheduler.get_seq(seq_id)
            drafts = out.draft_token_ids.get(seq_id, [])
            start, end = v["query_start_loc"][i], v["query_start_loc"][i + 1]
            computed = out.num_computed_tokens[i]
            assert end - start == out.num_scheduled_tokens[i]
            assert v["kv_lens"][i] == computed + end - start
            table = v["block_tables"][i]
            np.testing.assert_array_equal(table[:len(seq.block_table)], seq.block_table)
            self._check_kv(seq, table, computed)
            for t_index in range(start, end):
                pos = int(v["positions"][t_index])
                token = int(v["token_ids"][t_index])
                if token < 0:                          # the device's sample of last step
                    assert -1 - token == rows[i] and pos == seq.num_tokens, "bad device token"
                    token = self.last_tokens[int(rows[i])]
                    event("token fed from the device")
                if pos >= seq.num_tokens and drafts:      # a draft, right or wrong
                    assert token == drafts[pos - seq.num_tokens], (seq, pos)
                else:
                    assert token == self._true_token(seq, pos), (seq, pos)
                slot = int(v["slot_mapping"][t_index])
                assert slot == table[pos // bm.block_size] * bm.block_size + pos % bm.block_size
                self.kv[divmod(slot, bm.block_size)] = token
            kv_len = int(v["kv_lens"][i])
            first = kv_len - len(drafts)                # where the first new token goes
            tokens = [self._true_token(seq, first)] if out.is_sampling[i] else [-7]
            for j, draft in enumerate(drafts):          # accept the right prefix
                if draft != tokens[-1]:
                    break
                tokens.append(self._true_token(seq, first + j + 1))
                event("draft accepted")
            assert v["num_drafts"][i] == len(drafts)
            sampled.append(tokens[0])
            emitted.append(tokens)
        for row, tokens in zip(rows.tolist(), emitted):
            self.last_tokens[row] = tokens[-1]         # garbage (-7) for mid-prefill rows
        self.in_flight.append((out, rows, sampled, emitted if out.draft_token_ids else None))
        return True

    def _collect(self, stop) -> None:
        out, rows, sampled, emitted = self.in_flight.popleft()
        kv_lens = np.asarray(out.num_computed_tokens) + np.asarray(out.num_scheduled_tokens)
        if emitted is None:
            self.batch.record_sampled(out.seq_ids, rows, kv_lens, out.is_sampling, sampled)
        else:
            drafts = np.array([len(out.draft_token_ids.get(s, ())) for s in out.seq_ids])
            grid = np.full((out.num_rows, 4), -1)
            for i, tokens in enumerate(emitted):
                grid[i, :len(tokens)] = tokens
            self.batch.record_emitted(out.seq_ids, rows, kv_lens - drafts, out.is_sampling,
                                      grid, np.array([len(t) for t in emitted]))
        for row, seq in self.scheduler.update_from_output(out, sampled, emitted):
            extra = emitted[row][1:] if emitted else []
            while True:          # as the engine does: each token through the stop checks
                if seq.num_tokens >= self.max_len[seq.request_id] or stop():
                    self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                    self.live.remove(seq)
                    break
                if not extra:
                    break
                seq.token_ids.append(extra.pop(0))

    @staticmethod
    def _true_token(seq: Sequence, pos: int) -> int:
        """Prompt tokens, then what the fake model samples at each position."""
        if pos < seq.num_prompt_tokens:
            return seq.token_ids[pos]
        return 3 + (seq.seq_id * 7 + pos) % 5

    def _check_kv(self, seq: Sequence, table, num_computed: int) -> None:
        bs = self.bm.block_size
        for pos in range(num_computed):
            assert self.kv.get((int(table[pos // bs]), pos % bs)) == self._true_token(seq, pos), \
                (seq, pos)

    @invariant()
    def consistent(self):
        if not hasattr(self, "scheduler"):
            return
        scheduler, batch = self.scheduler, self.batch
        self.bm.check_invariants(self.live)
        live_ids = {id(seq) for seq in self.live}
        assert {id(s) for s in (*scheduler.running, *scheduler.waiting)} == live_ids
        for seq in scheduler.running:
            assert seq.status == SequenceStatus.RUNNING
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens
            self._check_kv(seq, seq.block_table, min(seq.num_computed_tokens, seq.num_tokens))
            # The runner's row says what the scheduler believes.
            row = batch.row_of[seq.seq_id]
            known = int(batch.num_known[row])
            assert known == seq.num_tokens, (seq, known)   # collected tokens are recorded
            np.testing.assert_array_equal(batch.token_ids[row, :known], seq.token_ids)
            assert np.all(batch.token_ids[row, known:] == -1)
            # A rollback of rejected drafts reaches the runner with the next step.
            num_blocks = scheduler._rolled_back.get(seq.seq_id, batch.num_blocks[row])
            np.testing.assert_array_equal(batch.block_table[row, :num_blocks], seq.block_table)
        for seq in scheduler.waiting:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq.seq_id not in batch.row_of
        # Rows exist for running sequences and for those finished since the last step.
        assert set(batch.row_of) == {s.seq_id for s in scheduler.running} | set(
            scheduler._finished_ids)
        if not self.live:
            assert self.bm.num_free_blocks == self.bm.num_blocks

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        # Liveness: the oldest running seq always progresses, so every seq finishes
        # within (sum of remaining lengths) steps, never reading its own preemption.
        limit = 2 * sum(self.max_len[seq.request_id] for seq in self.live) + 2
        for _ in range(limit):
            if not self.scheduler.has_unfinished() and not self.in_flight:
                break
            self._step(stop=lambda: False)
            self.consistent()
        assert not self.scheduler.has_unfinished() and not self.live and not self.in_flight
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants([])


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, database=None)
test_scheduler_state_machine = SchedulerMachine.TestCase


def _siblings(tokens, n, request_id="multi") -> list[Sequence]:
    params = SamplingParams(n=n)
    seqs = [Sequence(request_id, list(tokens), params, index=i) for i in range(n)]
    for seq in seqs:
        _NAMES[seq.seq_id] = request_id
        seq.sampling_params = params
    return seqs


def test_n_siblings_prefill_the_shared_prompt_once():
    scheduler = make_scheduler(num_blocks=32, max_num_batched_tokens=16, max_model_len=32)
    leader, *others = _siblings(range(10), 3)       # 10 tokens: 2 full blocks to share
    for seq in (leader, *others):
        scheduler.add_seq(seq)
    other_request = make_seq([50, 51, 52], request_id="other")
    scheduler.add_seq(other_request)
    first = step(scheduler)
    # The siblings keep their place; the request behind them is not held up.
    assert planned(first) == [("multi", 10), ("other", 3)]
    assert [s.seq_id for s in scheduler.waiting] == [s.seq_id for s in others]
    second = step(scheduler)
    # Each sibling finds both full prompt blocks cached and computes only the tail.
    assert planned(second) == [("multi", 1), ("other", 1), ("multi", 2), ("multi", 2)]
    assert all(s.num_cached_tokens == 8 for s in others)
    blocks = scheduler.block_manager
    assert (blocks.prefix_cache_queries, blocks.prefix_cache_hits) == (3 * 10 + 3, 2 * 8)
    assert all(s.block_table[:2] == leader.block_table[:2] for s in others)
    blocks.check_invariants(scheduler.running)


def test_siblings_go_ahead_when_the_leader_is_aborted_before_caching_the_prompt():
    scheduler = make_scheduler(num_blocks=32, max_num_batched_tokens=8, max_model_len=32)
    leader, sibling = _siblings(range(12), 2)
    scheduler.add_seq(leader)
    scheduler.add_seq(sibling)
    assert planned(step(scheduler)) == [("multi", 8)]     # a chunk: the prompt is not cached
    scheduler.finish_seq(leader, SequenceStatus.FINISHED_ABORTED)
    # The sibling prefills the rest itself (the leader's one finished chunk is still cached).
    assert planned(step(scheduler)) == [("multi", 4)]
    assert sibling.status == SequenceStatus.RUNNING and sibling.num_cached_tokens == 8


def test_short_prompts_and_disabled_prefix_caching_admit_siblings_together():
    for tokens, caching in ((range(4), True), (range(10), False)):
        scheduler = make_scheduler(num_blocks=32, max_num_batched_tokens=32,
                                   enable_prefix_caching=caching)
        for seq in _siblings(tokens, 2):
            scheduler.add_seq(seq)
        assert planned(step(scheduler)) == [("multi", len(tokens))] * 2

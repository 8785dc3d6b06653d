"""Scheduler: continuous batching, chunked prefill, preemption, finishing and aborts."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxserve.config import SchedulerConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                   max_model_len=32, enable_chunked_prefill=True, enable_prefix_caching=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=enable_chunked_prefill)
    block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(config, block_manager, max_model_len)


def make_seq(tokens, request_id="r") -> Sequence:
    return Sequence(request_id, list(tokens), sampling_params=None)


def planned(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def step(scheduler: Scheduler, max_len: dict[str, int] | None = None,
         token: int = 0) -> SchedulerOutput:
    """One engine step: schedule, compute, append a token to ready seqs, finish at max_len."""
    out = scheduler.schedule()
    for seq in scheduler.complete_step(out):
        seq.append_token(token)
        if max_len is not None and seq.num_tokens >= max_len[seq.request_id]:
            scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
    return out


def test_chunked_prefill_splits_long_prompt_under_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_model_len=32)
    seq = make_seq(range(20))
    scheduler.add_seq(seq)
    chunks = []
    for _ in range(3):
        out = scheduler.schedule()
        assert out.num_batched_tokens <= 8
        chunks.append(out.scheduled[0].num_new_tokens)
        ready = scheduler.complete_step(out)
        assert ready == ([seq] if sum(chunks) == 20 else [])
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
    assert out.num_batched_tokens == 8


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
        preempted += out.preempted
        assert not {id(s) for s in out.preempted} & {id(s.seq) for s in out.scheduled}
        scheduler.block_manager.check_invariants([*scheduler.running, *scheduler.waiting])
    assert not scheduler.has_unfinished()
    assert preempted and all(seq is new for seq in preempted)
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
    assert planned(out) == [("a", 1)] and out.preempted == [b]
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
    assert out.is_empty and out.preempted == [seq]
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
    assert out.scheduled[0].seq is new
    assert new.num_cached_tokens > 0
    assert out.scheduled[0].num_new_tokens == new.num_tokens - new.num_cached_tokens


def test_complete_step_returns_only_fully_computed_seqs():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    short, long = make_seq(range(3), "short"), make_seq(range(20), "long")
    scheduler.add_seq(short)
    scheduler.add_seq(long)
    out = scheduler.schedule()
    assert planned(out) == [("short", 3), ("long", 7)]
    assert scheduler.complete_step(out) == [short]


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


def test_seq_aborted_during_step_is_not_returned_by_complete_step():
    scheduler = make_scheduler()
    seq = make_seq(range(5))
    scheduler.add_seq(seq)
    out = scheduler.schedule()
    scheduler.abort_request("r")
    assert scheduler.complete_step(out) == []
    assert seq.num_computed_tokens == 0


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
                budget=st.integers(1, 12), chunked=st.booleans(), prefix_caching=st.booleans())
    def setup(self, max_model_len, block_size, spare_blocks, max_num_seqs, budget, chunked,
              prefix_caching):
        # Room for one max-length seq and hardly more, so preemption is common.
        num_blocks = -(-max_model_len // block_size) + spare_blocks
        self.max_model_len = max_model_len
        if not chunked:
            budget = max(budget, self.max_model_len)
        self.scheduler = make_scheduler(num_blocks, block_size, max_num_seqs, budget,
                                        self.max_model_len, chunked, prefix_caching)
        self.bm = self.scheduler.block_manager
        self.max_len: dict[str, int] = {}       # request id -> final length of its seqs
        self.live: list[Sequence] = []
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token id written
        self.num_requests = 0

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
            seq = Sequence(request_id, prompt, sampling_params=None, index=index)
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
        scheduler, bm = self.scheduler, self.bm
        running_before = scheduler.num_running
        out = scheduler.schedule()
        ids = [id(s.seq) for s in out.scheduled]
        assert len(set(ids)) == len(ids), "a seq scheduled twice"
        assert not set(ids) & {id(seq) for seq in out.preempted}
        assert all(s.num_new_tokens > 0 for s in out.scheduled)
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(out.scheduled) <= scheduler.max_num_seqs
        assert scheduler.num_running <= scheduler.max_num_seqs
        if out.preempted:
            assert scheduler.num_running <= running_before, "admitted despite preemption"
        if scheduler.has_unfinished():
            assert not out.is_empty, "no progress"
        bm.check_invariants(self.live)
        if out.preempted:
            event("preemption")
        if any(s.seq.num_cached_tokens and s.seq.num_computed_tokens == s.seq.num_cached_tokens
               for s in out.scheduled):
            event("prefix-cache hit used")
        # The "model" reads the prefix's KV and writes the new tokens' KV.
        for scheduled in out.scheduled:
            seq, start = scheduled.seq, scheduled.seq.num_computed_tokens
            self._check_kv(seq, start)
            for pos in range(start, start + scheduled.num_new_tokens):
                self.kv[self._slot(seq, pos)] = seq.token_ids[pos]
        for seq in scheduler.complete_step(out):
            seq.append_token(1)
            if seq.num_tokens >= self.max_len[seq.request_id] or stop():
                scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                self.live.remove(seq)

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.bm.block_size], pos % self.bm.block_size

    def _check_kv(self, seq: Sequence, num_computed: int) -> None:
        for pos in range(num_computed):
            assert self.kv.get(self._slot(seq, pos)) == seq.token_ids[pos], (seq, pos)

    @invariant()
    def consistent(self):
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        self.bm.check_invariants(self.live)
        live_ids = {id(seq) for seq in self.live}
        assert {id(s) for s in (*scheduler.running, *scheduler.waiting)} == live_ids
        for seq in scheduler.running:
            assert seq.status == SequenceStatus.RUNNING
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens
            self._check_kv(seq, seq.num_computed_tokens)
        for seq in scheduler.waiting:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        if not self.live:
            assert self.bm.num_free_blocks == self.bm.num_blocks

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        # Liveness: the oldest running seq always progresses, so every seq finishes
        # within (sum of remaining lengths) steps, never reading its own preemption.
        limit = sum(self.max_len[seq.request_id] for seq in self.live) + 1
        for _ in range(limit):
            if not self.scheduler.has_unfinished():
                break
            self._step(stop=lambda: False)
            self.consistent()
        assert not self.scheduler.has_unfinished() and not self.live
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants([])


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, database=None)
test_scheduler_state_machine = SchedulerMachine.TestCase

"""The scheduler's inlined fast paths (plain decodes in `schedule`, plain samples in
`update_from_output`) do exactly what its general path does: two schedulers, one with
`inline_fast_paths` off, run the same random workload in lockstep (async steps in flight,
drafts, preemption, prefix-cache hits, finishes and aborts) and must plan identical steps
and end in identical states."""

from __future__ import annotations

import random
from collections import deque

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`


class GeneralPathScheduler(Scheduler):
    inline_fast_paths = False


class _World:
    """One scheduler and its sequences, numbered in creation order (seq ids differ
    between the two worlds; the creation index does not)."""

    def __init__(self, cls, rng_args) -> None:
        num_blocks, block_size, max_num_seqs, budget, max_len, prefix = rng_args
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 enable_chunked_prefill=True)
        self.scheduler = cls(config, BlockManager(num_blocks, block_size, prefix), max_len)
        self.seqs: list[Sequence] = []
        self.index: dict[int, int] = {}
        self.in_flight: deque = deque()

    def add(self, prompt: list[int], max_tokens: int) -> None:
        seq = Sequence(f"r{len(self.seqs)}", list(prompt), SamplingParams(),
                       max_num_tokens=max_tokens)
        self.index[seq.seq_id] = len(self.seqs)
        self.seqs.append(seq)
        self.scheduler.add_seq(seq)

    def plan(self, out) -> tuple:
        """The step's plan with seq ids as creation indices."""
        ix = self.index
        return (
            [ix[s] for s in out.seq_ids], out.num_scheduled_tokens, out.num_computed_tokens,
            out.is_sampling, out.num_decode_tokens, out.total_num_scheduled_tokens,
            [(ix[n.seq_id], n.token_ids, n.num_computed_tokens, n.block_ids) for n in out.new_seqs],
            {ix[k]: v for k, v in out.new_block_ids.items()},
            sorted(ix[s] for s in out.preempted_seq_ids),
            sorted(ix[s] for s in out.finished_seq_ids),
            {ix[k]: v for k, v in out.block_table_lengths.items()},
            {ix[k]: v for k, v in out.draft_token_ids.items()})

    def state(self) -> list[tuple]:
        return [(s.status, list(s.token_ids), s.num_computed_tokens, s.num_pending_tokens,
                 list(s.block_table), s.num_cached_tokens) for s in self.seqs] + \
            [(self.scheduler.block_manager.num_free_blocks, self.scheduler.num_preemptions)]


def _run(seed: int, num_steps: int = 60) -> int:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    max_len = rng.randint(4, 24)
    shape = (-(-max_len // block_size) + rng.randint(0, 6), block_size, rng.randint(1, 6),
             rng.randint(max(2, max_len // 2), 32), max_len, rng.random() < 0.7)
    worlds = [_World(Scheduler, shape), _World(GeneralPathScheduler, shape)]
    steps_in_flight = rng.choice([1, 2])
    num_fast = 0
    for _ in range(num_steps):
        if rng.random() < 0.3:
            prefix = rng.choice([[], [7] * 4, [7] * 4 + [8] * 3])
            prompt = (prefix + [rng.randint(0, 3) for _ in range(rng.randint(1, max_len))]
                      )[:max_len - 1] or [0]
            max_tokens = rng.randint(len(prompt) + 1, max_len)
            for w in worlds:
                w.add(prompt, max_tokens)
        # Drafts (only with nothing in flight, as the engine proposes them)
        drafts_by_index = {}
        first = worlds[0]
        if not first.in_flight and rng.random() < 0.3:
            for seq in first.scheduler.draft_candidates(first.scheduler.max_num_seqs):
                drafts_by_index[first.index[seq.seq_id]] = [
                    rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
        if len(first.in_flight) < steps_in_flight and first.scheduler.has_unfinished():
            plans = []
            for w in worlds:
                drafts = {w.seqs[i].seq_id: d for i, d in drafts_by_index.items()}
                out = w.scheduler.schedule(drafts)
                plans.append(w.plan(out))
                w.in_flight.append(out)
            assert plans[0] == plans[1], f"seed {seed}: schedule differs"
            num_fast += sum(1 for n, d in zip(plans[0][1], plans[0][0])
                            if n == 1 and d not in plans[0][11])
        if first.in_flight and (len(first.in_flight) >= steps_in_flight or rng.random() < 0.5):
            outs = [w.in_flight.popleft() for w in worlds]
            n = outs[0].num_rows
            sampled = [rng.randint(0, 5) for _ in range(n)]
            emitted = None
            if outs[0].draft_token_ids:
                emitted = [[sampled[r]] + [rng.randint(0, 5) for _ in range(
                    rng.randint(0, len(outs[0].draft_token_ids.get(s, ()))))]
                    for r, s in enumerate(outs[0].seq_ids)]
            stops = [rng.random() < 0.1 for _ in range(n)]
            received = []
            for w, out in zip(worlds, outs):
                got = w.scheduler.update_from_output(out, sampled, emitted)
                received.append([(row, w.index[seq.seq_id]) for row, seq in got])
                for row, seq in got:
                    for token in (emitted[row][1:] if emitted else []):
                        if seq.num_tokens >= seq.max_num_tokens:
                            break
                        seq.token_ids.append(token)
                    if seq.num_tokens >= seq.max_num_tokens or stops[row]:
                        w.scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
            assert received[0] == received[1], f"seed {seed}: update differs"
        if rng.random() < 0.05 and first.seqs:
            victim = rng.randrange(len(first.seqs))
            for w in worlds:
                w.scheduler.abort_request(w.seqs[victim].request_id)
        assert worlds[0].state() == worlds[1].state(), f"seed {seed}: states differ"
    return num_fast


def test_inlined_fast_paths_equal_the_general_path_on_random_workloads():
    num_fast = sum(_run(seed) for seed in range(150))
    assert num_fast > 1000     # the workloads do exercise the plain-decode case


def test_the_general_path_is_really_taken_when_inlining_is_off(monkeypatch):
    calls = []
    original = Scheduler._schedule_running_seq

    def spy(self, *args):
        calls.append(type(self))
        return original(self, *args)

    monkeypatch.setattr(Scheduler, "_schedule_running_seq", spy)
    _run(0, num_steps=40)
    assert GeneralPathScheduler in calls
    assert calls.count(GeneralPathScheduler) > calls.count(Scheduler)

"""The scheduler's inlined per-sequence fast paths (a plain decode in `schedule`, a sampled
token in `update_from_output`) give exactly what the general path gives, on random
workloads: prompts of random lengths, n > 1, one and two steps in flight, a KV cache small
enough to preempt, random finishes."""

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


def run_workload(seed: int, steps_in_flight: int, fast: bool) -> list:
    """A trace of every step's plan and of what each collected step handed back."""
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 20, 64])
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16,
                             enable_chunked_prefill=True)
    scheduler = Scheduler(config, BlockManager(num_blocks, 4, rng.random() < 0.7), 48)
    scheduler.inline_fast_paths = fast
    names: dict[int, tuple[str, int]] = {}
    trace: list = []
    in_flight: deque = deque()
    for step in range(150):
        if step < 100 and rng.random() < 0.25:
            request_id = f"r{step}"
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
            max_num_tokens = min(48, len(prompt) + rng.randrange(1, 24))
            for index in range(rng.choice([1, 1, 2])):
                seq = Sequence(request_id, prompt, SamplingParams(), index=index,
                               max_num_tokens=max_num_tokens)
                names[seq.seq_id] = (request_id, index)
                scheduler.add_seq(seq)
        dispatched = False
        if len(in_flight) < steps_in_flight and scheduler.has_unfinished():
            out = scheduler.schedule()
            trace.append(("plan", [names[i] for i in out.seq_ids], out.num_scheduled_tokens,
                          out.num_computed_tokens, out.is_sampling, out.num_decode_tokens,
                          [names[i] for i in out.preempted_seq_ids],
                          [names[i] for i in out.finished_seq_ids],
                          [(names[s.seq_id], list(s.block_table)) for s in scheduler.running]))
            in_flight.append((step, out))
            dispatched = True
        if in_flight and (len(in_flight) >= steps_in_flight or not dispatched):
            collect_step(scheduler, names, trace, rng, *in_flight.popleft())
    return trace


def collect_step(scheduler: Scheduler, names: dict, trace: list, rng: random.Random,
                 step: int, out) -> None:
    tokens = [(step * 7 + row * 3) % 5 for row in range(out.num_rows)]
    received = scheduler.update_from_output(out, tokens)
    trace.append(("got", [(row, names[seq.seq_id], list(seq.token_ids), seq.num_computed_tokens,
                           seq.num_pending_tokens) for row, seq in received]))
    for _, seq in received:
        if seq.num_tokens >= seq.max_num_tokens:
            scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
        elif rng.random() < 0.03:
            scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_inlined_fast_paths_equal_the_general_path_on_random_workloads(steps_in_flight):
    num_decodes = 0
    for seed in range(40):
        fast = run_workload(seed, steps_in_flight, fast=True)
        assert fast == run_workload(seed, steps_in_flight, fast=False), seed
        num_decodes += sum(entry[5] for entry in fast if entry[0] == "plan")
    assert num_decodes > 1000            # the fast paths really ran

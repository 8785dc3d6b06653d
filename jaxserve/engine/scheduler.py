"""Continuous batching: which sequences run this step, and how many tokens each.

All scheduled tokens share one flat token axis, so a step mixes decodes (one
token), chunks of long prompts (chunked prefill) and newly admitted prompts
under one token budget. When the KV cache runs out, the newest running
sequence is preempted by recompute: its blocks are freed and it goes back to
the front of the waiting queue, to be recomputed (prompt + output so far) when
it is admitted again; the prefix cache often makes that cheap.

The scheduler knows sequences and blocks, never tensors.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from jaxserve.config import SchedulerConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    # Batch order: running sequences first, then newly admitted ones.
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting queue (FIFO) and running list; ``schedule`` then ``complete_step`` each step."""

    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int) -> None:
        budget = scheduler_config.max_num_batched_tokens
        if budget is None or budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget} "
                             "(call EngineConfig.finalize first)")
        if not scheduler_config.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled, or long prompts could never be scheduled")
        capacity = block_manager.num_blocks * block_manager.block_size
        if capacity < max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                f"({max_model_len}); a single sequence could never finish")
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = budget
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []   # in admission order; the last is the newest
        self.num_preemptions = 0

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def add_seq(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, seq
        assert seq.num_tokens <= self.max_model_len, (seq.num_tokens, self.max_model_len)
        self._waiting.append(seq)

    # ------------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their KV blocks."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # Running sequences first: decodes and the next chunks of unfinished prefills.
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            # Everything before index i is already scheduled, so the newest running
            # sequence is always a legal victim; when it is seq itself, seq yields.
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self._running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1

        # Then admit waiting sequences in FIFO order, unless the cache was just short.
        if not out.preempted:
            while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
                seq = self._waiting[0]
                assert seq.num_tokens <= self.max_model_len, seq
                computed_blocks, num_cached = self.block_manager.get_computed_blocks(seq)
                num_remaining = seq.num_tokens - num_cached
                num_new = min(num_remaining, budget)
                if not self.enable_chunked_prefill and num_new < num_remaining:
                    break
                if not self.block_manager.allocate_slots(seq, num_new, computed_blocks):
                    break  # head-of-line blocking keeps admission FIFO-fair
                self._waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self._running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def complete_step(self, out: SchedulerOutput) -> list[Sequence]:
        """Record that the step computed its scheduled tokens.

        Returns the sequences whose tokens are now all computed (the engine samples
        and appends one token to each); sequences mid-prefill are not returned, nor
        are sequences finished (e.g. aborted) while the step ran.
        """
        ready = []
        for scheduled in out.scheduled:
            seq = scheduled.seq
            if seq.is_finished:
                continue
            seq.num_computed_tokens += scheduled.num_new_tokens
            assert seq.num_computed_tokens <= seq.num_tokens, seq
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(seq)
        return ready

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free ``seq``'s blocks and requeue it at the front, to be recomputed."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        logger.debug("preempted %r (KV cache full; %d free blocks)", seq,
                     self.block_manager.num_free_blocks)

    # ------------------------------------------------------------ finishing
    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark ``seq`` finished, free its blocks and drop it from the queues. Idempotent."""
        assert status.is_finished, status
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of ``request_id`` as aborted, waiting or running."""
        seqs = [seq for seq in (*self._running, *self._waiting) if seq.request_id == request_id]
        for seq in seqs:
            self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

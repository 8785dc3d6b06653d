"""Micro-batches in flight for pipeline parallelism (vLLM's virtual engines).

With one batch in flight, pipeline stages take turns: while stage 1 runs step N, stage 0
waits, because step N+1's decodes need step N's tokens. Splitting the running sequences
into M micro-batches, each step scheduling only one of them (in turn), makes consecutive
steps independent: the engine keeps M steps in flight, and stage 0 runs micro-batch k+1
while stage 1 runs micro-batch k.

A sequence joins the micro-batch of the step that admits it and stays there until it
finishes or is preempted (re-admitted, it may join another). Each micro-batch admits at
most ceil(max_num_seqs / M) sequences, so the running set splits evenly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


class MicroBatches:
    """Which micro-batch each running sequence belongs to, and which one steps next."""

    def __init__(self, count: int, max_num_seqs: int) -> None:
        self.count = count
        self.current = 0                 # the micro-batch the next schedule() fills
        self.cap = math.ceil(max_num_seqs / count)
        self._of: dict[int, int] = {}    # seq id -> micro-batch

    def skips(self, seq_id: int) -> bool:
        """Whether this step passes over a running sequence (it is another micro-batch's)."""
        return self._of.get(seq_id, self.current) != self.current

    def has_room(self, running: Iterable[Any]) -> bool:
        """Whether the current micro-batch may admit one more sequence."""
        current = self.current
        return sum(1 for seq in running if self._of.get(seq.seq_id) == current) < self.cap

    def admit(self, seq_id: int) -> None:
        self._of[seq_id] = self.current

    def forget(self, seq_id: int) -> None:
        self._of.pop(seq_id, None)

    def advance(self) -> None:
        self.current = (self.current + 1) % self.count

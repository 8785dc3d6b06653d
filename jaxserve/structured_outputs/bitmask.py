"""The step's grammar bitmask: i32[rows, ceil(V / 32)] in batch order, bit 1 = allowed.

Only rows that sample a token from a constrained sequence are filled from their
matchers; every other row is all ones (-1). Each such row's matcher has seen every
token of its sequence: the scheduler never schedules a constrained sequence while
it has a pending (unseen) token.

A matcher is one request's data: if it raises, that row stays all ones (its sampled
token is never used) and the sequence is reported back, so the engine ends that request
with finish_reason "error" while the step runs for everyone else.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxserve.step_contract import SchedulerOutput


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def grammar_bitmask(out: SchedulerOutput, get_seq: Callable, vocab_size: int
                    ) -> tuple[np.ndarray | None, dict[int, Exception]]:
    """The bitmask of ``out``'s rows (None when no sampling row is constrained), and the
    sequences (seq id -> exception) whose matcher raised while filling its row."""
    bitmask = None
    faults: dict[int, Exception] = {}
    for row, (seq_id, sampling) in enumerate(zip(out.seq_ids, out.is_sampling)):
        if not sampling:
            continue
        seq = get_seq(seq_id)
        if seq is None or seq.grammar is None:
            continue
        assert seq.num_pending_tokens == 1, "a constrained row ran with an unseen token"
        if bitmask is None:
            bitmask = np.full((out.num_rows, bitmask_words(vocab_size)), -1, np.int32)
        try:
            seq.grammar.fill_bitmask(bitmask, row)
        except Exception as exc:   # this request's matcher: it alone fails
            bitmask[row] = -1
            faults[seq_id] = exc
    return bitmask, faults

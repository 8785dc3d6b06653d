"""One sequence's grammar state: an xgrammar matcher advanced with each accepted token.

Lives on the `Sequence` (``seq.grammar``); each of a request's n sequences has its own.
The matcher sees exactly the sequence's output tokens, in order, when the host first
learns them (output processing). Preemption by recompute keeps the output tokens, so
the matcher is kept too: after the recompute the next token continues the same state.

With ``start_after`` (a reasoning model's end-of-thinking token id), the grammar applies
only to the tokens after that token: until it is sampled every token is allowed and none
reaches the matcher (as vLLM: the constraint starts where the answer starts).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np


class SeqGrammar:
    __slots__ = ("_future", "_matcher", "_start_after")

    def __init__(self, compiled: Future, start_after: int | None = None) -> None:
        self._future = compiled
        self._matcher: Any = None
        self._start_after = start_after           # None once the constraint is active

    @property
    def is_ready(self) -> bool:
        """The grammar compiled (the sequence may be scheduled). A failed one never is: the
        engine ends its request (EngineCore._fail_unbuildable_grammars)."""
        return self._future.done() and self._future.exception() is None

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._future.result())   # raises if it failed
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        if self._start_after is not None:
            if token_id == self._start_after:
                self._start_after = None
            return True
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self._start_after is None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (packed i32, bit 1 = allowed)."""
        if self._start_after is not None:
            bitmask[row] = -1
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

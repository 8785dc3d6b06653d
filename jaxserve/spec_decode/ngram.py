"""N-gram prompt lookup (vLLM's ``method: ngram``): propose the tokens that followed the
latest earlier occurrence of each sequence's suffix.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens are
searched for in the sequence's own history (prompt and output); the longest n that matches
wins, its most recent earlier occurrence gives up to k continuation tokens. Runs on the
host in numpy over the whole batch at once: one padded [B, L] array, one sliding-window
comparison per n, so the cost is a few vector passes, never a Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def reset(self) -> None:
        """Nothing to drop: proposals read only the histories they are given."""

    def propose(self, histories: Sequence[Sequence[int]], max_drafts: Sequence[int]
                ) -> list[list[int]]:
        """Per sequence, up to min(k, max_drafts[i]) draft tokens (empty: no match)."""
        batch = len(histories)
        if batch == 0:
            return []
        lengths = np.fromiter((len(h) for h in histories), np.int64, batch)
        width = int(lengths.max())
        tokens = np.full((batch, width), -1, np.int64)
        for i, history in enumerate(histories):      # one copy per row, not per token
            tokens[i, :lengths[i]] = history
        rows = np.arange(batch)
        found = np.full(batch, -1, np.int64)          # where the continuation starts
        for n in range(min(self.max_n, width - 1), self.min_n - 1, -1):
            todo = (found < 0) & (lengths > n)
            if not todo.any():
                continue
            suffix_idx = lengths[:, None] - n + np.arange(n)          # [B, n]
            suffix = tokens[rows[:, None], np.maximum(suffix_idx, 0)]
            windows = sliding_window_view(tokens, n, axis=1)          # [B, width-n+1, n]
            match = (windows == suffix[:, None, :]).all(-1)
            starts = np.arange(windows.shape[1])
            # An earlier occurrence: it ends before the suffix's own last token, so at least
            # one token follows it.
            match &= starts[None, :] + n < lengths[:, None]
            match &= todo[:, None]
            has = match.any(1)
            latest = windows.shape[1] - 1 - np.argmax(match[:, ::-1], 1)
            found = np.where(has, latest + n, found)
        limit = np.minimum(self.k, np.asarray(max_drafts, np.int64))
        counts = np.where(found >= 0, np.minimum(limit, lengths - found), 0)
        counts = np.maximum(counts, 0)
        return [tokens[i, found[i]:found[i] + counts[i]].tolist() if counts[i] else []
                for i in range(batch)]

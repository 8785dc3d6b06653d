"""The one place that decides which step shapes exist (warm-up and serving agree).

A step is padded to a token bucket T (a power of two) and a sequence bucket
S = min(T, seq_cap), where seq_cap is max_num_seqs rounded up to a power of two.
Tying S to T gives one compiled shape per token bucket: a decode step of n
sequences is exactly (T, S) = (p, p) with p = next_pow2(n), and a prefill step
pays at most `S` rows of lm_head for its padding — cheap next to the layers.

Speculative decoding adds narrow shapes: a verify step of n sequences carries up to
n·(k+1) tokens, which the rule above pads to S = T rows -- and the verifier computes logits
and samples for every token of every one of those rows. A single stream with k = 4 drafts
would pay 8 rows × 5 positions of lm_head and sampler, several times a decode step where
a verify step should cost little more than one. So with drafting on, (next_pow2(n·(k+1)), n) for every
power of two n up to the drafting cut is a shape too, chosen for a step of n sequences or
fewer with more tokens than sequences (a verify step with fewer drafts pads its tokens).
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 1 up to (and including) the padded token budget."""
    top = next_power_of_2(max_num_batched_tokens)
    buckets, t = [], 1
    while t <= top:
        buckets.append(t)
        t *= 2
    return buckets


class BucketPolicy:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, *,
                 num_spec_tokens: int = 0, max_spec_rows: int = 0) -> None:
        self.token_buckets = token_buckets(max_num_batched_tokens)
        self.seq_cap = next_power_of_2(max_num_seqs)
        # Verify-step shapes (T, S) with S < min(T, seq_cap); see the module docstring.
        self.spec_shapes: set[tuple[int, int]] = set()
        n = 1
        while num_spec_tokens and n <= min(max_spec_rows, self.seq_cap):
            t = next_power_of_2(n * (num_spec_tokens + 1))
            if t <= self.token_buckets[-1] and n < min(t, self.seq_cap):
                self.spec_shapes.add((t, n))
            n *= 2

    def shape_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """(T, S) padded shape for a step with this many tokens and sequences."""
        t = next_power_of_2(max(num_tokens, num_seqs, 1))
        if t > self.token_buckets[-1]:
            raise ValueError(f"step of {num_tokens} tokens exceeds the largest bucket "
                             f"{self.token_buckets[-1]}")
        if num_tokens > num_seqs and self.spec_shapes:      # some row has drafts (or a chunk)
            s = next_power_of_2(max(num_seqs, 1))
            narrow = next(((ts, ss) for ts, ss in sorted(self.spec_shapes)
                           if ss == s and ts >= t), None)
            if narrow is not None:    # pad the tokens, not the rows: rows cost k+1 logits each
                return narrow
        return t, min(t, self.seq_cap)

    def all_shapes(self) -> list[tuple[int, int]]:
        """Every compiled shape, by tokens then sequences (the largest last)."""
        return sorted({(t, min(t, self.seq_cap)) for t in self.token_buckets}
                      | self.spec_shapes)

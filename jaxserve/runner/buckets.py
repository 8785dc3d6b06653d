"""The one place that decides which step shapes exist (warm-up and serving agree).

A step is padded to a token bucket T (a power of two) and a sequence bucket
S = min(T, seq_cap), where seq_cap is max_num_seqs rounded up to a power of two.
Tying S to T gives one compiled shape per token bucket: a decode step of n
sequences is exactly (T, S) = (p, p) with p = next_pow2(n), and a prefill step
pays at most `S` rows of lm_head for its padding — cheap next to the layers.
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
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.token_buckets = token_buckets(max_num_batched_tokens)
        self.seq_cap = next_power_of_2(max_num_seqs)

    def shape_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """(T, S) padded shape for a step with this many tokens and sequences."""
        t = next_power_of_2(max(num_tokens, num_seqs, 1))
        if t > self.token_buckets[-1]:
            raise ValueError(f"step of {num_tokens} tokens exceeds the largest bucket "
                             f"{self.token_buckets[-1]}")
        return t, min(t, self.seq_cap)

    def all_shapes(self) -> list[tuple[int, int]]:
        return [(t, min(t, self.seq_cap)) for t in self.token_buckets]

"""What an engine reports about itself: gauges and counters at one moment, and how the
snapshots of data-parallel replicas combine into one (the server publishes one after each step)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges and counters at one moment (the server publishes one after each step)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0          # fraction of KV blocks referenced, [0, 1]
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0        # tokens looked up / found in the prefix cache
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    max_num_active_seqs: int = 0         # the RUNNING cap (--max-num-active-seqs)
    num_held_by_active_cap: int = 0      # waiting sequences that cap kept out
    num_prompt_tokens: int = 0           # totals since start
    num_generation_tokens: int = 0
    num_steps: int = 0
    spec_decode_num_drafts: int = 0          # speculative decoding: rows that had drafts,
    spec_decode_num_draft_tokens: int = 0    # draft tokens verified, and accepted
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()   # accepted at draft position j
    max_lora: int = 0                                 # LoRA slots (0: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()   # sorted names: adapters of running /
    waiting_lora_adapters: tuple[str, ...] = ()   # waiting requests


def combine_snapshots(parts: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """Replicas' snapshots as one engine's: counts add, per-position counts add position by
    position, adapter names unite, and KV usage is the used fraction of all replicas' blocks."""
    def combine(name: str, values: list):
        if name == "kv_cache_usage":
            used = sum(p.kv_cache_usage * p.num_blocks for p in parts)
            return used / max(1, sum(p.num_blocks for p in parts))
        if name.endswith("_lora_adapters"):
            return tuple(sorted(set().union(*values)))
        if name == "spec_decode_accepted_per_pos":
            width = max(map(len, values), default=0)
            return tuple(sum(v[j] for v in values if j < len(v)) for j in range(width))
        return sum(values)

    return EngineSnapshot(**{f.name: combine(f.name, [getattr(p, f.name) for p in parts])
                             for f in dataclasses.fields(EngineSnapshot)})

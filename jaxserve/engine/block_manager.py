"""Paged KV-cache blocks: allocation, reference counts and the prefix cache.

Every block holds ``block_size`` consecutive tokens of one or more sequences.
A block is *used* while some block table references it (``ref > 0``) and
*free* otherwise; a free block whose contents are registered in the prefix
cache stays findable until the allocator hands it out again (eviction).

Prefix caching identifies a full block by a hash chain over its tokens:
``hash_i = hash((hash_{i-1}, tuple(tokens of block i)))``, so a hit on block
``i`` implies the whole prefix up to block ``i`` matches. Each cache entry
keeps its parent hash and token tuple and a lookup checks them, so a 64-bit
hash collision cannot serve the wrong KV. A sequence under a LoRA adapter starts its chain
from the adapter's key instead of ``_NO_PARENT`` (`_root`): the same prompt under two
adapters (or an adapter and the base model) has different KV and never shares blocks.

The free pool is one ordered dict used as an LRU queue: allocation takes from
the front, a freed cached block goes to the back (evicted last), a freed block
with no cached contents goes to the front (it has nothing worth keeping).
Allocation, free, hit and eviction are O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from jaxserve.engine.sequence import Sequence

_NO_PARENT = -1  # parent hash of a sequence's first block


def _root(seq: Sequence) -> int:
    """The parent hash of seq's first block: its LoRA adapter's key, if it has one."""
    return _NO_PARENT if seq.lora is None else hash(("lora", *seq.lora.key))


class BlockManager:
    """Ref-counted KV-cache blocks ``0 .. num_blocks-1`` with a hash-chained prefix cache."""

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free block ids in eviction order (front is handed out first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix cache: hash -> block, and per block its (parent hash, tokens) for verification.
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        # How many leading blocks of each live sequence are registered (or were hits).
        # seq id -> how many of its leading blocks are in the prefix cache (read by the
        # scheduler's per-step loop to skip `cache_full_blocks` calls with nothing to do)
        self.num_registered: dict[int, int] = {}
        self.prefix_cache_queries = 0   # tokens looked up
        self.prefix_cache_hits = 0      # tokens found

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, including cached ones that can be evicted."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_registered_blocks(self, seq: Sequence) -> int:
        """Leading blocks of live `seq` that are in the prefix cache (registered or hits)."""
        return self.num_registered.get(seq.seq_id, 0)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest prefix-cache hit for a waiting ``seq``: (block ids, number of tokens).

        Only whole blocks count, and at most ``seq.num_tokens - 1`` tokens, because the
        last token must still run through the model to give logits. Takes no references;
        pass the blocks to ``allocate_slots`` in the same scheduling step.
        """
        assert seq.num_computed_tokens == 0 and not seq.block_table, seq
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_hit_blocks)
        blocks: list[int] = []
        parent = _root(seq)
        for i in range(max_hit_blocks):
            block_hash = seq.block_hashes[i]
            block = self._hash_to_block.get(block_hash)
            if block is None or self._block_key[block] != (parent, self._block_tokens(seq, i)):
                break
            blocks.append(block)
            parent = block_hash
        return blocks, len(blocks) * self.block_size

    # --------------------------------------------------------------- mutations
    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Grow ``seq.block_table`` to hold ``num_new_tokens`` more tokens.

        Pass ``computed_blocks`` (the result of ``get_computed_blocks``, possibly empty)
        when admitting a waiting sequence, None otherwise: the hit blocks are referenced
        first and become the sequence's cached, already computed prefix. Free cached
        blocks count as free. Returns False, changing nothing, when there are not enough.
        """
        first_allocation = computed_blocks is not None  # a waiting seq being admitted
        if not first_allocation and (seq.num_computed_tokens + num_new_tokens
                                     <= len(seq.block_table) * self.block_size):
            return True     # fits in the blocks it has: most decode steps end here
        computed_blocks = computed_blocks or []
        if first_allocation:
            assert seq.num_computed_tokens == 0 and not seq.block_table, seq
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_needed - len(seq.block_table) - len(computed_blocks))
        # A hit on a free (evictable) block uses up a free block just like a new one.
        num_revived = sum(1 for block in computed_blocks if self.ref_counts[block] == 0)
        if num_new_blocks + num_revived > len(self._free):
            return False

        for block in computed_blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        if first_allocation:
            self.num_registered[seq.seq_id] = len(computed_blocks)  # hits are registered
            seq.num_computed_tokens = num_computed
            seq.num_cached_tokens = num_computed
            if self.enable_prefix_caching:
                # Counted per admission (not per attempt), in tokens, as vLLM counts them.
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_computed
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose tokens the host knows: with async scheduling the newest computed
        # position may hold a token still pending on the device.
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        start = self.num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(seq, num_full)
        for i in range(start, num_full):
            block_hash = seq.block_hashes[i]
            if block_hash in self._hash_to_block:
                # Another sequence computed the same block first; keep its entry and let
                # this duplicate go back to the pool uncached when it is freed.
                continue
            block = seq.block_table[i]
            parent = seq.block_hashes[i - 1] if i > 0 else _root(seq)
            self._hash_to_block[block_hash] = block
            self._block_hash[block] = block_hash
            self._block_key[block] = (parent, self._block_tokens(seq, i))
        self.num_registered[seq.seq_id] = num_full

    def rollback(self, seq: Sequence) -> None:
        """Release ``seq``'s tail blocks past its computed tokens (after rejected draft
        tokens were rolled back from ``seq.num_computed_tokens``). Such a block holds only
        rejected tokens: it is the sequence's own (ref 1) and was never registered."""
        num_needed = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > num_needed:
            block = seq.block_table.pop()
            assert self.ref_counts[block] == 1 and self._block_hash[block] is None, block
            self.ref_counts[block] = 0
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        registered = self.num_registered.get(seq.seq_id)
        if registered is not None and registered > len(seq.block_table):
            self.num_registered[seq.seq_id] = len(seq.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references and clear its block table. Safe to call twice."""
        # Reverse order: a sequence's tail blocks are the least likely to be shared
        # again, so they reach the front of the LRU queue first.
        for block in reversed(seq.block_table):
            assert self.ref_counts[block] > 0, f"block {block} freed twice"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self._block_hash[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table.clear()
        self.num_registered.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only possible (returns True) when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        self._hash_to_block.clear()
        self._block_hash = [None] * self.num_blocks
        self._block_key = [None] * self.num_blocks
        return True

    # ---------------------------------------------------------------- helpers
    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        block_hash = self._block_hash[block]
        if block_hash is not None:  # evict its cached contents
            del self._hash_to_block[block_hash]
            self._block_hash[block] = None
            self._block_key[block] = None
        self.ref_counts[block] = 1
        return block

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Compute ``seq.block_hashes`` up to ``num_blocks`` full blocks (each only once;
        token ids only ever grow, so earlier hashes stay valid)."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i > 0 else _root(seq)
            hashes.append(hash((parent, self._block_tokens(seq, i))))

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError on any inconsistency (for tests).

        With ``seqs`` (every sequence that may hold blocks), also check that each
        block's ref count equals the number of block tables holding it.
        """
        assert len(self.ref_counts) == self.num_blocks
        assert all(ref >= 0 for ref in self.ref_counts), "negative ref count"
        free = set(self._free)
        assert len(free) == len(self._free)
        assert free == {b for b, ref in enumerate(self.ref_counts) if ref == 0}, \
            "free pool must hold exactly the unreferenced blocks"
        assert all(0 <= b < self.num_blocks for b in free)
        for block_hash, block in self._hash_to_block.items():
            assert self._block_hash[block] == block_hash, f"stale hash entry for block {block}"
        for block, block_hash in enumerate(self._block_hash):
            assert (block_hash is None) == (self._block_key[block] is None)
            if block_hash is not None:
                assert self._hash_to_block.get(block_hash) == block
        if not self.enable_prefix_caching:
            assert not self._hash_to_block
        if seqs is not None:
            holders = [0] * self.num_blocks
            for seq in seqs:
                assert len(set(seq.block_table)) == len(seq.block_table), seq
                for block in seq.block_table:
                    holders[block] += 1
            assert holders == self.ref_counts, "ref counts differ from block tables"

"""BlockManager: allocation, ref counts, the prefix cache and its LRU eviction."""

from __future__ import annotations

import pytest

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sequence import Sequence

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`


def make_seq(tokens, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens), sampling_params=None)


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` with its prefix-cache hit and compute all its tokens in one step."""
    blocks, num_cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - num_cached, blocks)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_block_table_covers_new_tokens_and_grows_a_block_at_a_time():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(5))
    assert bm.allocate_slots(seq, 5, [])
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    seq.num_computed_tokens = 5
    seq.append_token(7)
    assert bm.allocate_slots(seq, 1)            # position 5 fits in block 1
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 6
    for token in (8, 9):
        seq.append_token(token)
    assert bm.allocate_slots(seq, 2)            # positions 6, 7 fill block 1
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    seq.append_token(10)
    assert bm.allocate_slots(seq, 1)            # position 8 needs block 2
    assert len(seq.block_table) == 3
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants([seq])


def test_prefix_hit_after_first_seq_blocks_are_cached_and_freed():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(range(10))
    run_prefill(bm, first)
    first_blocks = list(first.block_table)
    bm.free(first)
    assert bm.num_free_blocks == 8
    second = make_seq([*range(10), 42, 43])      # same 10-token prefix, then differs
    blocks, num_cached = bm.get_computed_blocks(second)
    assert blocks == first_blocks[:2] and num_cached == 8
    assert bm.allocate_slots(second, second.num_tokens - num_cached, blocks)
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert second.block_table[:2] == first_blocks[:2]
    assert bm.prefix_cache_queries == 10 + 12 and bm.prefix_cache_hits == 8
    bm.check_invariants([second])


def test_prefix_hit_shares_blocks_of_a_running_seq():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(range(9))
    run_prefill(bm, first)
    second = make_seq(range(9))
    run_prefill(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert bm.ref_counts[first.block_table[0]] == 2
    bm.check_invariants([first, second])
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_prefix_hit_is_capped_so_the_last_token_is_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    run_prefill(bm, make_seq(range(8)))
    exact = make_seq(range(8))                   # two full blocks, all cached
    blocks, num_cached = bm.get_computed_blocks(exact)
    assert len(blocks) == 1 and num_cached == 4
    longer = make_seq(range(9))
    assert bm.get_computed_blocks(longer)[1] == 8


def test_hit_requires_whole_prefix_to_match():
    bm = BlockManager(num_blocks=8, block_size=4)
    run_prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 1 has the same tokens, but its parent block differs: no hit at all.
    assert bm.get_computed_blocks(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == ([], 0)


def test_hash_collision_does_not_serve_wrong_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    run_prefill(bm, make_seq([1, 2, 3, 4, 5]))
    other = make_seq([9, 9, 9, 9, 5])
    other.block_hashes = [hash((-1, (1, 2, 3, 4)))]   # forge the colliding hash
    assert bm.get_computed_blocks(other) == ([], 0)


def test_lru_eviction_reuses_least_recently_freed_cached_block_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = make_seq([1, 1, 0]), make_seq([2, 2, 0])
    run_prefill(bm, old)
    run_prefill(bm, new)
    old_full, new_full = old.block_table[0], new.block_table[0]
    bm.free(old)
    bm.free(new)
    # Uncached partial blocks are handed out first, then the least recently freed cached one.
    taker = make_seq([5, 5, 5, 5, 5])
    assert bm.allocate_slots(taker, 5, [])
    assert old_full in taker.block_table and new_full not in taker.block_table
    assert bm.get_computed_blocks(make_seq([1, 1, 0])) == ([], 0)          # evicted
    assert bm.get_computed_blocks(make_seq([2, 2, 0])) == ([new_full], 2)  # still cached
    bm.check_invariants([taker])


def test_free_releases_tail_blocks_first_for_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7])
    run_prefill(bm, seq)                 # three full cached blocks and a partial one
    head, middle, tail, partial = seq.block_table
    bm.free(seq)
    taker = make_seq([9, 9, 9, 9, 9])
    assert bm.allocate_slots(taker, 5, [])
    # The uncached partial block goes first; then, of the cached blocks, the tail ones.
    assert taker.block_table == [partial, tail, middle]
    assert bm.get_computed_blocks(make_seq([1, 2, 9])) == ([head], 2)


def test_disabled_prefix_caching_never_hits_or_hashes():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = make_seq(range(9))
    run_prefill(bm, first)
    bm.free(first)
    second = make_seq(range(9))
    assert bm.get_computed_blocks(second) == ([], 0)
    assert first.block_hashes == [] and second.block_hashes == []
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0
    bm.check_invariants([])


def test_failed_allocation_leaves_state_unchanged():
    bm = BlockManager(num_blocks=4, block_size=2)
    cached = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, cached)                   # 3 blocks, 2 of them cached
    bm.free(cached)
    holder = make_seq([7, 7])
    assert bm.allocate_slots(holder, 2, [])   # takes the uncached block, 3 evictable remain
    seq = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks, _ = bm.get_computed_blocks(seq)
    assert len(blocks) == 2
    before = (list(bm.ref_counts), bm.num_free_blocks, list(bm._free), dict(bm._hash_to_block))
    assert not bm.allocate_slots(seq, 5, blocks)    # needs 2 hits + 3 new = 5 > 3 free
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert (list(bm.ref_counts), bm.num_free_blocks, list(bm._free),
            dict(bm._hash_to_block)) == before
    assert bm.allocate_slots(seq, 1, blocks)        # 2 hits + 1 new fits
    bm.check_invariants([holder, seq])


def test_free_twice_is_harmless():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3])
    run_prefill(bm, seq)
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.block_table == []
    bm.check_invariants([seq])


def test_duplicate_block_computed_by_two_seqs_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    first, second = make_seq([1, 2, 3]), make_seq([1, 2, 3])
    for seq in (first, second):                   # both admitted before either computes
        assert bm.allocate_slots(seq, 3, bm.get_computed_blocks(seq)[0])
    for seq in (first, second):
        seq.num_computed_tokens = 3
        bm.cache_full_blocks(seq)
    bm.check_invariants([first, second])
    assert bm.get_computed_blocks(make_seq([1, 2, 3]))[0] == [first.block_table[0]]
    bm.free(first)
    bm.free(second)
    bm.check_invariants([])


def test_reset_prefix_cache_only_when_no_block_is_used():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3])
    run_prefill(bm, seq)
    assert not bm.reset_prefix_cache()
    bm.free(seq)
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(make_seq([1, 2, 3])) == ([], 0)
    bm.check_invariants([])


def test_block_filled_over_several_steps_is_cached_with_its_full_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq([1, 2, 3, 4, 5, 6])
    assert bm.allocate_slots(seq, 6, bm.get_computed_blocks(seq)[0])
    seq.num_computed_tokens = 6                    # block 1 half computed: not cached yet
    bm.cache_full_blocks(seq)
    for token in (7, 8):                           # decodes fill block 1
        seq.append_token(token)
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    table = list(seq.block_table)
    bm.free(seq)
    blocks, num_cached = bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert num_cached == 8 and blocks == table[:2]
    bm.check_invariants([])


def test_rollback_of_rejected_drafts_frees_their_blocks_and_never_caches_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(7))
    run_prefill(bm, seq)                       # 7 computed; blocks 0-1 (block 0 cached)
    seq.num_computed_tokens = 6                # the newest token (position 6) is not yet
    seq.append_token(50)                       # ... a decode: newest + 4 drafts = 5 slots
    assert bm.allocate_slots(seq, 5)           # positions 6..10 → a third block
    seq.num_computed_tokens += 5
    assert len(seq.block_table) == 3
    tail = seq.block_table[2]
    seq.num_computed_tokens -= 3               # 1 draft accepted of 4: computed = 8
    bm.rollback(seq)
    assert len(seq.block_table) == 2 and bm.ref_counts[tail] == 0
    bm.check_invariants([seq])
    seq.token_ids += [51, 52]                  # the accepted draft and the correction
    bm.cache_full_blocks(seq)                  # block 1 (positions 4-7) is full: cached
    other = make_seq(seq.token_ids[:8] + [99, 98, 97])
    blocks, num_cached = bm.get_computed_blocks(other)
    assert num_cached == 8 and blocks == seq.block_table[:2]
    bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8

"""BlockManager: on-demand blocks, reference counts, prefix sharing, cache invalidation."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colorl.engines.native import block_manager as bm_module
from colorl.engines.native.block_manager import BlockManager, block_key, chain_root


def _offer(bm: BlockManager, blocks: list[int], tokens: list[int]) -> None:
    """Register `blocks` as holding the full blocks of `tokens`, the way the scheduler does."""
    parent = chain_root(bm.epoch)
    for i, block in enumerate(blocks):
        chunk = tokens[i * bm.block_size:(i + 1) * bm.block_size]
        parent = block_key(parent, chunk)
        bm.register(block, parent, chunk)


def test_policy_modules_do_not_import_torch():
    from colorl.engines.native import scheduler

    for module in (bm_module, scheduler):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in imported, module.__name__


def test_allocate_and_free_track_counts():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.blocks_for(5) == 3
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 1 and bm.num_used_blocks == 3
    assert not bm.can_allocate(2)
    with pytest.raises(RuntimeError):
        bm.allocate(2)
    bm.free(a)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        bm.free(a[:1])


def test_prefix_match_shares_full_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    first = bm.allocate(3)
    _offer(bm, first[:2], prompt)
    blocks, keys = bm.match_prefix(prompt, max_blocks=2)
    assert blocks == first[:2] and len(keys) == 2
    assert bm.ref_counts[first[0]] == 2 and bm.num_used_blocks == 3
    # a different second block stops the match after the first
    other = prompt[:4] + [99] + prompt[5:]
    blocks, _ = bm.match_prefix(other, max_blocks=2)
    assert blocks == first[:1]
    # max_blocks caps the match
    assert bm.match_prefix(prompt, max_blocks=0) == ([], [])


def test_freed_blocks_keep_content_until_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4]
    blocks = bm.allocate(2)
    _offer(bm, blocks, tokens)
    bm.free(blocks)
    assert bm.num_free_blocks == 3
    hit, _ = bm.match_prefix(tokens, max_blocks=2)
    assert hit == blocks and bm.num_free_blocks == 1  # revived from the free list
    bm.free(hit)
    bm.allocate(3)  # evicts everything
    bm.free(list(range(3)))
    assert bm.match_prefix(tokens, max_blocks=2) == ([], [])


def test_reset_prefix_cache_stops_sharing():
    bm = BlockManager(num_blocks=4, block_size=2)
    blocks = bm.allocate(1)
    _offer(bm, blocks, [7, 8])
    bm.reset_prefix_cache()
    assert bm.match_prefix([7, 8, 9], max_blocks=1) == ([], [])
    # a registration under the old epoch's chain is never matched by new lookups
    _offer_old = block_key(chain_root(bm.epoch - 1), [7, 8])
    bm.register(blocks[0], _offer_old, [7, 8])
    assert bm.match_prefix([7, 8, 9], max_blocks=1) == ([], [])


def test_hash_collision_is_guarded_by_tokens():
    bm = BlockManager(num_blocks=2, block_size=2)
    block = bm.allocate(1)[0]
    key = block_key(chain_root(bm.epoch), [5, 6])
    bm.register(block, key, [1, 1])  # same key, different content
    assert bm.match_prefix([5, 6, 0], max_blocks=1) == ([], [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "match"]), st.integers(0, 5)), max_size=40))
def test_random_operations_keep_invariants(ops):
    bm = BlockManager(num_blocks=6, block_size=2)
    held: list[list[int]] = []  # each entry: the blocks of one owner
    for op, n in ops:
        if op == "alloc" and bm.can_allocate(n):
            blocks = bm.allocate(n)
            _offer(bm, blocks, [n] * (2 * n))
            held.append(blocks)
        elif op == "free" and held:
            bm.free(held.pop(n % len(held)))
        elif op == "match":
            blocks, _ = bm.match_prefix([n] * (2 * n), max_blocks=n)
            held.append(blocks)
        expected = [0] * bm.num_blocks
        for blocks in held:
            for b in blocks:
                expected[b] += 1
        assert bm.ref_counts == expected
        assert bm.num_free_blocks == sum(1 for c in expected if c == 0)


def test_allocation_reuses_warm_blocks_before_touching_new_memory():
    bm = BlockManager(num_blocks=100, block_size=2)
    for _ in range(50):  # a steady state of 3 live blocks touches only a handful
        blocks = bm.allocate(3)
        bm.free(blocks)
    assert bm.num_touched_blocks == 3
    cached = bm.allocate(2)
    _offer(bm, cached, [1, 2, 3, 4])
    bm.free(cached)
    bm.allocate(5)  # 1 warm, then the 2 cached ones are evicted before touching cold blocks
    assert bm.num_touched_blocks == 5
    assert bm.match_prefix([1, 2, 3, 4], max_blocks=2) == ([], [])

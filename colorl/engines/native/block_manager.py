"""KV-cache blocks: who owns which fixed-size block, and which full blocks can be shared.

Pure Python (no torch): the model runner owns the tensors, this module only hands out block ids.

- A block holds `block_size` consecutive tokens of one sequence. Blocks are taken on demand as a
  sequence grows; nothing is reserved for its maximum length.
- Prefix sharing: a *full* block is keyed by a hash chain over its tokens and every token before
  it (plus a cache epoch, bumped whenever cached KV stops being valid, e.g. on a weight update).
  A new sequence whose leading full blocks match reuses them (reference count + 1) instead of
  recomputing them, so the S samples of a GRPO group prefill their shared prompt once.
- A block whose reference count drops to zero is free but keeps its content and its key, so a
  later identical prefix (a resumed request, a recomputed preempted one, the next group with the
  same system prompt) can still hit it.
- Allocation order: a free block without cached content that has been used before, else the
  least recently freed cached block (evicting its content), else a never-used block. So the part
  of the pool ever touched stays as small as the peak need: on CPU the pool is allocated lazily
  and untouched pages cost no memory. (A pure LRU over the whole pool would keep more cached
  prefixes but touch every block of a pool sized by `memory_fraction`.)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """Key of a full block: its tokens chained on the key of the block before it."""
    return hash((parent, tuple(tokens)))


def chain_root(epoch: int) -> int:
    """Key that the first block of every sequence chains on; a new epoch starts a new namespace."""
    return hash(("colorl-kv", epoch))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._cold = list(range(num_blocks - 1, -1, -1))  # never used; pop() gives 0, 1, 2, ...
        self._warm: list[int] = []  # used before, no cached content; reused last-freed first
        self._cached: OrderedDict[int, None] = OrderedDict()  # free with cached content, LRU first
        self._key_of: dict[int, int] = {}  # block id -> key, for full blocks with reusable content
        self._block_of: dict[int, int] = {}  # key -> block id
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block id -> tokens (guards hash collisions)
        self.epoch = 0

    # ------------------------------------------------------------ capacity
    @property
    def num_free_blocks(self) -> int:
        return len(self._cold) + len(self._warm) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out: the part of the pool whose memory is really in use."""
        return self.num_blocks - len(self._cold)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """Take n fresh blocks (warm, then evicted cached, then cold), forgetting cached content."""
        if not self.can_allocate(n):
            raise RuntimeError(f"allocate({n}) with only {self.num_free_blocks} free blocks; check can_allocate first")
        taken = []
        for _ in range(n):
            if self._warm:
                block = self._warm.pop()
            elif self._cached:
                block, _ = self._cached.popitem(last=False)
            else:
                block = self._cold.pop()
            self._forget(block)
            self.ref_counts[block] = 1
            taken.append(block)
        return taken

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks become free (content kept for reuse)."""
        for block in blocks:
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed more times than it was taken")
            self.ref_counts[block] = count - 1
            if count == 1:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._warm.append(block)

    # ------------------------------------------------------------ prefix sharing
    def match_prefix(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Take a reference on the longest run of cached full blocks that starts `token_ids`.

        Returns (block ids, their keys). At most `max_blocks` are matched; the caller keeps the
        block holding the last token out of the match so that at least one token is computed.
        """
        blocks, keys = [], []
        parent = chain_root(self.epoch)
        size = self.block_size
        for i in range(min(max_blocks, len(token_ids) // size)):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            key = block_key(parent, tokens)
            block = self._block_of.get(key)
            if block is None or self._tokens_of.get(block) != tokens:
                break
            if self.ref_counts[block] == 0:
                del self._cached[block]
            self.ref_counts[block] += 1
            blocks.append(block)
            keys.append(key)
            parent = key
        return blocks, keys

    def register(self, block: int, key: int, tokens: Sequence[int]) -> None:
        """Offer a full block for sharing. Call it once the block's KV is (or, within the same
        model step, is about to be) written; a block already offered under that key wins."""
        if key in self._block_of or block in self._key_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block
        self._tokens_of[block] = tuple(tokens)

    def reset_prefix_cache(self) -> None:
        """Cached KV no longer matches the weights: stop sharing anything computed so far."""
        self.epoch += 1
        self._warm.extend(self._cached)
        self._cached.clear()
        self._key_of.clear()
        self._block_of.clear()
        self._tokens_of.clear()

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            del self._tokens_of[block]

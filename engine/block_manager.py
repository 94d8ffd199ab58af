"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts and
the prefix cache.

Prefix caching: a block whose tokens are all computed is *committed* under a hash of its content
chained to its predecessors': sha256(parent hash, the block's token ids), rooted in the
sequence's cache salt and adapter version. So a hit means the same salt (the gateway passes the
tenant), the same adapter version (or both the base model) and the same tokens from position 0:
two adapters, an adapter and the base, or two tenants never share KV. The hash is
cryptographic because a chosen collision would let one tenant read another's KV.

A sequence scheduled for the first time (or again after preemption) looks up its full blocks
(`cached_prefix`) and starts with the longest committed run as computed; the hit never covers
its last token, whose logits it needs. Blocks are reference-counted; one whose count drops to 0
keeps its cached content and joins an LRU of reusable blocks, evicted (its hash forgotten) only
when an allocation finds no empty block. Only the blocks of a sequence that failed in a step
are forgotten at once (`discard`): their K/V may be non-finite.

A committed block is never written again: a sequence writes K/V only at positions at or after
its num_computed_tokens, past every block it shares.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from engine.sequence import Sequence


def block_hash_root(cache_salt: str | None, adapter: str | None) -> bytes:
    """The chain's root for a sequence: its salt and adapter version (None for the base model)."""
    h = hashlib.sha256(b"tessera-kv-v1")
    for part in (cache_salt, adapter):
        data = b"\x00" if part is None else b"\x01" + part.encode()
        h.update(len(data).to_bytes(4, "little") + data)
    return h.digest()


class BlockManager:
    """Hands out KV blocks to sequences. Pairs: can_allocate/allocate, free; after each step the
    engine commits its sequences' computed blocks (`commit`)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: Prompt tokens looked up when sequences were first scheduled, and those found cached.
        self.stats = {"query_tokens": 0, "hit_tokens": 0}
        self.reset()

    def reset(self) -> None:
        """Every block free and nothing cached (the engine's reset: no sequence holds blocks)."""
        self._refs = [0] * self.num_blocks
        self._hash_of: list[bytes | None] = [None] * self.num_blocks
        self._cached: dict[bytes, int] = {}
        #: Free blocks holding nothing cached, taken first.
        self.free_blocks: deque[int] = deque(range(self.num_blocks))
        #: Free blocks holding a cached prefix, least recently used first (evicted from the front).
        self._reusable: OrderedDict[int, None] = OrderedDict()

    # -- state --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (empty or holding a reusable cached prefix)."""
        return len(self.free_blocks) + len(self._reusable)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return len(self._reusable)

    def check_consistency(self, live: list[Sequence]) -> None:
        """Raise AssertionError unless the reference counts are exactly the block tables of
        `live` (every sequence holding blocks), the free lists hold the other blocks once each,
        and the hash map and the blocks' hashes agree (tests; O(blocks))."""
        refs = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                refs[b] += 1
        assert refs == self._refs, "reference counts differ from the live block tables"
        free = list(self.free_blocks) + list(self._reusable)
        assert len(free) == len(set(free)), "a block is free twice"
        assert sorted(free) == [b for b in range(self.num_blocks) if refs[b] == 0], "free lists != unreferenced"
        assert all(self._hash_of[b] is None for b in self.free_blocks), "an empty free block holds a hash"
        assert all(self._hash_of[b] is not None for b in self._reusable), "a reusable block lost its hash"
        assert all(self._hash_of[b] == h for h, b in self._cached.items()), "hash map and block hashes differ"
        assert sum(h is not None for h in self._hash_of) == len(self._cached), "a block's hash is not mapped"

    # -- allocation -------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The committed blocks `seq` can start from: the longest run of its leading full blocks
        found in the cache, leaving at least its last token to compute. Empty unless `seq` holds
        no blocks (first scheduling, or after preemption). No side effects."""
        if not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
            return []
        n = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, n)
        hit: list[int] = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hit: list[int] = ()) -> int:
        """Extra blocks `seq` needs to hold `num_new_tokens` more computed tokens (after starting
        from the cached blocks `hit`, which are not counted)."""
        held = len(seq.block_table) + len(hit)
        total = seq.num_computed_tokens + len(hit) * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - held)

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` no sequence holds (a hit on them takes them off the free lists)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def num_exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks only `seq` holds: what freeing it adds to the free blocks."""
        return sum(1 for b in seq.block_table if self._refs[b] == 1)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: list[int] = ()) -> bool:
        return self.blocks_needed(seq, num_new_tokens, hit) <= self.num_free_blocks - self.num_unheld(hit)

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: list[int] = ()) -> None:
        """Take the cached blocks `hit` (from `cached_prefix`; they count as computed) and grow
        seq's block table to fit `num_new_tokens` more tokens; call can_allocate first."""
        if not self.can_allocate(seq, num_new_tokens, hit):
            raise RuntimeError("KV cache out of blocks (call can_allocate first)")
        if seq.num_cached_tokens is None:
            # The first scheduling: what OpenAI's usage reports as cached prompt tokens.
            seq.num_cached_tokens = min(len(hit) * self.block_size, seq.num_prompt_tokens)
            self.stats["query_tokens"] += seq.num_prompt_tokens
            self.stats["hit_tokens"] += seq.num_cached_tokens
        need = self.blocks_needed(seq, num_new_tokens, hit)
        for b in hit:
            if self._refs[b] == 0:
                del self._reusable[b]
            self._refs[b] += 1
        if hit:  # only ever taken into an empty table (cached_prefix)
            seq.block_table.extend(hit)
            seq.num_computed_tokens += len(hit) * self.block_size
            seq.num_committed_blocks = len(hit)
        for _ in range(need):
            b = self._take_free()
            self._refs[b] = 1
            seq.block_table.append(b)

    def _take_free(self) -> int:
        if self.free_blocks:
            return self.free_blocks.popleft()
        b, _ = self._reusable.popitem(last=False)  # the least recently used cached block
        del self._cached[self._hash_of[b]]
        self._hash_of[b] = None
        return b

    # -- after a step ------------------------------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Offer `seq`'s newly computed full blocks to the cache (after the step that computed
        them). A block whose content is already cached under another block stays private, and
        one holding a token whose value is still pending (Sequence.num_pending) waits for it."""
        if not self.enable_prefix_caching:
            return
        full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size, len(seq.block_table))
        if full <= seq.num_committed_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            b, h = seq.block_table[i], hashes[i]
            if self._hash_of[b] is None and h not in self._cached:
                self._cached[h] = b
                self._hash_of[b] = h
        seq.num_committed_blocks = full

    # -- release ------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. A block no one holds any more is free; if it holds a cached
        prefix it stays reusable, most recently used. Tail blocks go first, so they are evicted
        before the shared head of their prefix."""
        for b in reversed(seq.block_table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash_of[b] is not None:
                    self._reusable[b] = None
                else:
                    self.free_blocks.append(b)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def discard(self, seq: Sequence) -> list[int]:
        """Forget the cached content of the blocks only `seq` holds (it failed in a step: their
        K/V may be non-finite) and return them, for the caller to zero before `free`. Blocks
        other sequences hold stay cached: they were computed for the same salt, adapter and
        tokens, so a fault in them is those sequences' fault too."""
        mine = [b for b in seq.block_table if self._refs[b] == 1]
        for b in mine:
            h = self._hash_of[b]
            if h is not None:
                del self._cached[h]
                self._hash_of[b] = None
        return mine

    # -- hashing ------------------------------------------------------------------------------

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """The chained hashes of seq's first `n` full blocks (memoized on the sequence: a
        block's hash depends only on the tokens up to its end, which never change)."""
        hashes = seq.block_hashes
        bs = self.block_size
        if len(hashes) < n:
            parent = hashes[-1] if hashes else block_hash_root(seq.cache_salt, seq.adapter)
            tokens = seq.token_ids
            for i in range(len(hashes), n):
                parent = hashlib.sha256(parent + array("q", tokens[i * bs:(i + 1) * bs]).tobytes()).digest()
                hashes.append(parent)
        return hashes[:n] if len(hashes) > n else hashes

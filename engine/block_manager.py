"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, a free list."""
from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    """Hands out KV blocks to sequences. Pairs: can_allocate/allocate, free."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_new_tokens` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to fit `num_new_tokens` more tokens; call can_allocate first."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError("KV cache out of blocks (call can_allocate first)")
        for _ in range(need):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` to the pool."""
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def reset(self) -> None:
        """Every block free again (the engine's reset: no sequence holds blocks any more)."""
        self.free_blocks = deque(range(self.num_blocks))

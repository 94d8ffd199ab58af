"""The paged KV cache and the attention metadata of one step (the data every backend's attention
reads; the ops are the backend's: engine.backends, torch reference in engine.backends.torch_ops).

The step's tokens are laid out decode-first: tokens [0, num_decode) are one new token each of
`num_decode` decoding sequences; after them come prefill chunks, one contiguous run per sequence.
All tensors live on the engine's device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the step."""

    start: int                 #: index of the chunk's first token in the step's token list
    num_tokens: int            #: tokens in this chunk
    context_len: int           #: tokens cached for the sequence after this chunk (incl. the chunk)
    context_slots: torch.Tensor | None  #: [context_len] cache slots; None when the chunk is the whole context
    mask: torch.Tensor | None  #: [num_tokens, context_len] bool (True = attend); None = causal from 0


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step (built by the model runner)."""

    slot_mapping: torch.Tensor            #: [T] int64: flat cache slot of each token's K/V
    num_decode: int                       #: leading tokens that are single decode tokens
    decode_slots: torch.Tensor | None     #: [num_decode, Lmax] int64 cache slots (padded with the row's own first slots)
    decode_mask: torch.Tensor | None      #: [num_decode, 1, 1, Lmax] bool, True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_lens: torch.Tensor | None = None  #: [num_decode] int64 context length (new token included)


class KVCache:
    """Paged K/V storage: per layer, `[num_blocks * block_size, num_kv_heads, head_dim]`.

    A token's slot is `block_id * block_size + offset`; the block manager owns which blocks
    belong to which sequence.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        slots = num_blocks * block_size
        self.k = [torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

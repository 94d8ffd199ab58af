"""The paged KV cache and the attention metadata of one step (the data every backend's attention
reads; the ops are the backend's: engine.backends, torch reference in engine.backends.torch_ops).

The step's tokens are laid out decode-first: tokens [0, num_decode) are one new token each of
`num_decode` decoding sequences; after them come prefill chunks, one contiguous run per sequence.
All tensors live on the engine's device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes, besides its inputs: head counts and size, the score
    scale, and the family's variations (engine.config.ModelConfig: sliding_window, softcap)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float                       #: factor on q @ k.T
    sliding_window: int | None = None  #: a query at position p sees keys at positions > p - window; None: all
    softcap: float | None = None       #: scores become softcap * tanh(scores / softcap) before masking


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the step."""

    start: int                 #: index of the chunk's first token in the step's token list
    num_tokens: int            #: tokens in this chunk
    context_len: int           #: tokens cached for the sequence after this chunk (incl. the chunk)
    context_slots: torch.Tensor | None  #: [context_len] cache slots; None when the chunk is the whole context
    mask: torch.Tensor | None  #: [num_tokens, context_len] bool (True = attend); None = causal from 0


@dataclass
class PagedMetadata:
    """The block-table form of a step's attention inputs, for backends whose kernels read K/V
    through block tables (ModelRunner builds it instead of the slot lists and masks when
    `backend.paged_attention` is True). Rows of a table past a sequence's own blocks are padding:
    kernels mask by the lengths and never read them."""

    positions: torch.Tensor                      #: [T] int64: position of each token
    decode_block_tables: torch.Tensor | None     #: [num_decode, W] int32
    decode_seq_lens: torch.Tensor | None         #: [num_decode] int32 context length (new token included)
    prefill_block_tables: torch.Tensor | None    #: [S, W'] int32, one row per prefill chunk
    prefill_query_start: torch.Tensor | None     #: [S + 1] int32 chunk boundaries, rows from num_decode
    prefill_context_lens: torch.Tensor | None    #: [S] int32 tokens cached after the chunk (chunk included)
    prefill_max_query_len: int = 0               #: longest chunk, a host int (grid size without a sync)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step (built by the model runner)."""

    slot_mapping: torch.Tensor            #: [T] int64: flat cache slot of each token's K/V
    num_decode: int                       #: leading tokens that are single decode tokens
    decode_slots: torch.Tensor | None     #: [num_decode, Lmax] int64 cache slots (padded with the row's own first slots)
    decode_mask: torch.Tensor | None      #: [num_decode, 1, 1, Lmax] bool, True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_lens: torch.Tensor | None = None  #: [num_decode] int64 context length (new token included)
    paged: PagedMetadata | None = None       #: the block-table form (then decode_slots, masks and chunk slots are None)


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

"""Grouped-query attention over the paged KV cache.

The step's tokens are laid out decode-first: tokens [0, num_decode) are one new token each of
`num_decode` decoding sequences; after them come prefill chunks, one contiguous run per sequence.
K/V of every token are written to their cache slots first, then each query attends to its
sequence's cached keys (which now include itself).

`attention` is the layer's entry: the decode tokens go through the C kernel
(model.cpu_ops.decode_attention: RoPE, cache write and attention in one call, cached rows read in
place) where it can take them; prefill chunks, and decode tokens where it cannot, through RoPE in
torch and `paged_attention` (index gathers + SDPA).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model import cpu_ops
from engine.model.layers import RotaryEmbedding


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


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots of any shape: rows [*slots.shape, Hkv, D]. index_select on the flat
    slot list is much faster on CPU than advanced indexing with a 2-D index (bench/RESULTS.md),
    and attention gathers twice per layer."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def attention(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
              head_dim: int, scale: float) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D], unrotated q | k | v heads of the step's tokens; cos_sin: [T, 1, D]
    each (RotaryEmbedding.cos_sin). Writes the step's K/V to the cache and returns the attention
    output [T, Hq * D]."""
    T = qkv.shape[0]
    out = torch.empty(T, num_heads * head_dim, dtype=qkv.dtype)
    nd = meta.num_decode
    first = 0  # rows [first, T) still need the torch path
    if nd and meta.decode_lens is not None and cpu_ops.decode_attention(
            qkv, nd, num_heads, num_kv_heads, head_dim, cos_sin[0][:nd], cos_sin[1][:nd], k_cache, v_cache,
            meta.decode_slots, meta.decode_lens, scale, out):
        first = nd
    if first < T:
        rest = qkv[first:]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qk, v = rest.split([q_size + kv_size, kv_size], dim=-1)
        # q and k heads are adjacent in the fused projection: rotate them in one pass.
        qk = RotaryEmbedding.apply((cos_sin[0][first:], cos_sin[1][first:]),
                                   qk.reshape(T - first, num_heads + num_kv_heads, head_dim))
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        v = v.reshape(T - first, num_kv_heads, head_dim)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, scale, first=first)
        out[first:] = o.reshape(T - first, q_size)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, first: int = 0) -> torch.Tensor:
    """q: [T', Hq, D]; k, v: [T', Hkv, D] (new keys/values of the step's tokens [first, T)) ->
    out [T', Hq, D]. `first` is 0, or num_decode when the decode tokens were done elsewhere."""
    slot_mapping = meta.slot_mapping[first:] if first else meta.slot_mapping
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decode - first
    if nd:
        kd = _gather(k_cache, meta.decode_slots).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _gather(v_cache, meta.decode_slots).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)                            # [B, Hq, 1, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                            scale=scale, enable_gqa=True)
        out[:nd] = od.squeeze(2)
    for p in meta.prefills:
        # 4-D [1, H, Q, D] operands: with a batch dim SDPA takes its CPU flash kernel (3-D ones
        # fall back to the math path, which copies K/V per GQA group).
        s, e = p.start - first, p.start - first + p.num_tokens
        qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
        if p.context_slots is None:
            kp, vp = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
        else:
            kp = _gather(k_cache, p.context_slots).transpose(0, 1)  # [Hkv, L, D]
            vp = _gather(v_cache, p.context_slots).transpose(0, 1)
        op = F.scaled_dot_product_attention(qp, kp.unsqueeze(0), vp.unsqueeze(0), attn_mask=p.mask,
                                            is_causal=p.mask is None, scale=scale, enable_gqa=True)
        out[s:e] = op[0].transpose(0, 1)
    return out

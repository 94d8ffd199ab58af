"""The model's ops in plain torch, on any device: the reference every backend's kernels are
tested against, and the path a backend takes where its own kernels cannot take a call (the CPU
backend's C kernels answer "unavailable" for non-fp32 tensors, the Triton backend has no fused
norms or paged attention yet).

Attention's contract (shared by every backend): the step's tokens are laid out decode-first:
tokens [0, num_decode) are one new token each of `num_decode` decoding sequences; after them
come prefill chunks, one contiguous run per sequence. K/V of every token are written to their
cache slots first, then each query attends to its sequence's cached keys (which include itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attention import AttentionMetadata
from engine.model.layers import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> x * rsqrt(mean(x^2) + eps) * weight, statistics in fp32 whatever the
    activation dtype (as HF's LlamaRMSNorm)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused op instead of seven: per-op dispatch is a visible share of a decode step.
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(weight.dtype)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a, rms_norm(x + a)) for the residual stream x."""
    x = x + a
    return x, rms_norm(x, weight, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g).mul_(u)


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate | up) -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU, tanh-approximated)."""
    g, u = gu.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh").mul_(u)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots of any shape: rows [*slots.shape, Hkv, D]. index_select on the flat
    slot list is much faster on CPU than advanced indexing with a 2-D index (bench/RESULTS.md),
    and attention gathers twice per layer."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def attention(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
              head_dim: int, scale: float, *, sliding_window: int | None = None, softcap: float | None = None,
              first: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D], unrotated q | k | v heads of the step's tokens; cos_sin: [T, 1, D]
    each. Writes the K/V of tokens [first, T) to the cache and their attention output into
    out[first:] ([T, Hq * D], allocated if None), which it returns. `first` is 0, or num_decode
    when a backend's kernel did the decode tokens. `sliding_window` and `softcap` as
    engine.model.attention.AttentionSpec states them."""
    T = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if out is None:
        out = torch.empty(T, q_size, dtype=qkv.dtype, device=qkv.device)
    if first >= T:
        return out
    qk, v = qkv[first:].split([q_size + kv_size, kv_size], dim=-1)
    # q and k heads are adjacent in the fused projection: rotate them in one pass.
    qk = RotaryEmbedding.apply((cos_sin[0][first:], cos_sin[1][first:]), qk.reshape(T - first, num_heads + num_kv_heads, head_dim))
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = v.reshape(T - first, num_kv_heads, head_dim)
    o = paged_attention(q, k, v, k_cache, v_cache, meta, scale, first=first, sliding_window=sliding_window,
                        softcap=softcap)
    out[first:] = o.reshape(T - first, q_size)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float, softcap: float | None) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, L, D] -> [B, Hq, Q, D]; `mask` bool (True = attend),
    broadcastable to [B, Hq, Q, L]. SDPA without a soft-cap; with one, the scores are capped
    explicitly (SDPA has no hook for it) in fp32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal and mask is None:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vf).to(q.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, first: int = 0, *,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [T', Hq, D]; k, v: [T', Hkv, D] (rotated keys and values of the step's tokens [first, T))
    -> out [T', Hq, D]: K/V written to their slots, batched SDPA over slot-gathered keys for
    decodes, per-sequence SDPA for prefill chunks (causal from 0, or with a mask over cached
    context). Decode slot rows and chunk context slots list a sequence's keys in position order
    from 0, which is how the sliding window finds each key's position."""
    slot_mapping = meta.slot_mapping[first:] if first else meta.slot_mapping
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decode - first
    if nd:
        kd = _gather(k_cache, meta.decode_slots).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _gather(v_cache, meta.decode_slots).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)                            # [B, Hq, 1, D]
        mask = meta.decode_mask
        if sliding_window is not None:
            lens = meta.decode_lens if meta.decode_lens is not None else mask.view(nd, -1).sum(-1)
            keys = torch.arange(kd.shape[2], device=q.device)
            near = keys[None, :] > (lens[:, None] - 1 - sliding_window)  # [B, L]
            mask = mask & near[:, None, None, :]
        od = _sdpa(qd, kd, vd, mask, False, scale, softcap)
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
        mask = p.mask
        if sliding_window is not None:
            qpos = torch.arange(p.context_len - p.num_tokens, p.context_len, device=q.device)
            keys = torch.arange(kp.shape[1], device=q.device)
            visible = (keys[None, :] <= qpos[:, None]) & (keys[None, :] > qpos[:, None] - sliding_window)
            mask = visible if mask is None else mask & visible
        op = _sdpa(qp, kp.unsqueeze(0), vp.unsqueeze(0), mask, True, scale, softcap)
        out[s:e] = op[0].transpose(0, 1)
    return out

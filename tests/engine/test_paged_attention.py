"""The Triton attention kernels (engine/backends/triton/attention.py) against the torch reference
(engine.backends.torch_ops): RoPE + K/V slot writes, decode and prefill attention over the paged
cache, with metadata built the way ModelRunner.prepare builds it.

Every case runs on CPU tensors through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), and on CUDA tensors with compiled kernels where a GPU is present
(`TRITON_INTERPRET=0 pytest tests/engine/test_paged_attention.py`); one process runs one of the two.

Sliding windows and logit soft-capping (Gemma 2/3, Mistral, Phi-3) are checked against a plain
eager reference written here (HF's: cap, then mask, then softmax), with the keys a window hides
set to NaN in the cache, so a kernel that reads one fails.

The references run in float64 on the same (rounded) inputs; tolerances are those of the kernel's
dtype: fp32 1e-5, bf16 1.6e-2 (bf16's 8 mantissa bits, plus bf16 probabilities in the GPU's
value product), fp16 2e-3 (11 bits, fp16 probabilities in the value product).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.backends import torch_ops
from engine.backends.triton import attention as tri
from engine.model.attention import AttentionMetadata, PrefillChunk
from engine.model.layers import RotaryEmbedding
from punica_kernels.kernels import _common

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# A paged cache with sequences in blocks scattered anywhere, NaN wherever no key should be read.


class Paged:
    """Sequences of `lens` tokens in a cache of randomly placed blocks. Slots past a sequence's
    length in its last block and one spare block hold NaN; tables are wider than needed and
    padded with the NaN block and with out-of-range ids, so a kernel that reads past a
    sequence's keys produces NaN (or faults)."""

    def __init__(self, lens, Hkv, D, block_size, dtype, device, seed=0, extra_cols=2):
        g = torch.Generator().manual_seed(seed)
        self.bs, self.lens = block_size, list(lens)
        need = [math.ceil(n / block_size) for n in lens]
        num_blocks = sum(need) + 3
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.nan_block = perm.pop()
        self.blocks, i = [], 0
        for n in need:
            self.blocks.append(perm[i:i + n])
            i += n
        slots = num_blocks * block_size
        k = torch.randn(slots, Hkv, D, generator=g).to(dtype)
        v = torch.randn(slots, Hkv, D, generator=g).to(dtype)
        nan_slots = [self.nan_block * block_size + o for o in range(block_size)]
        for blks, n in zip(self.blocks, lens):
            if blks:
                nan_slots += [blks[-1] * block_size + o for o in range(n - (len(blks) - 1) * block_size, block_size)]
        k[nan_slots] = float("nan")
        v[nan_slots] = float("nan")
        self.k, self.v = k.to(device), v.to(device)
        # The reference reads the same values, NaN-free (torch's masked SDPA still multiplies
        # masked values by 0, and 0 * NaN is NaN).
        self.k64 = torch.nan_to_num(k.double(), nan=0.0)
        self.v64 = torch.nan_to_num(v.double(), nan=0.0)
        width = max(need) + extra_cols
        bt = torch.empty(len(lens), width, dtype=torch.int32)
        for r, blks in enumerate(self.blocks):
            bt[r, :len(blks)] = torch.tensor(blks, dtype=torch.int32)
            for c in range(len(blks), width):
                bt[r, c] = self.nan_block if c % 2 else 1 << 30
        self.block_tables = bt.to(device)

    def slots(self, r: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        bt = torch.tensor(self.blocks[r], dtype=torch.int64)
        return bt[pos // self.bs] * self.bs + pos % self.bs

    def hide(self, r: int, end: int) -> None:
        """NaN in the kernels' cache at sequence r's positions before `end` (keys a sliding window
        hides from every query); the reference keeps reading the true values (k64, v64)."""
        if end > 0:
            slots = self.slots(r, 0, end).to(self.k.device)
            self.k[slots] = float("nan")
            self.v[slots] = float("nan")


def _decode_meta(blocks: list[list[int]], lens: list[int], bs: int) -> AttentionMetadata:
    """As ModelRunner.prepare for decodes: slots padded with the row's own first block, a mask."""
    lens_t = torch.tensor(lens)
    width = max(len(b) for b in blocks)
    bt = torch.zeros(len(lens), width, dtype=torch.int64)
    for i, blks in enumerate(blocks):
        bt[i, :len(blks)] = torch.tensor(blks)
        bt[i, len(blks):] = blks[0]
    lmax = int(lens_t.max())
    decode_slots = (bt[:, :, None] * bs + torch.arange(bs)).reshape(len(lens), -1)[:, :lmax].contiguous()
    decode_mask = (torch.arange(lmax)[None, :] < lens_t[:, None])[:, None, None, :]
    slot_mapping = decode_slots.gather(1, (lens_t - 1)[:, None]).squeeze(1)
    return AttentionMetadata(slot_mapping=slot_mapping, num_decode=len(lens), decode_slots=decode_slots,
                             decode_mask=decode_mask, prefills=[], decode_lens=lens_t)


def _prefill_chunks(paged: "Paged", rows: list[int], chunks, start: int) -> tuple[list[PrefillChunk], torch.Tensor]:
    """As ModelRunner.prepare for prefills: (chunks, their tokens' slots); context slots and a
    mask only for chunks continuing a cached prefix. chunks: (cached prefix, length) per row."""
    out, slot_parts = [], []
    for r, (c0, n) in zip(rows, chunks):
        c1 = c0 + n
        slots = paged.slots(r, 0, c1)
        slot_parts.append(slots[c0:c1])
        if c0 == 0:
            out.append(PrefillChunk(start, n, c1, None, None))
        else:
            mask = torch.arange(c1)[None, :] <= (c0 + torch.arange(n))[:, None]
            out.append(PrefillChunk(start, n, c1, slots, mask))
        start += n
    return out, torch.cat(slot_parts)


def _windowed_reference(paged: Paged, r: int, q: torch.Tensor, positions: list[int], scale: float,
                        window: int | None, softcap: float | None) -> torch.Tensor:
    """Eager attention, float64, as HF's Gemma 2 / Mistral: queries q [n, Hq, D] of sequence r at
    `positions` over its cached keys 0 .. max(positions); scores scaled, soft-capped, then masked
    to p - window < j <= p, softmax, times the values. Query head h reads KV head h // G."""
    L = max(positions) + 1
    slots = paged.slots(r, 0, L)
    G = q.shape[1] // paged.k64.shape[1]
    k = paged.k64[slots].repeat_interleave(G, dim=1)  # [L, Hq, D]
    v = paged.v64[slots].repeat_interleave(G, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double().cpu(), k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p, j = torch.tensor(positions)[:, None], torch.arange(L)[None, :]
    visible = j <= p
    if window is not None:
        visible &= j > p - window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def _decode_reference(paged: Paged, q: torch.Tensor, scale: float) -> torch.Tensor:
    meta = _decode_meta(paged.blocks, paged.lens, paged.bs)
    k64, v64 = paged.k64.clone(), paged.v64.clone()
    # paged_attention rewrites the new tokens' K/V first: the same values.
    kn, vn = k64[meta.slot_mapping], v64[meta.slot_mapping]
    return torch_ops.paged_attention(q.double().cpu(), kn, vn, k64, v64, meta, scale)


# ---------------------------------------------------------------------------------------------
# rope_kv_write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_rope_kv_write_matches_torch_rope_and_index_copy(device, dtype, T):
    Hq, Hkv, D, P, num_slots = 6, 2, 32, 40, 50
    g = torch.Generator().manual_seed(T)
    rope = RotaryEmbedding(D, P, 10000.0, dtype)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    positions = torch.randint(0, P, (T,), generator=g)
    slot_mapping = torch.randperm(num_slots, generator=g)[:T]
    k_cache = torch.randn(num_slots, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, Hkv, D, generator=g).to(dtype)

    # torch_ops.attention's RoPE + index_copy, in float64 on the same inputs.
    cos, sin = rope.cos.double()[positions].unsqueeze(1), rope.sin.double()[positions].unsqueeze(1)
    q64, k64, v64 = qkv.double().split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    qk = RotaryEmbedding.apply((cos, sin), torch.cat([q64, k64], -1).reshape(T, Hq + Hkv, D))
    want_k, want_v = k_cache.double().index_copy(0, slot_mapping, qk[:, Hq:]), \
        v_cache.double().index_copy(0, slot_mapping, v64.reshape(T, Hkv, D))

    kc, vc = k_cache.to(device), v_cache.to(device)
    q = tri.rope_kv_write(qkv.to(device), rope.cos.to(device), rope.sin.to(device), positions.to(device),
                          kc, vc, slot_mapping.to(device), Hq, Hkv, D)
    assert q.shape == (T, Hq, D) and q.is_contiguous() and q.dtype == dtype
    _close(q, qk[:, :Hq], dtype)
    _close(kc, want_k, dtype)
    assert torch.equal(vc.cpu(), want_v.to(dtype))  # values are copied, not rounded


def test_rope_kv_write_skips_negative_slots(device):
    Hq, Hkv, D, P = 2, 1, 32, 8
    rope = RotaryEmbedding(D, P, 10000.0, torch.float32)
    qkv = torch.randn(3, (Hq + 2 * Hkv) * D, device=device)
    kc = torch.zeros(4, Hkv, D, device=device)
    vc = torch.zeros(4, Hkv, D, device=device)
    slots = torch.tensor([2, -1, 0], device=device)
    tri.rope_kv_write(qkv, rope.cos.to(device), rope.sin.to(device), torch.tensor([0, 1, 2], device=device),
                      kc, vc, slots, Hq, Hkv, D)
    written = (vc.abs().sum((1, 2)) > 0).tolist()
    assert written == [True, False, True, False]
    assert torch.equal(vc[2, 0], qkv[0, (Hq + Hkv) * D:])


# ---------------------------------------------------------------------------------------------
# decode


BS = 8
#: 1, block_size - 1, block_size, block_size + 1, several blocks
MIXED_LENS = [1, BS - 1, BS, BS + 1, 3 * BS + 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_decode_matches_torch_reference(device, dtype, D, G):
    Hkv = 2
    paged = Paged(MIXED_LENS, Hkv, D, BS, dtype, device, seed=G * D)
    q = torch.randn(len(MIXED_LENS), G * Hkv, D).to(dtype)
    scale = D ** -0.5
    want = _decode_reference(paged, q, scale)
    seq_lens = torch.tensor(MIXED_LENS, dtype=torch.int32, device=device)
    outs = [tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens,
                                       BS, scale, num_splits=n) for n in (1, 3)]
    for out in outs:
        assert out.dtype == dtype and out.shape == q.shape
        _close(out, want, dtype)
    # Splitting changes only the order of fp32 sums: the same result within the dtype's rounding.
    _close(outs[1], outs[0], dtype)


@pytest.mark.parametrize("lens", [[1], [BS + 1], [5 * BS - 3]])
def test_decode_batch_of_one(device, lens):
    Hkv, G, D = 1, 4, 32
    paged = Paged(lens, Hkv, D, BS, torch.float32, device, seed=len(lens) + lens[0], extra_cols=3)
    q = torch.randn(1, G * Hkv, D)
    want = _decode_reference(paged, q, 0.3)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for n in (1, 2, 4):
        out = tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, 0.3,
                                         num_splits=n)
        _close(out, want, torch.float32)


def test_decode_default_splits_and_more_splits_than_keys(device, monkeypatch):
    """num_splits=None picks a count itself; with one split per key (split_min_tokens 1) a
    sequence gets more splits than it has key tiles, and the empty ones must weigh nothing."""
    lens = [2, 20]
    paged = Paged(lens, 2, 32, BS, torch.float32, device, seed=5)
    q = torch.randn(2, 4, 32)
    want = _decode_reference(paged, q, 0.2)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, 0.2)
    _close(out, want, torch.float32)
    cfg = dict(tri.KERNEL_CONFIGS[("interpreter", "decode", None)], split_min_tokens=1)
    monkeypatch.setitem(tri.KERNEL_CONFIGS, ("interpreter", "decode", None), cfg)
    out = tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, 0.2,
                                     num_splits=7)
    _close(out, want, torch.float32)


#: Window sizes against contexts of up to 45 (decode) / 47 (prefill) keys in tables of 64 keys:
#: one key (only the query itself), within a block, one key tile, one context's length, past
#: every context but within the table (the windowed build, hiding nothing), past the table (the
#: full-attention build).
WINDOWS = [1, 6, 16, 29, 50, 1000]
#: (dtype, head_dim, softcap, window): window and soft-cap together over every window in fp32,
#: then each alone, a cap far above the scores (nearly the identity: tanh must not cancel near
#: 0), the GPU's half types (fp16 takes the kernels' half-precision tl.dot path in the
#: interpreter too; bf16 is widened there), head_dim 64, 128 and Gemma's 256. Scores have a std
#: of about 4, well into a cap of 3's curve.
WINDOW_CASES = [
    *[(torch.float32, 64, 3.0, w) for w in WINDOWS],
    (torch.float32, 64, None, 6), (torch.float32, 32, 1000.0, 16),
    (torch.bfloat16, 128, 3.0, 16), (torch.float16, 64, None, 1), (torch.float16, 64, 3.0, 29),
    (torch.bfloat16, 256, 30.0, 6),
]
WINDOW_IDS = [f"{str(dt).removeprefix('torch.')}-D{D}-cap{cap}-w{w}" for dt, D, cap, w in WINDOW_CASES]


@pytest.mark.parametrize("dtype,D,softcap,window", WINDOW_CASES, ids=WINDOW_IDS)
def test_decode_sliding_window_and_softcap(device, dtype, D, softcap, window):
    """GQA (G = 2) decode with a window and soft-cap, one split and several (splits partition
    only the window's keys, and cross block and tile boundaries); the keys before each window are
    NaN in the cache, so reading one would show."""
    lens, Hkv, G = [1, 7, 9, 29, 45], 2, 2
    paged = Paged(lens, Hkv, D, BS, dtype, device, seed=D + window)
    q = (4 * torch.randn(len(lens), G * Hkv, D, generator=torch.Generator().manual_seed(window))).to(dtype)
    scale = D ** -0.5  # scores of std ~4: well into the cap's curve
    want = torch.cat([_windowed_reference(paged, r, q[r:r + 1], [n - 1], scale, window, softcap)
                      for r, n in enumerate(lens)])
    for r, n in enumerate(lens):
        paged.hide(r, n - window)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for n in (1, 3):
        out = tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, scale,
                                         num_splits=n, sliding_window=window, softcap=softcap)
        assert out.dtype == dtype and out.shape == q.shape
        _close(out, want, dtype)


# ---------------------------------------------------------------------------------------------
# paged_decode_attention_rope: RoPE, the new token's K/V write and decode attention in one launch,
# the same bits as rope_kv_write followed by paged_decode_attention.


def _fused_against_unfused(device, dtype, lens, Hkv, G, D, splits, *, pad=(), window=None, softcap=None, seed=0):
    """Decode rows of lengths `lens` (rows in `pad`: padding, slot -1): rope_kv_write +
    paged_decode_attention on one copy of the cache and paged_decode_attention_rope on another,
    whose new-token slots hold NaN (a read of one before its write would show), for each split
    count. The outputs are bit-identical (padding rows included: both read what the cache
    holds), the caches after the calls identical (NaN where NaN: a padding row's slot is
    written by neither), and real rows match a float64 reference over the written cache."""
    paged = Paged(lens, Hkv, D, BS, dtype, device, seed=seed)
    if window is not None:
        for r, n in enumerate(lens):
            paged.hide(r, n - window)
    Hq, B = G * Hkv, len(lens)
    rope = RotaryEmbedding(D, max(lens) + 1, 10000.0, dtype)
    qkv = (2 * torch.randn(B, (Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(seed))).to(dtype)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.cat([paged.slots(r, n - 1, n) for r, n in enumerate(lens)])
    real = [r for r in range(B) if r not in pad]
    slots[list(pad)] = -1
    dev = lambda t: t.to(device)  # noqa: E731
    seq_lens = dev(torch.tensor(lens, dtype=torch.int32))
    extra = dict(sliding_window=window, softcap=softcap)
    scale = D ** -0.5

    k1, v1 = paged.k.clone(), paged.v.clone()
    q = tri.rope_kv_write(dev(qkv), dev(rope.cos), dev(rope.sin), dev(positions), k1, v1, dev(slots), Hq, Hkv, D)
    paged.k64, paged.v64 = torch.nan_to_num(k1.double().cpu(), nan=0.0), torch.nan_to_num(v1.double().cpu(), nan=0.0)
    want = torch.cat([_windowed_reference(paged, r, q[r:r + 1], [lens[r] - 1], scale, window, softcap) for r in real])
    for n in splits:
        unfused = tri.paged_decode_attention(q, k1, v1, paged.block_tables, seq_lens, BS, scale, num_splits=n,
                                             **extra).cpu()
        k2, v2 = paged.k.clone(), paged.v.clone()
        k2[dev(slots[real])] = float("nan")
        v2[dev(slots[real])] = float("nan")
        fused = tri.paged_decode_attention_rope(dev(qkv), dev(rope.cos), dev(rope.sin), dev(positions), k2, v2,
                                                dev(slots), paged.block_tables, seq_lens, BS, scale, Hq, Hkv, D,
                                                num_splits=n, **extra).cpu()
        assert fused.dtype == dtype and fused.shape == (B, Hq, D)
        assert torch.equal(fused, unfused), n
        torch.testing.assert_close(k2, k1, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v2, v1, rtol=0, atol=0, equal_nan=True)
        _close(fused[real], want, dtype)
    assert _counters_zero(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 3])
def test_decode_rope_matches_rope_kv_write_then_decode(device, dtype, G):
    """Lengths from one key to several blocks, key tiles (16) and splits (16 keys each): the new
    key alone in the last split (17, 33), inside a tile (30), first in a block (9); one padding
    row (slot -1)."""
    _fused_against_unfused(device, dtype, [1, 7, 9, 17, 30, 33, 1], 2, G, 32, (1, 3), pad=(6,), seed=G)


def test_decode_rope_sliding_window_softcap_and_empty_splits(device, monkeypatch):
    """A window and soft-cap (keys before each window are NaN: never read); then splits of one
    key each (split_min_tokens 1) in a grid of 7, so a row of 20 keys leaves its last splits
    empty: the new key's K/V are written by the split holding it, not the last."""
    _fused_against_unfused(device, torch.float32, [1, 7, 9, 29, 45], 2, 2, 64, (1, 3), window=6, softcap=3.0,
                           seed=7)
    cfg = dict(tri.KERNEL_CONFIGS[("interpreter", "decode", None)], split_min_tokens=1)
    monkeypatch.setitem(tri.KERNEL_CONFIGS, ("interpreter", "decode", None), cfg)
    _fused_against_unfused(device, torch.float32, [2, 20], 2, 2, 32, (7,), seed=8)


def test_decode_rope_refuses_bad_inputs(device):
    Hq, Hkv, D = 4, 2, 32
    paged = Paged([3], Hkv, D, BS, torch.float32, device)
    rope = RotaryEmbedding(D, 8, 10000.0, torch.float32)
    qkv = torch.randn(1, (Hq + 2 * Hkv) * D, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    args = dict(qkv=qkv, cos=rope.cos.to(device), sin=rope.sin.to(device),
                positions=torch.tensor([2], device=device), k_cache=paged.k, v_cache=paged.v,
                slot_mapping=torch.tensor([2], device=device), block_tables=paged.block_tables, seq_lens=lens,
                block_size=BS, scale=0.1, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    for bad, match in ((dict(qkv=qkv[:, :-D]), "qkv"),
                       (dict(positions=torch.tensor([2], dtype=torch.int32, device=device)), "positions"),
                       (dict(qkv=qkv.bfloat16()), "dtype"), (dict(seq_lens=lens.long()), "seq_lens"),
                       (dict(num_heads=3, qkv=torch.randn(1, 7 * D, device=device)), "multiple"),
                       (dict(softcap=0.0), "softcap")):
        with pytest.raises(ValueError, match=match):
            tri.paged_decode_attention_rope(**{**args, **bad})


def test_choose_num_splits():
    kw = dict(split_min_tokens=256, max_splits=16)
    # A full wave of programs already: no split.
    assert tri.choose_num_splits(64, 8, 8192, 132, **kw) == 1
    # One long sequence: split to fill the SMs, capped.
    assert tri.choose_num_splits(1, 8, 8192, 132, **kw) == 16
    assert tri.choose_num_splits(2, 8, 32768, 132, **kw) == 9
    # Short contexts are not split below split_min_tokens keys per split.
    assert tri.choose_num_splits(1, 8, 600, 132, **kw) == 2
    assert tri.choose_num_splits(1, 8, 100, 132, **kw) == 1


def test_kernel_config_falls_back_to_default(monkeypatch):
    monkeypatch.setitem(tri.KERNEL_CONFIGS, ("default", "untuned", None), dict(num_warps=8))
    assert tri.kernel_config(torch.device("cpu"), "untuned", 64) == dict(num_warps=8)
    assert tri.kernel_config(torch.device("cpu"), "decode", 64) == tri.KERNEL_CONFIGS[("interpreter", "decode", None)]


# ---------------------------------------------------------------------------------------------
# prefill


def _prefill_case(device, dtype, chunks, Hkv, G, D, seed):
    """chunks: (cached prefix, chunk length) per sequence -> (paged, q, metadata, query_start,
    context_lens, the float64 reference)."""
    lens = [c0 + n for c0, n in chunks]
    paged = Paged(lens, Hkv, D, BS, dtype, device, seed=seed)
    Tp = sum(n for _, n in chunks)
    q = torch.randn(Tp, G * Hkv, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    prefills, slot_mapping = _prefill_chunks(paged, list(range(len(chunks))), chunks, 0)
    meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode=0, decode_slots=None,
                             decode_mask=None, prefills=prefills)
    k64, v64 = paged.k64.clone(), paged.v64.clone()
    want = torch_ops.paged_attention(q.double(), k64[meta.slot_mapping], v64[meta.slot_mapping], k64, v64,
                                     meta, D ** -0.5)
    query_start = torch.tensor([0] + [sum(n for _, n in chunks[:i + 1]) for i in range(len(chunks))],
                               dtype=torch.int32, device=device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return paged, q, query_start, context_lens, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,G", [(32, 3), (64, 1), (64, 4)])
def test_prefill_fresh_and_continued_chunks(device, dtype, D, G):
    # Fresh prompts (prefix 0) of 1, block_size and odd lengths beside chunks continuing cached
    # prefixes (one ending mid-block, one a single token), in one call.
    chunks = [(0, 5), (7, 9), (0, 1), (16, 1), (3, 20), (0, BS)]
    paged, q, qs, ctx, want = _prefill_case(device, dtype, chunks, Hkv=2, G=G, D=D, seed=D + G)
    out = tri.paged_prefill_attention(q.to(device), paged.k, paged.v, paged.block_tables, qs, ctx, BS,
                                      D ** -0.5, max_query_len=max(n for _, n in chunks))
    assert out.shape == q.shape and out.dtype == dtype
    _close(out, want, dtype)


def _check_prefill_window(device, dtype, D, softcap, window):
    """GQA (G = 2) prefill with a window and soft-cap: fresh prompts and chunks continuing a cached
    prefix (context > chunk), chunks of two query tiles whose windows start in different key
    tiles. Keys before the window of a chunk's first query are NaN in the cache: the kernel must
    skip their tiles, not only mask them."""
    chunks = [(0, 5), (7, 9), (16, 1), (3, 20), (0, 19), (30, 17)]
    Hkv, G = 2, 2
    lens = [c0 + n for c0, n in chunks]
    paged = Paged(lens, Hkv, D, BS, dtype, device, seed=D + window)
    Tp = sum(n for _, n in chunks)
    q = (4 * torch.randn(Tp, G * Hkv, D, generator=torch.Generator().manual_seed(window))).to(dtype)
    scale = D ** -0.5
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    want = torch.cat([_windowed_reference(paged, r, q[starts[r]:starts[r + 1]], list(range(c0, c0 + n)), scale,
                                          window, softcap) for r, (c0, n) in enumerate(chunks)])
    for r, (c0, _) in enumerate(chunks):
        paged.hide(r, c0 - window + 1)
    out = tri.paged_prefill_attention(q.to(device), paged.k, paged.v, paged.block_tables,
                                      torch.tensor(starts, dtype=torch.int32, device=device),
                                      torch.tensor(lens, dtype=torch.int32, device=device), BS, scale,
                                      max_query_len=max(n for _, n in chunks), sliding_window=window, softcap=softcap)
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, want, dtype)


@pytest.mark.parametrize("dtype,D,softcap,window", WINDOW_CASES, ids=WINDOW_IDS)
def test_prefill_sliding_window_and_softcap(device, dtype, D, softcap, window):
    _check_prefill_window(device, dtype, D, softcap, window)


@pytest.mark.parametrize("window", [6, 16])
def test_prefill_window_with_query_tiles_taller_than_key_tiles(device, monkeypatch, window):
    """Query tiles twice as tall as key tiles (the GPU's head_dim-128 tiles, 64 x 32; here 32 x 16
    in the interpreter): a tile's later queries see no key of its first key tile, and must come
    out finite and right all the same."""
    monkeypatch.setitem(tri.KERNEL_CONFIGS, ("interpreter", "prefill", None),
                        dict(block_m=32, block_n=16, num_warps=4, num_stages=1))
    _check_prefill_window(device, torch.float32, 128, 3.0, window)


def test_prefill_empty(device):
    paged = Paged([3], 1, 32, BS, torch.float32, device)
    q = torch.empty(0, 1, 32, device=device)
    out = tri.paged_prefill_attention(q, paged.k, paged.v, paged.block_tables[:0],
                                      torch.zeros(1, dtype=torch.int32, device=device),
                                      torch.zeros(0, dtype=torch.int32, device=device), BS, 0.1, max_query_len=0)
    assert out.shape == (0, 1, 32)


# ---------------------------------------------------------------------------------------------
# The kernels together, as TritonBackend.attention runs them (the decode rows fused, RoPE + K/V
# write then prefill attention for the chunks), reproduce torch_ops.attention on a mixed step.


def test_step_matches_torch_ops_attention(device):
    Hq, Hkv, D, P = 6, 2, 32, 64
    dtype = torch.float32
    rope = RotaryEmbedding(D, P, 10000.0, dtype)
    # Two decodes (contexts 9 and 17 after their new token), then a fresh prompt of 6 and a
    # chunk of 5 after 11 cached tokens.
    decode_lens, chunks = [9, 17], [(0, 6), (11, 5)]
    seqs = decode_lens + [c0 + n for c0, n in chunks]
    paged = Paged(seqs, Hkv, D, BS, dtype, torch.device("cpu"), seed=3)
    k_cache, v_cache = paged.k64.float(), paged.v64.float()
    dmeta = _decode_meta(paged.blocks[:2], decode_lens, BS)
    prefills, prefill_slots = _prefill_chunks(paged, [2, 3], chunks, start=2)
    meta = dataclasses.replace(dmeta, slot_mapping=torch.cat([dmeta.slot_mapping, prefill_slots]), prefills=prefills)
    positions = torch.tensor([n - 1 for n in decode_lens] + [p for c0, n in chunks for p in range(c0, c0 + n)])
    T = len(positions)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(1))
    kr, vr = k_cache.clone(), v_cache.clone()
    want = torch_ops.attention(qkv, rope.cos_sin(positions), kr, vr, meta, Hq, Hkv, D, D ** -0.5)

    dev = lambda t: t.to(device)  # noqa: E731
    kc, vc = dev(k_cache), dev(v_cache)
    bt_all = dev(paged.block_tables)
    qkv, cos, sin = dev(qkv), dev(rope.cos), dev(rope.sin)
    positions, slot_mapping = dev(positions), dev(meta.slot_mapping)
    od = tri.paged_decode_attention_rope(qkv[:2], cos, sin, positions[:2], kc, vc, slot_mapping[:2], bt_all[:2],
                                         dev(torch.tensor(decode_lens, dtype=torch.int32)), BS, D ** -0.5, Hq, Hkv, D,
                                         num_splits=2)
    q = tri.rope_kv_write(qkv[2:], cos, sin, positions[2:], kc, vc, slot_mapping[2:], Hq, Hkv, D)
    op = tri.paged_prefill_attention(q, kc, vc, bt_all[2:], dev(torch.tensor([0, 6, 11], dtype=torch.int32)),
                                     dev(torch.tensor([6, 16], dtype=torch.int32)), BS, D ** -0.5, max_query_len=6)
    torch.testing.assert_close(torch.cat([od, op]).reshape(T, Hq * D).cpu(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(kc.cpu(), kr, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc.cpu(), vr)


def test_wrong_device_or_dtype_is_refused(device):
    paged = Paged([3], 1, 32, BS, torch.float32, device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="dtype"):
        tri.paged_decode_attention(torch.randn(1, 1, 32, device=device, dtype=torch.bfloat16), paged.k, paged.v,
                                   paged.block_tables, lens, BS, 0.1)
    with pytest.raises(ValueError, match="int32"):
        tri.paged_decode_attention(torch.randn(1, 1, 32, device=device), paged.k, paged.v,
                                   paged.block_tables.long(), lens, BS, 0.1)
    q = torch.randn(1, 1, 32, device=device)
    for bad in (dict(sliding_window=0), dict(sliding_window=2.5), dict(softcap=0.0), dict(softcap=float("inf"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tri.paged_decode_attention(q, paged.k, paged.v, paged.block_tables, lens, BS, 0.1, **bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            tri.paged_prefill_attention(q, paged.k, paged.v, paged.block_tables,
                                        torch.tensor([0, 1], dtype=torch.int32, device=device), lens, BS, 0.1,
                                        max_query_len=1, **bad)


def test_decode_empty_sequence_gives_zeros(device):
    """A row with seq_lens 0 (a padding row of a fixed-size batch) reads nothing and yields zeros,
    not NaN, split or not; its neighbours are unaffected."""
    paged = Paged([5, 3], 1, 32, BS, torch.float32, device, seed=2)
    q = torch.randn(2, 2, 32)
    want = _decode_reference(paged, q, 0.2)
    want_windowed = _windowed_reference(paged, 0, q[:1], [4], 0.2, 2, None)[0]
    seq_lens = torch.tensor([5, 0], dtype=torch.int32, device=device)
    for n in (1, 3):
        for window, w in ((None, want[0]), (2, want_windowed)):
            out = tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, 0.2,
                                             num_splits=n, sliding_window=window).cpu()
            _close(out[0], w, torch.float32)
            assert torch.equal(out[1], torch.zeros(2, 32))


# ---------------------------------------------------------------------------------------------
# Decode splits: each sequence splits its keys by its own length (at most the launch's count),
# and the split that finishes a sequence's set combines them in the same launch.

#: Splits of two key tiles (split_min_tokens 32 over the interpreter's 16-key tiles), as the GPU's
#: configuration has several tiles to a split: a row's partition into n splits then differs from
#: its partition into more, so a row split by the grid's count instead of its own would show.
SPLIT_MIN = 32
#: One token, exactly one split's keys, one key past it, exactly two splits, rows of 4 and 7.
SPLIT_LENS = [1, 32, 33, 64, 100, 200]


@pytest.fixture
def split_min(monkeypatch) -> int:
    """The interpreter's decode configuration with SPLIT_MIN keys per split."""
    key = ("interpreter", "decode", None)
    monkeypatch.setitem(tri.KERNEL_CONFIGS, key, dict(tri.KERNEL_CONFIGS[key], split_min_tokens=SPLIT_MIN))
    return SPLIT_MIN


def _splits(lens: list[int], window: int | None = None) -> list[int]:
    """The splits each row needs: one per SPLIT_MIN keys it sees, at least one."""
    return [max(1, -(-min(n, window or n) // SPLIT_MIN)) for n in lens]


def _counters_zero(device) -> bool:
    return not _common.zeroed_counters(torch.device(device), 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_decode_rows_split_by_their_own_length(device, split_min, dtype, G):
    """Mixed lengths in one batch under grids of 1, 2, 4 and 16 splits: every row matches the
    reference. A row uses only the splits its length needs, so every grid at least that wide
    gives it the same bits (a CUDA graph's wide grid and an eager step's agree), and a row of
    one split's keys comes out exactly as from an unsplit launch."""
    Hkv, D = 2, 32
    paged = Paged(SPLIT_LENS, Hkv, D, BS, dtype, device, seed=G)
    q = torch.randn(len(SPLIT_LENS), G * Hkv, D, generator=torch.Generator().manual_seed(G)).to(dtype)
    scale = D ** -0.5
    want = _decode_reference(paged, q, scale)
    seq_lens = torch.tensor(SPLIT_LENS, dtype=torch.int32, device=device)
    outs = {n: tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, scale,
                                          num_splits=n).cpu() for n in (1, 2, 4, 16)}
    for out in outs.values():
        assert out.dtype == dtype and out.shape == q.shape
        _close(out, want, dtype)
    needs = _splits(SPLIT_LENS)
    assert needs == [1, 1, 2, 2, 4, 7]
    for r, need in enumerate(needs):
        grids = [n for n in outs if n >= need]
        for n in grids[1:]:
            assert torch.equal(outs[n][r], outs[grids[0]][r]), (r, n)
    assert _counters_zero(device)


@pytest.mark.parametrize("window,softcap", [(40, 3.0), (17, None), (1, 3.0)], ids=["w40-cap3", "w17", "w1-cap3"])
def test_decode_window_splits_by_the_keys_it_sees(device, split_min, window, softcap):
    """With a sliding window a row's splits partition only its window's keys and their count comes
    from them (keys before each window are NaN in the cache: none is read): long rows need no more
    splits than the window's keys, whatever their length or the grid."""
    lens, Hkv, G, D = [1, 30, 120, 200], 2, 2, 64
    paged = Paged(lens, Hkv, D, BS, torch.float32, device, seed=window)
    q = 4 * torch.randn(len(lens), G * Hkv, D, generator=torch.Generator().manual_seed(window))
    scale = D ** -0.5
    want = torch.cat([_windowed_reference(paged, r, q[r:r + 1], [n - 1], scale, window, softcap)
                      for r, n in enumerate(lens)])
    for r, n in enumerate(lens):
        paged.hide(r, n - window)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    outs = {n: tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, scale,
                                          num_splits=n, sliding_window=window, softcap=softcap).cpu()
            for n in (1, 2, 16)}
    for out in outs.values():
        _close(out, want, torch.float32)
    need = max(_splits(lens, window))
    assert need <= 2
    assert torch.equal(outs[2], outs[16])
    if need == 1:
        assert torch.equal(outs[1], outs[16])
    assert _counters_zero(device)


def test_decode_repeated_calls_leave_counters_zero(device):
    """The split counters are zero after every launch (no launch zero-fills them first): calls
    repeated, interleaved with other batch sizes and head counts and written into a caller's
    rows, give identical results every time."""
    D = 32
    big = Paged(SPLIT_LENS, 2, D, BS, torch.float32, device, seed=11)
    small = Paged([70, 5], 1, D, BS, torch.float32, device, seed=12)
    q_big = torch.randn(len(SPLIT_LENS), 6, D, generator=torch.Generator().manual_seed(1)).to(device)
    q_small = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(2)).to(device)
    lens_big = torch.tensor(SPLIT_LENS, dtype=torch.int32, device=device)
    lens_small = torch.tensor([70, 5], dtype=torch.int32, device=device)

    def run_big(out=None):
        return tri.paged_decode_attention(q_big, big.k, big.v, big.block_tables, lens_big, BS, 0.2, num_splits=16,
                                          out=out)

    def run_small():
        return tri.paged_decode_attention(q_small, small.k, small.v, small.block_tables, lens_small, BS, 0.2,
                                          num_splits=5)

    first_big, first_small = run_big().clone(), run_small().clone()
    _close(first_big, _decode_reference(big, q_big, 0.2), torch.float32)
    _close(first_small, _decode_reference(small, q_small, 0.2), torch.float32)
    assert _counters_zero(device)
    rows = torch.full((len(SPLIT_LENS) + 2, 6, D), float("nan"), device=device)
    for _ in range(2):
        assert torch.equal(run_small(), first_small)
        assert _counters_zero(device)
        assert torch.equal(run_big(), first_big)
        assert _counters_zero(device)
        run_big(out=rows[1:-1])
        assert torch.equal(rows[1:-1], first_big)
        assert rows[0].isnan().all() and rows[-1].isnan().all()
        assert _counters_zero(device)


def test_decode_split_counters_grow_for_larger_batches(device, monkeypatch):
    """A launch with more (sequence, KV head) pairs than the device's counters gets a larger
    buffer and the right result; the smaller buffer stays allocated (a captured CUDA graph may
    still replay against it)."""
    monkeypatch.setattr(_common, "MIN_COUNTERS", 4)
    monkeypatch.setattr(_common, "_COUNTERS", {})
    monkeypatch.setattr(_common, "_RETIRED_COUNTERS", [])
    D = 32
    for lens, seed in (([40, 3], 1), ([40, 3, 20, 33, 1], 2)):
        paged = Paged(lens, 2, D, BS, torch.float32, device, seed=seed)
        q = torch.randn(len(lens), 4, D, generator=torch.Generator().manual_seed(seed))
        out = tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables,
                                         torch.tensor(lens, dtype=torch.int32, device=device), BS, 0.2, num_splits=3)
        _close(out, _decode_reference(paged, q, 0.2), torch.float32)
        assert _common.zeroed_counters(torch.device(device), 0).numel() >= 2 * len(lens)
        assert _counters_zero(device)
    assert [b.numel() for b in _common._RETIRED_COUNTERS] == [4]


def test_decode_default_grid_uses_few_split_counts(device, monkeypatch):
    """With num_splits None the grid's split count comes from max_seq_len in power-of-two
    buckets, so a whole range of step lengths launches only a handful of configurations; results
    are right whether max_seq_len is exact or only a bound (the table's capacity)."""
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)  # a GPU's SM count: splits worth making
    grids = []
    kernel = tri._decode_kernel

    class Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(tri, "_decode_kernel", Recording())
    lens = [3, 17]
    paged = Paged(lens, 2, 32, BS, torch.float32, device, seed=4, extra_cols=24)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(4))
    want = _decode_reference(paged, q, 0.2)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for bound in [*range(17, 201, 9), None]:
        out = tri.paged_decode_attention(q.to(device), paged.k, paged.v, paged.block_tables, seq_lens, BS, 0.2,
                                         max_seq_len=bound)
        _close(out, want, torch.float32)
    assert {g[2] for g in grids} == {2, 4, 8, 16}
    assert _counters_zero(device)

"""GGUF (llama.cpp) layer weights as engine.loader.quantized.QuantizedWeight: the file's codes and
scales rearranged, never dequantized, and exactly the weight llama.cpp's reference dequantization
(gguf.quants.dequantize) gives.

    qw = quantized_weight(t.data, GGMLQuantizationType(t.tensor_type), (N, K))   # GGUFReader tensor t

`raw` is the tensor's data as stored: uint8 [N, bytes per row] (any shape with those bytes), N
outputs, K inputs, each row whole blocks of its type. Per type (`SERVED_TYPES`):

| type | block | bits | group | codes | scales | mins |
| --- | --- | --- | --- | --- | --- | --- |
| Q4_0 | 32: d, 16 B | 4 | 32 | the file's nibbles | d fp16 | -8 d fp16 |
| Q4_1 | 32: d, m, 16 B | 4 | 32 | the file's nibbles | d fp16 | m fp16 |
| Q5_0 | 32: d, qh, qs | 8 | 32 | q - 16 (-16..15) | d fp16 | None |
| Q5_1 | 32: d, m, qh, qs | 8 | 32 | q (0..31) | d fp16 | m fp16 |
| Q8_0 | 32: d, 32 int8 | 8 | 32 | q | d fp16 | None |
| Q2_K | 256: 16 x (4-bit sc, 4-bit m), d, dmin | 8 | 16 | q (0..3) | sc uint8 x d fp16 | m uint8 x -dmin fp16 |
| Q3_K | 256: 16 x 6-bit signed sc, d | 8 | 16 | q (-4..3) | sc int8 (-32..31) x d fp16 | None |
| Q4_K | 256: 8 x (6-bit sc, 6-bit m), d, dmin | 4 | 32 | repacked nibbles | sc uint8 x d fp16 | m uint8 x -dmin fp16 |
| Q5_K | 256: as Q4_K, a fifth bit in qh | 8 | 32 | q (0..31) | sc uint8 x d fp16 | m uint8 x -dmin fp16 |
| Q6_K | 256: 16 x int8 sc, d | 8 | 16 | q - 32 (-32..31) | sc int8 x d fp16 | None |

"x" marks QuantizedWeight's two levels (`super_size` 256, K-quant super-blocks): the integer
sub-block values per group as the file stores them (6-bit and 4-bit values unpacked to whole
bytes), the fp16 d and -dmin per super-block (`super_scales`, `super_mins`). group_scales() and
group_mins() of such a weight are the fp32 products d sc and -(dmin m), bit for bit (below).

Why this is exact: every reference computes `d * q` or `(d * sc) * q`, then adds `m` or subtracts
`dmin * m`, in fp32. d, dmin, m are fp16 and sc, m, q integers of at most 8 bits, so `d * sc`,
`dmin * m` and `-8 d` are exact in fp32 (one-level scales fp16 where the format stores one value;
where it multiplies two, the two levels, whose product group_scales() / the kernels form in fp32,
the same operands as the reference's; and (-dmin) m is -(dmin m), signed zeros included),
`code * scale` is exact, and QuantizedWeight.dequantize's `code * scale + min` then rounds once,
as the reference does (x - y is x + (-y) in IEEE arithmetic). So the symmetric formats (Q5_0,
Q8_0, Q3_K, Q6_K) have no mins at all: their reference is one product, and an added zero would
turn its -0.0 into +0.0. Q4_0 keeps the W4
layout's unsigned nibbles, so its reference `d * (q - 8)` becomes `q d + (-8 d)`: the same value,
except that where the reference gives -0.0 (q = 8 with d < 0) this gives +0.0, which no matmul can
tell apart. If -8 d overflows fp16 (|d| > 8188, no real checkpoint) Q4_0's scales and mins are
fp32. Scales are assumed finite (a file with an inf or NaN scale dequantizes to inf/NaN either way).

Dense types (F32, F16, BF16) are not converted: a layer weight stored dense is read with `dense`,
as are the non-layer tensors (token embedding, norms, an output matrix the loader keeps dense)
of any type gguf-py dequantizes. Any other type for a layer weight (IQ*, TQ*, MXFP4, ...) is
UnsupportedQuantizationError.

Bits a weight on the device (codes, sub-block values, fp16 factors; the file's in brackets):
Q2_K 9.125 (2.625), Q3_K 8.5625 (3.4375), Q4_K 4.625 (4.5), Q5_K 8.625 (5.5), Q6_K 8.5625
(6.5625); the 5/6-bit and 2/3-bit codes take a byte each (the W8A16 kernels' int8).

`q4_1_blocks` goes back: the GGUF Q4_1 blocks of a Q4_0/Q4_1-sourced weight, which the CPU
backend's Q4_1 kernel reads.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.loader.quantized import PACK, QuantizedWeight, UnsupportedQuantizationError

_T = GGMLQuantizationType

#: The quantized GGML types a layer weight may have, each converted by `quantized_weight`.
SERVED_TYPES: tuple[GGMLQuantizationType, ...] = (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
                                                  _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K)
#: Types stored as plain floats: read with `dense`, never converted.
DENSE_TYPES: tuple[GGMLQuantizationType, ...] = (_T.F32, _T.F16, _T.BF16)
#: Weights per K-quant super-block (llama.cpp's QK_K).
QK_K = 256

_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
_SHIFT_1BIT = np.arange(8, dtype=np.uint8)[:, None]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block: float16 [..., blocks]."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """32-weight nibble block(s) [..., 16] -> values [..., 32]: byte j holds weight j low, j + 16 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 32] -> 2-bit values [..., 128]: value 32 k + l is bits 2k..2k+1 of byte l."""
    return ((qs[..., None, :] >> _SHIFT_2BIT) & 3).reshape(*qs.shape[:-1], 4 * qs.shape[-1])


def _bits(mask: np.ndarray) -> np.ndarray:
    """Bytes [..., 32] -> bits [..., 256]: value 32 b + l is bit b of byte l."""
    return ((mask[..., None, :] >> _SHIFT_1BIT) & 1).reshape(*mask.shape[:-1], 8 * mask.shape[-1])


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] -> (sc, m) uint8 [..., 8], 6 bits each: sub-blocks
    0..3 in the low 6 bits of bytes 0..3 (sc) and 4..7 (m); sub-blocks 4..7 in byte 8..11's low
    (sc) and high (m) nibble, their top 2 bits in the top 2 bits of bytes 0..3 (sc) and 4..7 (m)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes [..., 12] -> signed scales int8 [..., 16] (6 bits, minus 32): scale j's
    low nibble is nibble j // 8 of byte j % 8, its top 2 bits bits 2 (j // 4) of byte 8 + j % 4."""
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    high = ((packed[..., None, 8:12] >> _SHIFT_2BIT) & 3).reshape(*packed.shape[:-1], 16)
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


# Each converter: blocks uint8 [N, blocks, type size] -> (bits, codes, scales, mins, group_size),
# codes [N, ...] in input order (4-bit: the W4 layout), scales/mins [N, blocks, groups per block];
# a two-level one (the K-quants) adds (super_scales, super_mins) [N, blocks], one per block
# (super_size QK_K; super_mins None where mins are).


def _q4_0(b):
    d = _f16(b, 0)
    mins32 = _f32(d) * np.float32(-8)
    with np.errstate(over="ignore"):
        mins = mins32.astype(np.float16)
    if np.array_equal(_f32(mins), mins32, equal_nan=True):
        return 4, b[..., 2:18], d, mins, 32
    return 4, b[..., 2:18], _f32(d), mins32, 32


def _q4_1(b):
    return 4, b[..., 4:20], _f16(b, 0), _f16(b, 2), 32


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 [..., 32]: the low nibbles as in Q4_0, bit j of the little-endian
    32-bit qh the fifth bit of weight j."""
    high = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return _low_high(qs) | (high << 4)


def _q5_0(b):
    codes = _five_bit(b[..., 2:6], b[..., 6:22]).astype(np.int8) - np.int8(16)
    return 8, codes, _f16(b, 0), None, 32


def _q5_1(b):
    return 8, _five_bit(b[..., 4:8], b[..., 8:24]).astype(np.int8), _f16(b, 0), _f16(b, 2), 32


def _q8_0(b):
    return 8, np.ascontiguousarray(b[..., 2:34]).view(np.int8), _f16(b, 0), None, 32


def _q2_k(b):
    # scales[16] | qs[64] | d | dmin; 16 sub-blocks of 16, qs as two halves of 128 weights; sc the
    # low nibble of each scale byte, m the high one.
    packed = b[..., 0:16]
    codes = _crumbs(b[..., 16:80].reshape(*b.shape[:-1], 2, 32))
    return 8, codes.astype(np.int8), packed & 0x0F, packed >> 4, 16, _f16(b, 80), -_f16(b, 82)


def _q3_k(b):
    # hmask[32] | qs[64] | scales[12] | d; a weight is its 2 low bits minus 4 where its hmask bit is 0.
    low = _crumbs(b[..., 32:96].reshape(*b.shape[:-1], 2, 32)).reshape(*b.shape[:-1], QK_K)
    high = _bits(b[..., 0:32])
    codes = (low | (high << 2)).astype(np.int8) - np.int8(4)
    return 8, codes, _q3_k_scales(b[..., 96:108]), None, 16, _f16(b, 108), None


def _q4_k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K's qs [..., 128] (per 64 weights 32 bytes: weights 0..31 low nibbles, 32..63 high) ->
    the W4 layout [..., 128] (per 32 weights 16 bytes: byte j holds weight j low, j + 16 high)."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    first, second = q[..., :16], q[..., 16:]
    low_subblock = (first & 0x0F) | (second << 4)
    high_subblock = (first >> 4) | (second & 0xF0)
    return np.stack([low_subblock, high_subblock], axis=-2).reshape(qs.shape)


def _q4_k(b):
    # d | dmin | scales[12] | qs[128]; two levels: sc, m as stored, d and -dmin per super-block.
    sc, m = _k_scale_min(b[..., 4:16])
    return 4, _q4_k_nibbles(b[..., 16:144]), sc, m, 32, _f16(b, 0), -_f16(b, 2)


def _q5_k(b):
    # d | dmin | scales[12] | qh[32] | qs[128]; bit i of qh[l] is the fifth bit of weight 32 i + l.
    sc, m = _k_scale_min(b[..., 4:16])
    q = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low = np.stack([q & 0x0F, q >> 4], axis=-2).reshape(*b.shape[:-1], QK_K)
    codes = (low | (_bits(b[..., 16:48]) << 4)).astype(np.int8)
    return 8, codes, sc, m, 32, _f16(b, 0), -_f16(b, 2)


def _q6_k(b):
    # ql[128] | qh[64] | scales[16] int8 | d; per 128 weights: 64 ql bytes (weights 0..63 low
    # nibbles, 64..127 high), 32 qh bytes (bits 2k..2k+1 of byte l: top bits of weight 32 k + l).
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)
    high = _crumbs(b[..., 128:192].reshape(*lead, 2, 32))
    codes = (low | (high << 4)).astype(np.int8).reshape(*lead, QK_K) - np.int8(32)
    scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return 8, codes, scales, None, 16, _f16(b, 208), None


_CONVERTERS = {_T.Q4_0: _q4_0, _T.Q4_1: _q4_1, _T.Q5_0: _q5_0, _T.Q5_1: _q5_1, _T.Q8_0: _q8_0,
               _T.Q2_K: _q2_k, _T.Q3_K: _q3_k, _T.Q4_K: _q4_k, _T.Q5_K: _q5_k, _T.Q6_K: _q6_k}


def _served_list() -> str:
    return ", ".join(t.name for t in SERVED_TYPES)


def _blocks(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    """raw's bytes as uint8 [N, blocks per row, type size]; ValueError for a size `shape` rules out."""
    n, k = (int(x) for x in shape)
    block, size = GGML_QUANT_SIZES[qtype]
    if n <= 0 or k <= 0 or k % block:
        what = f"whole {block}-weight super-blocks" if block == QK_K else f"whole {block}-weight blocks"
        raise ValueError(f"a {qtype.name} tensor of shape {(n, k)}: its rows must be {what}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != n * (k // block) * size:
        raise ValueError(f"a {qtype.name} tensor of shape {(n, k)} has {n * (k // block) * size} bytes, "
                         f"not {data.size}")
    return data.reshape(n, k // block, size)


def quantized_weight(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """The GGUF tensor `raw` (its stored bytes) of type `qtype` and shape (N outputs, K inputs) as a
    QuantizedWeight whose dequantize() equals gguf.quants.dequantize(raw, qtype) (module
    docstring: the mapping, and why it is exact). Vectorized over all blocks; shares no memory
    with `raw`. UnsupportedQuantizationError for a type not in SERVED_TYPES; ValueError for a
    dense type (read it with `dense`) or a size that does not fit `shape`."""
    qtype = GGMLQuantizationType(qtype)
    if qtype in DENSE_TYPES:
        raise ValueError(f"{qtype.name} is a dense type: read it with dense(), not as a QuantizedWeight")
    convert = _CONVERTERS.get(qtype)
    if convert is None:
        dense_list = ", ".join(t.name for t in DENSE_TYPES)
        raise UnsupportedQuantizationError(f"GGUF type {qtype.name} is not served for layer weights "
                                           f"(served: {_served_list()}, and dense {dense_list})")
    blocks = _blocks(raw, qtype, shape)
    n = blocks.shape[0]
    bits, codes, scales, mins, group, *supers = convert(blocks)

    def tensor(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.array(a.reshape(n, -1), order="C", copy=True))

    two = {"super_scales": tensor(supers[0]), "super_mins": tensor(supers[1]), "super_size": QK_K} if supers else {}
    return QuantizedWeight(bits=bits, codes=tensor(codes), scales=tensor(scales), mins=tensor(mins),
                           group_size=group, source=f"gguf {qtype.name.lower()}", **two)


def dense(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor of any type gguf-py dequantizes as fp32 of `shape` (equal to
    gguf.quants.dequantize): dense layer weights, and the tensors that are never QuantizedWeight
    (token embedding, llama.cpp's quantized output, norms). A matrix of a served quantized type is
    dequantized a few million weights at a time through quantized_weight (torch, every core),
    so the host holds the fp32 result and one chunk's temporaries, not several full-size fp32
    arrays. UnsupportedQuantizationError for a type gguf-py cannot read; ValueError for a size
    that does not fit `shape`."""
    qtype = GGMLQuantizationType(qtype)
    if qtype in _CONVERTERS and len(shape) == 2:
        rows = np.asarray(raw).reshape(shape[0], -1)
        out = np.empty(shape, dtype=np.float32)
        step = max(1, (1 << 22) // shape[1])
        for start in range(0, shape[0], step):
            part = rows[start:start + step]
            out[start:start + len(part)] = quantized_weight(part, qtype, (len(part), shape[1])).dequantize().numpy()
        return out
    try:
        values = dequantize(np.asarray(raw), qtype)
    except NotImplementedError:
        raise UnsupportedQuantizationError(f"GGUF type {qtype.name} cannot be read") from None
    if values.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"a {qtype.name} tensor of {values.size} weights does not have shape {tuple(shape)}")
    return np.asarray(values, dtype=np.float32).reshape(shape)


#: Bytes of one GGUF Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles (32 weights).
Q4_1_BLOCK_BYTES = GGML_QUANT_SIZES[_T.Q4_1][1]


def q4_1_blocks(qw: QuantizedWeight) -> np.ndarray | None:
    """The GGUF Q4_1 blocks (uint8 [N, K/32 * 20]) of a 4-bit weight with 32-input groups, fp16
    scales and mins and no input permutation, i.e. of every Q4_0/Q4_1-sourced weight (the CPU
    backend's Q4_1 kernel reads these); None for any other weight. The W4 nibble layout is
    GGUF's, so quantized_weight(q4_1_blocks(qw), Q4_1, qw.shape) is qw again."""
    if (qw.bits != 4 or qw.group_size != PACK or qw.super_size or qw.scales.dtype != torch.float16
            or qw.mins is None or qw.perm is not None):
        return None
    n, groups = qw.N, qw.K // PACK
    out = np.empty((n, groups, Q4_1_BLOCK_BYTES), dtype=np.uint8)
    out[..., 0:2] = qw.scales.cpu().numpy().view(np.uint8).reshape(n, groups, 2)
    out[..., 2:4] = qw.mins.cpu().numpy().view(np.uint8).reshape(n, groups, 2)
    out[..., 4:] = qw.codes.cpu().numpy().reshape(n, groups, PACK // 2)
    return out.reshape(n, groups * Q4_1_BLOCK_BYTES)

"""GGUF files written as llama.cpp's converter (convert_hf_to_gguf.py) writes each served family,
so engine.loader.gguf_loader (and llama.cpp) read them back to the same model.

    write_gguf(path, cfg, tensors, tokenizer_metadata_from_hf(hf_dir), quant="q4_0")

`tensors` is the loaders' contract (engine.loader: HF Llama names, fused projections split, norms
as applied), e.g. load_checkpoint(hf_dir)[1]. Per family (ModelConfig.architecture ->
llama.cpp's arch, engine.loader.architectures):
- tensor names: gguf.constants' names for the arch (token_embd, blk.N.attn_q, ..., output);
  Gemma's four norms as attn_norm, post_attention_norm, ffn_norm, post_ffw_norm; Phi-3's q/k/v
  fused into attn_qkv and gate | up into ffn_up; arch "llama" (Llama, Mistral) has its Q/K rows
  permuted into llama.cpp's interleaved RoPE layout, the others none; norm weights as given
  (the contract's are already Gemma's 1 + w, which is what the converter writes);
- RoPE: `rope.freq_base`; linear and YaRN scaling as `rope.scaling.*` keys; llama3 scaling as a
  `rope_freqs` tensor of per-frequency divisors (as the converter writes Llama 3.1); Phi-3's
  LongRoPE as `rope_factors_short` / `rope_factors_long` with `rope.scaling.attn_factor` and
  `rope.scaling.original_context_length`; Gemma 3's local theta as `rope.freq_base_swa`;
- attention: `attention.key_length`/`value_length` (head_dim), `attention.sliding_window` (with
  `attention.sliding_window_pattern` only where the layers differ from llama.cpp's rule for the
  arch), soft-caps, and `attention.scale` only where query_pre_attn_scalar is not the value
  llama.cpp assumes for the arch;
- quantization (`QUANTS`): "f32", "f16", "q8_0", or "q4_0"/"q4_1" for layer matrices with Q8_0
  embeddings and lm_head (as the synthetic checkpoints), with gguf.quants.quantize; and
  llama.cpp's K-quant mixes as llama-quantize chooses them (llama_tensor_get_type), quantized by
  this module's own `quantize_k` (gguf-py has no K-quant quantizer), in llama.cpp's byte layout:
  "q4_k_m" (layer matrices and the token embedding Q4_K; attn_v and ffn_down on the
  `use_more_bits` layers, the first and last eighth and every third between, Q6_K; a fused
  attn_qkv Q5_K; the lm_head, or a tied token embedding, Q6_K), "q5_k_m" (the same with Q5_K,
  attn_qkv Q6_K) and "q6_k" (Q6_K throughout). Vectors (norms, biases, RoPE factors) stay F32; a
  matrix whose rows are not whole blocks of its type falls back as llama.cpp's does (Q4_K ->
  Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and to F16 where those do not fit either.

A ModelConfig GGUF metadata cannot express (dynamic NTK RoPE, llama3 scaling on Gemma, LongRoPE
outside Phi-3, sliding windows of several sizes, ...) is an UnsupportedModelError naming it,
never a file that loads as another model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, RopeScalingType
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS
from gguf.quants import quant_shape_to_byte_shape, quantize

from engine.config import ModelConfig
from engine.loader.architectures import ARCHITECTURES, UnsupportedModelError, default_sliding_layers, global_every
from engine.loader.gguf_loader import (FUSED_TENSORS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS,
                                       contract_tensor_names, contract_tensor_shape, default_query_pre_attn_scalar,
                                       layer_tensor_map)
from engine.model.rope import longrope_attention_default

F32, F16, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0
Q4_0, Q4_1 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1
Q5_0, Q5_1 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1
Q2_K, Q3_K, Q4_K = GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K
Q5_K, Q6_K = GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K


class QuantMix(NamedTuple):
    """The GGML type a `quant` writes each matrix in (vectors are F32 under every quant)."""

    #: Layer matrices.
    layer: GGMLQuantizationType
    #: The token embedding, and the lm_head where `output` is None.
    embedding: GGMLQuantizationType
    #: general.file_type.
    file_type: LlamaFileType
    #: llama.cpp's output rule: the lm_head, and the token embedding of a tied model (no lm_head).
    output: GGMLQuantizationType | None = None
    #: attn_v and ffn_down on llama.cpp's `use_more_bits` layers.
    more_bits: GGMLQuantizationType | None = None
    #: A fused attn_qkv (Phi-3).
    attn_qkv: GGMLQuantizationType | None = None


#: quant -> its QuantMix.
QUANTS = {
    "f32": QuantMix(F32, F32, LlamaFileType.ALL_F32),
    "f16": QuantMix(F16, F16, LlamaFileType.MOSTLY_F16),
    "q8_0": QuantMix(Q8_0, Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": QuantMix(Q4_0, Q8_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": QuantMix(Q4_1, Q8_0, LlamaFileType.MOSTLY_Q4_1),
    "q4_k_m": QuantMix(Q4_K, Q4_K, LlamaFileType.MOSTLY_Q4_K_M, output=Q6_K, more_bits=Q6_K, attn_qkv=Q5_K),
    "q5_k_m": QuantMix(Q5_K, Q5_K, LlamaFileType.MOSTLY_Q5_K_M, output=Q6_K, more_bits=Q6_K, attn_qkv=Q6_K),
    "q6_k": QuantMix(Q6_K, Q6_K, LlamaFileType.MOSTLY_Q6_K, output=Q6_K),
}

#: llama.cpp's type for a matrix whose rows are not whole super-blocks of the type it chose.
K_FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

#: llama.cpp's `tokenizer.ggml.pre` names of the byte-level BPE pre-tokenizers served, by the
#: regex of their tokenizer.json Split step (None: ByteLevel's own GPT-2 regex).
PRE_TOKENIZER_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt2": None,
}


# ----------------------------------------------------------------------------- tensor plan


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a GGUF file of a ModelConfig."""

    #: GGUF name (e.g. "blk.0.attn_qkv.weight").
    name: str
    #: (rows, cols) in HF's [out, in] order for matrices, (n,) for vectors.
    shape: tuple[int, ...]
    #: The contract tensors whose rows it is, concatenated in order; () for the RoPE tensors.
    sources: tuple[str, ...]
    #: Heads to permute the rows by (llama.cpp's Q/K layout for arch "llama"), or None.
    permute_heads: int | None = None
    #: The token embedding or the lm_head (their own quantization type, see QUANTS).
    embedding: bool = False


def _gguf_arch(cfg: ModelConfig):
    """(Architecture, llama.cpp arch name, gguf MODEL_ARCH) of cfg's family."""
    arch = ARCHITECTURES.get(cfg.architecture)
    if arch is None:
        raise UnsupportedModelError(f"unsupported architecture {cfg.architecture!r}; served: "
                                    f"{', '.join(sorted(ARCHITECTURES))}")
    model_arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch.gguf_arch)
    return arch, arch.gguf_arch, model_arch


def rope_tensor_values(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The RoPE tensors a GGUF of `cfg` carries (float32): `rope_freqs` for llama3 scaling (the
    converter's per-frequency divisors: 1 above the high-frequency wavelength, the factor below the
    low one, smooth between) or stated freq_factors; LongRoPE's short and long factors."""
    r, dim = cfg.rope, cfg.head_dim
    out: dict[str, np.ndarray] = {}
    if r.rope_type == "llama3":
        # As convert_hf_to_gguf's LlamaModel computes them: frequencies in float32, factors in float64.
        freqs = 1.0 / (r.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
        low_wavelen = r.original_max_position / r.low_freq_factor
        high_wavelen = r.original_max_position / r.high_freq_factor
        factors = []
        for freq in freqs.astype(np.float64):
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                factors.append(1.0)
            elif wavelen > low_wavelen:
                factors.append(r.factor)
            else:
                smooth = ((r.original_max_position / wavelen - r.low_freq_factor)
                          / (r.high_freq_factor - r.low_freq_factor))
                factors.append(1 / ((1 - smooth) / r.factor + smooth))
        out[ROPE_FREQS] = np.array(factors, dtype=np.float32)
    elif r.freq_factors is not None:
        out[ROPE_FREQS] = np.array(r.freq_factors, dtype=np.float32)
    if r.rope_type == "longrope":
        out[ROPE_FACTORS_LONG] = np.array(r.long_factor, dtype=np.float32)
        out[ROPE_FACTORS_SHORT] = np.array(r.short_factor, dtype=np.float32)
    return out


def gguf_plan(cfg: ModelConfig) -> list[PlannedTensor]:
    """The tensors of a GGUF of `cfg`, in the order written: RoPE tensors, token embedding, each
    layer's, output norm, untied output. UnsupportedModelError for a model the arch cannot hold."""
    arch, name, model_arch = _gguf_arch(cfg)
    allowed = MODEL_TENSORS[model_arch]
    plan = []
    for rope_name, values in rope_tensor_values(cfg).items():
        kind = {ROPE_FREQS: MODEL_TENSOR.ROPE_FREQS, ROPE_FACTORS_LONG: MODEL_TENSOR.ROPE_FACTORS_LONG,
                ROPE_FACTORS_SHORT: MODEL_TENSOR.ROPE_FACTORS_SHORT}[rope_name]
        if kind not in allowed:
            raise UnsupportedModelError(f"rope_type {cfg.rope.rope_type!r} has no GGUF form for architecture "
                                        f"{name!r} (llama.cpp reads no {rope_name} there)")
        plan.append(PlannedTensor(rope_name, values.shape, ()))
    to_gguf = {hf: g for g, hf in layer_tensor_map(arch).items()}
    fused = {parts[0]: (g, parts) for g, parts in FUSED_TENSORS.items()} if arch.fused_projections else {}
    folded = {p for _, parts in fused.values() for p in parts}
    permute = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads} if arch.gguf_permuted_qk else {}
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    for hf in contract_tensor_names(cfg):
        if hf in globals_:
            shape = contract_tensor_shape(cfg, hf)
            plan.append(PlannedTensor(globals_[hf], shape, (hf,), embedding=hf != "model.norm.weight"))
            continue
        _, _, idx, rest = hf.split(".", 3)
        prefix = f"model.layers.{idx}."
        if rest in fused:
            gname, parts = fused[rest]
            sources = tuple(prefix + p for p in parts)
            rows = sum(contract_tensor_shape(cfg, s)[0] for s in sources)
            plan.append(PlannedTensor(f"blk.{idx}.{gname}", (rows, cfg.hidden_size), sources))
        elif rest in folded:
            continue
        else:
            heads = permute.get(rest.rsplit(".", 1)[0])
            plan.append(PlannedTensor(f"blk.{idx}.{to_gguf[rest]}", contract_tensor_shape(cfg, hf), (hf,), heads))
    return plan


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's layers whose attn_v and ffn_down the K-quant "_M" mixes give more bits: the
    first and last eighth, and every third layer between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def tensor_type(planned: PlannedTensor, quant: str, *, num_layers: int | None = None,
                tied: bool = False) -> GGMLQuantizationType:
    """The GGML type `planned` is written in under `quant` (QUANTS; vectors F32; a matrix whose rows
    are not whole blocks of its type: K_FALLBACK, then F16). The K-quant mixes depend on the file:
    its `num_layers` (use_more_bits) and whether the token embedding is `tied` as the lm_head;
    `tensor_types` passes both."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    if len(planned.shape) == 1:
        return F32
    mix = QUANTS[quant]
    role = planned.name.split(".", 2)[2] if planned.name.startswith("blk.") else planned.name
    if planned.embedding:
        is_output = role == "output.weight" or (tied and role == "token_embd.weight")
        qtype = mix.output if is_output and mix.output is not None else mix.embedding
    elif role == "attn_qkv.weight" and mix.attn_qkv is not None:
        qtype = mix.attn_qkv
    elif role in ("attn_v.weight", "ffn_down.weight") and mix.more_bits is not None:
        if num_layers is None:
            raise ValueError(f"quant {quant!r} chooses {planned.name}'s type by the file's layer count: "
                             "pass num_layers (tensor_types does)")
        layer = int(planned.name.split(".")[1])
        qtype = mix.more_bits if use_more_bits(layer, num_layers) else mix.layer
    else:
        qtype = mix.layer
    cols = planned.shape[-1]
    if qtype not in (F32, F16) and cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = K_FALLBACK.get(qtype, F16)
        if qtype != F16 and cols % GGML_QUANT_SIZES[qtype][0]:
            qtype = F16
    return qtype


def tensor_types(plan: Sequence[PlannedTensor], quant: str) -> list[GGMLQuantizationType]:
    """tensor_type of each tensor of `plan` (a gguf_plan), with the file's layer count and whether
    it has an lm_head."""
    num_layers = len({p.name.split(".")[1] for p in plan if p.name.startswith("blk.")})
    tied = not any(p.name == "output.weight" for p in plan)
    return [tensor_type(p, quant, num_layers=num_layers, tied=tied) for p in plan]


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF's rotate-half halves -> interleaved RoPE pairs); the
    inverse of gguf_loader._unpermute_rope."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- K-quants
#
# Each quantizer: fp32 super-blocks [n, 256] -> llama.cpp's blocks uint8 [n, type size]. Sub-block
# scales (and offsets) first, from the sub-block's range; then the super-block's fp16 d (and
# dmin), rounded up so no sub-block scale exceeds its integer range; then each sub-block's integer
# scale rounded up against d, so the quantized step still covers the sub-block's range; then the
# codes rounded against the steps the file states. Every weight is within half its sub-block's
# stated step of what llama.cpp dequantizes (up to fp32 rounding).

QK_K = 256


def _fp16_at_least(x: np.ndarray) -> np.ndarray:
    """The least float16 >= x (x >= 0 finite float32): a super-block scale that never clips."""
    if np.any(x > np.finfo(np.float16).max):
        raise ValueError("weights too large for a K-quant's fp16 super-block scale")
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _multiples(need: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """ceil(need / unit) clipped to 0..top (0 where unit is 0): the integer sub-block scales."""
    unit = unit.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.ceil(need / unit)
    return np.where(unit > 0, np.clip(q, 0, top), 0).astype(np.uint8)


def _codes(x: np.ndarray, step: np.ndarray, offset: np.ndarray | float, low: int, high: int) -> np.ndarray:
    """round((x + offset) / step) clipped to low..high, 0 where the step is 0 (int16)."""
    step = step[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((x + offset) / step)
    return np.where(step > 0, np.clip(q, low, high), 0).astype(np.int16)


def _affine(x: np.ndarray, levels: int, scale_max: int):
    """Sub-blocks x [n, S, G] as d * sc * code - dmin * m, code 0..levels, sc and m 0..scale_max:
    -> (d, dmin float16 [n], sc, m uint8 [n, S], codes int16 [n, S, G]). As llama.cpp's, the
    offset is never above zero (m >= 0)."""
    below = -np.minimum(x.min(axis=-1), 0)                     # [n, S], >= 0
    dmin = _fp16_at_least(below.max(axis=-1) / np.float32(scale_max))
    m = _multiples(below, dmin, scale_max)
    offset = dmin.astype(np.float32)[:, None] * m              # >= below: the lowest weight fits
    span = (x.max(axis=-1) + offset) / np.float32(levels)      # the step the sub-block needs
    d = _fp16_at_least(span.max(axis=-1) / np.float32(scale_max))
    sc = _multiples(span, d, scale_max)
    step = d.astype(np.float32)[:, None] * sc
    return d, dmin, sc, m, _codes(x, step, offset[..., None], 0, levels)


def _symmetric(x: np.ndarray, low: int, high: int, scale_max: int):
    """Sub-blocks x [n, S, G] as d * sc * code, code low..high, sc 0..scale_max: -> (d float16 [n],
    sc uint8 [n, S], codes int16 [n, S, G])."""
    span = np.abs(x).max(axis=-1) / np.float32(high)
    d = _fp16_at_least(span.max(axis=-1) / np.float32(scale_max))
    sc = _multiples(span, d, scale_max)
    step = d.astype(np.float32)[:, None] * sc
    return d, sc, _codes(x, step, 0.0, low, high)


def _half(d: np.ndarray) -> np.ndarray:
    """float16 [n] -> its bytes uint8 [n, 2]."""
    return np.ascontiguousarray(d, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def _pack_crumbs(v: np.ndarray) -> np.ndarray:
    """2-bit values [n, H, 4, 32] -> bytes [n, H * 32]: bits 2k..2k+1 of byte l hold value (k, l)."""
    v = v.astype(np.uint8)
    packed = v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)
    return packed.reshape(v.shape[0], -1)


def _pack_bits(v: np.ndarray) -> np.ndarray:
    """Bits [n, 8, 32] -> bytes [n, 32]: bit b of byte l holds value (b, l)."""
    return np.packbits(v.astype(np.uint8).transpose(0, 2, 1), axis=-1, bitorder="little").reshape(v.shape[0], 32)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 6-bit sc, m [n, 8] -> its 12 scale bytes (the inverse of gguf_quants' unpacking)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=-1)


def _low_nibbles_by_64(q: np.ndarray) -> np.ndarray:
    """Codes [n, 256] (their low 4 bits) -> Q4_K/Q5_K's qs [n, 128]: per 64 weights, byte l holds
    weight l in its low nibble and weight 32 + l in its high nibble."""
    q = (q & 0x0F).astype(np.uint8).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 15, 63)
    return np.concatenate([_half(d), _half(dmin), _pack_k_scales(sc, m), _low_nibbles_by_64(q.reshape(-1, QK_K))],
                          axis=-1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 31, 63)
    qh = _pack_bits(q >> 4)
    return np.concatenate([_half(d), _half(dmin), _pack_k_scales(sc, m), qh, _low_nibbles_by_64(q.reshape(-1, QK_K))],
                          axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), -32, 31, 127)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 2, 64)        # per 128 weights: two runs of 64
    ql = ((u[:, :, 0] & 0x0F) | ((u[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    qh = _pack_crumbs((u >> 4).reshape(-1, 2, 4, 32))
    return np.concatenate([ql, qh, sc.view(np.uint8), _half(d)], axis=-1)


def _quantize_q3_k(x: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), -4, 3, 31)
    u = (q + 4).astype(np.uint8).reshape(-1, 8, 32)             # bit 2: the hmask bit
    hmask = _pack_bits(u >> 2)
    qs = _pack_crumbs((u & 3).reshape(-1, 2, 4, 32))
    s6 = sc + np.uint8(32)                                       # 6-bit scales stored as sc + 32
    low = (s6[:, :8] & 0x0F) | ((s6[:, 8:] & 0x0F) << 4)
    top = (s6 >> 4).reshape(-1, 4, 4)                            # [n, k, i]: scale 4 k + i
    high = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
    return np.concatenate([hmask, qs, low, high, _half(d)], axis=-1)


def _quantize_q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 16, 16), 3, 15)
    qs = _pack_crumbs(q.reshape(-1, 2, 4, 32))
    return np.concatenate([sc | (m << 4), qs, _half(d), _half(dmin)], axis=-1)


#: The K-quant types `quantize_k` writes.
K_QUANTIZERS = {Q2_K: _quantize_q2_k, Q3_K: _quantize_q3_k, Q4_K: _quantize_q4_k, Q5_K: _quantize_q5_k,
                Q6_K: _quantize_q6_k}


def quantize_k(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """fp32 [rows, K] (K a multiple of 256) as `qtype` (K_QUANTIZERS) in llama.cpp's byte layout:
    uint8 [rows, K / 256 * type size]. Each weight comes back (gguf.quants.dequantize) within half
    its sub-block's step d * sc (see the section comment). Vectorized over super-blocks, a few
    million weights at a time to bound memory."""
    rows, k = values.shape
    if k % QK_K:
        raise ValueError(f"{qtype.name} rows must be whole {QK_K}-weight super-blocks, not {k} weights")
    quantize_blocks = K_QUANTIZERS[qtype]
    out = np.empty((rows, k // QK_K * GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    step = max(1, (1 << 22) // k)
    for start in range(0, rows, step):
        part = np.asarray(values[start:start + step], dtype=np.float32).reshape(-1, QK_K)
        out[start:start + step] = quantize_blocks(part).reshape(-1, out.shape[1])
    return out


def quantize_tensor(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A tensor's stored data in `qtype`: quantize_k for the K-quants, gguf.quants.quantize for the
    others (float32 / float16 values for F32 / F16, uint8 blocks for the quantized types)."""
    if qtype in K_QUANTIZERS:
        return quantize_k(values, qtype)
    return quantize(values, qtype)


# ----------------------------------------------------------------------------- metadata


def add_metadata_value(w: GGUFWriter, key: str, value: Any) -> None:
    """One tokenizer / free-form key in GGUF's types: bool, uint32 for ids and counts, float32,
    string, array."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def _eos_slots(cfg: ModelConfig, tokenizer_meta: Mapping[str, Any]) -> dict[str, int]:
    """cfg.eos_token_ids as GGUF's three end-of-sequence keys (llama.cpp stops at each): the
    tokenizer's eos where it is one of them, else the first; <|eom_id|> as eom; the others as eot,
    then eom. UnsupportedModelError for more ids than the keys hold."""
    ids = list(cfg.eos_token_ids)
    if not ids:
        return {}
    tokens = tokenizer_meta.get("tokenizer.ggml.tokens") or []
    text = (lambda i: tokens[i] if 0 <= i < len(tokens) else None)
    stated = tokenizer_meta.get("tokenizer.ggml.eos_token_id")
    eos = stated if stated in ids else ids[0]
    rest = [i for i in ids if i != eos]
    eom = next((i for i in rest if text(i) == "<|eom_id|>"), None)
    others = [i for i in rest if i != eom]
    if len(others) > 1 and eom is None:
        eom = others.pop(1)
    if len(others) > 1:
        raise UnsupportedModelError(f"eos_token_id lists {len(ids)} ids; a GGUF file holds at most three "
                                    "(tokenizer.ggml.eos/eot/eom_token_id)")
    slots = {"tokenizer.ggml.eos_token_id": eos}
    if others:
        slots["tokenizer.ggml.eot_token_id"] = others[0]
    if eom is not None:
        slots["tokenizer.ggml.eom_token_id"] = eom
    return slots


def _add_rope(w: GGUFWriter, cfg: ModelConfig, name: str) -> None:
    r = cfg.rope
    w.add_rope_freq_base(r.theta)
    if r.rope_type == "dynamic":
        raise UnsupportedModelError("rope_type 'dynamic' has no GGUF form (llama.cpp has no dynamic NTK scaling)")
    if r.rope_type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(r.factor)
    elif r.rope_type == "yarn":
        if r.mscale is not None or r.mscale_all_dim is not None or not r.truncate:
            raise UnsupportedModelError("YaRN with mscale, mscale_all_dim or truncate false has no GGUF form here")
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(r.factor)
        w.add_rope_scaling_orig_ctx_len(r.original_max_position)
        if (r.beta_fast, r.beta_slow) != (32.0, 1.0):
            w.add_rope_scaling_yarn_beta_fast(r.beta_fast)
            w.add_rope_scaling_yarn_beta_slow(r.beta_slow)
        if r.attention_factor is not None:
            w.add_rope_scaling_attn_factors(r.attention_factor)
    elif r.rope_type == "longrope":
        # The converter states no scaling type for Phi-3: the factor tensors are the scaling, and
        # the factor is the context extension (what its attention factor is derived from).
        orig = r.original_max_position
        if not math.isclose(r.factor, cfg.max_position_embeddings / orig, rel_tol=1e-9):
            raise UnsupportedModelError(f"longrope factor {r.factor} is not max_position_embeddings / "
                                        f"original_max_position_embeddings, the only one GGUF expresses")
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(r.attention_factor if r.attention_factor is not None
                                        else longrope_attention_default(r.factor, orig))
    if cfg.local_rope is not None:
        local = cfg.local_rope
        if local.rope_type != "default" or local.freq_factors is not None:
            raise UnsupportedModelError(f"a sliding-layer RoPE of type {local.rope_type!r} has no GGUF form "
                                        "(only its theta: rope.freq_base_swa)")
        w.add_rope_freq_base_swa(local.theta)


def _add_windows(w: GGUFWriter, cfg: ModelConfig) -> None:
    if not cfg.layer_windows:
        return
    sizes = {x for x in cfg.layer_windows if x is not None}
    if len(sizes) != 1:
        raise UnsupportedModelError(f"sliding windows of {len(sizes)} sizes have no GGUF form (one "
                                    "attention.sliding_window)")
    w.add_sliding_window(sizes.pop())
    sliding = [x is not None for x in cfg.layer_windows]
    if sliding == default_sliding_layers(ARCHITECTURES[cfg.architecture], cfg.num_layers):
        return
    n = next((n for n in range(2, cfg.num_layers + 1)
              if sliding == global_every(cfg.num_layers, n)), None)
    w.add_sliding_window_pattern(n if n is not None else sliding)


def _add_metadata(w: GGUFWriter, cfg: ModelConfig, tokenizer_meta: Mapping[str, Any], file_type: int) -> None:
    arch, name, _ = _gguf_arch(cfg)
    if cfg.hidden_act != arch.hidden_act:
        raise UnsupportedModelError(f"activation {cfg.hidden_act!r} has no GGUF form for architecture {name!r} "
                                    f"(llama.cpp runs {arch.hidden_act})")
    w.add_type("model")
    w.add_name(cfg.name)
    if cfg.architecture == "mistral" and "mistral" not in cfg.name.lower():
        w.add_basename("Mistral")  # llama.cpp writes Mistral as "llama": the name tells the family
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _add_rope(w, cfg, name)
    _add_windows(w, cfg)
    if cfg.attn_logit_softcap is not None:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcap)
    if cfg.final_logit_softcap is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcap)
    if cfg.query_pre_attn_scalar is not None:
        assumed = (default_query_pre_attn_scalar(name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim)
                   if arch.scaled_embeddings else None)
        if cfg.query_pre_attn_scalar != assumed:
            w.add_attention_scale(cfg.query_pre_attn_scalar ** -0.5)
    w.add_file_type(int(file_type))
    w.add_quantization_version(2)
    meta = dict(tokenizer_meta)
    if cfg.bos_token_id is not None:
        meta["tokenizer.ggml.bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            meta.pop(key, None)
        meta.update(_eos_slots(cfg, tokenizer_meta))
    for key, value in meta.items():
        add_metadata_value(w, key, value)


# ----------------------------------------------------------------------------- the file


#: One tensor to write: (planned tensor, its GGML type, a function returning its stored data:
#: float32 / float16 values, or uint8 [rows, bytes per row] blocks for quantized types).
Entry = tuple[PlannedTensor, GGMLQuantizationType, Callable[[], np.ndarray]]


def stored_nbytes(shape: Sequence[int], qtype: GGMLQuantizationType) -> int:
    """Bytes a tensor of `shape` takes in `qtype`."""
    n = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    block, size = GGML_QUANT_SIZES[qtype]
    return n * (shape[-1] // block) * size


def write_gguf_stream(path: str | Path, cfg: ModelConfig, tokenizer_meta: Mapping[str, Any], entries: Sequence[Entry],
                      *, file_type: int) -> Path:
    """Write a GGUF of `cfg` whose tensors are `entries` (in order): metadata and tensor infos
    first, then each tensor's data as its function returns it, so memory stays near the largest
    tensor. The synthetic checkpoints (engine.loader.synthetic) write through here too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), ARCHITECTURES[cfg.architecture].gguf_arch)
    try:
        _add_metadata(w, cfg, tokenizer_meta, file_type)
        for planned, qtype, _ in entries:
            if qtype in (F32, F16):
                w.add_tensor_info(planned.name, planned.shape, np.dtype(np.float32 if qtype == F32 else np.float16),
                                  stored_nbytes(planned.shape, qtype))
            else:
                w.add_tensor_info(planned.name, quant_shape_to_byte_shape(planned.shape, qtype), np.dtype(np.uint8),
                                  stored_nbytes(planned.shape, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for planned, qtype, produce in entries:
            w.write_tensor_data(produce())
    finally:
        w.close()
    return path


def write_gguf(path: str | Path, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor],
               tokenizer_meta: Mapping[str, Any] | None = None, quant: str = "f32") -> Path:
    """Write the model `cfg` + `tensors` (the loaders' contract) as llama.cpp would convert it
    (see the module docstring), with `tokenizer_meta` (`tokenizer.ggml.*` / `tokenizer.chat_template`
    keys, e.g. tokenizer_metadata_from_hf); its bos/eos ids are cfg's. Returns the path.
    ValueError for a missing tensor or a quant not in QUANTS; UnsupportedModelError for a model
    GGUF cannot express."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    plan = gguf_plan(cfg)
    missing = [s for p in plan for s in p.sources if s not in tensors]
    if missing:
        raise ValueError(f"no tensor {missing[0]} for a {cfg.architecture} checkpoint")
    rope = rope_tensor_values(cfg)

    def produce(planned: PlannedTensor, qtype: GGMLQuantizationType) -> np.ndarray:
        if not planned.sources:
            return rope[planned.name]
        arr = np.concatenate([tensors[s].detach().to(torch.float32).cpu().numpy() for s in planned.sources])
        if arr.shape != tuple(planned.shape):
            raise ValueError(f"{planned.name}: shape {arr.shape}, expected {tuple(planned.shape)}")
        if planned.permute_heads:
            arr = permute_rope(arr, planned.permute_heads)
        return quantize_tensor(np.ascontiguousarray(arr), qtype)

    entries = [(p, qtype, lambda p=p, q=qtype: produce(p, q)) for p, qtype in zip(plan, tensor_types(plan, quant))]
    return write_gguf_stream(path, cfg, tokenizer_meta or {}, entries, file_type=QUANTS[quant].file_type)


# ----------------------------------------------------------------------------- tokenizer


def _looks_special(token: str) -> bool:
    """llama.cpp's converter marks these added tokens control tokens even where tokenizer.json
    does not call them special (does_token_look_special)."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _pre_name(pre: Mapping[str, Any] | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre_tokenizer, recognised by its
    steps and regex (llama.cpp recognises a tokenizer by its output on a test text; the served
    ones differ in their regex). UnsupportedModelError for any other."""
    if not pre:
        raise UnsupportedModelError("tokenizer.json has no pre_tokenizer (not byte-level BPE)")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name, known in PRE_TOKENIZER_REGEX.items():
            if known is not None and regex == known:
                return name
    raise UnsupportedModelError(f"unsupported pre-tokenizer ({' + '.join(map(str, kinds))}); served: "
                                f"{', '.join(list(PRE_TOKENIZER_REGEX) + ['smollm'])}")


def _token_text(value) -> str | None:
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def tokenizer_metadata_from_hf(path: str | Path, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The `tokenizer.ggml.*` and `tokenizer.chat_template` keys llama.cpp's converter writes for
    the byte-level BPE tokenizer of HF checkpoint directory `path` (tokenizer.json,
    tokenizer_config.json, chat_template.jinja): model "gpt2", the pre-tokenizer's name, tokens
    (padded to `vocab_size`, default config.json's, with unused "[PAD{i}]" tokens), token types
    (added special tokens and those that look special: control; other added tokens: user
    defined), merges, bos/eos/pad ids, add_bos_token, chat template. UnsupportedModelError for a
    tokenizer that is not byte-level BPE (SentencePiece-style vocabularies are not served)."""
    path = Path(path)
    tj = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise UnsupportedModelError(f"{path / 'tokenizer.json'}: not a byte-level BPE tokenizer "
                                    "(only those are served)")
    pre = _pre_name(tj.get("pre_tokenizer"))
    tcfg_path = path / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}
    if vocab_size is None and (path / "config.json").is_file():
        vocab_size = json.loads((path / "config.json").read_text()).get("vocab_size")

    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    size = max(vocab_size or 0, max(by_id) + 1)
    if vocab_size is not None and size > vocab_size:
        raise ValueError(f"{path}: the tokenizer has ids up to {size - 1}, beyond vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif i in added:
            special = added[i].get("special") or _looks_special(by_id[i])
            tokens.append(by_id[i])
            types.append(TOKEN_CONTROL if special else TOKEN_USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TOKEN_NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens)}

    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    for key, field in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
        text = _token_text(tcfg.get(field))
        if text is not None and text in ids:
            meta[f"tokenizer.ggml.{key}_token_id"] = ids[text]
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:  # transformers 5 states it in the post-processor only
        post = tj.get("post_processor") or {}
        steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
        single = next((s.get("single") for s in steps if s.get("type") == "TemplateProcessing"), None) or []
        bos = _token_text(tcfg.get("bos_token"))
        add_bos = bool(single) and "SpecialToken" in single[0] and single[0]["SpecialToken"].get("id") == bos
    meta["tokenizer.ggml.add_bos_token"] = bool(add_bos)
    template = tcfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: the default one, the others under their names
        for t in template:
            key = "tokenizer.chat_template" if t.get("name") == "default" else f"tokenizer.chat_template.{t['name']}"
            meta[key] = t["template"]
    elif template:
        meta["tokenizer.chat_template"] = template
    return meta

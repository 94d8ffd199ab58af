"""Synthetic checkpoints: real shapes, seeded random weights, a working tokenizer, no download.

For machines with no model hub (the GPU machine, CI), two kinds:

- The Llama GGUF shapes of the first benchmarks, `SHAPES` ("tiny", "smollm2", "llama3-8b"):

    python -m engine.loader.synthetic --shape tiny --out /tmp/tiny.gguf [--seed N] [--quant q4_1|q4_0]

- Every served family at a real model's shape or a tiny one for tests, `FAMILIES`
  ("llama3.1-8b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "gemma2-9b", "gemma3-1b",
  "phi3.5-mini", and "<family>-tiny" of each), as a Hugging Face directory or a llama.cpp GGUF:

    python -m engine.loader.synthetic --family qwen2.5-7b --format safetensors --out DIR [--seed N]
    python -m engine.loader.synthetic --family qwen2.5-7b --format gguf --quant q4_0 --out FILE.gguf

  The directory is what `save_pretrained` leaves: config.json with the real model's fields
  (`_name_or_path` "tessera-synthetic/<family>"), bf16 model.safetensors (shards of at most
  ~2 GB with model.safetensors.index.json above that), tokenizer.json, tokenizer_config.json
  (with the family's chat template) and generation_config.json (the family's eos ids);
  transformers' AutoModelForCausalLM / AutoTokenizer load it. The GGUF is what llama.cpp's
  converter writes for the family (engine.loader.gguf_writer), with layer weights in the 4-bit
  or 8-bit type named and Q8_0 embeddings (f16: all F16).

Both are generated and written tensor by tensor, so memory stays near the largest tensor; an
8B model takes seconds per GB (numpy's raw bit-generator words, not normal deviates).

Contract of the legacy shapes (write_synthetic_gguf):
- Layer weights are Q4_1 (the embedded SmolLM2's type) or Q4_0; norms F32 (ones); the token
  embedding and an untied lm_head Q8_0 (or F16 with `embed_quant="f16"`).
- Quantized blocks are drawn directly from a numpy Generator seeded by (seed, tensor index):
  uniform nibbles / int8 values and fp16 scales near a target standard deviation, so the same
  seed gives the same bytes and activations stay finite and O(1) through every layer. Layer
  weights have std ~ 1/sqrt(fan_in) (zero mean: Q4_1's min is -7.5 x its scale), the embedding
  and lm_head std ~ 3/sqrt(hidden) (logits of std ~ 3 from a unit-RMS hidden state).
- Q/K rows are random, so llama.cpp's RoPE row permutation is not applied: the loader's
  un-permutation only reorders random rows. The blocks' bytes are as `random_blocks` returns
  them for (seed, tensor index), in GGUF's row order.
- The tokenizer is byte-level BPE (`tokenizer.ggml.model` "gpt2"): ids 0-2 are the control
  tokens <|endoftext|>, <|im_start|> (bos), <|im_end|> (eos), then the 256 byte tokens, then
  merges learned deterministically from a small built-in English text, then unused tokens
  `<|reserved_N|>` up to the shape's vocab size. The chat template is ChatML.

Contract of the families (write_family):
- Weights as above (the same stds; the same `random_blocks` for the GGUF's quantized tensors,
  seeded by the tensor's index in `gguf_plan`); half-precision weights (the directory's bf16,
  the GGUF's F16) are `random_half`: a random sign and mantissa with an exponent drawn so the
  standard deviation is the target's. Norms are ones as applied (Gemma's directory stores
  zeros: HF applies 1 + w); Qwen2's q/k/v biases std 0.02; RoPE tensors from the config.
- The tokenizer is byte-level BPE learned from the same text, with the family's special tokens
  at the ids the real vocabulary has them where it fits (Llama 3's 256 at the end, Qwen's after
  its 151643 ordinary tokens, Gemma's and Mistral's first, Phi-3's at 0-2 and 32000+), its
  pre-tokenizer where it is byte-level (Llama 3's and Qwen2's regexes; GPT-2's for the families
  whose real tokenizer is SentencePiece), and a chat template shaped like the public one.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

from engine.config import ModelConfig
from engine.loader.architectures import ARCHITECTURES, model_config_from_hf
from engine.loader.gguf_loader import contract_tensor_names, contract_tensor_shape
from engine.loader.gguf_writer import (PRE_TOKENIZER_REGEX, QUANTS, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED,
                                       TOKEN_USER_DEFINED, add_metadata_value, gguf_plan, rope_tensor_values,
                                       quantize_tensor, tensor_types, write_gguf_stream)
from engine.tokenizer import byte_level_chars

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
BOS_ID, EOS_ID = 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _CONTROL, _UNUSED = 1, 3, 5

# Merges are learned from this text: enough English to give the common pieces ("the", "ing",
# " and") so prompts take fewer tokens than bytes; the rest of the vocabulary is unused.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A robot learning to paint starts with simple
shapes and colors, then tries landscapes and portraits. Rainbows form when sunlight is refracted,
reflected and dispersed inside water droplets, which spreads the light into its colors.
To stay focused while studying, take short breaks, put the phone away, and set clear goals for
each session. The water cycle moves water from the oceans into the air as vapor, into clouds,
and back to the ground as rain or snow, where it flows into rivers and returns to the sea.
Regular exercise strengthens the heart and the muscles, improves sleep and mood, and helps
people live longer and healthier lives. The printing press, invented in the fifteenth century,
made books cheaper and spread knowledge across the world. Airplanes stay in the air because
their wings push air down and the air pushes the wings up. A simple tomato soup needs tomatoes,
an onion, garlic, olive oil, salt, pepper and a little water; cook them together and blend.
What is the capital of France? The capital of France is Paris. Write a short story, explain an
idea, list some tips, describe the process, tell me about the history, give me a recipe.
"""


@dataclass(frozen=True)
class SyntheticShape:
    """The dimensions of a synthetic Llama checkpoint (metadata and tensor shapes)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-5


SHAPES: dict[str, SyntheticShape] = {
    # For tests: loads in well under a second; GQA (2 q heads per kv head); untied lm_head.
    "tiny": SyntheticShape(num_layers=2, hidden_size=128, intermediate_size=352, num_heads=4, num_kv_heads=2,
                           head_dim=32, vocab_size=512, context_length=1024, rope_theta=10000.0,
                           tie_word_embeddings=False),
    # SmolLM2-135M's shape (the embedded model): tied embeddings.
    "smollm2": SyntheticShape(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                              head_dim=64, vocab_size=49152, context_length=8192, rope_theta=100000.0,
                              tie_word_embeddings=True),
    # Llama-3-8B's shape: untied lm_head, rope_theta 500000.
    "llama3-8b": SyntheticShape(num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                                num_kv_heads=8, head_dim=128, vocab_size=128256, context_length=8192,
                                rope_theta=500000.0, tie_word_embeddings=False),
}

LAYER_QUANTS = {"q4_1": GGMLQuantizationType.Q4_1, "q4_0": GGMLQuantizationType.Q4_0}
#: write_family_gguf's quants: random blocks of the simple types, llama.cpp's K-quant mixes.
FAMILY_GGUF_QUANTS = ("q4_0", "q4_1", "q8_0", "f16", "q4_k_m", "q5_k_m", "q6_k")
EMBED_QUANTS = {"q8_0": GGMLQuantizationType.Q8_0, "f16": GGMLQuantizationType.F16}

# One block's numpy layout per type (32 weights a block), as ggml stores it.
_BLOCK_DTYPES = {
    GGMLQuantizationType.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    GGMLQuantizationType.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    GGMLQuantizationType.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
}
_RANDOM_BLOCK_TYPES = frozenset(_BLOCK_DTYPES)
# Standard deviation of one weight per unit scale d: nibbles uniform on 0..15 (centered at 7.5
# for Q4_1, at 8 for Q4_0), int8 uniform on -128..127.
_STD_PER_D = {
    GGMLQuantizationType.Q4_0: float(np.sqrt((16 ** 2 - 1) / 12 + 0.25)),
    GGMLQuantizationType.Q4_1: float(np.sqrt((16 ** 2 - 1) / 12)),
    GGMLQuantizationType.Q8_0: float(np.sqrt((256 ** 2 - 1) / 12 + 0.25)),
}


# ----------------------------------------------------------------------------- tensors


def tensor_plan(shape: SyntheticShape, quant: str = "q4_1", embed_quant: str = "q8_0"):
    """[(GGUF tensor name, (rows, cols) in HF's [out, in] order, GGML type, std)] in file order.
    A tensor's index in this list seeds its generator."""
    if quant not in LAYER_QUANTS:
        raise ValueError(f"quant must be one of {sorted(LAYER_QUANTS)}, not {quant!r}")
    if embed_quant not in EMBED_QUANTS:
        raise ValueError(f"embed_quant must be one of {sorted(EMBED_QUANTS)}, not {embed_quant!r}")
    s = shape
    lq, eq, f32 = LAYER_QUANTS[quant], EMBED_QUANTS[embed_quant], GGMLQuantizationType.F32
    embed_std = 3.0 / np.sqrt(s.hidden_size)
    q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    plan = [("token_embd.weight", (s.vocab_size, s.hidden_size), eq, embed_std)]
    for i in range(s.num_layers):
        for name, rows, cols, qtype in (
            ("attn_norm.weight", 1, s.hidden_size, f32),
            ("attn_q.weight", q_size, s.hidden_size, lq),
            ("attn_k.weight", kv_size, s.hidden_size, lq),
            ("attn_v.weight", kv_size, s.hidden_size, lq),
            ("attn_output.weight", s.hidden_size, q_size, lq),
            ("ffn_norm.weight", 1, s.hidden_size, f32),
            ("ffn_gate.weight", s.intermediate_size, s.hidden_size, lq),
            ("ffn_up.weight", s.intermediate_size, s.hidden_size, lq),
            ("ffn_down.weight", s.hidden_size, s.intermediate_size, lq),
        ):
            plan.append((f"blk.{i}.{name}", (rows, cols), qtype, 1.0 / np.sqrt(cols)))
    plan.append(("output_norm.weight", (1, s.hidden_size), f32, 1.0))
    if not s.tie_word_embeddings:
        plan.append(("output.weight", (s.vocab_size, s.hidden_size), eq, embed_std))
    return plan


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, std: float, seed: int, index: int) -> np.ndarray:
    """The stored data of one tensor, drawn from Generator((seed, index)): uint8 [rows, bytes per
    row] for quantized types (scales within 25% of std / the type's std per unit scale, so the
    weights have about `std`; Q4_1's min is -7.5 x scale), float16 [rows, cols] ~ N(0, std^2) for
    F16, and float32 ones [cols] for F32 (the norms)."""
    rng = np.random.default_rng([seed, index])
    if qtype == GGMLQuantizationType.F32:
        return np.ones(cols, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)).astype(np.float16)
    if cols % 32:
        raise ValueError(f"{qtype.name} needs a multiple of 32 inputs, not {cols}")
    blocks = np.empty((rows, cols // 32), dtype=_BLOCK_DTYPES[qtype])
    n_qs = blocks["qs"].size
    # The bit generator's raw 64-bit words are uniform bytes, drawn three times faster than bytes().
    raw = rng.bit_generator.random_raw(-(-n_qs // 8)).view(np.uint8)[:n_qs]
    blocks["qs"] = raw.view(blocks["qs"].dtype).reshape(blocks["qs"].shape)
    d = rng.uniform(0.75, 1.25, size=blocks.shape).astype(np.float32) * np.float32(std / _STD_PER_D[qtype])
    blocks["d"] = d.astype(np.float16)
    if qtype == GGMLQuantizationType.Q4_1:
        blocks["m"] = (blocks["d"].astype(np.float32) * np.float32(-7.5)).astype(np.float16)
    return blocks.view(np.uint8).reshape(rows, -1)


def dequantize_blocks(qtype: GGMLQuantizationType, data: np.ndarray, cols: int) -> np.ndarray:
    """fp32 [rows, cols] of `random_blocks`' data, by ggml's formulas (Q4_0: d x (q - 8); Q4_1:
    d x q + m, with byte j of a block holding weight j in its low nibble and j + 16 in its high
    one; Q8_0: d x q). An independent reading of the layout, for tests."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(data, dtype=np.float32).reshape(-1, cols)
    blocks = np.ascontiguousarray(data).view(_BLOCK_DTYPES[qtype]).reshape(data.shape[0], cols // 32)
    d = blocks["d"].astype(np.float32)[..., None]
    if qtype == GGMLQuantizationType.Q8_0:
        q = blocks["qs"].astype(np.float32)
        return (d * q).reshape(-1, cols)
    qs = blocks["qs"]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    w = d * (q - 8) if qtype == GGMLQuantizationType.Q4_0 else d * q + blocks["m"].astype(np.float32)[..., None]
    return w.reshape(-1, cols)


# ----------------------------------------------------------------------------- tokenizer


def learn_merges(text: str, max_merges: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from `text`, deterministically: each step merges the most
    frequent adjacent pair (ties: the lexicographically smallest), until `max_merges` or no pair
    occurs twice. Words are split as the tokenizer's ByteLevel pre-tokenizer splits them."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(w for w, _ in pre.pre_tokenize_str(text))
    splits = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter = Counter()
        for w, n in words.items():
            sym = splits[w]
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best_count = max(pairs.values())
        if best_count < 2:
            break
        best = min(p for p, c in pairs.items() if c == best_count)
        merges.append(best)
        for w, sym in splits.items():
            i, out = 0, []
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == best:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            splits[w] = out
    return merges


@lru_cache(maxsize=1)
def _all_corpus_merges() -> tuple[tuple[str, str], ...]:
    return tuple(learn_merges(_CORPUS, max_merges=1 << 20))


def corpus_merges(max_merges: int) -> list[tuple[str, str]]:
    """learn_merges(_CORPUS, max_merges), learned once per process: the merges are greedy, so
    fewer of them are the first ones of the full list."""
    return list(_all_corpus_merges()[:max(max_merges, 0)])


def tokenizer_metadata(vocab_size: int) -> dict:
    """The `tokenizer.ggml.*` / `tokenizer.chat_template` fields of a synthetic file (see the
    module docstring for the id layout). Needs vocab_size >= 3 + 256 + a few."""
    base = len(SPECIAL_TOKENS) + 256
    if vocab_size < base + 8:
        raise ValueError(f"vocab_size must be at least {base + 8}")
    tokens = list(SPECIAL_TOKENS) + list(byte_level_chars())
    types = [_CONTROL] * len(SPECIAL_TOKENS) + [_NORMAL] * 256
    known = set(tokens)
    # Keep a few unused ids whatever the vocabulary size, as real vocabularies have.
    merges = corpus_merges(vocab_size - base - 8)
    for a, b in merges:
        if a + b not in known:
            known.add(a + b)
            tokens.append(a + b)
            types.append(_NORMAL)
    n = 0
    while len(tokens) < vocab_size:
        tokens.append(f"<|reserved_{n}|>")
        types.append(_UNUSED)
        n += 1
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": BOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.padding_token_id": EOS_ID,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------------- the file


def write_synthetic_gguf(path: str | Path, shape: str = "tiny", *, seed: int = 0, quant: str = "q4_1",
                         embed_quant: str = "q8_0") -> Path:
    """Write a synthetic Llama GGUF of the named shape (`SHAPES`) to `path` and return the path.

    Deterministic: the same (shape, seed, quant, embed_quant) gives the same bytes. Tensors are
    generated and written one at a time, so memory stays at the largest tensor's size.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    s = SHAPES[shape]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = tensor_plan(s, quant, embed_quant)

    w = GGUFWriter(str(path), "llama")
    w.add_name(f"tessera-synthetic-{shape}")
    w.add_type("model")
    w.add_block_count(s.num_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(s.intermediate_size)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_vocab_size(s.vocab_size)
    w.add_rope_dimension_count(s.head_dim)
    w.add_file_type(LlamaFileType.MOSTLY_Q4_1 if quant == "q4_1" else LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(2)
    for key, value in tokenizer_metadata(s.vocab_size).items():
        add_metadata_value(w, key, value)

    # Declare every tensor, write the header, then generate and write the data tensor by tensor.
    for name, (rows, cols), qtype, _ in plan:
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor_info(name, (rows, cols), np.dtype(np.float16), rows * cols * 2)
        else:
            row_bytes = cols // 32 * _BLOCK_DTYPES[qtype].itemsize
            w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (_, (rows, cols), qtype, std) in enumerate(plan):
        w.write_tensor_data(random_blocks(qtype, rows, cols, std, seed, index))
    w.close()
    return path


# ============================================================================= families
#
# Every served family, at a real model's shape and at a tiny one for tests. A family is its HF
# config.json (the real model's fields; the token ids are filled in from the tokenizer's layout)
# and its tokenizer's layout; ModelConfig comes from config.json through the loader's own parser.


@dataclass(frozen=True)
class TokenizerSpec:
    """A synthetic family tokenizer: byte-level BPE learned from the built-in text, plus the
    family's added tokens at fixed ids."""

    #: (first id, tokens): added tokens placed from that id on; a negative id counts from the end
    #: of the vocabulary (Llama 3's -256 is id 128000 of 128256).
    blocks: tuple[tuple[int, tuple[str, ...]], ...]
    #: tokenizer_config.json's tokens (bos may be None).
    bos: str | None
    eos: str
    #: `tokenizer.ggml.pre`: "llama-bpe", "qwen2" or "gpt2" (the stand-in for a SentencePiece
    #: vocabulary, which is not synthesized).
    pre: str
    chat_template: str
    add_bos: bool = False
    pad: str | None = None
    unk: str | None = None
    #: Added tokens that are not special (transformers' special=False), e.g. Qwen's <tool_call>.
    plain: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Family:
    """A synthetic model: config.json fields and tokenizer; `params`: the real model's published
    parameter count (the tests hold the tensor plan to it)."""

    config: dict[str, Any]
    tokenizer: TokenizerSpec
    #: config.json's eos_token_id, as tokens (one: an int in the file, several: a list).
    config_eos: tuple[str, ...]
    #: generation_config.json's eos_token_id, as tokens, and its other fields.
    generation_eos: tuple[str, ...]
    generation: dict[str, Any] = field(default_factory=dict)
    #: config.json's pad_token_id, as a token.
    config_pad: str | None = None
    #: config.json's bos_token_id, as a token, where it is not the tokenizer's bos (Qwen's
    #: <|endoftext|>, which nothing adds).
    config_bos: str | None = None
    params: int | None = None


def _numbered(pattern: str, first: int, count: int) -> tuple[str, ...]:
    return tuple(pattern.format(n) for n in range(first, first + count))


def _llama3_block(size: int) -> tuple[str, ...]:
    named = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
    return named + _numbered("<|reserved_special_token_{}|>", 3, size - len(named))


_QWEN25_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
_QWEN3_TOKENS = _QWEN25_TOKENS + ("<tool_response>", "</tool_response>", "<think>", "</think>")
_QWEN_PLAIN = frozenset({"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                         "<think>", "</think>"})


def _gemma_block(unused: int) -> tuple[str, ...]:
    return (("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]") + _numbered("<unused{}>", 0, unused)
            + ("<start_of_turn>", "<end_of_turn>"))


def _mistral_block(controls: int) -> tuple[str, ...]:
    return (("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
             "[TOOL_RESULTS]", "[/TOOL_RESULTS]") + _numbered("[control_{}]", 8, controls))


_PHI3_TOKENS = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")

# Chat templates in the shape of each family's public one (their roles, markers and system
# handling; the tool-calling branches left out).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: 26 Jul 2024\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (loop.first and message['role'] == 'system') %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = none %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.last and system_message is not none %}\n"
    "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST] ' + message['content'] + '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") + message['content'] | trim"
    " + '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# Phi-3.5-mini's LongRoPE factors: 48 per list (head_dim 96), short near 1 rising to ~2.8, long
# rising from ~1 to ~65 (the published lists' range and shape).
_PHI35_SHORT = tuple(round(1.0 + 1.84 * (i / 47) ** 2.2, 2) for i in range(48))
_PHI35_LONG = tuple(round(1.08 + 63.76 / (1 + math.exp(-(i - 22) / 3.2)), 2) for i in range(48))


def _tiny_config(real: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A real family's config.json at a test shape: 2 layers, hidden 128, 4 heads over 2 KV heads
    (whole 32-weight blocks everywhere, so every GGUF type applies), 512 ids."""
    cfg = {**real, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096}
    cfg.pop("head_dim", None)
    cfg.update(overrides)
    return cfg

_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
_MISTRAL = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32768,
}
_GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid", "final_logit_softcapping": 30.0,
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 256000,
}
_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "cache_implementation": "hybrid",
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 262144,
}
_PHI35 = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False, "attention_dropout": 0.0,
    "embd_pdrop": 0.0, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": list(_PHI35_LONG), "short_factor": list(_PHI35_SHORT), "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32064,
}

_LLAMA3_TOK = TokenizerSpec(blocks=((-256, _llama3_block(256)),), bos="<|begin_of_text|>", eos="<|eot_id|>",
                            pre="llama-bpe", chat_template=LLAMA3_TEMPLATE, add_bos=True)
_QWEN25_TOK = TokenizerSpec(blocks=((151643, _QWEN25_TOKENS),), bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                            pre="qwen2", chat_template=QWEN25_TEMPLATE, plain=_QWEN_PLAIN)
_QWEN3_TOK = replace(_QWEN25_TOK, blocks=((151643, _QWEN3_TOKENS),), chat_template=QWEN3_TEMPLATE)
_MISTRAL_TOK = TokenizerSpec(blocks=((0, _mistral_block(761)),), bos="<s>", eos="</s>", unk="<unk>", pre="gpt2",
                             chat_template=MISTRAL_TEMPLATE, add_bos=True)
_GEMMA2_TOK = TokenizerSpec(blocks=((0, _gemma_block(100)),), bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
                            pre="gpt2", chat_template=GEMMA_TEMPLATE, add_bos=True)
_GEMMA3_TOK = replace(_GEMMA2_TOK, blocks=((0, _gemma_block(99)),), eos="<end_of_turn>")
_PHI35_TOK = TokenizerSpec(blocks=((0, ("<unk>", "<s>", "</s>")), (-64, _PHI3_TOKENS)), bos="<s>", eos="<|endoftext|>",
                           pad="<|endoftext|>", unk="<unk>", pre="gpt2", chat_template=PHI3_TEMPLATE)

_LLAMA31_GEN = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
_QWEN25_GEN = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
_QWEN3_GEN = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
_LLAMA31_EOS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")

FAMILIES: dict[str, Family] = {
    "llama3.1-8b": Family(_LLAMA31, _LLAMA3_TOK, _LLAMA31_EOS, _LLAMA31_EOS, _LLAMA31_GEN, params=8_030_261_248),
    "qwen2.5-7b": Family(_QWEN25, _QWEN25_TOK, ("<|im_end|>",), ("<|im_end|>", "<|endoftext|>"), _QWEN25_GEN,
                         config_bos="<|endoftext|>", params=7_615_616_512),
    "qwen3-8b": Family(_QWEN3, _QWEN3_TOK, ("<|im_end|>",), ("<|im_end|>", "<|endoftext|>"), _QWEN3_GEN,
                       config_bos="<|endoftext|>", params=8_190_735_360),
    "mistral-7b": Family(_MISTRAL, _MISTRAL_TOK, ("</s>",), ("</s>",), params=7_248_023_552),
    "gemma2-9b": Family(_GEMMA2, _GEMMA2_TOK, ("<eos>", "<end_of_turn>"), ("<eos>", "<end_of_turn>"),
                        config_pad="<pad>", params=9_241_705_984),
    "gemma3-1b": Family(_GEMMA3, _GEMMA3_TOK, ("<eos>", "<end_of_turn>"), ("<eos>", "<end_of_turn>"),
                        {"cache_implementation": "hybrid", "top_k": 64, "top_p": 0.95}, config_pad="<pad>",
                        params=999_885_952),
    "phi3.5-mini": Family(_PHI35, _PHI35_TOK, ("<|endoftext|>",), ("<|end|>", "<|assistant|>", "<|endoftext|>"),
                          config_pad="<|endoftext|>", params=3_821_079_552),
}


def _tiny(real: str, blocks: tuple[tuple[int, tuple[str, ...]], ...] | None = None, **config: Any) -> Family:
    """Family `real` at _tiny_config's shape with `config` set, its added tokens in `blocks`."""
    family = FAMILIES[real]
    tokenizer = family.tokenizer if blocks is None else replace(family.tokenizer, blocks=blocks)
    return replace(family, tokenizer=tokenizer, config=_tiny_config(family.config, **config), params=None)


# The tiny variants: every field that sets the family apart is set, at sizes that exercise it
# in two layers (a llama3 smoothing band, a window shorter than a prompt, a head size that is
# not hidden / heads, a query_pre_attn_scalar that is not the head size, a global layer, Gemma
# 3's linear scaling of its larger models).
FAMILIES.update({
    "llama3.1-tiny": _tiny("llama3.1-8b", ((-16, _llama3_block(16)),), max_position_embeddings=2048,
                           rope_scaling={**_LLAMA31["rope_scaling"], "original_max_position_embeddings": 256}),
    "qwen2.5-tiny": _tiny("qwen2.5-7b", ((-32, _QWEN25_TOKENS),), max_window_layers=2),
    "qwen3-tiny": _tiny("qwen3-8b", ((-32, _QWEN3_TOKENS),), head_dim=48, max_window_layers=2,
                        tie_word_embeddings=True),
    "mistral-tiny": _tiny("mistral-7b", ((0, _mistral_block(4)),), sliding_window=64),
    "gemma2-tiny": _tiny("gemma2-9b", ((0, _gemma_block(2)),), head_dim=32, query_pre_attn_scalar=24,
                         sliding_window=16, sliding_window_size=16),
    "gemma3-tiny": _tiny("gemma3-1b", ((0, _gemma_block(2)),), head_dim=32, query_pre_attn_scalar=24,
                         sliding_window=16, sliding_window_pattern=2,
                         rope_scaling={"factor": 8.0, "rope_type": "linear"}),
    # Hidden 256: every layer matrix takes whole 256-weight K-quant super-blocks (llama.cpp's
    # Q4_K_M mix without its fallbacks for narrow rows).
    "llama3.1-wide-tiny": _tiny("llama3.1-8b", ((-16, _llama3_block(16)),), hidden_size=256, intermediate_size=512,
                                max_position_embeddings=2048,
                                rope_scaling={**_LLAMA31["rope_scaling"], "original_max_position_embeddings": 256}),
    "qwen2.5-wide-tiny": _tiny("qwen2.5-7b", ((-32, _QWEN25_TOKENS),), hidden_size=256, intermediate_size=512,
                               max_window_layers=2),
    "phi3.5-tiny": _tiny("phi3.5-mini", num_key_value_heads=4, original_max_position_embeddings=1024, sliding_window=64,
                         rope_scaling={"long_factor": list(_PHI35_LONG[::3]), "short_factor": list(_PHI35_SHORT[::3]),
                                       "type": "longrope"}),
})


# ----------------------------------------------------------------------------- family tokenizer


@dataclass(frozen=True)
class Vocabulary:
    """A family tokenizer's ids: `tokens[i]` and its GGUF type, and the BPE merges."""

    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[tuple[str, str], ...]

    @cached_property
    def _ids(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def id(self, token: str) -> int:
        return self._ids[token]


@lru_cache(maxsize=8)
def family_vocabulary(spec: TokenizerSpec, vocab_size: int) -> Vocabulary:
    """Place the spec's added tokens, then the 256 byte tokens and the learned merges at the
    lowest free ids (a few kept unused), then unused `<|reserved_N|>` tokens in what is left.
    ValueError where the blocks do not fit the vocabulary."""
    tokens: list[str | None] = [None] * vocab_size
    types = [TOKEN_UNUSED] * vocab_size
    for start, block in spec.blocks:
        first = start if start >= 0 else vocab_size + start
        if first < 0 or first + len(block) > vocab_size or any(tokens[i] is not None for i in
                                                                range(first, first + len(block))):
            raise ValueError(f"added tokens at {start} do not fit a vocabulary of {vocab_size}")
        for i, t in enumerate(block, first):
            tokens[i] = t
            types[i] = TOKEN_USER_DEFINED if t in spec.plain else TOKEN_CONTROL
    free = [i for i, t in enumerate(tokens) if t is None]
    if len(free) < 256 + 8:
        raise ValueError(f"a vocabulary of {vocab_size} leaves no room for the 256 byte tokens")
    # Keep a few unused ids whatever the vocabulary size, as real vocabularies have.
    merges = corpus_merges(len(free) - 256 - 8)
    normal = list(byte_level_chars())
    known = set(normal)
    for a, b in merges:
        if a + b not in known:
            known.add(a + b)
            normal.append(a + b)
    reserved = (f"<|reserved_{n}|>" for n in range(vocab_size))
    for k, i in enumerate(free):
        if k < len(normal):
            tokens[i], types[i] = normal[k], TOKEN_NORMAL
        else:
            tokens[i] = next(reserved)
    return Vocabulary(tuple(tokens), tuple(types), tuple(merges))


def family_ids(family: Family, vocab: Vocabulary) -> dict[str, Any]:
    """config.json's token ids of `family` in `vocab`: bos_token_id, eos_token_id (an int for one
    token, else a list), and pad_token_id where the family states one."""
    eos = [vocab.id(t) for t in family.config_eos]
    ids: dict[str, Any] = {"bos_token_id": vocab.id(family.config_bos or family.tokenizer.bos),
                           "eos_token_id": eos[0] if len(eos) == 1 else eos}
    if family.config_pad is not None:
        ids["pad_token_id"] = vocab.id(family.config_pad)
    return ids


def family_config_json(name: str, num_layers: int | None = None) -> dict[str, Any]:
    """The config.json of synthetic family `name` (FAMILIES), token ids included; `num_layers`
    keeps the family's shapes with fewer (or more) layers (load-time benchmarks at real widths)."""
    family = _family(name)
    vocab = family_vocabulary(family.tokenizer, family.config["vocab_size"])
    layers = {} if num_layers is None else {"num_hidden_layers": num_layers}
    return {"_name_or_path": f"tessera-synthetic/{name}", **family.config, **layers, **family_ids(family, vocab)}


def family_model_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """ModelConfig of synthetic family `name` as the HF loader reads its config.json."""
    return model_config_from_hf(family_config_json(name, num_layers), f"tessera-synthetic/{name}")


def _hf_tokenizer(spec: TokenizerSpec, vocab: Vocabulary):
    """tokenizers.Tokenizer of the family vocabulary, split as `spec.pre` names (Qwen2 also
    NFC-normalizes, as its tokenizer.json does), BOS first where the family adds it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=list(vocab.merges),
                               fuse_unk=False, byte_fallback=False))
    regex = PRE_TOKENIZER_REGEX[spec.pre]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=spec.pre != "qwen2", use_regex=False)])
    if spec.pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    added = [t for t, ty in zip(vocab.tokens, vocab.types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added if t not in spec.plain])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added if t in spec.plain])
    if spec.add_bos:
        bos = spec.bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab.id(bos))])
    return tok


def family_tokenizer_metadata(name: str) -> dict[str, Any]:
    """The GGUF `tokenizer.*` keys of synthetic family `name` (what tokenizer_metadata_from_hf
    reads from its directory, with unused ids typed unused)."""
    family = _family(name)
    spec = family.tokenizer
    vocab = family_vocabulary(spec, family.config["vocab_size"])
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": spec.pre,
        "tokenizer.ggml.tokens": list(vocab.tokens),
        "tokenizer.ggml.token_type": list(vocab.types),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in vocab.merges],
    }
    for key, token in (("bos", spec.bos), ("eos", spec.eos), ("padding", spec.pad), ("unknown", spec.unk)):
        if token is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = vocab.id(token)
    meta["tokenizer.ggml.add_bos_token"] = spec.add_bos
    meta["tokenizer.chat_template"] = spec.chat_template
    return meta


# ----------------------------------------------------------------------------- family weights


_HALF_FORMATS = {"bf16": (7, 8, 127), "f16": (10, 5, 15)}  # mantissa bits, exponent bits, bias
_HALF_CHUNK = 1 << 24


def random_half(rows: int, cols: int, std: float, seed: int, index: int, fmt: str = "bf16") -> np.ndarray:
    """uint16 [rows, cols]: the bits of bf16 (or, fmt "f16", IEEE half) weights drawn from
    Generator((seed, index)) with standard deviation `std` and mean 0, from the bit generator's
    raw words (no normal deviates: an 8B model in seconds per GB). Each weight is one random
    16-bit word with its exponent field replaced: a random sign and mantissa make |w| uniform
    on [2^e, 2^(e+1)), and the replaced field's random bits pick e or e + 1 with the probability
    that makes E[w^2] = std^2 (to 1/256 for bf16, 1/32 for f16)."""
    mant, ebits, bias = _HALF_FORMATS[fmt]
    a = std / math.sqrt(7 / 3)
    e = math.floor(math.log2(a))
    p = (std * std / (7 / 3 * 4.0 ** e) - 1) / 3  # in [0, 1): the share of weights at e + 1
    levels = 1 << ebits
    threshold = np.uint16(round(p * levels))
    keep = np.uint16(0x8000 | ((1 << mant) - 1))
    base, step = np.uint16((e + bias) << mant), np.uint16(1 << mant)
    rng = np.random.default_rng([seed, index])
    out = np.empty(rows * cols, dtype=np.uint16)
    for start in range(0, out.size, _HALF_CHUNK):
        n = min(_HALF_CHUNK, out.size - start)
        raw = rng.bit_generator.random_raw(-(-n // 4)).view(np.uint16)[:n]
        bump = ((raw >> np.uint16(mant)) & np.uint16(levels - 1)) < threshold
        chunk = out[start:start + n]
        np.bitwise_and(raw, keep, out=chunk)
        chunk |= base
        chunk += bump.view(np.uint8).astype(np.uint16) * step
    return out.reshape(rows, cols)


_HALF_ONE = {"bf16": 0x3F80, "f16": 0x3C00}
#: Standard deviation of Qwen2's q/k/v biases.
BIAS_STD = 0.02


def _weight_std(name: str, cols: int, hidden: int) -> float:
    """Embeddings and lm_head 3 / sqrt(hidden) (logits of std ~3), other matrices 1 / sqrt(fan_in)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight", "token_embd.weight", "output.weight"):
        return 3.0 / math.sqrt(hidden)
    return 1.0 / math.sqrt(cols)


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a synthetic family directory, in the checkpoint's own names (Phi-3 fused)."""

    name: str
    shape: tuple[int, ...]
    #: "matrix", "bias", "norm" (ones as applied) or "norm_offset" (zeros: HF applies 1 + w).
    kind: str


def hf_plan(cfg: ModelConfig) -> list[HFTensor]:
    """The tensors of a HF checkpoint of `cfg` as transformers names them, in order (Phi-3's
    qkv_proj and gate_up_proj fused). A tensor's index here seeds its generator."""
    arch = ARCHITECTURES[cfg.architecture]
    plan = []
    for name in contract_tensor_names(cfg):
        shape = contract_tensor_shape(cfg, name)
        if arch.fused_projections and name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue  # rows of the fused tensor planned at q_proj / gate_proj
        if arch.fused_projections and name.endswith("q_proj.weight"):
            name, shape = name.replace("q_proj", "qkv_proj"), (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
        elif arch.fused_projections and name.endswith("gate_proj.weight"):
            name, shape = name.replace("gate_proj", "gate_up_proj"), (2 * cfg.intermediate_size, cfg.hidden_size)
        if name.endswith("norm.weight"):
            kind = "norm_offset" if arch.norm_plus_one else "norm"
        else:
            kind = "bias" if name.endswith(".bias") else "matrix"
        plan.append(HFTensor(name, shape, kind))
    return plan


def _hf_data(t: HFTensor, cfg: ModelConfig, seed: int, index: int) -> np.ndarray:
    rows, cols = (1, t.shape[0]) if len(t.shape) == 1 else t.shape
    if t.kind == "norm":
        return np.full(t.shape, _HALF_ONE["bf16"], dtype=np.uint16)
    if t.kind == "norm_offset":
        return np.zeros(t.shape, dtype=np.uint16)
    std = BIAS_STD if t.kind == "bias" else _weight_std(t.name, cols, cfg.hidden_size)
    return random_half(rows, cols, std, seed, index).reshape(t.shape)


#: Largest safetensors shard (transformers' save_pretrained shards likewise, above its own size).
SHARD_BYTES = 2_000_000_000


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]],
                       dtype: str = "BF16", item_bytes: int = 2) -> None:
    """One safetensors file, streamed: the header from the shapes, then each tensor's bytes as its
    function returns them."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape)) * item_bytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape, produce in tensors:
            data = produce()
            if data.shape != tuple(shape) or data.itemsize != item_bytes:
                raise AssertionError(f"{name}: produced {data.shape} x {data.itemsize} B, planned {shape}")
            data.tofile(f)


def write_family_safetensors(out: str | Path, name: str, *, seed: int = 0, num_layers: int | None = None) -> Path:
    """Write synthetic family `name` (FAMILIES) as a HF checkpoint directory `out` (see the module
    docstring), with `num_layers` layers if given. Deterministic: the same (name, seed) gives the
    same files."""
    family = _family(name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = family_config_json(name, num_layers)
    cfg = model_config_from_hf(config, config["_name_or_path"])
    vocab = family_vocabulary(family.tokenizer, cfg.vocab_size)

    plan = hf_plan(cfg)
    shards: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(plan):
        n = int(np.prod(t.shape)) * 2
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for file in out.glob("model*.safetensors*"):
        file.unlink()  # a rewrite with other shards must not leave stale ones behind
    weight_map = {}
    for file, members in zip(files, shards):
        _write_safetensors(out / file, [(plan[i].name, plan[i].shape,
                                         lambda i=i: _hf_data(plan[i], cfg, seed, i)) for i in members])
        weight_map.update({plan[i].name: file for i in members})
    if len(shards) > 1:
        total = sum(int(np.prod(t.shape)) * 2 for t in plan)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = family_ids(family, vocab)
    gen_eos = [vocab.id(t) for t in family.generation_eos]
    generation = {"_from_model_config": False, "bos_token_id": ids["bos_token_id"],
                  "eos_token_id": gen_eos[0] if len(gen_eos) == 1 else gen_eos, **family.generation}
    if "pad_token_id" in ids:
        generation["pad_token_id"] = ids["pad_token_id"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_family_tokenizer(out, name)
    return out


def write_family_tokenizer(out: str | Path, name: str, *, vocab_size: int | None = None) -> Vocabulary:
    """Write synthetic family `name`'s tokenizer.json and tokenizer_config.json (its chat
    template, bos/eos/pad/unk tokens, add_bos_token) into directory `out`, at `vocab_size` ids
    (default: the family's); returns the vocabulary, for the token ids."""
    family = _family(name)
    spec = family.tokenizer
    vocab = family_vocabulary(spec, vocab_size or family.config["vocab_size"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _hf_tokenizer(spec, vocab).save(str(out / "tokenizer.json"))
    tcfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": spec.add_bos,
                            "add_eos_token": False, "bos_token": spec.bos, "eos_token": spec.eos,
                            "clean_up_tokenization_spaces": False,
                            "model_max_length": family.config["max_position_embeddings"],
                            "chat_template": spec.chat_template}
    for key, token in (("pad_token", spec.pad), ("unk_token", spec.unk)):
        if token is not None:
            tcfg[key] = token
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    return vocab


def family_gguf_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The ModelConfig a synthetic family's GGUF states: config.json's, with generation_config's
    eos ids added (llama.cpp stops at each, as transformers' generate does)."""
    family = _family(name)
    cfg = family_model_config(name, num_layers)
    vocab = family_vocabulary(family.tokenizer, cfg.vocab_size)
    eos = list(cfg.eos_token_ids)
    eos += [i for i in (vocab.id(t) for t in family.generation_eos) if i not in eos]
    return replace(cfg, eos_token_ids=tuple(eos))


def write_family_gguf(path: str | Path, name: str, *, seed: int = 0, quant: str = "q4_1",
                      num_layers: int | None = None) -> Path:
    """Write synthetic family `name` (FAMILIES) as a llama.cpp GGUF at `path`, with `num_layers`
    layers if given: layer matrices in `quant` ("q4_0", "q4_1", "q8_0", "f16" with embeddings
    Q8_0, F16 for "f16"; or llama.cpp's mixes "q4_k_m", "q5_k_m", "q6_k", gguf_writer.QUANTS),
    norms ones, the RoPE tensors of its config (gguf_writer's plan and metadata). Deterministic:
    the same (name, seed, quant) gives the same bytes."""
    if quant not in FAMILY_GGUF_QUANTS:
        raise ValueError(f"quant must be one of {', '.join(FAMILY_GGUF_QUANTS)}, not {quant!r}")
    cfg = family_gguf_config(name, num_layers)
    rope = rope_tensor_values(cfg)

    def produce(index: int, planned, qtype) -> np.ndarray:
        if planned.name in rope:
            return rope[planned.name]
        if len(planned.shape) == 1:
            if planned.name.endswith(".bias"):
                rng = np.random.default_rng([seed, index])
                return (rng.standard_normal(planned.shape[0], dtype=np.float32) * np.float32(BIAS_STD))
            return np.ones(planned.shape[0], dtype=np.float32)
        rows, cols = planned.shape
        std = _weight_std(planned.name, cols, cfg.hidden_size)
        if qtype == GGMLQuantizationType.F16:
            return random_half(rows, cols, std, seed, index, "f16").view(np.float16)
        if qtype in _RANDOM_BLOCK_TYPES:
            return random_blocks(qtype, rows, cols, std, seed, index)
        # llama.cpp's mixes (K-quants and their fallbacks): random weights quantized as it would.
        return quantize_tensor(random_half(rows, cols, std, seed, index, "f16").view(np.float16).astype(np.float32),
                               qtype)

    entries = []
    plan = gguf_plan(cfg)
    for index, (planned, qtype) in enumerate(zip(plan, tensor_types(plan, quant))):
        entries.append((planned, qtype, lambda i=index, p=planned, q=qtype: produce(i, p, q)))
    return write_gguf_stream(path, cfg, family_tokenizer_metadata(name), entries, file_type=QUANTS[quant][2])


def write_family(out: str | Path, name: str, *, fmt: str = "gguf", seed: int = 0, quant: str = "q4_1",
                 num_layers: int | None = None) -> Path:
    """write_family_gguf or write_family_safetensors by `fmt` ("gguf" | "safetensors")."""
    if fmt == "gguf":
        return write_family_gguf(out, name, seed=seed, quant=quant, num_layers=num_layers)
    if fmt == "safetensors":
        return write_family_safetensors(out, name, seed=seed, num_layers=num_layers)
    raise ValueError(f"format must be gguf or safetensors, not {fmt!r}")


def family_plan_bytes(name: str, fmt: str = "safetensors", quant: str = "q4_1") -> int:
    """Bytes of tensor data a synthetic family's checkpoint holds (its plan, no file written)."""
    from engine.loader.gguf_writer import stored_nbytes

    if fmt == "safetensors":
        return sum(int(np.prod(t.shape)) * 2 for t in hf_plan(family_model_config(name)))
    cfg = family_gguf_config(name)
    plan = gguf_plan(cfg)
    return sum(stored_nbytes(p.shape, qtype) for p, qtype in zip(plan, tensor_types(plan, quant)))


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; expected one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.loader.synthetic",
                                 description="Write a synthetic checkpoint (seeded random weights, BPE tokenizer).")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--shape", choices=sorted(SHAPES), help="a Llama GGUF shape (default: tiny)")
    what.add_argument("--family", choices=sorted(FAMILIES), help="a model family at a real or tiny shape")
    ap.add_argument("--format", default="gguf", choices=("gguf", "safetensors"),
                    help="--family only: a llama.cpp .gguf file or a HF checkpoint directory")
    ap.add_argument("--out", required=True, help="the .gguf file, or the directory for --format safetensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=None,
                    help="--family only: this many layers at the family's widths (default: the family's)")
    ap.add_argument("--quant", default="q4_1", choices=FAMILY_GGUF_QUANTS,
                    help="layer weights' type (--shape: q4_0 or q4_1)")
    ap.add_argument("--embed-quant", default="q8_0", choices=sorted(EMBED_QUANTS),
                    help="--shape only: token embedding and lm_head type")
    args = ap.parse_args(argv)
    fmt = args.format if args.family else "gguf"
    if args.family is None and args.format != "gguf":
        return _fail("--format safetensors needs --family")
    if fmt == "gguf" and not args.out.endswith(".gguf"):
        return _fail("--out must name a .gguf file (the loader reads only that suffix)")
    if fmt == "safetensors" and Path(args.out).is_file():
        return _fail(f"--out {args.out} is a file; --format safetensors writes a directory")
    t0 = time.perf_counter()
    if args.family is None:
        shape = args.shape or "tiny"
        if args.quant not in LAYER_QUANTS:
            return _fail(f"--shape takes --quant q4_0 or q4_1, not {args.quant}")
        path = write_synthetic_gguf(args.out, shape, seed=args.seed, quant=args.quant, embed_quant=args.embed_quant)
        what_ = f"shape {shape}, {args.quant} layers, {args.embed_quant} embeddings"
    else:
        if args.num_layers is not None and args.num_layers < 1:
            return _fail(f"--num-layers must be at least 1, not {args.num_layers}")
        path = write_family(args.out, args.family, fmt=fmt, seed=args.seed, quant=args.quant,
                            num_layers=args.num_layers)
        what_ = f"family {args.family}, " + (f"{args.quant} layers" if fmt == "gguf" else "bf16 safetensors")
    size = (path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
    print(f"{path}: {what_}, seed {args.seed}, {size / 2 ** 20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

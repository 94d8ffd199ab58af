"""Synthetic Llama-family GGUF checkpoints: real shapes, seeded random weights, a working tokenizer.

For machines with no model hub (the GPU machine, CI): `write_synthetic_gguf(path, "llama3-8b")`
writes a file that `engine.loader.load_checkpoint` reads like any llama.cpp GGUF, at the shape
of the model a benchmark or test needs, with no download and no float weights quantized.

    python -m engine.loader.synthetic --shape tiny --out /tmp/tiny.gguf [--seed N] [--quant q4_1|q4_0]

Contract:
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
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

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
EMBED_QUANTS = {"q8_0": GGMLQuantizationType.Q8_0, "f16": GGMLQuantizationType.F16}

# One block's numpy layout per type (32 weights a block), as ggml stores it.
_BLOCK_DTYPES = {
    GGMLQuantizationType.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    GGMLQuantizationType.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    GGMLQuantizationType.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
}
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
    merges = learn_merges(_CORPUS, max_merges=vocab_size - base - 8)
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
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.loader.synthetic",
                                 description="Write a synthetic Llama GGUF (seeded random weights, BPE tokenizer).")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, help="the .gguf file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quant", default="q4_1", choices=sorted(LAYER_QUANTS), help="layer weights' type")
    ap.add_argument("--embed-quant", default="q8_0", choices=sorted(EMBED_QUANTS),
                    help="token embedding and lm_head type")
    args = ap.parse_args(argv)
    if not args.out.endswith(".gguf"):
        print("error: --out must name a .gguf file (the loader reads only that suffix)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    path = write_synthetic_gguf(args.out, args.shape, seed=args.seed, quant=args.quant, embed_quant=args.embed_quant)
    print(f"{path}: shape {args.shape}, {args.quant} layers, {args.embed_quant} embeddings, seed {args.seed}, "
          f"{path.stat().st_size / 2 ** 20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

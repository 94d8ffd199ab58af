"""The model families Tessera serves, as data: what each family's checkpoint means.

One `Architecture` per family says how its config and tensors map onto the one decoder
(engine.model.decoder) through engine.config.ModelConfig's fields: its activation, biases, q/k
norms, norm layout, embedding scale, sliding-window rule and fused projections. Both loaders
read it: `model_config_from_hf` here for config.json, engine.loader.gguf_loader for GGUF files
(llama.cpp's architecture name and metadata keys). Adding a family is adding an entry (and, where
it has a piece no family has yet, a ModelConfig field the decoder honours): see
docs/ARCHITECTURE.md, "Model families".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from engine.config import ModelConfig, RopeConfig


class UnsupportedModelError(ValueError):
    """The checkpoint is of a family or uses a feature Tessera does not serve; the message names it."""


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one family's checkpoints (see ModelConfig for each effect)."""

    #: HF config.json model_type values of the family.
    model_types: tuple[str, ...]
    #: llama.cpp's `general.architecture` for it.
    gguf_arch: str
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    #: Embeddings times sqrt(hidden) (Gemma).
    scaled_embeddings: bool = False
    #: Norm weights are stored as w and applied as (1 + w) (Gemma in HF checkpoints; llama.cpp's
    #: converter writes 1 + w into GGUF files).
    norm_plus_one: bool = False
    #: q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj` (Phi-3).
    fused_projections: bool = False
    #: llama.cpp permutes Q/K rows of this arch into its interleaved RoPE layout (Llama only).
    gguf_permuted_qk: bool = False
    #: Which layers use `sliding_window` when config.json has no `layer_types`: "none", "all",
    #: "alternate" (Gemma 2: even layers), "pattern" (Gemma 3: all but every
    #: sliding_window_pattern-th), "qwen" (use_sliding_window: layers from max_window_layers on).
    window_rule: str = "none"


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(model_types=("llama",), gguf_arch="llama", gguf_permuted_qk=True),
    "mistral": Architecture(model_types=("mistral",), gguf_arch="llama", gguf_permuted_qk=True, window_rule="all"),
    "qwen2": Architecture(model_types=("qwen2",), gguf_arch="qwen2", attention_bias=True, window_rule="qwen"),
    "qwen3": Architecture(model_types=("qwen3",), gguf_arch="qwen3", qk_norm=True, window_rule="qwen"),
    "gemma2": Architecture(model_types=("gemma2",), gguf_arch="gemma2", hidden_act="gelu_tanh", sandwich_norms=True,
                           scaled_embeddings=True, norm_plus_one=True, window_rule="alternate"),
    "gemma3_text": Architecture(model_types=("gemma3_text",), gguf_arch="gemma3", hidden_act="gelu_tanh",
                                qk_norm=True, sandwich_norms=True, scaled_embeddings=True, norm_plus_one=True,
                                window_rule="pattern"),
    "phi3": Architecture(model_types=("phi3",), gguf_arch="phi3", fused_projections=True, window_rule="all"),
}
_BY_MODEL_TYPE = {t: a for a in ARCHITECTURES.values() for t in a.model_types}
#: HF activation names of the gated MLPs served, by ModelConfig.hidden_act.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def architecture_of(model_type: Any) -> Architecture:
    """The family of HF `model_type`; UnsupportedModelError naming it (and what is served) otherwise."""
    arch = _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        hint = (" (a Gemma 3 checkpoint with its vision tower: serve its text model, model_type gemma3_text)"
                if model_type == "gemma3" else "")
        raise UnsupportedModelError(f"unsupported model_type {model_type!r}{hint}; served: "
                                    f"{', '.join(sorted(_BY_MODEL_TYPE))}")
    return arch


def architecture_of_gguf(gguf_arch: Any, *, name: str = "") -> tuple[str, Architecture]:
    """(HF model_type, family) of a GGUF `general.architecture`; a "llama" file named like a
    Mistral model is the mistral family (llama.cpp writes both as llama)."""
    if gguf_arch == "llama":
        return ("mistral", ARCHITECTURES["mistral"]) if "mistral" in name.lower() else ("llama", ARCHITECTURES["llama"])
    for model_type, arch in ARCHITECTURES.items():
        if arch.gguf_arch == gguf_arch and model_type not in ("llama", "mistral"):
            return model_type, arch
    served = sorted({a.gguf_arch for a in ARCHITECTURES.values()})
    raise UnsupportedModelError(f"unsupported GGUF architecture {gguf_arch!r}; served: {', '.join(served)}")


# ---------------------------------------------------------------------------------------------
# RoPE


_ROPE_ALIASES = {"su": "longrope", "mrope": None}


def rope_from_hf(params: Mapping[str, Any] | None, *, theta: float, max_position: int,
                 original_max_position: int | None = None) -> RopeConfig:
    """A RopeConfig from a HF rope dict (`rope_scaling`, or one entry of transformers 5's
    `rope_parameters`) and the config's theta. An unknown rope_type, or a partial rotary factor,
    is UnsupportedModelError naming it."""
    params = dict(params or {})
    theta = float(params.get("rope_theta", theta))
    kind = params.get("rope_type", params.get("type")) or "default"
    kind = _ROPE_ALIASES.get(kind, kind)
    if kind is None or kind not in ("default", "linear", "dynamic", "llama3", "yarn", "longrope"):
        raise UnsupportedModelError(f"unsupported rope_type {params.get('rope_type', params.get('type'))!r} "
                                    "(served: default, linear, dynamic, llama3, yarn, longrope)")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    orig = params.get("original_max_position_embeddings") or original_max_position
    factor = params.get("factor")
    if kind in ("longrope", "yarn") and factor is None and orig:
        factor = max_position / orig  # what transformers derives when the config leaves it out
    if kind in ("linear", "dynamic", "llama3", "yarn") and not factor:
        raise UnsupportedModelError(f"rope_type {kind!r} needs a factor")
    if kind in ("llama3", "longrope") and not orig:
        raise UnsupportedModelError(f"rope_type {kind!r} needs original_max_position_embeddings")

    def opt(key):
        v = params.get(key)
        return None if v is None else float(v)

    def factors(key):
        v = params.get(key)
        if kind == "longrope" and not isinstance(v, (list, tuple)):
            raise UnsupportedModelError(f"rope_type 'longrope' needs a {key} list")
        return None if v is None else tuple(float(x) for x in v)

    return RopeConfig(
        theta=theta, rope_type=kind, factor=float(factor or 1.0),
        original_max_position=int(orig) if orig else (max_position if kind == "yarn" else None),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"), attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        short_factor=factors("short_factor") if kind == "longrope" else None,
        long_factor=factors("long_factor") if kind == "longrope" else None,
    )


def _ropes_from_hf(cfg: Mapping[str, Any], max_pos: int) -> tuple[RopeConfig, RopeConfig | None]:
    """(global rope, local rope or None) from either config form: transformers 5's
    `rope_parameters` (flat, or per layer type as Gemma 3 writes it), or `rope_theta` +
    `rope_scaling` (+ Gemma 3's `rope_local_base_freq`)."""
    orig = cfg.get("original_max_position_embeddings")
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        full = params.get("full_attention") or {}
        glob = rope_from_hf(full, theta=float(full.get("rope_theta", 10000.0)), max_position=max_pos,
                            original_max_position=orig)
        local = params.get("sliding_attention")
        return glob, (None if local is None else rope_from_hf(local, theta=float(local.get("rope_theta", 10000.0)),
                                                              max_position=max_pos, original_max_position=orig))
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = (params or {}).get("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling") if cfg.get("rope_scaling") is not None else params
    glob = rope_from_hf(scaling, theta=float(theta), max_position=max_pos, original_max_position=orig)
    local_base = cfg.get("rope_local_base_freq")
    local = None if local_base is None else RopeConfig(theta=float(local_base))
    return glob, local


# ---------------------------------------------------------------------------------------------
# Sliding windows


def global_every(num_layers: int, n: int) -> list[bool]:
    """Which layers slide when every n-th layer is global (Gemma 3's pattern, llama.cpp's
    set_swa_pattern(n))."""
    return [(i + 1) % n != 0 for i in range(num_layers)]


def default_sliding_layers(arch: Architecture, num_layers: int) -> list[bool]:
    """Which layers slide where a checkpoint states a window but not which layers: the family's
    rule (Gemma 2: even layers; Gemma 3: all but every sixth), else all (Mistral, Phi-3, a GGUF
    of any other family)."""
    if arch.window_rule == "alternate":
        return [i % 2 == 0 for i in range(num_layers)]
    if arch.window_rule == "pattern":
        return global_every(num_layers, 6)
    return [True] * num_layers


def _layer_windows(cfg: Mapping[str, Any], arch: Architecture, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise UnsupportedModelError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise UnsupportedModelError(f"unsupported layer type {unknown[0]!r}")
        sliding = [t == "sliding_attention" for t in types]
    elif arch.window_rule == "pattern":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        sliding = global_every(num_layers, pattern)
    elif arch.window_rule in ("all", "alternate"):
        sliding = default_sliding_layers(arch, num_layers)
    elif arch.window_rule == "qwen":
        first = int(cfg.get("max_window_layers", num_layers))
        sliding = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(num_layers)]
    else:
        sliding = [False] * num_layers
    if not any(sliding):
        return ()
    if not window or int(window) <= 0:
        if types is not None and any(sliding):
            raise UnsupportedModelError("layer_types has sliding layers but sliding_window is not set")
        return ()
    return tuple(int(window) if s else None for s in sliding)


# ---------------------------------------------------------------------------------------------
# config.json


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def model_config_from_hf(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """ModelConfig of a HF config.json (any served family); UnsupportedModelError naming what is
    not served (the family, a rope type, an activation, a partial rotary embedding)."""
    arch = architecture_of(cfg.get("model_type", "llama"))
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or arch.hidden_act
    act = _ACTIVATIONS.get(act_name)
    if act is None:
        raise UnsupportedModelError(f"unsupported activation {act_name!r} (served: {', '.join(sorted(_ACTIVATIONS))})")
    rope, local_rope = _ropes_from_hf(cfg, max_pos)
    bias = bool(cfg.get("attention_bias", arch.attention_bias)) if "attention_bias" in cfg else arch.attention_bias
    qpas = cfg.get("query_pre_attn_scalar")
    return ModelConfig(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.scaled_embeddings)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        architecture=arch.model_types[0],
        rope=rope,
        local_rope=local_rope,
        hidden_act=act,
        attention_bias=bias,
        qk_norm=arch.qk_norm,
        sandwich_norms=arch.sandwich_norms,
        embedding_multiplier=math.sqrt(hidden) if arch.scaled_embeddings else None,
        query_pre_attn_scalar=float(qpas) if qpas is not None and arch.scaled_embeddings else None,
        attn_logit_softcap=_opt_float(cfg.get("attn_logit_softcapping")),
        final_logit_softcap=_opt_float(cfg.get("final_logit_softcapping")),
        layer_windows=_layer_windows(cfg, arch, layers),
        fused_projections=arch.fused_projections,
    )


def _opt_float(v) -> float | None:
    return None if v is None else float(v)

"""Llama-family decoder (SmolLM2, Llama 2/3 shapes) over a paged KV cache.

Weights come in HF layout from engine.loader; q/k/v and gate/up are fused into one matmul each.
Every op runs on the engine's backend (engine.backends: norms, linears, attention, SiLU*mul),
which also placed the weights on its device. LoRA is added by an optional `lora` object passed
to forward (the backend's LoRABatch), whose `apply(layer, group, x, y)` adds each token's
adapter term into y in place for the fused groups "qkv", "o", "gate_up" and "down".
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.loader.gguf_loader import Q4_0_SUFFIX, Q4_1_SUFFIX
from engine.model.attention import AttentionMetadata, KVCache
from engine.model.layers import RMSNorm, RotaryEmbedding


def _raw_blocks(w: dict[str, torch.Tensor], names: list[str]) -> tuple[str, torch.Tensor] | None:
    """The checkpoint's raw 4-bit rows of these weights as (qtype, rows concatenated like the
    weights: the fused projections), or None unless every part is stored in the same 4-bit type
    (engine.loader.gguf_loader.Q4_0_SUFFIX / Q4_1_SUFFIX)."""
    for qtype, suffix in (("q4_1", Q4_1_SUFFIX), ("q4_0", Q4_0_SUFFIX)):
        raws = [w.get(n + suffix) for n in names]
        if all(r is not None for r in raws):
            return qtype, torch.cat(raws)
    return None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor], backend):
        super().__init__()
        p = f"model.layers.{idx}."
        self.idx = idx
        self.cfg = cfg
        self.backend = backend
        dt, dev = backend.dtype, backend.device
        self.input_norm = RMSNorm(w[p + "input_layernorm.weight"].to(device=dev, dtype=dt), cfg.rms_norm_eps)
        self.post_attn_norm = RMSNorm(w[p + "post_attention_layernorm.weight"].to(device=dev, dtype=dt),
                                      cfg.rms_norm_eps)
        qkv = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        o, down = [p + "self_attn.o_proj.weight"], [p + "mlp.down_proj.weight"]
        self.qkv_proj = backend.linear(torch.cat([w[n] for n in qkv]), raw=_raw_blocks(w, qkv))
        self.o_proj = backend.linear(w[o[0]], raw=_raw_blocks(w, o))
        self.gate_up_proj = backend.linear(torch.cat([w[n] for n in gate_up]), raw=_raw_blocks(w, gate_up))
        self.down_proj = backend.linear(w[down[0]], raw=_raw_blocks(w, down))
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos_sin, kv: KVCache, attn: AttentionMetadata, lora, exact: bool):
        """x: [T, H] the residual stream (updated in place and returned)."""
        cfg, be = self.cfg, self.backend
        h = be.rms_norm(x, self.input_norm.weight, self.input_norm.eps)
        qkv = self.qkv_proj(h, exact)
        if lora is not None:
            lora.apply(self.idx, "qkv", h, qkv)
        o = be.attention(qkv, cos_sin, kv.k[self.idx], kv.v[self.idx], attn, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim, self.scale)
        out = self.o_proj(o, exact)
        if lora is not None:
            lora.apply(self.idx, "o", o, out)
        x, h = be.add_rms_norm(x, out, self.post_attn_norm.weight, self.post_attn_norm.eps)
        gu = self.gate_up_proj(h, exact)
        if lora is not None:
            lora.apply(self.idx, "gate_up", h, gu)
        m = be.silu_mul(gu)
        d = self.down_proj(m, exact)
        if lora is not None:
            lora.apply(self.idx, "down", m, d)
        return x.add_(d)


class LlamaModel(nn.Module):
    """forward(input_ids [T], positions [T], kv, attn, lora) -> hidden [T, H];
    compute_logits(hidden [N, H], exact) -> fp32 logits [N, V]. `exact` is the backend's
    `exact_step(attn)` (a backend with an exact weight copy uses it for steps that prefill)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, backend):
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.dtype = backend.dtype
        dt, dev = backend.dtype, backend.device
        embed = weights["model.embed_tokens.weight"].to(device=dev, dtype=dt)
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, weights, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(weights["model.norm.weight"].to(device=dev, dtype=dt), cfg.rms_norm_eps)
        head = weights["model.embed_tokens.weight"] if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = backend.linear(head, lm_head=True)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, dt).to(dev)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                attn: AttentionMetadata, lora=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions)
        exact = self.backend.exact_step(attn)
        for layer in self.layers:
            x = layer(x, cos_sin, kv, attn, lora, exact)
        return self.backend.rms_norm(x, self.norm.weight, self.norm.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, exact: bool = True) -> torch.Tensor:
        return self.lm_head(hidden, exact).float()

"""The decoder of every served family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3,
Phi-3) over a paged KV cache. A family is its ModelConfig (engine.config; read by
engine.loader.architectures), never a branch on its name: each difference is a named piece this
module honours where the config sets it:

    embedding_multiplier   x = embed(ids) * m                      (Gemma)
    attention_bias         qkv += bias                              (Qwen2)
    qk_norm                q, k heads RMS-normed before RoPE       (Qwen3, Gemma 3)
    layer_windows, rope /  per-layer sliding window and RoPE table (Gemma 2/3, Mistral, Phi-3)
      local_rope
    attn_logit_softcap,    attention scale and score capping       (Gemma 2/3)
      query_pre_attn_scalar
    sandwich_norms         attention and MLP outputs normed before their residual add (Gemma)
    hidden_act             silu(gate) * up, or gelu_tanh(gate) * up (Gemma)
    final_logit_softcap    logits = cap * tanh(logits / cap)        (Gemma 2)

Weights come in the loaders' layout (engine.loader: tensors, and QuantizedWeights for the layer
matrices a checkpoint quantizes); q/k/v and gate/up are fused into one linear each, whose parts
the backend joins as their forms allow. Every op runs on the engine's backend (engine.backends: norms, linears, attention, the
gated activation), which also placed the weights on its device. LoRA is added by an optional
`lora` object passed to forward (the backend's LoRABatch), whose `linear(layer, group, lin, x)`
gives lin(x) plus each token's adapter term for the fused groups "qkv", "o", "gate_up" and "down"
(its `apply(layer, group, x, y)` adding the term into lin's output, or one kernel doing both).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.attention import AttentionMetadata, AttentionSpec, KVCache
from engine.model.layers import RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor], backend):
        super().__init__()
        p = f"model.layers.{idx}."
        self.idx = idx
        self.cfg = cfg
        self.backend = backend
        dt, dev = backend.dtype, backend.device

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w[p + name].to(device=dev, dtype=dt), cfg.rms_norm_eps)

        self.input_norm = norm("input_layernorm.weight")
        if cfg.sandwich_norms:
            self.attn_out_norm = norm("post_attention_layernorm.weight")
            self.mlp_in_norm = norm("pre_feedforward_layernorm.weight")
            self.mlp_out_norm = norm("post_feedforward_layernorm.weight")
        else:
            self.attn_out_norm = self.mlp_out_norm = None
            self.mlp_in_norm = norm("post_attention_layernorm.weight")
        self.q_norm = norm("self_attn.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = norm("self_attn.k_norm.weight") if cfg.qk_norm else None
        qkv = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        o, down = [p + "self_attn.o_proj.weight"], [p + "mlp.down_proj.weight"]
        self.qkv_proj = backend.linear([w[n] for n in qkv])
        self.o_proj = backend.linear([w[n] for n in o])
        self.gate_up_proj = backend.linear([w[n] for n in gate_up])
        self.down_proj = backend.linear([w[n] for n in down])
        self.qkv_bias = None
        if cfg.attention_bias:
            bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            self.qkv_bias = nn.Parameter(bias.to(device=dev, dtype=dt), requires_grad=False)
        window = cfg.window(idx)
        self.local = window is not None and cfg.local_rope is not None
        self.attn = AttentionSpec(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                  scale=cfg.attention_scale, sliding_window=window,
                                  softcap=cfg.attn_logit_softcap)

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """RMSNorm over each q and k head of qkv [T, (Hq + 2 Hkv) D], in place (before RoPE)."""
        cfg, be = self.cfg, self.backend
        T, D = qkv.shape[0], cfg.head_dim
        for start, heads, norm in ((0, cfg.num_heads, self.q_norm), (cfg.q_size, cfg.num_kv_heads, self.k_norm)):
            part = qkv[:, start:start + heads * D].reshape(T * heads, D)
            qkv[:, start:start + heads * D] = be.rms_norm(part, norm.weight, norm.eps).view(T, heads * D)

    def forward(self, x, pending, ropes, kv: KVCache, attn: AttentionMetadata, lora):
        """x: [T, H] the residual stream (updated in place); pending: the previous layer's output
        still to be added to it (None for the first layer), added here by the input norm's fused
        add + norm, one launch for both; ropes: the model's (rope, cos_sin) pairs, global first
        then local. Returns (x, this layer's output: the pending of the next layer or the final norm)."""
        cfg, be = self.cfg, self.backend
        if pending is None:
            h = be.rms_norm(x, self.input_norm.weight, self.input_norm.eps)
        else:
            x, h = be.add_rms_norm(x, pending, self.input_norm.weight, self.input_norm.eps)
        qkv = self.qkv_proj(h) if lora is None else lora.linear(self.idx, "qkv", self.qkv_proj, h)
        if self.qkv_bias is not None:
            qkv.add_(self.qkv_bias)
        if self.q_norm is not None:
            self._norm_qk(qkv)
        rope, cos_sin = ropes[1] if self.local else ropes[0]
        o = be.attention(qkv, rope, cos_sin, kv.k[self.idx], kv.v[self.idx], attn, self.attn)
        out = self.o_proj(o) if lora is None else lora.linear(self.idx, "o", self.o_proj, o)
        if self.attn_out_norm is not None:
            out = be.rms_norm(out, self.attn_out_norm.weight, self.attn_out_norm.eps)
        x, h = be.add_rms_norm(x, out, self.mlp_in_norm.weight, self.mlp_in_norm.eps)
        gu = self.gate_up_proj(h) if lora is None else lora.linear(self.idx, "gate_up", self.gate_up_proj, h)
        if lora is None:
            d = be.gated_linear(self.down_proj, gu, cfg.hidden_act)
        else:  # the down group's shrink reads the activation: materialize it
            m = be.act_mul(gu, cfg.hidden_act)
            d = lora.linear(self.idx, "down", self.down_proj, m)
        if self.mlp_out_norm is not None:
            d = be.rms_norm(d, self.mlp_out_norm.weight, self.mlp_out_norm.eps)
        return x, d


class DecoderModel(nn.Module):
    """forward(input_ids [T], positions [T], kv, attn, lora) -> hidden [T, H];
    compute_logits(hidden [N, H]) -> fp32 logits [N, V], for the step the last forward ran
    (forward starts with `backend.begin_step(attn)`)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, backend):
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.dtype = backend.dtype
        dt, dev = backend.dtype, backend.device
        embed = weights["model.embed_tokens.weight"].to(device=dev, dtype=dt)
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        # Rounded to the activation dtype, as the reference multiplies (Gemma: a bf16 sqrt(hidden)).
        self.embed_multiplier = (None if cfg.embedding_multiplier is None
                                 else torch.tensor(cfg.embedding_multiplier, dtype=dt).item())
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, weights, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(weights["model.norm.weight"].to(device=dev, dtype=dt), cfg.rms_norm_eps)
        head = weights["model.embed_tokens.weight"] if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = backend.linear([head], lm_head=True)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope, dt).to(dev)
        self.local_rope = (None if cfg.local_rope is None
                           else RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope, dt).to(dev))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                attn: AttentionMetadata, lora=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_multiplier is not None:
            x = x * self.embed_multiplier
        ropes = [(self.rope, self.rope.cos_sin(positions))]
        if self.local_rope is not None:
            ropes.append((self.local_rope, self.local_rope.cos_sin(positions)))
        self.backend.begin_step(attn)
        pending = None
        for layer in self.layers:
            x, pending = layer(x, pending, ropes, kv, attn, lora)
        if pending is None:  # no layers
            return self.backend.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.backend.add_rms_norm(x, pending, self.norm.weight, self.norm.eps)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

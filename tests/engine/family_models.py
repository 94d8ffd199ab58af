"""Small random-weight models of every served family, built with transformers from a config of
that family's real kind with every distinguishing field set (biases, q/k norms, soft-caps,
sliding windows shorter than the test prompts, rope scaling whose factors change the result at
the tested positions), saved as HF checkpoint directories: the references of
tests/engine/test_families.py and the LoRA tests beside it. Nothing is downloaded."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320  # >= the synthetic tokenizer's 267 ids (engine.loader.synthetic.tokenizer_metadata)

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)


def family_configs():
    """name -> a transformers config of that family (fresh objects on every call)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    half = 8  # head_dim 16 -> 8 rotary frequencies
    return {
        # Llama 3.1: llama3 rope scaling with an original context far below the tested positions'
        # wavelengths, untied lm_head.
        "llama3": LlamaConfig(**_COMMON, head_dim=16, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        # Llama 3.2: tied embeddings, linear scaling for variety.
        "llama3.2-tied": LlamaConfig(**_COMMON, head_dim=16, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "mistral": MistralConfig(**_COMMON, head_dim=16, sliding_window=8, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # Qwen2.5: q/k/v biases, YaRN.
        "qwen2": Qwen2Config(**_COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
        # Qwen3: q/k norms, head_dim != hidden / heads.
        "qwen3": Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Gemma 2: GeGLU, sandwich norms, scaled embeddings, both soft-caps small enough to bite,
        # query_pre_attn_scalar != head_dim, even layers sliding (window 8).
        "gemma2": Gemma2Config(**_COMMON, head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=3.0, sliding_window=8, hidden_activation="gelu_pytorch_tanh",
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # Gemma 3: q/k norms, local rope theta 10000 on sliding layers, linear-scaled global rope.
        "gemma3": Gemma3TextConfig(**_COMMON, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                                       "factor": 8.0}}),
        # Phi-3.5: fused qkv_proj / gate_up_proj, LongRoPE (short factors below 64 positions),
        # sliding window.
        "phi3": Phi3Config(**{**_COMMON, "num_key_value_heads": 4}, sliding_window=12, tie_word_embeddings=False,
                           original_max_position_embeddings=64,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "short_factor": [1.0 + 0.15 * i for i in range(half)],
                                            "long_factor": [1.5 + 0.3 * i for i in range(half)],
                                            "original_max_position_embeddings": 64}),
    }


FAMILIES = tuple(family_configs())


def build_family_model(name: str, out: Path, seed: int = 0):
    """A random-weight transformers model of family `name`, saved to `out` (safetensors); returns
    the model (fp32, eager attention, eval mode). Weights are drawn large enough that the
    logits are far from uniform, norms around their identity (Gemma's stored w around 0)."""
    from transformers import AutoModelForCausalLM

    cfg = family_configs()[name]
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    gemma = cfg.model_type.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p) * (0.3 if gemma else 1.0))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return model


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, logits [len(prompt) + steps - 1, V]) of the reference model, each step a
    full forward over the whole sequence (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids[len(prompt):], logits[len(prompt) - 1:len(ids) - 1]

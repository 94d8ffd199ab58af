"""Whole models in every quantized checkpoint format, through the whole engine, against their
dequantized reference.

For each format a small random-weight model of two families (Llama 3.1 with llama3 RoPE scaling,
Qwen2.5 with q/k/v biases; hidden 256, so every layer matrix takes whole 256-weight K-quant
super-blocks) is built with transformers, saved, and written in the format by this project's
writers (engine.loader.gguf_writer: llama.cpp's mixes; engine.loader.quantized_writer: AWQ, GPTQ,
compressed-tensors int and FP8). The engine loads the quantized checkpoint, its layer matrices as
QuantizedWeights (the file's codes and scales). The reference is transformers' model of the
family with those weights dequantized (QuantizedWeight.dequantize, checked bit-exact against each
format's own dequantization in test_gguf_kquants.py and test_hf_quantized.py), run in float64.

The CPU backend multiplies by the dequantized weights (its fp32 format); the Triton backend
(under the interpreter) keeps them quantized and dequantizes inside its W4A16 / W8A16 kernels,
fp32 activations. Every logits row is within LOGITS_RTOL of the reference row's largest and the
greedy tokens are the reference's.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.gguf_writer import write_gguf
from engine.loader.quantized import QuantizedWeight, dense
from engine.loader.synthetic import tokenizer_metadata
from engine.sampling_params import GenerationRequest, SamplingParams
from engine.tokenizer import TextTokenizer

from .family_models import VOCAB, hf_greedy
from .test_families import assert_rows_close, run_recording

#: Relative bound on |ours - reference| / max|reference| per logits row (fp32 against float64).
LOGITS_RTOL = 1e-4
STEPS = 4

_SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)


def _config(family: str):
    from transformers import LlamaConfig, Qwen2Config

    if family == "llama3.1":
        return LlamaConfig(**_SHAPE, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    return Qwen2Config(**_SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a saved random-weight fp32 HF checkpoint directory (weights at a trained
    model's scale: std 1/sqrt(fan_in), q/k/v biases)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, family in enumerate(("llama3.1", "qwen2.5")):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5 if "embed" not in name else 1.0)
                elif name.endswith("bias"):
                    p.normal_(0, 0.1)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = path
    return out


def _write(fmt: str, src: Path, out: Path) -> Path:
    """The checkpoint at `src` written in format `fmt` under `out`."""
    from engine.loader import quantized_writer

    kind, _, variant = fmt.partition(":")
    if kind == "gguf":
        cfg, tensors, _ = load_checkpoint(src)
        return write_gguf(out / "model.gguf", cfg, tensors, tokenizer_metadata(VOCAB), quant=variant)
    if kind == "awq":
        return quantized_writer.write_awq(src, out, group_size=int(variant))
    if kind == "gptq":
        bits, group, sym, act = variant.split("-")
        return quantized_writer.write_gptq(src, out, bits=int(bits), group_size=int(group), sym=sym == "sym",
                                           desc_act=act == "act")
    if kind == "fp8":
        strategy, _, size = variant.partition("-")
        return quantized_writer.write_compressed_fp8(src, out, strategy=strategy,
                                                     group_size=int(size) if strategy == "group" else None,
                                                     block=(int(size), int(size)) if strategy == "block" else None)
    if kind == "ct":
        bits, strategy, group, sym = variant.split("-")
        return quantized_writer.write_compressed(src, out, bits=int(bits), strategy=strategy,
                                                 group_size=int(group) or None, symmetric=sym == "sym")
    raise ValueError(fmt)


def _reference(checkpoint, family: str):
    """transformers' model of the family with the checkpoint's weights dequantized, float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float64)
    state = {name: dense(w).double() for name, w in checkpoint[1].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.eval()


#: (format, family): every format on the CPU backend and on the Triton backend (under the
#: interpreter): 4-bit codes with fp16 or fp32 scales, with and without mins or zero points, an
#: act-order permutation; 8-bit codes in groups of 16 or 32 or one scale per output channel; FP8
#: E4M3 codes per channel and in 128 x 128 blocks; the Q4_K_M and Q5_K_M mixes' q/k/v of two forms. tests/engine/test_w4a16.py and test_w8a16.py
#: check every weight form's kernels alone.
CASES = [
    ("gguf:q4_k_m", "llama3.1"),
    ("gguf:q4_k_m", "qwen2.5"),
    ("gguf:q5_k_m", "llama3.1"),
    ("gguf:q6_k", "qwen2.5"),
    ("gguf:q8_0", "llama3.1"),
    ("awq:128", "qwen2.5"),
    ("gptq:4-64-sym-act", "llama3.1"),
    ("gptq:4-128-asym-noact", "qwen2.5"),
    ("gptq:8-128-sym-noact", "llama3.1"),
    ("ct:4-group-128-sym", "llama3.1"),
    ("ct:4-group-64-asym", "qwen2.5"),
    ("ct:8-channel-0-sym", "qwen2.5"),
    ("fp8:channel", "llama3.1"),
    ("fp8:block-128", "qwen2.5"),
]


def _engine(path: Path, backend: str, device: str) -> LLMEngine:
    fmt = "fp32" if backend == "cpu" else "auto"
    cfg = EngineConfig(backend=backend, device=device, weight_format=fmt, dtype=torch.float32, block_size=16,
                       num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, startup_warmup=False)
    return LLMEngine(path, cfg, tokenizer=TextTokenizer.from_gguf_metadata(tokenizer_metadata(VOCAB)))


@pytest.mark.parametrize("fmt,family", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_quantized_model_gives_its_dequantized_references_logits(dense_dirs, tmp_path, request, fmt, family):
    path = _write(fmt, dense_dirs[family], tmp_path)
    checkpoint = load_checkpoint(path)
    layer = checkpoint[1]["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(layer, QuantizedWeight), f"{fmt}: the layer matrices were not kept quantized"
    reference = _reference(checkpoint, family)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, VOCAB, (13,), generator=g).tolist()
    want_tokens, want_rows = hf_greedy(reference, prompt, STEPS)

    for backend, device in (("cpu", "cpu"), ("triton", request.getfixturevalue("triton_engine_device"))):
        engine = _engine(path, backend, device)
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        tokens, rows, _ = run_recording(engine, [GenerationRequest("r", prompt_token_ids=prompt, params=params)])
        assert tokens["r"] == want_tokens, f"{fmt}/{family}/{backend}: greedy tokens differ from the reference's"
        assert_rows_close(rows["r"], want_rows.float(), f"{fmt}/{family}/{backend}", LOGITS_RTOL)

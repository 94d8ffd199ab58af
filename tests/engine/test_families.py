"""Every served family against transformers, through the whole engine.

For each family (tests/engine/family_models.py: a small random-weight model built with
transformers from a config of that family's kind, every distinguishing field set), the engine
loads the saved checkpoint directory and serves greedy requests on the CPU backend and on the
Triton backend (under the interpreter, all its kernels: fused RoPE + KV write with the layer's
rope table, paged decode/prefill attention with sliding windows and soft-caps, fused norms,
GeGLU): a 37-token prompt prefilled in chunks of 16 tokens, 16 decode steps across KV block
boundaries, then the same prompt again (a prefix-cache hit) in one batch with another prompt.
Every sampled logits row is within LOGITS_RTOL of transformers' (fp32, eager attention, a full
forward over the whole sequence) relative to the row's largest, and the greedy tokens are the
same.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.synthetic import tokenizer_metadata
from engine.sampling_params import GenerationRequest, SamplingParams
from engine.tokenizer import TextTokenizer

from .family_models import FAMILIES, VOCAB, build_family_model, hf_greedy

#: Relative bound on |ours - transformers| / max|transformers| per logits row (fp32 both).
LOGITS_RTOL = 1e-4
STEPS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_gguf_metadata(tokenizer_metadata(VOCAB))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build_family_model(request.param, path)
    return request.param, path, model


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def family_engine(path, backend: str, tokenizer, adapter_source=None, **kw) -> LLMEngine:
    """An engine on the checkpoint at `path`: exact fp32 weights, 16-token blocks and steps."""
    cfg = EngineConfig(**{"backend": backend, "weight_format": "fp32", "block_size": 16, "num_kv_blocks": 24,
                          "max_num_batched_tokens": 16, "max_num_seqs": 4, "startup_warmup": False, **kw})
    return LLMEngine(path, cfg, tokenizer=tokenizer, adapter_source=adapter_source)


def run_recording(engine: LLMEngine, requests: list[GenerationRequest]) -> tuple[dict, dict, dict]:
    """(greedy tokens, sampled logits rows in step order, cached prompt tokens) per request id."""
    rows: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(sched, lora=None, *pending):  # pending: an overlapped step's (CUDA's default)
        logits, seqs = execute(sched, lora, *pending)
        for row, seq in zip(logits, seqs):
            rows.setdefault(seq.request_id, []).append(row.detach().float().cpu().clone())
        return logits, seqs

    engine.runner.execute = recording
    for r in requests:
        engine.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
            if out.finished:
                cached[out.request_id] = out.cached_tokens
    engine.runner.execute = execute
    return tokens, rows, cached


def assert_rows_close(got: list[torch.Tensor], want: torch.Tensor, what: str, rtol: float = LOGITS_RTOL) -> None:
    assert len(got) == want.shape[0], f"{what}: {len(got)} logits rows, expected {want.shape[0]}"
    for step, row in enumerate(got):
        err = float((row - want[step]).abs().max() / want[step].abs().max())
        assert err < rtol, f"{what} step {step}: relative logits error {err:.2e}"


def _greedy(prompt) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_family_matches_transformers(family, backend, tokenizer, request):
    name, path, model = family
    long_prompt, short_prompt = _prompt(1, 37), _prompt(2, 21)
    want_long = hf_greedy(model, long_prompt, STEPS)
    want_short = hf_greedy(model, short_prompt, STEPS)

    device = request.getfixturevalue("triton_engine_device") if backend == "triton" else "cpu"
    engine = family_engine(path, backend, tokenizer, device=device)
    cfg = engine.model_config
    assert cfg.architecture == model.config.model_type
    # The prompts are longer than every sliding window, so the windows are what is compared.
    assert all(w is None or w < len(short_prompt) for w in cfg.layer_windows)

    tokens, rows, _ = run_recording(engine, [GenerationRequest("first", prompt_token_ids=long_prompt,
                                                               params=_greedy(long_prompt))])
    assert tokens["first"] == want_long[0], f"{name}/{backend}: greedy tokens differ from transformers'"
    assert_rows_close(rows["first"], want_long[1], f"{name}/{backend} chunked prefill + decode")

    # The same prompt again, batched with another: its full blocks come from the prefix cache.
    tokens, rows, cached = run_recording(engine, [
        GenerationRequest("hit", prompt_token_ids=long_prompt, params=_greedy(long_prompt)),
        GenerationRequest("other", prompt_token_ids=short_prompt, params=_greedy(short_prompt))])
    assert cached["hit"] == 32, "the repeated prompt's two full blocks were not served from the cache"
    assert tokens["hit"] == want_long[0] and tokens["other"] == want_short[0]
    assert_rows_close(rows["hit"], want_long[1], f"{name}/{backend} prefix-cache hit")
    assert_rows_close(rows["other"], want_short[1], f"{name}/{backend} batched")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_family_config_is_read_from_the_checkpoint(family):
    """What distinguishes each family reaches the ModelConfig (so the comparisons above test it)."""
    name, path, model = family
    cfg, tensors, _ = load_checkpoint(path)
    hf = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
         getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    expect = {
        "llama3": lambda: cfg.rope.rope_type == "llama3" and not cfg.tie_word_embeddings,
        "llama3.2-tied": lambda: cfg.rope.rope_type == "linear" and cfg.tie_word_embeddings,
        "mistral": lambda: cfg.layer_windows == (8, 8, 8),
        "qwen2": lambda: cfg.attention_bias and cfg.rope.rope_type == "yarn",
        "qwen3": lambda: cfg.qk_norm and cfg.head_dim == 32 and not cfg.attention_bias,
        "gemma2": lambda: (cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.attn_logit_softcap == 2.0
                           and cfg.final_logit_softcap == 3.0 and cfg.layer_windows == (8, None, 8)
                           and cfg.attention_scale == 24 ** -0.5),
        "gemma3": lambda: (cfg.qk_norm and cfg.local_rope.theta == 10000.0 and cfg.rope.rope_type == "linear"
                           and cfg.layer_windows == (8, 8, None)),
        "phi3": lambda: cfg.fused_projections and cfg.rope.rope_type == "longrope" and cfg.layer_windows == (12,) * 3,
    }[name]
    assert expect(), f"{name}: {cfg}"
    # Fused projections arrive split; Gemma's norms as applied (1 + w).
    assert "model.layers.0.self_attn.q_proj.weight" in tensors and "model.layers.0.mlp.up_proj.weight" in tensors
    if name.startswith("gemma"):
        stored = model.model.layers[0].input_layernorm.weight
        assert torch.allclose(tensors["model.layers.0.input_layernorm.weight"].float(), stored.float() + 1)


@pytest.mark.parametrize("quant, rtol", [("f32", 1e-5), ("q8_0", 0.05)])
def test_gguf_of_the_checkpoint_gives_the_same_logits(family, tokenizer, tmp_path, quant, rtol):
    """The model loaded from its safetensors directory and from the GGUF this project writes for
    it (llama.cpp's conventions for the family: names, permuted Q/K, fused Phi-3 tensors, rope
    factor tensors) serves the same logits: exactly up to fp32 rounding in f32, within Q8_0's
    rounding quantized."""
    from engine.loader.gguf_writer import write_gguf
    from engine.loader.synthetic import tokenizer_metadata

    name, path, _ = family
    cfg, tensors, _ = load_checkpoint(path)
    gguf = write_gguf(tmp_path / f"{name}.gguf", cfg, tensors, tokenizer_metadata(VOCAB), quant=quant)
    prompt = _prompt(3, 33)
    request = [GenerationRequest("r", prompt_token_ids=prompt, params=_greedy(prompt))]
    _, want, _ = run_recording(family_engine(path, "cpu", tokenizer), request)
    _, got, _ = run_recording(family_engine(gguf, "cpu", tokenizer), request)
    # Quantized, greedy tokens may part after a near-tie: the prefill's row is the one compared.
    rows = len(want["r"]) if quant == "f32" else 1
    assert_rows_close(got["r"][:rows], torch.stack(want["r"][:rows]), f"{name} from {quant} GGUF", rtol=rtol)

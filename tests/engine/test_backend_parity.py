"""The whole engine on the Triton backend against the CPU backend, on a tiny synthetic Llama.

The Triton backend runs here on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) with all its kernels: the W4A16 matmul on the file's own Q4_1 blocks, the
fused RoPE + KV write, paged decode and prefill attention, fused norms, and punica_kernels'
Triton SGMV/BGMV for the LoRA term; the CPU backend runs its C kernels (decode attention, norms,
the C LoRA kernel) on the exact fp32 weights, which are those blocks dequantized. So the only
differences are the kernels' summation orders: the
logits of every sampled row agree within 1e-4 of the row's largest, and greedy tokens are
identical, for a mixed batch (adapters of ranks 4, 8 and 16 beside base requests) that
prefills in chunks, decodes, and preempts.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.synthetic import write_synthetic_gguf
from engine.lora.source import LocalDirectoryAdapterSource
from engine.lora.weights import base_shape_of
from engine.sampling_params import GenerationRequest, SamplingParams
from engine.tokenizer import TextTokenizer

from .lora_fixtures import write_random_adapter

#: Relative bound on |logits_triton - logits_cpu| / max|logits_cpu| per row (fp32, two summation orders).
LOGITS_RTOL = 1e-4

ADAPTERS = {"r4-attn": (4, ("q_proj", "k_proj", "v_proj", "o_proj")), "r8-all": (8, None),
            "r16-mlp": (16, ("gate_proj", "up_proj", "down_proj"))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, triton_engine_device):
    root = tmp_path_factory.mktemp("tiny")
    path = write_synthetic_gguf(root / "tiny.gguf", "tiny", seed=3)
    checkpoint = load_checkpoint(path)
    cfg = checkpoint[0]
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        kw = {"targets": targets} if targets else {}
        write_random_adapter(root / "adapters" / name, rank, base=base_shape_of(cfg), seed=10 + i, std=0.08, **kw)
    return path, checkpoint, TextTokenizer.from_gguf_metadata(checkpoint[2]), root / "adapters", triton_engine_device


def _engine(tiny, backend: str, **overrides) -> LLMEngine:
    path, checkpoint, tokenizer, adapters, triton_device = tiny
    # The CPU backend's exact format against the Triton backend's own: 4-bit weights from the
    # file's Q4_1 blocks (they dequantize to exactly the CPU backend's fp32 weights).
    fmt = "fp32" if backend == "cpu" else "auto"
    device = "cpu" if backend == "cpu" else triton_device
    cfg = EngineConfig(**{"backend": backend, "weight_format": fmt, "device": device, "block_size": 16, "num_kv_blocks": 12,
                          "max_num_batched_tokens": 48, "max_num_seqs": 8, "max_loras": 4, "max_lora_rank": 16,
                          "startup_warmup": False, **overrides})
    return LLMEngine(path, cfg, checkpoint=checkpoint, tokenizer=tokenizer,
                     adapter_source=LocalDirectoryAdapterSource(adapters))


def _requests(tokenizer, max_tokens: int = 14) -> list[GenerationRequest]:
    """Six requests: two on the base, one per adapter, one more on r8; prompts of 5 to ~70
    tokens, so the longest prefill in chunks; `max_tokens` greedy tokens each, EOS ignored."""
    texts = ["hello", "the quick brown fox jumps over the lazy dog " * 2, "tell me a story about a robot",
             "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2, "pirates and parrots", "12 + 30 = 42"]
    adapters = [None, "r4-attn", "r8-all", None, "r16-mlp", "r8-all"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [GenerationRequest(request_id=f"r{i}", prompt_token_ids=tokenizer.encode(t), params=params, adapter=a)
            for i, (t, a) in enumerate(zip(texts, adapters))]


def _run(engine: LLMEngine, requests) -> tuple[dict, dict]:
    """Greedy tokens per request, and each request's sampled logits rows in step order."""
    rows: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(sched, lora=None, *pending):  # pending: an overlapped step's (CUDA's default)
        logits, seqs = execute(sched, lora, *pending)
        for row, seq in zip(logits, seqs):
            rows.setdefault(seq.request_id, []).append(row.detach().cpu().clone())
        return logits, seqs

    engine.runner.execute = recording
    for r in requests:
        engine.add_request(r)
    # Adapters load on background threads; the schedule (and so whether memory runs short
    # enough to preempt) is only the same on both engines once every load is in.
    for adapter in {r.adapter for r in requests} - {None}:
        engine.lora_manager.wait_loaded(adapter)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
    return tokens, rows


def test_triton_backend_matches_the_cpu_backend_on_a_mixed_adapter_batch(tiny):
    tokenizer = tiny[2]
    requests = _requests(tokenizer)
    cpu, triton = _engine(tiny, "cpu"), _engine(tiny, "triton")
    want_tokens, want_rows = _run(cpu, requests)
    got_tokens, got_rows = _run(triton, _requests(tokenizer))

    # The workload exercised what the test claims: chunked prefill, and preemption on both.
    assert max(len(r.prompt_token_ids) for r in requests) > cpu.config.max_num_batched_tokens
    assert cpu.stats["preemptions"] > 0 and triton.stats["preemptions"] > 0
    assert all(len(t) == 14 for t in want_tokens.values())
    # Adapters change the output (so their Triton path is what is compared).
    base_rows = want_rows["r1"][0]
    assert not torch.allclose(base_rows, _run(_engine(tiny, "cpu"), [GenerationRequest(
        request_id="r1", prompt_token_ids=requests[1].prompt_token_ids, params=requests[1].params)])[1]["r1"][0])

    assert got_tokens == want_tokens
    for rid, want in want_rows.items():
        got = got_rows[rid]
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want)):
            err = float((g - w).abs().max() / w.abs().max())
            assert err < LOGITS_RTOL, f"{rid} step {step}: relative logits error {err:.2e}"
    # Nothing leaked: every KV block is free again on both.
    for eng in (cpu, triton):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_triton_backend_takes_its_kernels_from_punica_and_places_everything_on_its_device(tiny):
    from engine.backends.triton.w4a16 import W4A16Linear

    eng = _engine(tiny, "triton")
    assert eng.backend.name == "triton" and eng.weight_format == "w4a16"
    layer = eng.model.layers[0]
    assert all(isinstance(m, W4A16Linear) and m.source == "gguf q4_1"
               for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
    # By type: the engine's device may name no index ("cuda"), the tensors' always do ("cuda:0").
    assert all(t.device.type == eng.device.type for t in eng.kv.k + eng.kv.v)
    assert eng.lora_manager.slots.ranks.device.type == eng.device.type


def test_triton_backend_refuses_what_it_cannot_run(tiny, monkeypatch):
    with pytest.raises(ValueError, match="int8"):
        _engine(tiny, "triton", weight_format="int8")
    with pytest.raises(ValueError, match="cpu backend"):
        EngineConfig(backend="triton", lora_dtype=torch.int8)
    with pytest.raises(ValueError, match="backend triton for cuda"):
        EngineConfig(backend="cpu", device="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _engine(tiny, "triton", device="cpu")

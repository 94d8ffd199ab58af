"""Our forward pass against Hugging Face transformers on the same dequantized GGUF weights."""
import torch

from engine.model.attention import AttentionMetadata, KVCache, PrefillChunk
from engine.backends.cpu import CpuBackend
from engine.config import EngineConfig
from engine.model.decoder import DecoderModel

from .conftest import chat

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 =", "¿Dónde está la biblioteca? 日本語も"]


def _our_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    cfg = model.cfg
    T = len(ids)
    kv = KVCache(cfg.num_layers, -(-T // 16), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    meta = AttentionMetadata(slot_mapping=torch.arange(T), num_decode=0, decode_slots=None,
                             decode_mask=None, prefills=[PrefillChunk(0, T, T, None, None)])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(T), kv, meta))


def test_logits_match_transformers_fp32(smollm_checkpoint, tokenizer, hf_model):
    cfg, weights, _ = smollm_checkpoint
    model = DecoderModel(cfg, weights, backend=CpuBackend(EngineConfig(weight_format="fp32")))
    for text in PROMPTS:
        ids = tokenizer.encode(chat(tokenizer, text))
        ours = _our_logits(model, ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-3, f"{text!r}: relative error {rel:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chunked_prefill_and_decode_give_the_same_logits(engine, tokenizer):
    """Prefill in small chunks, then decode, must reproduce the one-shot prefill logits."""
    ids = tokenizer.encode(chat(tokenizer, "Name three rivers in Europe."))
    full = _our_logits(engine.model, ids)
    from engine.sampling_params import GenerationRequest, SamplingParams
    from engine.scheduler import ScheduledSequence, SchedulerOutput

    seq = engine.add_request(GenerationRequest("chunked", prompt_token_ids=ids[:-1],
                                               params=SamplingParams(max_tokens=4, temperature=0)))
    engine.scheduler.waiting.remove(seq)
    try:
        rows = []
        c = 0
        for n in (5, 7, len(ids) - 1 - 12):
            engine.block_manager.allocate(seq, n)
            logits, _ = engine.runner.execute(SchedulerOutput(prefills=[ScheduledSequence(seq, n)]))
            seq.num_computed_tokens += n
            c += n
        rows.append(logits[-1])
        seq.append_token(ids[-1])  # feed the real next token as a decode step
        engine.block_manager.allocate(seq, 1)
        logits, _ = engine.runner.execute(SchedulerOutput(decodes=[ScheduledSequence(seq, 1)]))
        rows.append(logits[0])
    finally:
        engine.abort("chunked")
    assert torch.allclose(rows[0], full[-2], rtol=0, atol=1e-3 * full.abs().max())
    assert torch.allclose(rows[1], full[-1], rtol=0, atol=1e-3 * full.abs().max())

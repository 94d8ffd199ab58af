"""Token logprobs (SamplingParams.logprobs): the model's raw distribution, one entry per token."""
import pytest
import torch

from engine.model.attention import AttentionMetadata, KVCache, PrefillChunk
from engine.sampling_params import GenerationRequest, InvalidRequestError, SamplingParams

from .conftest import chat
from .helpers import greedy


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of `ids`, in one plain prefill."""
    cfg = model.cfg
    T = len(ids)
    kv = KVCache(cfg.num_layers, -(-T // 16), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    meta = AttentionMetadata(slot_mapping=torch.arange(T), num_decode=0, decode_slots=None,
                             decode_mask=None, prefills=[PrefillChunk(0, T, T, None, None)])
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(T), kv, meta))
    return torch.log_softmax(logits.float(), dim=-1)


def _run(engine, request: GenerationRequest):
    return engine.generate([request])[request.request_id]


def test_logprobs_match_the_models_distribution(engine, tokenizer):
    prompt = tokenizer.encode(chat(tokenizer, "Name three rivers in Europe."))
    out = _run(engine, GenerationRequest("lp-ref", prompt_token_ids=prompt,
                                         params=SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)))
    assert len(out.logprobs) == len(out.token_ids) == 8
    ref = _reference_logprobs(engine.model, prompt + out.token_ids[:-1])
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert entry["token_id"] == tok
        assert entry["logprob"] == pytest.approx(row[tok].item(), abs=1e-3)
        top = torch.topk(row, 5)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-3)
        # Greedy: the sampled token is the likeliest one.
        assert entry["top_logprobs"][0]["token_id"] == tok


def test_logprobs_ignore_temperature_and_do_not_change_sampling(engine):
    def first(rid, temperature, logprobs):
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=7, logprobs=logprobs, ignore_eos=True)
        return _run(engine, GenerationRequest(rid, prompt="Once upon a time", params=params))

    cold, hot = first("lp-t0", 0.0, 3), first("lp-t2", 2.0, 3)
    # The first token's context is the prompt alone: the same distribution whatever the temperature.
    a, b = cold.logprobs[0]["top_logprobs"], hot.logprobs[0]["top_logprobs"]
    assert [t["token_id"] for t in a] == [t["token_id"] for t in b]
    assert [t["logprob"] for t in a] == pytest.approx([t["logprob"] for t in b], abs=1e-4)
    assert first("lp-t2-off", 2.0, None).token_ids == hot.token_ids
    assert all(e["logprob"] <= 0.0 and len(e["top_logprobs"]) == 3 for e in hot.logprobs)


def test_only_rows_that_ask_get_logprobs_in_a_mixed_batch(engine):
    asks = GenerationRequest("lp-ask", prompt="The quick brown fox",
                             params=SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True))
    outs = engine.generate([asks, greedy("lp-not", "Water boils at", 6, ignore_eos=True)])
    assert outs["lp-not"].logprobs is None
    assert len(outs["lp-ask"].logprobs) == 6
    assert all(e["top_logprobs"] == [] for e in outs["lp-ask"].logprobs)
    assert outs["lp-ask"].token_ids == _run(engine, greedy("lp-alone", "The quick brown fox", 6,
                                                           ignore_eos=True)).token_ids


def test_every_delta_carries_the_entries_of_its_tokens(engine, tokenizer):
    """Streaming deltas (stop strings hold text back, not tokens): each delta has one entry per
    token id it carries, and the stop string's tokens are in the last one."""
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, stop=["Paris"])
    engine.add_request(GenerationRequest("lp-stream", prompt=chat(tokenizer, "What is the capital of France?"),
                                         params=params))
    deltas = []
    while engine.has_unfinished():
        deltas += [o for o in engine.step() if o.request_id == "lp-stream"]
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    for d in deltas:
        assert [e["token_id"] for e in d.logprobs] == d.token_ids
    assert not engine.output.pending_logprobs  # nothing kept for finished requests


def test_logprobs_out_of_range_are_refused_naming_the_field():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"logprobs": 21})
    assert e.value.param == "logprobs"
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({"logprobs": -1})

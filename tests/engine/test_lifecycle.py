"""Aborts, leaks and bad input: nothing is lost and nobody else is disturbed."""
import random

import pytest

from engine.sampling_params import GenerationRequest, InvalidRequestError, SamplingParams

from .helpers import PROMPTS, greedy


def test_no_leaked_blocks_after_100_mixed_finished_and_aborted(engine):
    rng = random.Random(0)
    total = engine.block_manager.num_blocks
    live: list[str] = []
    finished = aborted = 0
    for i in range(100):
        rid = f"mix{i}"
        engine.add_request(greedy(rid, rng.choice(PROMPTS), rng.randint(1, 12)))
        live.append(rid)
        if rng.random() < 0.5:
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
                    finished += 1
        if live and rng.random() < 0.4:
            victim = rng.choice(live)
            out = engine.abort(victim)
            assert out is not None and out.finish_reason == "abort"
            live.remove(victim)
            aborted += 1
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
                finished += 1
    assert not live
    assert finished + aborted == 100 and aborted > 10 and finished > 10
    assert engine.block_manager.num_free_blocks == total
    assert not engine.requests


def test_abort_mid_decode_reports_counts_and_frees_at_once(engine):
    engine.add_request(greedy("ab", "Tell me a long story about dragons.", 200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert used > 0
    out = engine.abort("ab")
    assert out.finished and out.finish_reason == "abort"
    assert out.completion_tokens == 5  # the prefill step samples the first token, then 4 decodes
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort("ab") is None


@pytest.mark.parametrize("params,message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"bogus_field": 1}, "unknown field 'bogus_field'"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_are_refused_clearly(params, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict(params)
    assert message in str(e.value)


def test_bad_prompts_are_refused_and_others_keep_running(engine, tokenizer):
    engine.add_request(greedy("good", "The capital of Italy is", 16, ignore_eos=True))
    engine.step()
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(greedy("empty", "", 8))
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(greedy("long", "word " * (engine.max_model_len + 10), 8))
    with pytest.raises(InvalidRequestError, match="exceeds the context"):
        engine.add_request(GenerationRequest("big", prompt="hi",
                                             params=SamplingParams(max_tokens=engine.max_model_len)))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request(GenerationRequest("ids", prompt_token_ids=[1, 10**9]))
    with pytest.raises(InvalidRequestError, match="priority"):
        engine.add_request(GenerationRequest("prio", prompt="hi", priority="urgent"))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request(greedy("good", "again", 4))
    assert set(engine.requests) == {"good"}
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert out.request_id == "good" and out.finish_reason == "length" and out.completion_tokens == 16
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

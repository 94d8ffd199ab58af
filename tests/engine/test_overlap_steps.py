"""Overlapped steps (EngineConfig.overlap_steps): step N+1 is scheduled and launched before the
host has step N's tokens, its decode rows reading them on the device. What a client sees must not
change: the same tokens, text, finish reasons, logprobs and usage as the engine that resolves
each step before the next, whatever ends a request (end of sequence, stop strings and ids,
max_tokens, an abort, a fault) and whatever its sampling needs (seeds, min_tokens, penalties,
a response_format grammar); every KV block comes back. Runs the CPU backend with overlap on
(steps there run while they are called, so this checks the bookkeeping; the device tokens path
is DeviceSampling's, which runs anywhere)."""
from __future__ import annotations

import json

import pytest

from engine.backends.step_sampling import DeviceSampling
from engine.llm_engine import NON_FINITE_MESSAGE
from engine.lora.source import LocalDirectoryAdapterSource
from engine.sampling_params import GenerationRequest, SamplingParams

from .conftest import chat
from .helpers import PROMPTS
from .lora_fixtures import write_random_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap-adapters")
    write_random_adapter(root / "fine", 8, seed=1, std=0.05)
    write_random_adapter(root / "overflow", 8, seed=2, alpha=1e30)  # non-finite activations
    return LocalDirectoryAdapterSource(root)


@pytest.fixture(scope="module")
def pair(make_engine, adapters):
    """(the engine resolving each step at once, the overlapped one), same model and adapters."""
    return (make_engine(adapters, max_loras=4, max_lora_rank=16, overlap_steps=False),
            make_engine(adapters, max_loras=4, max_lora_rank=16, overlap_steps=True))


def _req(rid: str, prompt: str, **params) -> GenerationRequest:
    adapter = params.pop("adapter", None)
    return GenerationRequest(rid, prompt=prompt, adapter=adapter, params=SamplingParams(**params))


def _drive(eng, batches: list[list[GenerationRequest]], *, abort: dict[str, int] | None = None):
    """Serve `batches` (the first at once, each next one after two more steps: arrivals while a
    step is in flight) to the end. `abort`: request id -> the step after which it is aborted.
    Returns request id -> its outputs in order (deltas, then the final one)."""
    outs: dict[str, list] = {}
    pending = list(batches)
    steps = 0
    while pending or eng.has_unfinished():
        if pending and steps % 2 == 0:
            for r in pending.pop(0):
                eng.add_request(r)
                outs[r.request_id] = []
        for out in eng.step():
            outs[out.request_id].append(out)
        steps += 1
        for rid, at in (abort or {}).items():
            if at == steps:
                final = eng.abort(rid)
                if final is not None:
                    outs[rid].append(final)
    assert not eng.requests and not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return outs


def _seen(outs: dict[str, list]) -> dict[str, dict]:
    """What a client saw per request: tokens, text, logprobs, the one final output's fields."""
    seen = {}
    for rid, lst in outs.items():
        finals = [o for o in lst if o.finished]
        assert len(finals) == 1 and lst[-1].finished, (rid, lst)  # exactly one end, and nothing after it
        f = finals[0]
        seen[rid] = {"tokens": [t for o in lst for t in o.token_ids], "text": "".join(o.text for o in lst),
                     "logprobs": [e for o in lst for e in (o.logprobs or [])],
                     "end": (f.finish_reason, f.error, f.adapter_fault, f.prompt_tokens, f.completion_tokens,
                             f.cached_tokens)}
    return seen


def _workload(tokenizer) -> list[list[GenerationRequest]]:
    france = chat(tokenizer, "What is the capital of France?")
    return [
        [_req("eos", france, max_tokens=64, temperature=0.0),  # ends on an end-of-sequence id
         _req("stop-text", france, max_tokens=40, temperature=0.0, stop=["Paris"]),
         _req("seeded", "Once upon a time", max_tokens=24, temperature=1.0, top_p=0.9, top_k=40, seed=11),
         _req("one", PROMPTS[3], max_tokens=1, temperature=0.0)],
        [_req("min-tokens", france, max_tokens=30, min_tokens=20, temperature=0.7, seed=5),
         _req("logprobs", PROMPTS[0], max_tokens=12, temperature=0.0, logprobs=3),
         _req("adapter", PROMPTS[1], max_tokens=16, temperature=0.0, ignore_eos=True, adapter="fine")],
        [_req("again", france, max_tokens=64, temperature=0.0),  # a prefix-cache hit on "eos"
         _req("stop-id", PROMPTS[2], max_tokens=30, temperature=0.0, stop_token_ids=[tokenizer.encode(" fib")[-1]]),
         _req("long", PROMPTS[4], max_tokens=48, temperature=0.0, ignore_eos=True)],
    ]


def test_overlapped_steps_give_what_resolving_each_step_gives(pair, tokenizer):
    sync, overlapped = pair
    want = _seen(_drive(sync, _workload(tokenizer)))
    before = overlapped.stats["overlapped_steps"]
    got = _seen(_drive(overlapped, _workload(tokenizer)))
    assert got == want
    # The workload ended requests every way it claims to, and the steps did overlap.
    ends = {rid: v["end"][0] for rid, v in want.items()}
    assert ends["eos"] == "stop" and ends["stop-text"] == "stop" and ends["one"] == "length"
    assert "Paris" not in want["stop-text"]["text"] and want["again"]["end"][5] > 0
    assert ends["stop-id"] == "stop" and len(want["min-tokens"]["tokens"]) >= 20
    assert overlapped.stats["overlapped_steps"] - before > 40


def test_penalties_and_grammars_get_their_tokens_before_sampling_again(pair, tokenizer):
    sync, overlapped = pair
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": person, "strict": True}}

    def batches():
        return [[_req("json", chat(tokenizer, "Describe a teacher."), max_tokens=60, temperature=0.0,
                      response_format=fmt),
                 _req("penalized", PROMPTS[6], max_tokens=30, temperature=0.0, repetition_penalty=1.3,
                      frequency_penalty=0.5, presence_penalty=0.4),
                 _req("plain", PROMPTS[7], max_tokens=30, temperature=0.0, ignore_eos=True)]]

    want = _seen(_drive(sync, batches()))
    got = _seen(_drive(overlapped, batches()))
    assert got == want
    assert json.loads(got["json"]["text"])["age"] >= 0


def test_aborts_and_faults_while_a_step_is_in_flight(pair, tokenizer):
    """An abort between steps and a request whose logits turn non-finite end once each, with the
    same outputs as without overlap; the others are untouched, every block comes back."""
    sync, overlapped = pair

    def batches():
        return [[_req("bad", PROMPTS[8], max_tokens=20, temperature=0.0, adapter="overflow"),
                 _req("aborted", PROMPTS[9], max_tokens=40, temperature=0.0, ignore_eos=True),
                 _req("base", PROMPTS[10], max_tokens=20, temperature=0.0, ignore_eos=True),
                 _req("fine", PROMPTS[11], max_tokens=20, temperature=0.0, ignore_eos=True, adapter="fine")]]

    want = _seen(_drive(sync, batches(), abort={"aborted": 6}))
    got = _seen(_drive(overlapped, batches(), abort={"aborted": 6}))
    # Aborted after the same number of step() calls, the overlapped engine has applied one step
    # fewer: the token still on the device is dropped with the request.
    cut, full = got.pop("aborted"), want.pop("aborted")
    assert cut["tokens"] == full["tokens"][:len(cut["tokens"])] and len(cut["tokens"]) == len(full["tokens"]) - 1
    assert cut["end"][:4] == full["end"][:4] == ("abort", None, None, full["end"][3])
    assert got == want
    assert got["bad"]["end"][0] == "error" and NON_FINITE_MESSAGE in got["bad"]["end"][1]
    assert got["base"]["end"][0] == got["fine"]["end"][0] == "length"


def test_preempted_sequences_recompute_the_same_tokens(make_engine):
    reqs = lambda: [[_req(f"p{i}", p, max_tokens=40, temperature=0.0, ignore_eos=True)  # noqa: E731
                     for i, p in enumerate(PROMPTS[:6])]]
    small = dict(num_kv_blocks=12, max_num_batched_tokens=64)
    sync, overlapped = make_engine(**small, overlap_steps=False), make_engine(**small, overlap_steps=True)
    want = _seen(_drive(sync, reqs()))
    got = _seen(_drive(overlapped, reqs()))
    assert overlapped.stats["preemptions"] > 0
    assert got == want


@pytest.mark.parametrize("penalized", [False, True])
def test_the_next_step_is_launched_before_the_host_waits_for_the_last(make_engine, penalized):
    """The order the device sees: forward 1, forward 2, wait 1, forward 3, wait 2, ... (tokens come
    back through DeviceSampling's one copy a step, started at launch and waited for a step later).
    Penalized rows need the last token counted before they sample: the step before is applied
    between the forward and the sampling, so the forward still goes first."""
    eng = make_engine(overlap_steps=True)
    events: list[str] = []
    execute = eng.runner.execute

    def launching(sched, lora=None, pending=None):
        events.append("launch")
        return execute(sched, lora, pending)

    def start_to_host(t):
        def wait():
            events.append("wait")
            return t.tolist()
        return wait

    eng.runner.execute = launching
    eng.executor.sampler = DeviceSampling(eng.backend.upload, eng.backend.to_host, start_to_host)
    penalty = {"frequency_penalty": 0.5} if penalized else {}
    outs = eng.generate([_req(f"o{i}", p, max_tokens=8, temperature=0.0, ignore_eos=True, **penalty)
                         for i, p in enumerate(PROMPTS[:3])])
    assert all(len(o.token_ids) == 8 for o in outs.values())
    assert events[:2] == ["launch", "launch"]
    assert "".join("L" if e == "launch" else "W" for e in events) == "L" + "LW" * 7 + "W"

"""A fault inside a step that can be traced to one request or one adapter version fails only
those requests (finish_reason "error", a message, KV blocks freed); the others in the same steps
produce exactly what they produce alone, and a version at fault is quarantined."""
import json
import time

import pytest
import torch

import engine.backends.step_sampling as step_sampling
from engine.llm_engine import NON_FINITE_MESSAGE
from engine.lora.source import LocalDirectoryAdapterSource
from engine.sampling_params import GenerationRequest, RequestOutput, SamplingParams

from .lora_fixtures import write_random_adapter

PROMPT = "Once upon a time, in a land far away,"


class RecordingSource(LocalDirectoryAdapterSource):
    """The local source, plus the registry's optional report_fault hook (recorded)."""

    def __init__(self, root):
        super().__init__(root)
        self.faults: list[tuple[str, str]] = []

    def report_fault(self, version_id: str, reason: str) -> None:
        self.faults.append((version_id, reason))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-adapters")
    write_random_adapter(root / "fine", 8, seed=1, std=0.05)
    # Finite tensors whose effective scale (alpha / r) overflows the activations.
    write_random_adapter(root / "overflow", 8, seed=2, alpha=1e30)
    write_random_adapter(root / "overflow-b", 8, seed=3, alpha=1e38)
    for name in ("crash", "crash-b", "sampled"):
        write_random_adapter(root / name, 4, seed=4, std=0.05)
    return RecordingSource(root)


@pytest.fixture(scope="module")
def eng(make_engine, source):
    return make_engine(source, max_loras=4, max_lora_rank=16)


def _wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _idle(eng) -> None:
    assert not eng.requests and not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def _req(rid, adapter=None, temperature=0.0, n=12, prompt=PROMPT):
    return GenerationRequest(rid, prompt=prompt, adapter=adapter,
                             params=SamplingParams(max_tokens=n, temperature=temperature, seed=7, ignore_eos=True))


def _alone(eng, req):
    out = eng.generate([req])[req.request_id]
    assert out.finish_reason == "length", out.error
    return out.token_ids


def test_non_finite_logits_fail_only_their_requests_and_quarantine_the_adapter(eng, source):
    ref_base = _alone(eng, _req("ref-base"))
    ref_fine = _alone(eng, _req("ref-fine", "fine"))
    ref_sampled = _alone(eng, _req("ref-sampled", "sampled", temperature=0.8))
    outs = eng.generate([
        _req("base"), _req("fine", "fine"), _req("sampled", "sampled", temperature=0.8),
        _req("bad-greedy", "overflow"), _req("bad-sampled", "overflow", temperature=1e-30),
    ])
    assert outs["base"].token_ids == ref_base
    assert outs["fine"].token_ids == ref_fine
    assert outs["sampled"].token_ids == ref_sampled
    for rid in ("bad-greedy", "bad-sampled"):
        out = outs[rid]
        assert out.finished and out.finish_reason == "error"
        assert NON_FINITE_MESSAGE in out.error and "overflow is quarantined" in out.error
        assert out.adapter_fault == "overflow"
        # The engine worker's NDJSON line reads back as the same output (HttpEngineClient).
        assert RequestOutput(**json.loads(json.dumps(vars(out)))) == out
    _idle(eng)
    # No non-finite value is left in the cache for the blocks' next owners.
    assert all(bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all()) for k, v in zip(eng.kv.k, eng.kv.v))
    # Later requests for the version fail at once, with the reason; the source was told.
    later = eng.generate([_req("later", "overflow")])["later"]
    assert later.finish_reason == "error" and later.completion_tokens == 0
    assert "quarantined" in later.error and later.adapter_fault == "overflow"
    _wait_for(lambda: source.faults)  # report_fault runs on the manager's pool
    assert [v for v, _ in source.faults] == ["overflow"]
    assert "non-finite" in source.faults[0][1]
    _idle(eng)


def test_a_non_finite_request_alone_fails_and_the_engine_goes_on(eng):
    out = eng.generate([_req("alone-bad", "overflow-b", temperature=1.0)])["alone-bad"]
    assert out.finish_reason == "error" and out.adapter_fault == "overflow-b"
    assert eng.generate([_req("after")])["after"].finish_reason == "length"
    _idle(eng)


def test_forward_exception_is_traced_to_its_adapter(eng, source, monkeypatch):
    ref_base = _alone(eng, _req("ref-base2"))
    ref_fine = _alone(eng, _req("ref-fine2", "fine"))
    real_batch_for = eng.lora_manager.batch_for

    def batch_for(sched):
        # Any batch that holds the "crash" adapter raises in its LoRA work, as a kernel would.
        batch = real_batch_for(sched)
        if any(s.seq.adapter == "crash" for s in sched.scheduled):
            def apply(*_a, **_k):
                raise RuntimeError("injected LoRA kernel failure")
            batch.apply = apply
        return batch

    monkeypatch.setattr(eng.lora_manager, "batch_for", batch_for)
    outs = eng.generate([_req("b", n=12), _req("f", "fine"), _req("c1", "crash"), _req("c2", "crash", temperature=0.5)])
    assert outs["b"].token_ids == ref_base
    assert outs["f"].token_ids == ref_fine
    for rid in ("c1", "c2"):
        assert outs[rid].finish_reason == "error"
        assert "the engine failed on this request (RuntimeError)" in outs[rid].error
        assert outs[rid].adapter_fault == "crash"
    assert eng.lora_manager.is_quarantined("crash")
    _wait_for(lambda: "crash" in [v for v, _ in source.faults])
    _idle(eng)


def test_forward_exception_is_traced_to_one_request(eng, monkeypatch):
    """A fault of one base-model request (no adapter to blame) fails only that request."""
    ref = {rid: _alone(eng, _req(f"ref-{rid}", prompt=p)) for rid, p in (("a", PROMPT), ("b", "The quick brown fox"))}
    real_execute = eng.runner.execute

    def execute(sched, lora=None, *pending):
        if any(s.seq.request_id == "poison" for s in sched.scheduled):
            raise IndexError("injected failure for one request")
        return real_execute(sched, lora, *pending)

    monkeypatch.setattr(eng.runner, "execute", execute)
    outs = eng.generate([_req("a"), _req("poison"), _req("b", prompt="The quick brown fox")])
    assert outs["a"].token_ids == ref["a"] and outs["b"].token_ids == ref["b"]
    assert outs["poison"].finish_reason == "error" and outs["poison"].adapter_fault is None
    assert "IndexError" in outs["poison"].error
    _idle(eng)


def test_unattributable_forward_fault_propagates(eng, monkeypatch):
    def execute(sched, lora=None):
        raise MemoryError("injected: nothing in the step can run")

    monkeypatch.setattr(eng.runner, "execute", execute)
    eng.add_request(_req("x"))
    eng.add_request(_req("y", prompt="The quick brown fox"))
    with pytest.raises(MemoryError):
        eng.step()
    assert sorted(eng.reset()) == ["x", "y"]
    _idle(eng)


def test_sampling_and_output_exceptions_fail_only_their_request(eng, monkeypatch):
    ref = _alone(eng, _req("ref-s", temperature=0.9))
    real_sample = step_sampling.sample

    def sample(logits, seqs, errors=None):
        # Raises for the whole batch (as a vectorized part would): the engine samples each
        # sequence on its own, and only the one that still raises fails.
        if any(s.request_id == "bad-sample" for s in seqs):
            raise RuntimeError("injected sampling failure")
        return real_sample(logits, seqs, errors)

    monkeypatch.setattr(step_sampling, "sample", sample)
    eng.add_request(_req("s", temperature=0.9))
    eng.add_request(_req("bad-sample", temperature=0.9))
    bad_text = eng.add_request(_req("bad-text"))

    class BrokenDetokenizer:
        def push(self, tok):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    bad_text.detokenizer = BrokenDetokenizer()
    outs = {}
    while eng.has_unfinished():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    assert [t for o in outs["s"] for t in o.token_ids] == ref
    assert outs["bad-sample"][-1].finish_reason == "error" and "sampling failed" in outs["bad-sample"][-1].error
    assert outs["bad-text"][-1].finish_reason == "error" and "UnicodeDecodeError" in outs["bad-text"][-1].error
    _idle(eng)

"""OpenAI's and vLLM's sampling controls (logit_bias, min_tokens, repetition / frequency /
presence penalties, min_p, beside temperature / top-k / top-p) match a plain per-row reference
implementation, in the sampler and through the engine on both sampling paths: the CPU backend's
(`HostSampling`) and the device path's (`DeviceSampling`, engine.backends.step_sampling, on the Triton
backend: CPU tensors under the interpreter here, the GPU with TRITON_INTERPRET=0). Each bound
is refused naming its field; the logprobs of a completion hold its end-of-sequence token."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.backends.step_sampling import DeviceSampling
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.synthetic import write_synthetic_gguf
from engine.sampler import probabilities, process_logits, sample, sample_tokens
from engine.sampling_params import SEED_MAX, SEED_MIN, GenerationRequest, InvalidRequestError, SamplingParams
from engine.sequence import Sequence, sampling_uniform
from engine.tokenizer import TextTokenizer

INF = float("inf")


# -- the reference: one row at a time, in plain Python floats --------------------------------------


def reference_logits(row, p: SamplingParams, prompt: list[int], output: list[int], eos_ids=()) -> list[float]:
    """logit_bias, the min_tokens mask, repetition, then frequency / presence penalties (vLLM's
    order) applied to one row of logits."""
    x = [float(v) for v in row]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            x[t] = -INF
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return x


def reference_probs(x: list[float], p: SamplingParams) -> list[float]:
    """Temperature, top-k, top-p, min-p over processed logits `x` -> the distribution drawn from
    (greedy: all mass on the first maximum)."""
    if p.greedy:
        best = x.index(max(x))
        return [1.0 if t == best else 0.0 for t in range(len(x))]
    m = max(x)
    z = [(v - m) / p.temperature for v in x]
    if 0 < p.top_k < len(x):
        kth = sorted(z, reverse=True)[p.top_k - 1]
        z = [v if v >= kth else -INF for v in z]
    w = [math.exp(v) for v in z]
    total = sum(w)
    probs = [v / total for v in w]
    if p.top_p < 1.0:
        keep, mass = set(), 0.0
        for t in sorted(range(len(x)), key=lambda t: -probs[t]):
            keep.add(t)
            mass += probs[t]
            if mass >= p.top_p:
                break
        probs = [v if t in keep else 0.0 for t, v in enumerate(probs)]
    if p.min_p > 0.0:
        top = max(probs)
        probs = [v if v >= p.min_p * top else 0.0 for v in probs]
    total = sum(probs)
    return [v / total for v in probs]


def reference_token_ok(probs: list[float], u: float, tok: int, slack: float = 1e-6) -> bool:
    """Whether `tok` is the inverse-CDF draw of `probs` at `u` (vocabulary order), up to `slack`
    of probability mass at the boundaries (the engine sums in another order and precision)."""
    below = sum(probs[:tok])
    return probs[tok] > 0 and below - slack <= u <= below + probs[tok] + slack


def _seq(params: SamplingParams, prompt=(1,), output=(), eos=(2,)) -> Sequence:
    s = Sequence("r", list(prompt), params, detokenizer=None, eos_token_ids=eos)
    for t in output:
        s.append_token(t)
    return s


# A batch that exercises every control, alone and together, greedy and sampled.
CASES = [
    (SamplingParams(temperature=0.0), [5, 6], [7, 7, 8]),
    (SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.5), [5, 6], [7, 7, 8, 9, 9, 9]),
    (SamplingParams(temperature=0.0, repetition_penalty=1.7, logit_bias={3: 5.0, 11: -100.0}), [3, 4, 4, 12], [11, 3]),
    (SamplingParams(temperature=0.8, seed=1, presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.3),
     [20, 21], [22, 22, 20]),
    (SamplingParams(temperature=1.2, seed=2, top_k=17, top_p=0.8, min_p=0.05, logit_bias={0: 3.0, 2: 100.0},
                    min_tokens=4, max_tokens=8, stop_token_ids=[9]), [1], [30, 31]),
    (SamplingParams(temperature=0.5, seed=3, min_p=0.2, repetition_penalty=0.6), [40, 41, 42], [43]),
    (SamplingParams(temperature=1.0, seed=4, top_p=0.5, frequency_penalty=-2.0), [50], [51, 51, 51, 52]),
    (SamplingParams(temperature=1.0, seed=5), [60], [61]),
    (SamplingParams(temperature=0.7, seed=6, min_tokens=3, max_tokens=5, ignore_eos=True, stop_token_ids=[13]),
     [1], [14]),
]


def _batch(vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(CASES), vocab, generator=g) * 3
    seqs = [_seq(p, prompt, out) for p, prompt, out in CASES]
    return logits, seqs


def test_processed_logits_match_the_reference():
    logits, seqs = _batch()
    got = process_logits(logits, seqs)
    assert not torch.equal(got, logits) and torch.equal(logits, _batch()[0])  # a copy; the input untouched
    sample(logits, seqs)  # writes the controls into the logits, and undoes them
    assert torch.equal(logits, _batch()[0])
    for i, (p, prompt, out) in enumerate(CASES):
        want = torch.tensor(reference_logits(logits[i].tolist(), p, prompt, out, eos_ids=(2,)), dtype=torch.float64)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        finite = torch.isfinite(want)
        assert torch.allclose(got[i].double()[finite], want[finite], rtol=1e-6, atol=1e-5), i


def test_probabilities_match_the_reference_and_do_not_depend_on_the_batch():
    logits, seqs = _batch(vocab=200, seed=1)
    got = probabilities(logits, seqs)
    for i, (p, prompt, out) in enumerate(CASES):
        want = reference_probs(reference_logits(logits[i].tolist(), p, prompt, out, eos_ids=(2,)), p)
        assert torch.allclose(got[i], torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0), i
        alone = probabilities(logits[i:i + 1], [seqs[i]])
        assert torch.equal(alone[0], got[i]), i


def test_each_token_is_the_inverse_cdf_draw_of_its_seed_and_step():
    logits, _ = _batch(vocab=200, seed=2)
    for step in range(4):  # the completion grows: a new uniform every token
        seqs = [_seq(p, prompt, list(out) + [33] * step) for p, prompt, out in CASES]
        tokens = sample(logits, seqs)
        for i, (tok, seq) in enumerate(zip(tokens, seqs)):
            want = reference_probs(reference_logits(logits[i].tolist(), seq.params, seq.prompt_token_ids,
                                                    seq.output_token_ids, eos_ids=(2,)), seq.params)
            u = sampling_uniform(seq.sampling_seed, len(seq.output_token_ids))
            assert reference_token_ok(want, u, tok), (i, step, tok)
            # The same seed and step, alone: the same token.
            assert sample(logits[i:i + 1], [_seq(seq.params, seq.prompt_token_ids, seq.output_token_ids)]) == [tok]


def test_draws_over_many_seeds_follow_the_distribution():
    vocab, n = 12, 6000
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    params = [SamplingParams(temperature=0.9, top_k=9, min_p=0.02, presence_penalty=1.0, seed=s) for s in range(n)]
    seqs = [_seq(p, [1], [4]) for p in params]
    tokens, ok = sample_tokens(row.expand(n, vocab).contiguous(), seqs)
    assert bool(ok.all())
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    want = probabilities(row, seqs[:1])[0]
    assert float((freq - want).abs().sum()) / 2 < 0.03  # total variation, ~4 sigma of sampling noise
    assert float(freq[want == 0].sum()) == 0.0  # dropped tokens are never drawn


#: Finite fp32 logits, from everyday magnitudes up to the edge of the range.
FP32_EDGE = 3.0000000054977558e+38


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=st.lists(st.floats(min_value=-FP32_EDGE, max_value=FP32_EDGE, width=32), min_size=3, max_size=24),
       temperature=st.sampled_from([0.0, 5e-324, 1e-40, 1e-7, 0.7, 2.0]),
       rep=st.sampled_from([5e-324, 1e-45, 1e-30, 0.5, 1.0, 2.0]),
       pres=st.floats(min_value=-2, max_value=2), freq=st.floats(min_value=-2, max_value=2),
       min_p=st.floats(min_value=0.0, max_value=1.0), bias=st.floats(min_value=-100, max_value=100),
       repeats=st.integers(min_value=0, max_value=300), seed=st.integers(min_value=SEED_MIN, max_value=SEED_MAX))
def test_every_accepted_control_value_samples_a_valid_token(row, temperature, rep, pres, freq, min_p, bias, repeats,
                                                            seed):
    params = SamplingParams(temperature=temperature, repetition_penalty=rep, presence_penalty=pres,
                            frequency_penalty=freq, min_p=min_p, logit_bias={0: bias, 1: -bias}, seed=seed,
                            max_tokens=400)
    seq = _seq(params, [0, 2], [1] * repeats)
    logits = torch.tensor([row], dtype=torch.float32)
    tokens, ok = sample_tokens(logits, [seq])
    assert bool(ok.all()) and 0 <= int(tokens[0]) < len(row)
    assert bool(torch.isfinite(process_logits(logits, [seq])).all())
    assert sample(logits, [_seq(params, [0, 2], [1] * repeats)]) == tokens.tolist()  # same seed, same token


def test_a_mask_wins_over_a_bias_and_a_fully_masked_row_fails_alone():
    logits = torch.zeros(3, 16)
    logits[:, 5] = -INF  # e.g. a response_format grammar's mask
    forced = SamplingParams(temperature=0.0, logit_bias={5: 100.0})
    sampled = SamplingParams(temperature=1.0, seed=9, logit_bias={5: 100.0})
    # min_tokens masks EOS (2), and a grammar allows nothing else: nothing can be sampled.
    stuck = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4)
    logits[2] = -INF
    logits[2, 2] = 0.0
    errors = {}
    tokens = sample(logits, [_seq(forced), _seq(sampled), _seq(stuck)], errors)
    assert tokens[0] != 5 and tokens[1] is not None and tokens[1] != 5
    assert tokens[2] is None and list(errors) == [2]
    assert float(probabilities(logits[:2], [_seq(forced), _seq(sampled)])[:, 5].sum()) == 0.0


def test_no_control_means_no_copy():
    logits = torch.randn(4, 32)
    seqs = [_seq(SamplingParams(temperature=t, seed=1)) for t in (0.0, 0.5, 1.0, 2.0)]
    assert process_logits(logits, seqs) is logits
    # min_tokens once reached costs nothing either.
    done, row = _seq(SamplingParams(temperature=0.0, min_tokens=1, max_tokens=3), output=[7]), logits[:1]
    assert process_logits(row, [done]) is row


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", float("nan")),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 2.01),
    ("min_p", -0.1), ("min_p", 1.01), ("min_tokens", -1), ("min_tokens", 17),  # > max_tokens (16)
    ("logit_bias", {"5": 100.5}), ("logit_bias", {"5": -101}), ("logit_bias", {"-1": 1.0}),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {"5": "high"}), ("logit_bias", {"5": float("nan")}),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}), ("logit_bias", [5]),
])
def test_each_bound_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({field: value})
    assert e.value.param == field, e.value.message


def test_accepted_values_survive_the_worker_protocol():
    p = SamplingParams.from_dict({"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 2,
                                  "logit_bias": {"50256": -100, 7: 100}, "min_p": 1, "min_tokens": 16,
                                  "max_tokens": 16})
    assert p.logit_bias == {50256: -100.0, 7: 100.0}
    # The engine client sends model_dump() as JSON (string keys); the worker validates it again.
    assert SamplingParams.from_dict(json.loads(json.dumps(p.model_dump()))) == p


# -- the engine, on both sampling paths -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "tiny", seed=3)
    checkpoint = load_checkpoint(path)
    return path, checkpoint, TextTokenizer.from_gguf_metadata(checkpoint[2])


def _engine(tiny, path_kind: str, triton_device: str | None = None) -> LLMEngine:
    """The tiny model on the CPU backend (HostSampling), or on the Triton backend with every step
    sampled by DeviceSampling (which the backend chooses only off the host)."""
    path, checkpoint, tokenizer = tiny
    backend = "cpu" if path_kind == "cpu" else "triton"
    cfg = EngineConfig(backend=backend, weight_format="fp32" if backend == "cpu" else "auto",
                       device="cpu" if backend == "cpu" else triton_device, block_size=16, num_kv_blocks=32,
                       max_num_batched_tokens=128, max_num_seqs=8, startup_warmup=False)
    eng = LLMEngine(path, cfg, checkpoint=checkpoint, tokenizer=tokenizer)
    eng.device_path_steps = 0
    if path_kind == "device" and eng.device.type == "cpu":
        device_sampling = DeviceSampling(eng.backend.upload, eng.backend.to_host)

        class OnDevice:
            def launch(self, logits, seqs, structured):
                eng.device_path_steps += 1
                return device_sampling.launch(logits, seqs, structured)

        eng.executor.sampler = OnDevice()
    return eng


def _run(eng: LLMEngine, requests: list[GenerationRequest]):
    """Each request's aggregated output, and the raw logits row of each of its sampled steps."""
    rows: dict[str, list[torch.Tensor]] = {}
    execute = eng.runner.execute

    def recording(sched, lora=None, *pending):  # pending: an overlapped step's (CUDA's default)
        logits, seqs = execute(sched, lora, *pending)
        for row, seq in zip(logits, seqs):
            rows.setdefault(seq.request_id, []).append(row.detach().cpu().double().clone())
        return logits, seqs

    eng.runner.execute = recording
    try:
        outs = eng.generate(requests)
    finally:
        eng.runner.execute = execute
    return outs, rows


PROMPT = [300, 301, 302, 303, 304, 305]


def _requests(eos: int) -> list[GenerationRequest]:
    def r(rid, **kw):
        return GenerationRequest(rid, prompt_token_ids=PROMPT, params=SamplingParams(**{"max_tokens": 10, **kw}))

    return [
        r("plain", temperature=0.0, ignore_eos=True),
        r("presence", temperature=0.0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0),
        r("repetition", temperature=0.0, repetition_penalty=1.8, logit_bias={7: 4.0, 300: -3.0}),
        r("forced", temperature=0.0, logit_bias={77: 100.0}, logprobs=2),
        r("min-tokens", temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5, logprobs=0),
        r("sampled", temperature=0.9, seed=11, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.7,
          frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={5: 2.0}, ignore_eos=True),
        r("sampled-plain", temperature=1.0, seed=12, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def runs(tiny, triton_engine_device):
    """{path kind: (engine, outputs, raw logits rows)} of `_requests` on both sampling paths."""
    out = {}
    for kind in ("cpu", "device"):
        eng = _engine(tiny, kind, triton_engine_device)
        out[kind] = (eng, *_run(eng, _requests(min(eng.eos_token_ids))))
    return out


@pytest.mark.parametrize("path_kind", ["cpu", "device"])
def test_the_engine_samples_what_the_reference_predicts(runs, path_kind):
    eng, outs, rows = runs[path_kind]
    assert (eng.device_path_steps > 0) == (path_kind == "device")
    eos = min(eng.eos_token_ids)
    requests = _requests(eos)
    for req in requests:
        out, p = outs[req.request_id], req.params
        assert out.error is None, out.error
        assert len(rows[req.request_id]) == len(out.token_ids) == out.completion_tokens
        for step, (row, tok) in enumerate(zip(rows[req.request_id], out.token_ids)):
            probs = reference_probs(reference_logits(row.tolist(), p, PROMPT, out.token_ids[:step],
                                                     eos_ids=eng.eos_token_ids), p)
            if p.greedy:
                assert probs[tok] == 1.0, (req.request_id, step, tok)
            else:
                u = sampling_uniform(p.seed, step)
                assert reference_token_ok(probs, u, tok), (req.request_id, step, tok)
    # What the controls do, as a user sees it:
    plain = outs["plain"].token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself greedily ...
    assert outs["presence"].token_ids != plain  # ... and the penalties move it off that
    assert outs["forced"].token_ids == [77] * 10
    mt = outs["min-tokens"]
    assert not set(mt.token_ids[:5]) & eng.eos_token_ids
    assert mt.token_ids[5] == eos and len(mt.token_ids) == 6 and mt.finish_reason == "stop"
    # Logprobs stay the model's raw distribution (the +100 bias is not in them), one per token,
    # the end-of-sequence token's included.
    raw = torch.log_softmax(rows["forced"][0], dim=-1)
    assert outs["forced"].logprobs[0]["logprob"] == pytest.approx(float(raw[77]), abs=1e-4)
    assert float(raw[77]) < -1.0
    assert [e["token_id"] for e in mt.logprobs] == mt.token_ids
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_both_sampling_paths_give_the_same_tokens(runs):
    """The same seeds and controls on the CPU backend and on the device path: the same tokens
    (the two backends' logits differ only in summation order)."""
    cpu, device = ({rid: o.token_ids for rid, o in runs[k][1].items()} for k in ("cpu", "device"))
    assert cpu == device


@pytest.mark.parametrize("path_kind", ["cpu", "device"])
def test_a_row_whose_sampling_raises_fails_alone(tiny, path_kind, monkeypatch):
    import engine.sampler as sampler_module

    def requests():
        params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, presence_penalty=1.0, ignore_eos=True)
        return [GenerationRequest(rid, prompt_token_ids=PROMPT, params=params) for rid in ("a", "bad", "b")]

    # The CPU backend's engine, sampling through either path (DeviceSampling runs anywhere).
    eng = _engine(tiny, "cpu")
    want = eng.generate([r for r in requests() if r.request_id != "bad"])
    if path_kind == "device":
        eng.executor.sampler = DeviceSampling(eng.backend.upload, eng.backend.to_host)
    plan_draw = sampler_module._plan_draw

    def failing(plan, seqs, vocab, dtype):
        if any(s.request_id == "bad" for s in seqs):
            raise RuntimeError("injected")
        return plan_draw(plan, seqs, vocab, dtype)

    monkeypatch.setattr(sampler_module, "_plan_draw", failing)
    got = eng.generate(requests())
    assert got["bad"].finish_reason == "error" and "sampling failed" in got["bad"].error
    assert got["a"].token_ids == want["a"].token_ids and got["b"].token_ids == want["b"].token_ids
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_logit_bias_id_outside_the_vocabulary_is_refused(tiny):
    eng = _engine(tiny, "cpu")
    for bad in (512, 10**9):
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request(GenerationRequest("bad", prompt_token_ids=PROMPT,
                                              params=SamplingParams(logit_bias={3: 1.0, bad: 1.0})))
        assert e.value.param == "logit_bias" and str(bad) in e.value.message
    assert not eng.requests and not eng.has_unfinished()


def test_stop_strings_apply_only_after_min_tokens(tiny):
    eng = _engine(tiny, "cpu")
    tokenizer = tiny[2]
    # Force the same token every step, then stop on its text: without min_tokens the first token
    # stops the request; with min_tokens 4 the fifth does.
    text = tokenizer.decode([77])
    assert text
    params = dict(temperature=0.0, logit_bias={77: 100.0}, stop=[text], max_tokens=10)
    free = eng.generate([GenerationRequest("free", prompt_token_ids=PROMPT, params=SamplingParams(**params))])["free"]
    held = eng.generate([GenerationRequest("held", prompt_token_ids=PROMPT,
                                           params=SamplingParams(min_tokens=4, **params))])["held"]
    assert free.finish_reason == "stop" and free.completion_tokens == 1 and free.text == ""
    assert held.finish_reason == "stop" and held.completion_tokens == 5 and held.text == text * 4


# -- the end-of-sequence token in the API's logprobs ------------------------------------------------


def test_the_api_logprobs_hold_every_counted_completion_token(tiny):
    from tessera.api.logprobs import ChoiceLogprobs, merge, token_texts

    eng = _engine(tiny, "cpu")
    eos = min(eng.eos_token_ids)
    params = SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3, max_tokens=8, logprobs=1)
    eng.add_request(GenerationRequest("lp", prompt_token_ids=PROMPT, params=params))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens == sum(len(o.token_ids) for o in deltas) == 4
    name = tiny[2].tokenizer.id_to_token(eos)  # e.g. "<|endoftext|>"
    assert name.startswith("<|")
    for kind in ("chat", "text"):
        choice, parts = ChoiceLogprobs(token_texts(tiny[2]), kind), []
        for out in deltas:  # as the gateway forwards them
            choice.push(out.logprobs)
            if (part := choice.release(out.text, final=out.finished)) is not None:
                parts.append(part)
        merged = merge(kind, parts)
        if kind == "chat":
            assert len(merged["content"]) == 4
            # As vLLM: the end-of-sequence entry names the token's own text.
            assert merged["content"][-1]["token"] == name
            assert merged["content"][-1]["bytes"] == list(name.encode())
        else:
            assert len(merged["tokens"]) == len(merged["token_logprobs"]) == len(merged["text_offset"]) == 4
            assert merged["tokens"][-1] == name
            assert merged["text_offset"][-1] == len("".join(o.text for o in deltas))

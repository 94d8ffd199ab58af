"""End-to-end generation behaviour: answers, batching invariance, sampling, stops."""

import torch

from engine.sampling_params import GenerationRequest, SamplingParams

from .conftest import chat
from .helpers import PROMPTS, greedy


def test_chat_answer_mentions_paris(engine, tokenizer):
    out = engine.generate([greedy("paris", chat(tokenizer, "What is the capital of France?"), 32)])["paris"]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.prompt_tokens == len(tokenizer.encode(chat(tokenizer, "What is the capital of France?")))
    assert out.completion_tokens == len(out.token_ids)


def test_concurrent_greedy_equals_alone(engine):
    alone = {}
    for i, p in enumerate(PROMPTS):
        alone[i] = engine.generate([greedy(f"alone{i}", p, 24, ignore_eos=True)])[f"alone{i}"].token_ids
    together = engine.generate([greedy(f"batch{i}", p, 24, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        assert together[f"batch{i}"].token_ids == alone[i], PROMPTS[i]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_under_memory_pressure_keeps_outputs(make_engine):
    """With a KV cache too small for everyone, sequences are preempted and recomputed; the
    outputs stay identical to running each alone, and every block comes back."""
    small = make_engine(num_kv_blocks=12, max_num_batched_tokens=64)
    reqs = [greedy(f"p{i}", p, 40, ignore_eos=True) for i, p in enumerate(PROMPTS[:6])]
    alone = {r.request_id: small.generate([r])[r.request_id].token_ids for r in
             [greedy(f"p{i}", p, 40, ignore_eos=True) for i, p in enumerate(PROMPTS[:6])]}
    together = small.generate(reqs)
    assert small.stats["preemptions"] > 0
    for rid, toks in alone.items():
        assert together[rid].token_ids == toks
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def _sampled(engine, rid, seed, prompt="Once upon a time"):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
    return engine.generate([GenerationRequest(rid, prompt=prompt, params=params)])[rid].token_ids


def test_same_seed_same_output_even_in_a_batch(engine):
    a = _sampled(engine, "s1", 1234)
    b = _sampled(engine, "s2", 1234)
    c = _sampled(engine, "s3", 99)
    assert a == b
    assert a != c
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    batch = engine.generate([GenerationRequest("s4", prompt="Once upon a time", params=params)] +
                            [greedy(f"noise{i}", p, 20) for i, p in enumerate(PROMPTS[:5])])
    assert batch["s4"].token_ids == a


def test_stop_string_split_across_tokens(engine, tokenizer):
    prompt = chat(tokenizer, "What is the capital of France?")
    full = engine.generate([greedy("full", prompt, 32)])["full"].text
    assert "France is Paris" in full
    # "is Pa" spans the tokens " is" and " Paris": matching must work on decoded text.
    seq_deltas = []
    engine.add_request(greedy("stopped", prompt, 32, stop=["is Pa"]))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            seq_deltas.append(out.text)
            if out.finished:
                final = out
    text = "".join(seq_deltas)
    assert final.finish_reason == "stop"
    assert text == full[: full.index("is Pa")]
    assert "is Pa" not in text and not text.endswith("is P")


def test_max_tokens_gives_length(engine):
    out = engine.generate([greedy("len", "Count: 1, 2, 3,", 5, ignore_eos=True)])["len"]
    assert out.finish_reason == "length"
    assert out.completion_tokens == 5 == len(out.token_ids)


def _nucleus(row: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """The test's own top-p nucleus: the most likely tokens of softmax(row / temperature), in
    order, up to and including the first one at which their mass reaches top_p."""
    probs = torch.softmax(row.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    kept, mass = set(), 0.0
    for tok in order:
        kept.add(tok)
        mass += float(probs[tok])
        if mass >= top_p:
            break
    return kept


def test_top_p_and_temperature_shape_what_is_sampled(engine, monkeypatch):
    """Every token sampled with top_p lies in the nucleus computed from that step's logits, and
    sampling really leaves the argmax; a top_p that keeps one token and temperature 0 are
    greedy whatever the seed; a seed reproduces its tokens."""
    import engine.backends.step_sampling as step_sampling

    seen = []  # (request id, logits row, sampled token) of every sampled step

    def recording_sample(logits, seqs, errors=None):
        tokens = llm_engine_sample(logits, seqs, errors)
        seen.extend((seq.request_id, logits[i].detach().clone(), tokens[i]) for i, seq in enumerate(seqs))
        return tokens

    llm_engine_sample = step_sampling.sample
    monkeypatch.setattr(step_sampling, "sample", recording_sample)

    prompt, top_p, temperature = "Once upon a time", 0.6, 1.0
    nucleus_params = {f"n{seed}": SamplingParams(max_tokens=12, temperature=temperature, top_p=top_p, seed=seed,
                                                 ignore_eos=True) for seed in range(6)}
    outs = engine.generate([GenerationRequest(rid, prompt=prompt, params=p) for rid, p in nucleus_params.items()])
    steps = [(row, tok) for rid, row, tok in seen if rid in nucleus_params]
    assert len(steps) == 6 * 12
    for row, tok in steps:
        assert tok in _nucleus(row, temperature, top_p), (tok, _nucleus(row, temperature, top_p))
    assert any(tok != int(row.argmax()) for row, tok in steps), "sampling never left the argmax"
    assert len({tuple(o.token_ids) for o in outs.values()}) > 1  # seeds explore different continuations

    want = engine.generate([greedy("g", prompt, 12, ignore_eos=True)])["g"].token_ids
    for seed in (1, 2, 3):
        tiny_p = SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=seed, ignore_eos=True)
        cold = SamplingParams(max_tokens=12, temperature=0.0, seed=seed, ignore_eos=True)
        got = engine.generate([GenerationRequest(f"p{seed}", prompt=prompt, params=tiny_p),
                               GenerationRequest(f"t{seed}", prompt=prompt, params=cold)])
        assert got[f"p{seed}"].token_ids == want and got[f"t{seed}"].token_ids == want, seed
    again = engine.generate([GenerationRequest("again", prompt=prompt, params=nucleus_params["n3"])])["again"]
    assert again.token_ids == outs["n3"].token_ids

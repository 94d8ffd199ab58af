"""Decode throughput with the sampling controls on (presence, frequency and repetition penalties
and a logit_bias) against the same requests with all of them off.

    python bench/sampling.py [--streams 32] [--new-tokens 64] [--rounds 5] [--temperature 0]
    python bench/sampling.py --compare-counts      # how the penalties' counts are built, per step

Prints one JSON object. `off_tok_s` and `on_tok_s`: decode tokens/s of `--streams` concurrent chat
requests (EOS ignored, so both arms decode the same number of tokens) on the embedded SmolLM2
model on the CPU backend, the median over `--rounds` rounds, the arms interleaved (their order
alternating round by round); `ratio` = on / off (the target is >= 0.9). Decode tokens/s counts
the tokens produced after every request of the round has its first token (prefill excluded),
over the wall time of those steps. The "on" arm: presence_penalty 0.5, frequency_penalty 0.5,
repetition_penalty 1.2 and a 32-entry logit_bias. `--temperature 0` (the default) is greedy, so
the "off" arm does no sampling work at all and the ratio is the controls' whole cost; a
temperature > 0 samples both arms with per-request seeds.

`--compare-counts` times, per step at `--streams` streams, the ways the penalties' token counts
can be built (each followed by applying the penalties to a [streams, vocab] logits tensor):
`incremental`, the engine's (engine.sequence.TokenCounts, kept per sequence as tokens are
appended, joined per step, applied sparsely); `per_step_unique` (distinct positions and counts
from the step's token lists by one torch.unique, applied sparsely); `dense` (a [streams, vocab]
count tensor built by one scatter_add from the padded token lists, applied densely); for
completions of 64, 256 and 1024 tokens. Each ends with the greedy row maximum over the
penalized logits (what a greedy step reads next), so all three pay for one pass over them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import PROMPTS, decode_tok_s, load_model, machine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import GenerationRequest, SamplingParams  # noqa: E402

#: The "on" arm's controls.
CONTROLS = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
            "logit_bias": {1000 + 37 * i: (-2.0 if i % 2 else 1.0) for i in range(32)}}


def requests(tokenizer, n: int, new_tokens: int, prefix: str, on: bool, temperature: float) -> list[GenerationRequest]:
    reqs = []
    for i in range(n):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        params = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i, ignore_eos=True,
                                **(CONTROLS if on else {}))
        reqs.append(GenerationRequest(f"{prefix}{i}", prompt=prompt, cache_salt=f"{prefix}{i}", params=params))
    return reqs


def throughput(args) -> dict:
    checkpoint, tokenizer = load_model()
    cfg = EngineConfig(dtype=torch.float32, weight_format="auto", kv_cache_bytes=args.kv_cache_mb << 20,
                       max_num_seqs=max(64, args.streams))
    engine = LLMEngine(config=cfg, checkpoint=checkpoint, tokenizer=tokenizer)
    for arm in ("off", "on"):  # warm both arms' paths and the step widths
        decode_tok_s(engine, requests(tokenizer, args.streams, 8, f"warm-{arm}-", arm == "on", args.temperature))
    figures: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
            reqs = requests(tokenizer, args.streams, args.new_tokens, f"{arm}-r{r}-", arm == "on", args.temperature)
            figures[arm].append(decode_tok_s(engine, reqs))
    off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
    return {"streams": args.streams, "new_tokens": args.new_tokens, "temperature": args.temperature,
            "rounds": args.rounds, "off_tok_s": round(off, 1), "on_tok_s": round(on, 1), "ratio": round(on / off, 3),
            "off_rounds": [round(x, 1) for x in figures["off"]], "on_rounds": [round(x, 1) for x in figures["on"]],
            "controls": "presence 0.5, frequency 0.5, repetition 1.2, logit_bias of 32 ids"}


# -- --compare-counts ---------------------------------------------------------------------------------


def compare_counts(args) -> dict:
    from engine.sampler import _controlled, _Plan, _plan_penalties
    from engine.sequence import Sequence

    vocab, n = 49152, args.streams
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=g)
    params = SamplingParams(max_tokens=4096, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    res = {}
    for length in (64, 256, 1024):
        seqs = []
        for i in range(n):
            # Zipf-like completions: some tokens repeat a lot, as text does.
            ranks = torch.randint(1, 2000, (length,), generator=g).float()
            out = (torch.floor(vocab / (ranks ** 1.2)).long() % vocab).tolist()
            s = Sequence(f"s{i}", torch.randint(0, vocab, (40,), generator=g).tolist(), params, detokenizer=None)
            for t in out:
                s.append_token(t)  # keeps s.token_counts, the engine's incremental counts
            seqs.append(s)

        def engine_way():
            plan = _Plan()
            _plan_penalties(plan, seqs, list(range(n)), vocab)
            with _controlled(logits, plan) as x:
                return x.max(dim=-1).values

        def per_step_way():
            outs = [s.output_token_ids for s in seqs]
            out_keys = (torch.tensor(list(itertools.chain.from_iterable(outs)), dtype=torch.int64)
                        + torch.repeat_interleave(torch.arange(n) * vocab, torch.tensor([len(o) for o in outs])))
            prompts = [torch.tensor(sorted(set(s.prompt_token_ids))) for s in seqs]  # cached per sequence
            keys = torch.cat([out_keys, torch.cat(prompts) + torch.repeat_interleave(
                torch.arange(n) * vocab, torch.tensor([len(p) for p in prompts]))])
            uniq, inverse = torch.unique(keys, return_inverse=True)
            counts = torch.zeros(len(uniq)).index_add_(0, inverse[:len(out_keys)], torch.ones(len(out_keys)))
            plan = _Plan()
            per = torch.tensor([[1.2], [0.5], [0.5]]).expand(3, len(uniq))
            plan.pen_keys, plan.pen_params = uniq, torch.cat([per, counts[None]])
            with _controlled(logits, plan) as x:
                return x.max(dim=-1).values

        def dense_way():
            width = max(len(s.token_ids) for s in seqs)
            ids = torch.tensor([s.token_ids + [0] * (width - len(s.token_ids)) for s in seqs])
            outs = torch.tensor([[0] * len(s.prompt_token_ids) + [1] * len(s.output_token_ids)
                                 + [0] * (width - len(s.token_ids)) for s in seqs], dtype=torch.float32)
            valid = torch.tensor([[1] * len(s.token_ids) + [0] * (width - len(s.token_ids)) for s in seqs],
                                 dtype=torch.float32)
            counts = torch.zeros(n, vocab).scatter_add_(1, ids, outs)
            seen = torch.zeros(n, vocab).scatter_add_(1, ids, valid) > 0
            x = torch.where(seen, torch.where(logits > 0, logits / 1.2, logits * 1.2), logits)
            return (x - (0.5 * counts + 0.5 * (counts > 0))).max(dim=-1).values

        want = dense_way()
        ways = (("incremental", engine_way), ("per_step_unique", per_step_way), ("dense", dense_way))
        for name, fn in ways:
            assert torch.allclose(fn(), want, atol=1e-5), name
        times = {name: [] for name, _ in ways}
        for _ in range(args.rounds * 4):
            for name, fn in ways:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1000)
        for name, ts in times.items():
            res[f"{name}_ms_len{length}"] = round(statistics.median(ts), 3)
    return {"streams": n, "vocab": vocab, **res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--compare-counts", action="store_true")
    args = ap.parse_args(argv)
    res = compare_counts(args) if args.compare_counts else throughput(args)
    res["machine"] = machine()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

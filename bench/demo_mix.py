"""The live path a newcomer meets: `tessera demo` (gateway + in-process engine, as `make run`
starts it) streaming chat completions through the official openai client, the demo's three
adapters mixed with the base model against the base model alone.

    .venv/bin/python bench/demo_mix.py [--streams 1,8,32] [--requests 48] [--max-tokens 64]
                                       [--lengths matched|natural|fixed]

For each stream count, after a warm-up (every model once, then `--warmup` requests of the mix),
two workloads run in turn, `--rounds` times each: "base" (every request on the base model) and
"mix" (requests cycle base, json-answer, pirate, upper), `--requests` requests per workload and
round, `streams` of them in flight at a time (a closed loop: a stream sends its next request when
its reply ends). Per request: time to first token (first content delta) and time per output
token after it ((finish - first) / (tokens - 1), the tokens from the usage chunk the request asks
for with `stream_options`, as serving benchmarks count them: not the content chunks, which skip
tokens that show no text).

How long the replies are (`--lengths`) decides when new requests arrive, and so how many other
requests' prefills land inside a request's decoding, which its time per token includes:
- "matched" (the default): request i of a workload asks for exactly lengths[i] tokens (the API's
  ignore_eos), the same spread of lengths between max-tokens/2 and max-tokens in both workloads,
  so both start requests at the same points and differ only in the model that serves them; the
  lengths differ between neighbouring requests, so prefills interleave with decodes as under
  real traffic;
- "natural": every request asks for max-tokens and its reply ends at EOS: the adapters' replies
  are shorter (json-answer answers in a few tokens), so the mix starts more requests per token
  decoded, and, the base's replies all running to max-tokens, the base workload's streams start
  and end together, its prefills never inside another request's decoding;
- "fixed": every reply exactly max-tokens long: both workloads in lockstep, no prefill inside a
  request's decoding (decode steps only).

Prints one JSON object per stream count: per-token p50 of base and of the mix and their ratio, the
mean reply length of each workload in tokens and in content chunks, first-token p50/p99/max of
base requests in the base workload, of adapter requests in the mix and of base requests in the mix
(beside the same adapter traffic), and the adapter requests whose first token took longer than
3x the base's p99 (their offset in seconds from the run's start, model, first-token seconds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine  # noqa: E402
from bench.demo_process import DemoProcess  # noqa: E402

ADAPTERS = ("json-answer", "pirate", "upper")
PROMPTS = ["Tell me about the history of the printing press.", "Explain how a rainbow forms.",
           "What are the benefits of regular exercise?", "Describe the water cycle in simple terms.",
           "How do airplanes stay in the air?", "Give me a recipe for a simple tomato soup."]


async def one(client, model: str, prompt: str, max_tokens: int, t_start: float, ignore_eos: bool = False) -> dict:
    """Stream one chat completion: its time to the first content delta, its time per output token
    after it ((finish - first) / (tokens - 1), the tokens from the stream's usage chunk) and its
    content chunks. Tokens and chunks differ where a token shows no text: with `ignore_eos` (the
    API's vLLM-style extension, every reply max_tokens long) an adapter that ends its turn early
    goes on through special tokens (its end of turn, the next turn's header), so dividing by the
    chunks would charge those tokens' time to the visible ones."""
    t0 = time.perf_counter()
    first = finish = None
    chunks, tokens = 0, None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True} if ignore_eos else None)
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            if chunk.choices[0].delta.content:
                first = first or now
                chunks += 1
            if chunk.choices[0].finish_reason:
                finish = now
    timed = first is not None and finish is not None and tokens is not None and tokens > 1
    return {"model": model, "at_s": round(t0 - t_start, 2), "ttft_s": (first or time.perf_counter()) - t0,
            "tpot_s": (finish - first) / (tokens - 1) if timed else None, "tokens": tokens or 0, "chunks": chunks}


def reply_lengths(mode: str, max_tokens: int) -> tuple[list[int], bool]:
    """(max_tokens of request i, cycled; ignore_eos) for a `--lengths` mode. "matched": 8 lengths
    evenly from max_tokens/2 to max_tokens in an order where neighbours differ (stride 3 of 8), the
    same in every workload."""
    if mode == "natural":
        return [max_tokens], False
    if mode == "fixed":
        return [max_tokens], True
    lo = max(2, max_tokens // 2)
    spread = [lo + round(k * (max_tokens - lo) / 7) for k in range(8)]
    return [spread[(3 * i) % 8] for i in range(8)], True


async def workload(client, models: list[str], streams: int, n: int, lengths: list[int], t_start: float,
                   ignore_eos: bool = False) -> list[dict]:
    """`n` requests cycling through `models`, PROMPTS and `lengths` (max_tokens), `streams` in
    flight at a time."""
    queue = list(range(n))
    results: list[dict] = []

    async def worker():
        while queue:
            i = queue.pop(0)
            results.append(await one(client, models[i % len(models)], PROMPTS[i % len(PROMPTS)],
                                     lengths[i % len(lengths)], t_start, ignore_eos))

    await asyncio.gather(*(worker() for _ in range(streams)))
    return results


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def run(args, demo: DemoProcess, base: str) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0, timeout=600)
    mix = [base, *ADAPTERS]
    lengths, ignore_eos = reply_lengths(args.lengths, args.max_tokens)
    t_start = time.perf_counter()
    await workload(client, mix, 1, len(mix), [8], t_start)  # every model once: loads, first builds
    out = []
    for streams in args.streams:
        await workload(client, mix, streams, max(args.warmup, streams), lengths, t_start, ignore_eos)
        runs: dict[str, list[dict]] = {"base": [], "mix": []}
        for _ in range(args.rounds):
            for key, models in (("base", [base]), ("mix", mix)):
                runs[key] += await workload(client, models, streams, args.requests, lengths, t_start, ignore_eos)
        tpot = {k: [r["tpot_s"] for r in v if r["tpot_s"] is not None] for k, v in runs.items()}
        base_ttft = [r["ttft_s"] for r in runs["base"]]
        adapter_ttft = [r for r in runs["mix"] if r["model"] != base]
        p99 = pct(base_ttft, 0.99)
        res = {
            "streams": streams, "lengths": args.lengths, "requests_per_workload": len(runs["base"]),
            "tpot_ms_p50_base": round(statistics.median(tpot["base"]) * 1000, 2),
            "tpot_ms_p50_mix": round(statistics.median(tpot["mix"]) * 1000, 2),
            "tokens_mean_base": round(statistics.mean(r["tokens"] for r in runs["base"]), 1),
            "tokens_mean_mix": round(statistics.mean(r["tokens"] for r in runs["mix"]), 1),
            "chunks_mean_base": round(statistics.mean(r["chunks"] for r in runs["base"]), 1),
            "chunks_mean_mix": round(statistics.mean(r["chunks"] for r in runs["mix"]), 1),
            "ttft_ms_base": [round(pct(base_ttft, q) * 1000, 1) for q in (0.5, 0.99, 1.0)],
            "ttft_ms_adapters": [round(pct([r["ttft_s"] for r in adapter_ttft], q) * 1000, 1)
                                 for q in (0.5, 0.99, 1.0)],
            "ttft_ms_base_in_mix": [round(pct([r["ttft_s"] for r in runs["mix"] if r["model"] == base], q) * 1000, 1)
                                    for q in (0.5, 0.99, 1.0)],
            "adapter_ttft_over_3x_base_p99": [{"at_s": r["at_s"], "model": r["model"], "ttft_s": round(r["ttft_s"], 3)}
                                              for r in adapter_ttft if r["ttft_s"] > 3 * p99],
        }
        res["mix_over_base_tpot_p50"] = round(res["tpot_ms_p50_mix"] / res["tpot_ms_p50_base"], 3)
        print(json.dumps(res), flush=True)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=48, help="requests per workload and round")
    ap.add_argument("--rounds", type=int, default=2, help="base, mix alternations per stream count")
    ap.add_argument("--warmup", type=int, default=16, help="mixed requests before each stream count's runs")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lengths", choices=("matched", "natural", "fixed"), default="matched",
                    help="reply lengths: the same spread in both workloads (matched), to EOS (natural), or "
                         "all max-tokens long (fixed); see the module docstring")
    args = ap.parse_args()
    demo = DemoProcess(Path(tempfile.mkdtemp(prefix="tessera-demo-mix-")))
    try:
        demo.wait_ready(600)
        import httpx

        models = httpx.get(demo.url + "/v1/models", headers={"Authorization": f"Bearer {demo.key}"}).json()["data"]
        names = {m["id"] for m in models}
        missing = [a for a in ADAPTERS if a not in names]
        if missing:
            raise SystemExit(f"the demo serves no {missing} (models: {sorted(names)})")
        base = models[0]["id"]  # the base model's card comes first (api/openai.py, list_models)
        results = asyncio.run(run(args, demo, base))
        print(json.dumps({"base_model": base, "max_tokens": args.max_tokens, "lengths": args.lengths,
                          "runs": results, "machine": machine()}))
    finally:
        demo.stop()


if __name__ == "__main__":
    main()

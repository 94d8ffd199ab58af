"""Prefix caching: TTFT with a cached 1,000-token system prompt against an uncached one, and the
throughput of 32 streams sharing a system prompt with caching on and off.

    python bench/prefix_cache.py [--system-tokens 1000] [--streams 32] [--new-tokens 32]
    python bench/prefix_cache.py --model /tmp/llama3-8b.gguf --backend triton --device cuda

Prints one JSON object:
- `ttft_ms_uncached` / `ttft_ms_cached`: median time to first token (on an idle engine) of a
  request whose prompt is a `--system-tokens` system prompt plus a short user turn, the system
  prompt new to the cache / cached by an earlier request with another user turn; every request
  has its own user turn, so only the system prompt can hit. `ttft_cached_over_uncached` is
  their ratio (target <= 0.15).
- `tok_s_shared_on` / `tok_s_shared_off`: aggregate completion tokens/s of `--streams`
  concurrent requests with the same system prompt and different user turns, submitted
  together to an engine with prefix caching on / off (wall time from submission, prefill
  included); `shared_on_over_off` is their ratio. Both engines are in this process, built alike.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (PROMPTS, add_model_args, is_default_run, load_model, machine, median,  # noqa: E402
                          run_info, sync, ttft_ms)
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import GenerationRequest, SamplingParams  # noqa: E402


def system_prompt(tokenizer, n: int, variant: int) -> list[int]:
    """`n` tokens of English text; `variant` changes the first words, so two variants share no
    block."""
    words = " ".join(PROMPTS * (n // 8 + 8))
    return tokenizer.encode(f"System prompt {variant}: you are assistant number {variant}. {words}")[:n]


def user_turn(tokenizer, i: int) -> list[int]:
    return tokenizer.encode(f"\nUser {i}: {PROMPTS[i % len(PROMPTS)]}\nAssistant:")


def shared_tok_s(engine: LLMEngine, system: list[int], tokenizer, streams: int, new_tokens: int, tag: str,
                 device: str) -> float:
    reqs = [GenerationRequest(f"{tag}{i}", prompt_token_ids=system + user_turn(tokenizer, 1000 + i),
                              params=SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
            for i in range(streams)]
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    sync(device)
    return sum(o.completion_tokens for o in outs.values()) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="TTFT samples per arm")
    ap.add_argument("--kv-cache-mb", type=int, default=1024)
    add_model_args(ap)
    args = ap.parse_args()

    t0 = time.perf_counter()
    checkpoint, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0

    def engine(caching: bool) -> LLMEngine:
        cfg = EngineConfig(kv_cache_bytes=args.kv_cache_mb << 20, backend=args.backend, device=args.device,
                           enable_prefix_caching=caching)
        return LLMEngine(args.model, cfg, checkpoint=checkpoint, tokenizer=tokenizer)

    on, off = engine(True), engine(False)
    for eng in (on, off):  # warm the kernels at this prompt length, outside the measured runs
        ttft_ms(eng, "warm", system_prompt(tokenizer, args.system_tokens, -1) + user_turn(tokenizer, 0), args.device)

    # TTFT: alternate the arms; each uncached sample has a system prompt no request used before,
    # each cached sample reuses the one the previous request (another user turn) put in the cache.
    cached_system = system_prompt(tokenizer, args.system_tokens, 0)
    ttft_ms(on, "prime", cached_system + user_turn(tokenizer, 1), args.device)
    uncached, cached = [], []
    for r in range(args.repeats):
        uncached.append(ttft_ms(on, f"u{r}", system_prompt(tokenizer, args.system_tokens, r + 1)
                                + user_turn(tokenizer, 10 + r), args.device))
        cached.append(ttft_ms(on, f"c{r}", cached_system + user_turn(tokenizer, 100 + r), args.device))

    shared = system_prompt(tokenizer, args.system_tokens, 999)
    tok_off = shared_tok_s(off, shared, tokenizer, args.streams, args.new_tokens, "off", args.device)
    tok_on = shared_tok_s(on, shared, tokenizer, args.streams, args.new_tokens, "on", args.device)

    res = {"system_tokens": args.system_tokens, "streams": args.streams, "new_tokens": args.new_tokens,
           "ttft_ms_uncached": round(median(uncached), 1), "ttft_ms_cached": round(median(cached), 1),
           "ttft_cached_over_uncached": round(median(cached) / median(uncached), 3),
           "tok_s_shared_off": round(tok_off, 1), "tok_s_shared_on": round(tok_on, 1),
           "shared_on_over_off": round(tok_on / tok_off, 2),
           "prefix_cache": {"query_tokens": on.block_manager.stats["query_tokens"],
                            "hit_tokens": on.block_manager.stats["hit_tokens"]},
           "machine": machine()}
    if not is_default_run(args):
        res["run"] = run_info(args, load_s)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

"""Decode throughput with a JSON schema (response_format) against the same requests without one.

    python bench/structured.py [--concurrency 1,32] [--new-tokens 64] [--rounds 2]

Prints one JSON object. For each concurrency N: `free_tok_s_c{N}` and `json_tok_s_c{N}`, the
decode tokens/s of N concurrent greedy chat requests (EOS ignored) without and with a JSON schema,
and `ratio_c{N}` = json / free (the target is >= 0.9). Decode tokens/s counts the tokens produced
after every request of the round has its first token (prefill excluded), over the wall time of
those steps; each arm's figure is the best of `--rounds` rounds, the arms interleaved in one run.
The schema asks for at least 20 people objects (names, integers, enums, arrays), so no request
completes its grammar within the tokens asked for: both arms decode the same number of tokens.
The grammar is compiled and warmed before timing (the engine's compile cache); the compile times
are reported: `first_compile_ms` (json_object, including the tokenizer's tables, once per engine),
`schema_compile_ms` (this schema), `cached_compile_ms` (the same schema again, from the cache).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import PROMPTS, decode_tok_s, load_model, machine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import GenerationRequest, SamplingParams  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es"]}, "maxItems": 4},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "languages", "mood"],
    "additionalProperties": False,
}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 20, "items": PERSON}},
          "required": ["people"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}


def requests(tokenizer, n: int, new_tokens: int, prefix: str, constrained: bool) -> list[GenerationRequest]:
    reqs = []
    for i in range(n):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " Answer with a list of people as JSON."}])
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                response_format=RESPONSE_FORMAT if constrained else None)
        reqs.append(GenerationRequest(f"{prefix}{i}", prompt=prompt, cache_salt=f"{prefix}{i}", params=params))
    return reqs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    args = ap.parse_args(argv)
    checkpoint, tokenizer = load_model()
    cfg = EngineConfig(dtype=torch.float32, weight_format="auto", kv_cache_bytes=args.kv_cache_mb << 20,
                       max_num_seqs=64)
    engine = LLMEngine(config=cfg, checkpoint=checkpoint, tokenizer=tokenizer)
    timings = {}
    for name, fmt in (("first_compile_ms", {"type": "json_object"}), ("schema_compile_ms", RESPONSE_FORMAT),
                      ("cached_compile_ms", RESPONSE_FORMAT)):
        t0 = time.perf_counter()
        engine.structured.compile(fmt)
        timings[name] = round((time.perf_counter() - t0) * 1000, 3)
    decode_tok_s(engine, requests(tokenizer, 2, 16, "warm-free", False))
    decode_tok_s(engine, requests(tokenizer, 2, 16, "warm-json", True))
    res: dict = {"new_tokens": args.new_tokens, **timings}
    for c in (int(x) for x in args.concurrency.split(",")):
        best = {"free": 0.0, "json": 0.0}
        for r in range(args.rounds):
            for arm in ("free", "json"):
                reqs = requests(tokenizer, c, args.new_tokens, f"{arm}-c{c}-r{r}-", arm == "json")
                best[arm] = max(best[arm], decode_tok_s(engine, reqs))
        res[f"free_tok_s_c{c}"] = round(best["free"], 1)
        res[f"json_tok_s_c{c}"] = round(best["json"], 1)
        res[f"ratio_c{c}"] = round(best["json"] / best["free"], 3)
    res["machine"] = machine()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

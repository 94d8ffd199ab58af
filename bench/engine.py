"""Engine throughput and TTFT against Hugging Face transformers on the same weights and prompts.

    python bench/engine.py [--formats auto,int8,bf16,fp32] [--skip-hf]

Prints one JSON object. `tok_s_c{N}`: aggregate completion tokens/s with N concurrent requests
of 64 new tokens each (greedy, EOS ignored, wall time including prefill), for the fastest of the
measured formats (see `formats`; "auto" is the engine's default: int8 weight-only for skinny
batches; wider decode batches on a dense copy in the dtype measured fastest at start,
reported under `choice`; steps that prefill on the fp32 copy); `hf_tok_s_c{N}`:
transformers' generate on the same dequantized GGUF weights (fp32, batch N, left padding);
`ttft_ms_p50_512`: median time to first token of a 512-token prompt on an idle engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import PROMPTS, engine_tok_s, fixed_requests, hf_baseline, hf_chat_batch, machine, median  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import default_model_path, load_gguf  # noqa: E402
from engine.sampling_params import GenerationRequest, SamplingParams  # noqa: E402
from engine.tokenizer import TextTokenizer  # noqa: E402

# weight format -> activation dtype. "auto"/"int8" keep fp32 activations (int8 weights for
# decode-sized batches, a dense copy measured at start for wider ones); "bf16" runs everything
# in bf16.
FORMATS = {"auto": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}
NEW_TOKENS = 64


def run_engine(checkpoint, tokenizer, fmt: str, concurrencies) -> dict:
    eng = LLMEngine(config=EngineConfig(dtype=FORMATS[fmt], weight_format=fmt, kv_cache_bytes=256 << 20),
                    checkpoint=checkpoint, tokenizer=tokenizer)
    engine_tok_s(eng, fixed_requests(tokenizer, 2, 8, "warm"))
    res = {}
    if eng.int8_max_rows is not None:
        fast = next(m for m in eng.model.modules() if getattr(m, "fmt", None) == "int8").dense_fast
        dense = torch.float32 if fast is None else fast.dtype
        res["choice"] = {"int8_max_rows": eng.int8_max_rows[0], "lm_head_int8_max_rows": eng.int8_max_rows[1],
                         "dense": str(dense).removeprefix("torch."), "dense_ms": eng.format_timings}
    for c in concurrencies:
        res[f"tok_s_c{c}"] = round(engine_tok_s(eng, fixed_requests(tokenizer, c, NEW_TOKENS, f"c{c}-")), 2)
    long_prompt = list(tokenizer.encode(" ".join(PROMPTS * 40)))[:512]
    ttfts = []
    for i in range(3):
        eng.add_request(GenerationRequest(f"ttft{i}", prompt_token_ids=long_prompt,
                                          params=SamplingParams(max_tokens=1, temperature=0)))
        t0 = time.perf_counter()
        while eng.has_unfinished():
            outs = eng.step()
            if any(o.token_ids for o in outs):
                break
        ttfts.append((time.perf_counter() - t0) * 1000)
    res["ttft_ms_p50_512"] = round(median(ttfts), 1)
    return res


def run_hf(concurrencies) -> dict:
    model, tok = hf_baseline()
    res = {}
    for c in concurrencies:
        batch = hf_chat_batch(tok, c)
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            dt = time.perf_counter() - t0
        new = (out.shape[1] - batch["input_ids"].shape[1]) * c
        res[f"hf_tok_s_c{c}"] = round(new / dt, 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="auto")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    checkpoint = load_gguf(default_model_path())
    tokenizer = TextTokenizer.from_gguf_metadata(checkpoint[2])
    formats = {f: run_engine(checkpoint, tokenizer, f, conc) for f in args.formats.split(",")}
    best = max(formats, key=lambda f: formats[f].get("tok_s_c1", 0) + formats[f].get("tok_s_c32", 0) / 8)
    result = {"engine_format": best, **formats[best]}
    if not args.skip_hf:
        result.update(run_hf([c for c in conc if c in (1, 32)] or conc))
        for c in (1, 32):
            if f"tok_s_c{c}" in result and f"hf_tok_s_c{c}" in result:
                result[f"speedup_c{c}"] = round(result[f"tok_s_c{c}"] / result[f"hf_tok_s_c{c}"], 2)
    result["formats"] = formats
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

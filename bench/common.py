"""Shared helpers for the engine benchmarks (run as scripts: `python bench/<name>.py`)."""
from __future__ import annotations

import os
import platform as _platform  # the standard library module (the repo's platform/ has no __init__)
import statistics
import time

import torch

from engine.sampling_params import GenerationRequest, SamplingParams

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a rainbow forms.",
    "List some tips for staying focused while studying.",
    "Describe the water cycle in simple terms.",
    "What are the benefits of regular exercise?",
    "Tell me about the history of the printing press.",
    "How do airplanes stay in the air?",
    "Give me a recipe for a simple tomato soup.",
]


def add_model_args(ap) -> None:
    """The flags every engine benchmark takes: which checkpoint, which backend, which device."""
    ap.add_argument("--model", default=None,
                    help="a .gguf file or HF safetensors directory (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "triton"), help="EngineConfig.backend")
    ap.add_argument("--device", default="cpu", help="EngineConfig.device: cpu, cuda or cuda:N")


def is_default_run(args) -> bool:
    """Whether the run is the embedded model on the CPU backend and device (the figures
    bench/RESULTS.md compares over time): its printed keys stay as they were."""
    return args.model is None and args.backend == "cpu" and args.device == "cpu"


def run_info(args, load_s: float) -> dict:
    """What a non-default run adds to its JSON: the model file, backend, device, load seconds."""
    info = {"model": str(args.model) if args.model else "default", "backend": args.backend, "device": args.device,
            "load_s": round(load_s, 1)}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return info


def load_model(path=None):
    """(checkpoint triple, TextTokenizer) of `path` (default: the embedded SmolLM2 GGUF)."""
    from engine.loader import default_model_path, load_checkpoint
    from engine.tokenizer import TextTokenizer

    path = default_model_path() if path is None else path
    checkpoint = load_checkpoint(path)
    tokenizer = (TextTokenizer.from_gguf_metadata(checkpoint[2]) if checkpoint[2]
                 else TextTokenizer.from_hf_directory(path))
    return checkpoint, tokenizer


def sync(device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously; CPU: nothing)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": _platform.python_version()}


def fixed_requests(tokenizer, n: int, new_tokens: int, prefix: str = "r", adapters=None) -> list[GenerationRequest]:
    """`n` greedy chat requests over PROMPTS, each under its own prefix-cache salt: the prompts
    repeat across runs and requests, and throughput figures measure computing them, not the
    prefix cache (bench/prefix_cache.py measures that)."""
    reqs = []
    for i in range(n):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        reqs.append(GenerationRequest(f"{prefix}{i}", prompt=prompt, adapter=adapters[i] if adapters else None,
                                      cache_salt=f"{prefix}{i}",
                                      params=SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)))
    return reqs


def engine_tok_s(engine, reqs) -> float:
    """Aggregate completion tokens per second for running `reqs` concurrently to the end
    (wall time from submission, prefill included). On CUDA the device is synchronized at both
    ends: the figure is end-to-end wall time, host work between launches included, which
    CUDA events on one stream would not count."""
    device = engine.config.device
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    sync(device)
    dt = time.perf_counter() - t0
    return sum(o.completion_tokens for o in outs.values()) / dt


def decode_tok_s(engine, reqs: list[GenerationRequest]) -> float:
    """Tokens/s of the steps after every request has its first token, until all finish."""
    for r in reqs:
        engine.add_request(r)
    started: set[str] = set()
    while len(started) < len(reqs):
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def hf_baseline(path=None, device: str = "cpu"):
    """A GGUF model (default: the embedded one) through Hugging Face transformers (the baseline
    the benchmarks compare against): (model in eval mode, its tokenizer padding on the left for
    batches). fp32 on the CPU; bf16 on CUDA, where it is the usual serving dtype.
    transformers (and gguf, which it reads the file with) are imported here: only the baseline
    runs need them, and a caller on a machine without them skips the baseline."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loader import default_model_path

    path = default_model_path() if path is None else Path(path)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    if device != "cpu":
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def hf_chat_batch(tok, n: int, device: str = "cpu"):
    """n chat prompts (PROMPTS in turn) through `tok`'s chat template, as one left-padded batch
    on `device`."""
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     add_generation_prompt=True, tokenize=False) for i in range(n)]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch if device == "cpu" else batch.to(device)


def ttft_ms(engine, request_id: str, prompt_ids: list[int], device, *, cache_salt: str | None = None) -> float:
    """Milliseconds from submitting a one-token greedy request for `prompt_ids` to its token, on
    `engine` (idle: nothing else runs; the device synchronized at both ends)."""
    engine.add_request(GenerationRequest(request_id, prompt_token_ids=prompt_ids, cache_salt=cache_salt,
                                         params=SamplingParams(max_tokens=1, temperature=0)))
    sync(device)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        if any(o.token_ids for o in engine.step()):
            break
    sync(device)
    dt = (time.perf_counter() - t0) * 1000.0
    while engine.has_unfinished():
        engine.step()
    return dt


def median(xs):
    return statistics.median(xs)

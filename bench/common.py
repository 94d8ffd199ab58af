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
    reqs = []
    for i in range(n):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        reqs.append(GenerationRequest(f"{prefix}{i}", prompt=prompt, adapter=adapters[i] if adapters else None,
                                      params=SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)))
    return reqs


def engine_tok_s(engine, reqs) -> float:
    """Aggregate completion tokens per second for running `reqs` concurrently to the end
    (wall time from submission, prefill included)."""
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return sum(o.completion_tokens for o in outs.values()) / dt


def hf_baseline():
    """The default GGUF model through Hugging Face transformers (the baseline the benchmarks
    compare against): (fp32 model in eval mode, its tokenizer padding on the left for batches).
    transformers is imported here: only the baseline runs need it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def hf_chat_batch(tok, n: int):
    """n chat prompts (PROMPTS in turn) through `tok`'s chat template, as one left-padded batch."""
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     add_generation_prompt=True, tokenize=False) for i in range(n)]
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def median(xs):
    return statistics.median(xs)

"""The demo adapters' behaviour through the engine, per adapter storage.

    python bench/demo_adapters.py

The 30 held-out prompts of platform/tessera/demo_adapters/behaviour.json (what
scripts/train_demo_adapters.py measured with transformers + PEFT), greedy, 48 new tokens, every
demo adapter in one batch, on four engines: the exact format with fp32 adapters, and the
measured ("auto") format with fp32, bf16 and int8 adapters (int8 is its default where the C LoRA
kernel is built). Prints one JSON object: per engine and adapter, the behaviour share (the
training script's metric) and the share of replies identical to those of the same format's
engine with fp32 adapters; and the base's behaviour share for each metric.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import machine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import default_model_path, load_gguf  # noqa: E402
from engine.lora.source import LocalDirectoryAdapterSource  # noqa: E402
from engine.sampling_params import GenerationRequest, SamplingParams  # noqa: E402
from engine.tokenizer import TextTokenizer  # noqa: E402
from scripts.train_demo_adapters import METRICS  # noqa: E402

ADAPTERS = ROOT / "platform" / "tessera" / "demo_adapters"
ENGINES = {"exact_fp32": ("fp32", torch.float32), "auto_fp32": ("auto", torch.float32),
           "auto_bf16": ("auto", torch.bfloat16), "auto_int8": ("auto", torch.int8)}


def replies(eng: LLMEngine, tokenizer, prompts: list[str], adapters: list[str | None],
            max_tokens: int) -> dict[str | None, list[str]]:
    """Greedy replies to every prompt under every adapter, all submitted together."""
    reqs = {(a, i): GenerationRequest(f"{a}-{i}", prompt=tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                      adapter=a, params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
            for a in adapters for i, p in enumerate(prompts)}
    outs = eng.generate(list(reqs.values()))
    return {a: [outs[reqs[(a, i)].request_id].text.strip() for i in range(len(prompts))] for a in adapters}


def main() -> None:
    beh = json.loads((ADAPTERS / "behaviour.json").read_text())["eval"]
    prompts, max_tokens = beh["prompts"], beh["max_new_tokens"]
    names = sorted(METRICS)
    checkpoint = load_gguf(default_model_path())
    tokenizer = TextTokenizer.from_gguf_metadata(checkpoint[2])
    res: dict = {"prompts": len(prompts), "max_new_tokens": max_tokens, "engines": {}}
    fp32_replies: dict[tuple[str, str], list[str]] = {}  # (format, adapter) -> fp32 adapters' replies
    for label, (fmt, lora_dtype) in ENGINES.items():
        eng = LLMEngine(config=EngineConfig(weight_format=fmt, lora_dtype=lora_dtype, max_loras=len(names),
                                            kv_cache_bytes=128 << 20),
                        checkpoint=checkpoint, tokenizer=tokenizer, adapter_source=LocalDirectoryAdapterSource(ADAPTERS))
        got = replies(eng, tokenizer, prompts, [*names, None] if label == "exact_fp32" else names, max_tokens)
        row = {}
        for name in names:
            key, fn = METRICS[name]
            outs = got[name]
            ref = fp32_replies.setdefault((fmt, name), outs)
            row[name] = {key: round(sum(map(fn, outs)) / len(outs), 3),
                         "same_as_fp32_adapters": round(sum(a == b for a, b in zip(outs, ref)) / len(outs), 3)}
        if label == "exact_fp32":
            res["base"] = {METRICS[n][0]: round(sum(map(METRICS[n][1], got[None])) / len(prompts), 3) for n in names}
        res["engines"][label] = row
        eng.lora_manager.shutdown()
    res["machine"] = machine()
    print(json.dumps(res))


if __name__ == "__main__":
    main()

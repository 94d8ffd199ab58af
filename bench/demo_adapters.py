"""The demo adapters' behaviour through the engine, per adapter storage.

    python bench/demo_adapters.py

The 30 held-out prompts of platform/tessera/demo_adapters/behaviour.json (what
scripts/train_demo_adapters.py measured with transformers + PEFT), greedy, 48 new tokens, every
demo adapter in one batch, on four engines: the exact format with fp32 adapters, and the
measured ("auto") format with fp32, bf16 and int8 adapters (int8 is its default where the C LoRA
kernel is built). Prints one JSON object: per engine and adapter, the behaviour share (the
training script's metric) and the share of replies identical to those of the same format's
engine with fp32 adapters; and the base's behaviour share for each metric.

    python bench/demo_adapters.py --simulate-bits 6,5,4

adds, for each bit width b, an "auto_rows{b}_simulated" engine: what storing adapters as b-bit
rows would do to them, before any such storage is built. Each adapter's A and B are quantized as
the int8 stacks quantize them (symmetric, one scale per row: A's rows over its inputs, B's over
the rank), but to b bits (levels -(2^(b-1) - 1) .. 2^(b-1) - 1), dequantized, and served as fp32
adapters by the measured format's engine (whose fp32-adapter replies are the reference).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

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


def quantized_rows(w: torch.Tensor, bits: int) -> torch.Tensor:
    """w with each row (last dim) rounded to `bits`-bit symmetric levels of its own scale, as fp32."""
    qmax = 2 ** (bits - 1) - 1
    scale = w.float().abs().amax(dim=-1, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w.float() / safe).clamp_(-qmax, qmax) * safe


def simulated_copies(names: list[str], bits: int, into: Path) -> tuple[Path, dict[str, float]]:
    """The adapters `names` with A and B rounded to `bits`-bit rows (`quantized_rows`), as PEFT
    directories under `into`; and per adapter the rounding's error on the adapter's term, in % of
    the term (|x A'^T B'^T - x A^T B^T| / |x A^T B^T|, x 64 Gaussian rows, mean over its modules)."""
    gen = torch.Generator().manual_seed(0)
    errors = {}
    for name in names:
        out = into / name
        out.mkdir(parents=True)
        shutil.copy(ADAPTERS / name / "adapter_config.json", out)
        tensors = load_file(str(ADAPTERS / name / "adapter_model.safetensors"))
        rounded = {k: quantized_rows(v, bits) if ".lora_A." in k or ".lora_B." in k else v for k, v in tensors.items()}
        save_file(rounded, str(out / "adapter_model.safetensors"))
        per_module = []
        for ka in (k for k in tensors if ".lora_A." in k):
            kb = ka.replace(".lora_A.", ".lora_B.")
            x = torch.randn(64, tensors[ka].shape[1], generator=gen)
            ref = x @ tensors[ka].float().T @ tensors[kb].float().T
            per_module.append(((x @ rounded[ka].T @ rounded[kb].T - ref).norm() / ref.norm()).item())
        errors[name] = round(100 * sum(per_module) / len(per_module), 2)
    return into, errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulate-bits", default="",
                    help="comma-separated bit widths of simulated row storages (e.g. 6,5,4); none by default")
    args = ap.parse_args()
    widths = [b.strip() for b in args.simulate_bits.split(",") if b.strip()]
    if not all(b.isdigit() and 2 <= int(b) <= 8 for b in widths):
        raise SystemExit(f"bench/demo_adapters.py: --simulate-bits takes widths from 2 to 8; got {args.simulate_bits!r}")
    bit_widths = [int(b) for b in widths]
    beh = json.loads((ADAPTERS / "behaviour.json").read_text())["eval"]
    prompts, max_tokens = beh["prompts"], beh["max_new_tokens"]
    names = sorted(METRICS)
    checkpoint = load_gguf(default_model_path())
    tokenizer = TextTokenizer.from_gguf_metadata(checkpoint[2])
    res: dict = {"prompts": len(prompts), "max_new_tokens": max_tokens, "engines": {}}
    fp32_replies: dict[tuple[str, str], list[str]] = {}  # (format, adapter) -> fp32 adapters' replies
    tmp = Path(tempfile.mkdtemp(prefix="tessera-adapter-bits-"))
    engines = {label: (fmt, lora_dtype, ADAPTERS) for label, (fmt, lora_dtype) in ENGINES.items()}
    term_errors = {}
    try:
        for b in bit_widths:
            label = f"auto_rows{b}_simulated"
            source, term_errors[label] = simulated_copies(names, b, tmp / str(b))
            engines[label] = ("auto", torch.float32, source)
        for label, (fmt, lora_dtype, source) in engines.items():
            run_engine(res, label, fmt, lora_dtype, source, checkpoint, tokenizer, prompts, names, max_tokens, fp32_replies)
            for name, pct in term_errors.get(label, {}).items():
                res["engines"][label][name]["term_error_pct"] = pct
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["machine"] = machine()
    print(json.dumps(res))


def run_engine(res: dict, label: str, fmt: str, lora_dtype, source: Path, checkpoint, tokenizer, prompts: list[str],
               names: list[str], max_tokens: int, fp32_replies: dict) -> None:
    """One engine's row of `res`: its replies' behaviour share and identity with `fp32_replies`."""
    eng = LLMEngine(config=EngineConfig(weight_format=fmt, lora_dtype=lora_dtype, max_loras=len(names),
                                        kv_cache_bytes=128 << 20),
                    checkpoint=checkpoint, tokenizer=tokenizer, adapter_source=LocalDirectoryAdapterSource(source))
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


if __name__ == "__main__":
    main()

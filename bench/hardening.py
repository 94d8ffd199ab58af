"""What the hardening of issue 19 costs, each against its peer in the same run. Prints one JSON object.

- `validation`: one adapter validated inline (`validate_adapter_files`, the peer) and in its bounded
  child process (`validate_in_sandbox`: a fresh interpreter with resource limits and a deadline),
  on the `pirate` demo adapter (rank 16, all seven targets, SmolLM2-135M). The difference is the
  price of a validation that can never stop the gateway.
- `non_finite_check`: the engine's per-step check of the sampled rows' logits (one sum per row,
  finite exactly when every logit is) against `isfinite().all(dim=1)` over the same rows
  (32 rows of the 49,152-token vocabulary).
- `tokenize`: a short chat prompt encoded inline (`encode_chat`) against the same call through a
  worker thread (`anyio.to_thread.run_sync`), the hop the gateway takes only for long prompts.

    .venv/bin/python bench/hardening.py [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import torch  # noqa: E402

from adapter_registry.settings import RegistrySettings  # noqa: E402
from adapter_registry.validation import validate_adapter_files, validate_in_sandbox  # noqa: E402
from bench.common import machine  # noqa: E402
from engine.loader.gguf_loader import default_model_path, read_metadata  # noqa: E402
from engine.tokenizer import TextTokenizer  # noqa: E402

PIRATE = Path(__file__).resolve().parent.parent / "platform" / "tessera" / "demo_adapters" / "pirate"
MESSAGES = [{"role": "user", "content": "Which color is a plum?"}]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm: imports, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 4)


def bench_validation(repeats: int) -> dict:
    settings = RegistrySettings(_env_file=None)
    files = dict(config_path=PIRATE / "adapter_config.json", weights_path=PIRATE / "adapter_model.safetensors",
                 settings=settings)
    inline = _median_ms(lambda: validate_adapter_files(**files), repeats)
    sandboxed = _median_ms(lambda: validate_in_sandbox(**files), repeats)
    return {"adapter": "pirate (rank 16, 7 targets)", "inline_ms": inline, "sandboxed_ms": sandboxed,
            "added_ms": round(sandboxed - inline, 2)}


def bench_non_finite(repeats: int) -> dict:
    logits = torch.randn(32, 49152)
    row_sum = _median_ms(lambda: bool(torch.isfinite(logits.sum(dim=1)).all()), repeats * 10)
    isfinite = _median_ms(lambda: bool(torch.isfinite(logits).all(dim=1).all()), repeats * 10)
    return {"rows": 32, "vocab": 49152, "row_sum_ms": row_sum, "isfinite_ms": isfinite}


def _tokenizer() -> TextTokenizer:
    from gguf import GGUFReader

    return TextTokenizer.from_gguf_metadata(read_metadata(GGUFReader(str(default_model_path()))))


def bench_tokenize(repeats: int) -> dict:
    tok = _tokenizer()
    inline = _median_ms(lambda: tok.encode_chat(MESSAGES), repeats * 10)

    async def hops() -> list[float]:
        await anyio.to_thread.run_sync(tok.encode_chat, MESSAGES)  # warm the thread pool
        times = []
        for _ in range(repeats * 10):
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(tok.encode_chat, MESSAGES)
            times.append((time.perf_counter() - t0) * 1000)
        return times

    threaded = round(statistics.median(anyio.run(hops)), 4)
    return {"prompt": "one short user message", "inline_ms": inline, "worker_thread_ms": threaded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    out = {"machine": machine(),
           "validation": bench_validation(args.repeats), "non_finite_check": bench_non_finite(args.repeats),
           "tokenize": bench_tokenize(args.repeats)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

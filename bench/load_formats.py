"""Load time and host peak memory of a quantized checkpoint in each format, at a real model's
widths: `python bench/load_formats.py [--family llama3.1-8b] [--layers 2,4] [--formats ...]`.

For each format and depth a synthetic checkpoint of the family (engine.loader.synthetic: seeded
random weights at the family's shapes, each `--layers` count of its layers) is written (not timed): GGUF
through llama.cpp's mixes (engine.loader.gguf_writer), AWQ / GPTQ / compressed-tensors from a
bf16 directory (engine.loader.quantized_writer); the bf16 directory itself is the peer. Then a
fresh Python process (so one format's pages and allocator state do not help the next) runs
engine.loader.load_checkpoint on it and reports the seconds, the process's peak resident memory
over its resident memory before the load, and the bytes of what the loader returned (quantized
layer matrices as stored, QuantizedWeight.nbytes; other tensors dense). Layer matrices dominate a
real model (an 8B model's 32 layers are 6.98 of its 8.03 billion weights), so load time and the
returned bytes grow linearly with the layer count: the full-depth estimate is the line through
the two depths measured, given next to what was measured. One JSON object per line, then a
summary.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine  # noqa: E402

#: format -> (how it is written, from what): "gguf:<quant>", or a quantized_writer call on the
#: bf16 directory.
FORMATS = {
    "bf16": "the bf16 directory (peer)",
    "gguf-q4_k_m": "gguf:q4_k_m",
    "gguf-q6_k": "gguf:q6_k",
    "gguf-q8_0": "gguf:q8_0",
    "awq-g128": "awq",
    "gptq-g128-act-order": "gptq",
    "ct-w4a16-g128": "ct4",
    "ct-w8a16-channel": "ct8",
}

_CHILD = r"""
import json, resource, sys, time
from engine.loader import load_checkpoint
from engine.loader.quantized import QuantizedWeight

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
before = rss()
t0 = time.perf_counter()
cfg, tensors, _ = load_checkpoint(sys.argv[1])
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
layer = sum(v.nbytes() for v in tensors.values() if isinstance(v, QuantizedWeight))
dense_layer = sum(v.numel() * v.element_size() for k, v in tensors.items()
                  if not isinstance(v, QuantizedWeight) and k.startswith("model.layers.") and v.dim() == 2)
other = sum(v.numel() * v.element_size() for k, v in tensors.items()
            if not isinstance(v, QuantizedWeight) and not (k.startswith("model.layers.") and v.dim() == 2))
print(json.dumps({"seconds": seconds, "peak_over_start": peak - before, "layer_bytes": layer + dense_layer,
                  "other_bytes": other, "quantized_layers": layer > 0}))
"""


def _write(fmt: str, family: str, layers: int, root: Path, bf16: Path) -> Path:
    from engine.loader import quantized_writer
    from engine.loader.synthetic import write_family_gguf

    how = FORMATS[fmt]
    if fmt == "bf16":
        return bf16
    root.mkdir(parents=True, exist_ok=True)
    if how.startswith("gguf:"):
        return write_family_gguf(root / f"{fmt}.gguf", family, quant=how.removeprefix("gguf:"), num_layers=layers)
    out = root / fmt
    if how == "awq":
        return quantized_writer.write_awq(bf16, out, group_size=128)
    if how == "gptq":
        return quantized_writer.write_gptq(bf16, out, bits=4, group_size=128, sym=True, desc_act=True)
    if how == "ct4":
        return quantized_writer.write_compressed(bf16, out, bits=4, strategy="group", group_size=128, symmetric=True)
    return quantized_writer.write_compressed(bf16, out, bits=8, strategy="channel", group_size=None, symmetric=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="llama3.1-8b", help="a synthetic family at a real shape")
    ap.add_argument("--layers", default="2,4", help="two layer counts written (the family's widths)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: " + ", ".join(FORMATS))
    ap.add_argument("--keep", default=None, help="a directory to write the checkpoints into and keep")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        print(f"error: unknown format {unknown[0]!r}; known: {', '.join(FORMATS)}", file=sys.stderr)
        return 2

    from engine.loader.synthetic import FAMILIES, family_model_config, write_family_safetensors

    small, big = (int(x) for x in args.layers.split(","))
    full = FAMILIES[args.family].config["num_hidden_layers"]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tessera-load-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        cfg = family_model_config(args.family)
        measured: dict[str, dict[int, dict]] = {f: {} for f in formats}
        for layers in (small, big):
            t0 = time.perf_counter()
            bf16 = write_family_safetensors(root / f"bf16-{layers}", args.family, num_layers=layers)
            print(f"# bf16 source, {layers} layers, written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            for fmt in formats:
                t0 = time.perf_counter()
                path = _write(fmt, args.family, layers, root / str(layers), bf16)
                written_s = time.perf_counter() - t0
                on_disk = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir())
                r = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
                if r.returncode:
                    print(r.stderr, file=sys.stderr)
                    return 1
                got = json.loads(r.stdout.strip().splitlines()[-1])
                measured[fmt][layers] = got | {"on_disk": on_disk, "written_s": written_s}
                if fmt != "bf16" and not args.keep:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            if not args.keep:
                shutil.rmtree(bf16)

        def at_full(fmt: str, key: str) -> float:
            a, b = measured[fmt][small][key], measured[fmt][big][key]
            return a + (b - a) / (big - small) * (full - small)

        results = []
        for fmt in formats:
            m = measured[fmt][big]
            row = {"format": fmt, "family": args.family, "hidden": cfg.hidden_size,
                   "intermediate": cfg.intermediate_size, "layers_measured": [small, big],
                   "load_s": [round(measured[fmt][n]["seconds"], 2) for n in (small, big)],
                   "peak_rss_over_start_mb": [round(measured[fmt][n]["peak_over_start"] / 2 ** 20) for n in (small, big)],
                   f"on_disk_mb_{big}_layers": round(m["on_disk"] / 2 ** 20), f"written_s_{big}_layers": round(m["written_s"], 1),
                   f"est_{full}_layers": {"load_s": round(at_full(fmt, "seconds"), 1),
                                          "peak_rss_over_start_gb": round(at_full(fmt, "peak_over_start") / 2 ** 30, 2),
                                          "layer_gb": round(at_full(fmt, "layer_bytes") / 2 ** 30, 2),
                                          "other_gb": round(m["other_bytes"] / 2 ** 30, 2)},
                   "quantized_layers": m["quantized_layers"]}
            results.append(row)
            print(json.dumps(row), flush=True)
        print(json.dumps({"summary": {r["format"]: r[f"est_{full}_layers"] for r in results},
                          "machine": machine()}))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU LoRA kernel (punica_kernels/csrc/add_lora_cpu.c) at a git revision against this tree's,
on one decode step's work: prints one JSON object (figures, never pass/fail).

    python bench/lora_kernel_ab.py [--against HEAD~1] [--rounds 40] [--rank 16] [--stack-rank 16]
                                   [--march native]

A step is SmolLM2-135M's 30 layers x 4 groups (qkv, o, gate_up, down) of int8 stacks, rank-16
adapters (`--rank`: another rank, 1-64), called as the engine's CPU backend calls them
(`cpu_native.StepCall`). The two builds take turns, step by step, so a host that slows down for a
while slows both (on a shared 2-core VM the same step swings 2x within minutes); reported: min and
median ms a step, per build, and whether both gave the same bits. Cases:
- distinct: 32 tokens on 32 slots (weights from memory: 157 MB a step, the many-adapter step);
- two slots: 32 one-token runs alternating between 2 slots (5 MB a layer, from L3);
- one layer: the same, with one layer's stacks for all 30 (in L2: the kernel's compute);
- 8 tokens: 2 tokens on each of 4 slots (a few streams);
- prompt: a 187-token prompt on one slot (the demo's chat prompt prefilled: runs of 8 tokens on
  the same weights, the step's compute).
`--stack-rank` sets the stacks' padded rank R (the engine's max_lora_rank; at least the adapters'
rank). `--march` builds both for another `-march` than this CPU's (e.g. `haswell`: the AVX2 code on
an AVX-512 CPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script, this folder's engine.py would shadow the package

import torch  # noqa: E402

import punica_kernels as pk  # noqa: E402
from bench.common import machine  # noqa: E402
from punica_kernels import cpu_native  # noqa: E402

HIDDEN, Q, KV, INTER, LAYERS, RANK = 576, 576, 192, 1536, 30, 16
GROUPS = {"qkv": (HIDDEN, (Q, KV, KV)), "o": (Q, (HIDDEN,)), "gate_up": (HIDDEN, (INTER, INTER)),
          "down": (INTER, (HIDDEN,))}
SOURCES = ("add_lora_cpu.c", "tessera_simd.h")


def build_at(rev: str, into: Path, march: str = "native"):
    """The kernel library built from `rev`'s sources."""
    for name in SOURCES:
        text = subprocess.run(["git", "show", f"{rev}:punica_kernels/csrc/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (into / name).write_text(text)
    return load(into / SOURCES[0], march)


def load(source: Path, march: str = "native"):
    lib = cpu_native.load_library(march=march, source=source)
    if lib is None:
        raise SystemExit("bench/lora_kernel_ab.py: the kernel could not be built (no C compiler?)")
    return lib


def stacks(num_slots: int, stack_rank: int, gen: torch.Generator, rank: int = RANK) -> list[tuple]:
    """(LoRAStack, in_features, out width) per (layer, group): int8, every slot filled at `rank`."""
    out = []
    for _ in range(LAYERS):
        for k, widths in GROUPS.values():
            a, b, a_rs, b_rs = [], [], [], []
            for n in widths:
                qa, ra = pk.quantize_rows(torch.randn(num_slots, stack_rank, k, generator=gen) * 0.02)
                qb, rb = pk.quantize_rows(torch.randn(num_slots, n, stack_rank, generator=gen) * 0.02)
                packed = torch.zeros_like(qb)
                for s in range(num_slots):
                    pk.int8_b_write(packed, s, qb[s, :, :rank])
                a.append(qa), b.append(packed), a_rs.append(ra), b_rs.append(rb)
            ranks = torch.full((num_slots,), rank, dtype=torch.int32)
            out.append((pk.lora_stack(a, b, torch.ones(num_slots), ranks, None, a_row_scales=a_rs, b_row_scales=b_rs),
                        k, sum(widths)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default="HEAD~1", help="the git revision whose kernel is the peer")
    ap.add_argument("--rounds", type=int, default=40, help="steps per build and case")
    ap.add_argument("--rank", type=int, default=RANK, help="the adapters' rank (1-64)")
    ap.add_argument("--stack-rank", type=int, default=None,
                    help="the stacks' padded rank R (default: the larger of 16 and --rank)")
    ap.add_argument("--march", default="native", help="the -march both builds are compiled for")
    args = ap.parse_args()
    if not 1 <= args.rank <= cpu_native.MAX_RANK:
        ap.error(f"--rank must be in 1..{cpu_native.MAX_RANK}")
    args.stack_rank = args.stack_rank or max(RANK, args.rank)
    if not args.rank <= args.stack_rank <= cpu_native.MAX_RANK:
        ap.error(f"--stack-rank must be in {args.rank}..{cpu_native.MAX_RANK}")
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="tessera-lora-ab-") as tmp:
        libs = {args.against: build_at(args.against, Path(tmp), args.march),
                "tree": load(cpu_native.SOURCE, args.march)}
    many, two = stacks(32, args.stack_rank, gen, args.rank), stacks(2, args.stack_rank, gen, args.rank)
    cases = {"distinct": (list(range(32)), many), "two_slots": ([0, 1] * 16, two),
             "one_layer": ([0, 1] * 16, two[:4] * LAYERS), "8_tokens": ([s for s in range(4) for _ in range(2)], many),
             "prompt": ([3] * 187, many)}
    res = {"against": args.against, "rank": args.rank, "stack_rank": args.stack_rank, "march": args.march,
           "rounds": args.rounds, "cases": {}}
    for name, (slots, step_stacks) in cases.items():
        t = len(slots)
        xs = {k: torch.randn(t, k, generator=gen) for k in (HIDDEN, INTER)}
        ys = {n: torch.zeros(t, n) for _, k, n in step_stacks[:4]}
        calls = {label: cpu_native.StepCall.for_slots(slots, step_stacks[0][0].num_slots, lib=lib)
                 for label, lib in libs.items()}
        ms = {label: [] for label in libs}
        outs = {}
        for _ in range(args.rounds):
            for label, call in calls.items():
                for y in ys.values():
                    y.zero_()
                t0 = time.perf_counter()
                for stack, k, n in step_stacks:
                    call(stack, xs[k], ys[n])
                ms[label].append((time.perf_counter() - t0) * 1e3)
                outs[label] = [y.clone() for y in ys.values()]
        first = next(iter(outs.values()))
        res["cases"][name] = {label: {"min_ms": round(min(v), 3), "median_ms": round(statistics.median(v), 3)}
                              for label, v in ms.items()}
        res["cases"][name]["same_bits"] = all(torch.equal(a, b) for o in outs.values() for a, b in zip(o, first))
    res["machine"] = machine()
    print(json.dumps(res))


if __name__ == "__main__":
    main()

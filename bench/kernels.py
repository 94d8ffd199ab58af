"""Benchmark punica_kernels: prints one JSON object per configuration (figures, never pass/fail).

    python bench/kernels.py            # CPU: the CPU path vs torch gather+bmm and a loop per adapter;
                                       # add_lora also without the C kernel, one decode step's LoRA work,
                                       # (fp32, bf16 and int8 stacks), and one decode step's int8 base weights
                                       # (C kernel vs torch at 1-4 rows; AMX kernel vs bf16 dense at 8-64)
    python bench/kernels.py --cuda     # CUDA: the Triton kernels (default when a GPU is present)
    python bench/kernels.py --device cuda [--quick]   # the same; --quick: hidden 4096, rank 16, fewer batches
    python bench/kernels.py --device cuda --only w4a16 # the W4A16 GEMV (4-bit base weights) alone
    python bench/kernels.py --device cuda --only quant # every quantized checkpoint format's linears
                                       # (W4A16Linear / W8A16Linear) at Llama-3.1-8B shapes, M 1-64

Workloads (Punica's): distinct (every token its own adapter), uniform (ceil(sqrt(n)) adapters),
skewed (Zipf 1.5 over adapters), identical (one adapter).

CUDA: each timing is a CUDA-graph replay of `iters` launches, timed with CUDA events, over
`rotate` copies of the inputs (x, weights, y) so the L2 cache does not hold the previous
iteration's bytes. Reported: microseconds per call, GB/s on the unique bytes moved (x, the
weights of the distinct adapters actually used up to their rank, v, y read + write), the ratio
to a measured device-to-device copy bandwidth, and the speedup over torch gather+bmm and over
a Python loop of one matmul per adapter. BGMV (decode: one token per row, any slot) at Punica's
batch sizes 1-256 over the four workloads; SGMV (prefill: 512 tokens in 1, 4, 16 or 64 segments,
each segment its own adapter) against the same gather+bmm baseline on the segments' tokens.
Then the Triton backend's W4A16 matmul at decode widths (run_cuda_w4a16), and (not with --quick)
the quantized formats' linears (run_quant): for each form a checkpoint's layer weights take
(QUANT_FORMS: GGUF Q4_0/Q4_1, Q4_K, Q8_0, Q6_K, Q5_K, GPTQ act-order, compressed-tensors W8A16 and FP8,
load-time 4-bit), random codes and scales built as a QuantizedWeight and run through the
backend's own module, at Llama-3.1-8B's qkv / o / gate_up / down shapes: microseconds, GB/s of
weight bytes and its ratio to the copy bandwidth, and dense bf16 matmul as the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

# The repository root first: run as a script, this folder's engine.py would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import punica_kernels as pk  # noqa: E402
from punica_kernels import cpu_native  # noqa: E402

WORKLOADS = ("distinct", "uniform", "skewed", "identical")


def make_slots(workload: str, n: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """[n] slot per token for a workload; num_slots must be >= n for distinct."""
    if workload == "distinct":
        return torch.randperm(num_slots, generator=gen)[:n]
    if workload == "uniform":
        k = math.ceil(math.sqrt(n))
        return torch.randperm(num_slots, generator=gen)[:k][torch.randint(0, k, (n,), generator=gen)]
    if workload == "skewed":
        w = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.5
        return torch.multinomial(w, n, replacement=True, generator=gen)
    return torch.zeros(n, dtype=torch.int64)


def baseline_gather_bmm_shrink(x, a, slots, scales):
    """The naive way: copy each token's A ([T, R, K]) and run a batched matvec (padded ranks)."""
    return torch.bmm(a[slots], x.unsqueeze(2)).squeeze(2).float() * scales[slots].unsqueeze(1)


def baseline_gather_bmm_expand(v, b, slots, y):
    y += torch.bmm(b[slots], v.to(b.dtype).unsqueeze(2)).squeeze(2)
    return y


def baseline_loop_shrink(x, a, slots_list, scales_list, ranks_list, out):
    for s in set(slots_list):
        idx = torch.tensor([i for i, t in enumerate(slots_list) if t == s], device=x.device)
        r = ranks_list[s]
        out[idx, :r] = (x.index_select(0, idx) @ a[s, :r].t()).float() * scales_list[s]
    return out


def baseline_loop_expand(v, b, slots_list, ranks_list, y):
    for s in set(slots_list):
        idx = torch.tensor([i for i, t in enumerate(slots_list) if t == s], device=y.device)
        r = ranks_list[s]
        y.index_add_(0, idx, v.index_select(0, idx)[:, :r].to(b.dtype) @ b[s, :, :r].t())
    return y


def unique_bytes(op: str, T: int, K: int, N: int, R: int, slots: torch.Tensor, ranks, elem: int) -> int:
    distinct = torch.unique(slots).tolist()
    w = sum(int(ranks[s]) for s in distinct)
    if op == "shrink":
        return T * K * elem + w * K * elem + T * R * 4
    return T * R * 4 + w * N * elem + 2 * T * N * elem


# ----------------------------------------------------------------------------- CPU


def cpu_time(fn, reps: int) -> float:
    """Best per-call time over 9 trials: on a shared machine the minimum is the least disturbed."""
    fn()
    best = float("inf")
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def run_cpu(args) -> None:
    gen = torch.Generator().manual_seed(0)
    S = 64
    for hidden in (576, 4096):
        for rank in (16,):
            # Rotate over several weight stacks (as a model's layers do), so the caches do not hold
            # the previous call's adapter weights: the CPU path is bound by reading them.
            copies = 16 if hidden == 576 else 2
            a_all = [torch.randn(S, rank, hidden, generator=gen) / hidden ** 0.5 for _ in range(copies)]
            b_all = [torch.randn(S, hidden, rank, generator=gen) / rank ** 0.5 for _ in range(copies)]
            a, b = a_all[0], b_all[0]
            turn = [0]

            def rot(seq):
                turn[0] = (turn[0] + 1) % len(seq)
                return seq[turn[0]]

            ranks = torch.full((S,), rank, dtype=torch.int32)
            scales = torch.ones(S)
            for workload in WORKLOADS:
                T = 32
                slots = make_slots(workload, T, S, gen)
                meta = pk.build_lora_metadata(slots, num_slots=S)
                x = torch.randn(T, hidden, generator=gen)
                y = torch.zeros(T, hidden)
                v = torch.randn(T, rank, generator=gen)
                sl, rl, scl = slots.tolist(), ranks.tolist(), scales.tolist()
                ts = meta.token_slots
                reps = 32 if hidden == 576 else 6
                ours_s = cpu_time(lambda: pk.bgmv_shrink(x, rot(a_all), ts, scales, ranks, meta=meta), reps)
                ours_e = cpu_time(lambda: pk.bgmv_expand(v, rot(b_all), ts, ranks, y, meta=meta), reps)
                fused = cpu_time(lambda: pk.add_lora(y, x, rot(a_all), rot(b_all), scales, ranks, meta=meta), reps)
                with torch_plan_only():
                    fused_torch = cpu_time(lambda: pk.add_lora(y, x, rot(a_all), rot(b_all), scales, ranks, meta=meta), reps)
                bmm_s = cpu_time(lambda: baseline_gather_bmm_shrink(x, rot(a_all), slots, scales), reps)
                bmm_e = cpu_time(lambda: baseline_gather_bmm_expand(v, rot(b_all), slots, y), reps)
                out = torch.zeros(T, rank)
                loop_s = cpu_time(lambda: baseline_loop_shrink(x, rot(a_all), sl, scl, rl, out), reps)
                loop_e = cpu_time(lambda: baseline_loop_expand(v, rot(b_all), sl, rl, y), reps)
                for op, ours, bmm, loop in (("bgmv_shrink", ours_s, bmm_s, loop_s), ("bgmv_expand", ours_e, bmm_e, loop_e),
                                            ("add_lora", fused, bmm_s + bmm_e, loop_s + loop_e)):
                    row = {
                        "device": "cpu", "threads": torch.get_num_threads(), "op": op, "workload": workload,
                        "tokens": T, "distinct_adapters": len(set(sl)), "hidden": hidden, "rank": rank,
                        "dtype": "float32", "weight_copies_rotated": copies, "us": round(ours, 1),
                        "gather_bmm_us": round(bmm, 1), "loop_us": round(loop, 1),
                        "speedup_vs_gather_bmm": round(bmm / ours, 2), "speedup_vs_loop": round(loop / ours, 2),
                    }
                    if op == "add_lora":  # the same call without the C kernel (the torch bmm plan)
                        row["torch_plan_us"] = round(fused_torch, 1)
                    print(json.dumps(row), flush=True)
            # Prefill: 4 sequences of 128 tokens, each with its own adapter (SGMV).
            T = 512
            slots = torch.arange(4).repeat_interleave(128)
            meta = pk.build_lora_metadata(slots, num_slots=S)
            x = torch.randn(T, hidden, generator=gen)
            y = torch.zeros(T, hidden)
            v = torch.randn(T, rank, generator=gen)
            sl, rl, scl = slots.tolist(), ranks.tolist(), scales.tolist()
            reps = 1
            ours_s = cpu_time(lambda: pk.sgmv_shrink(x, a, meta.seg_starts, meta.seg_slots, scales, ranks, meta=meta), reps)
            ours_e = cpu_time(lambda: pk.sgmv_expand(v, b, meta.seg_starts, meta.seg_slots, ranks, y, meta=meta), reps)
            bmm_s = cpu_time(lambda: baseline_gather_bmm_shrink(x, a, slots, scales), reps)
            bmm_e = cpu_time(lambda: baseline_gather_bmm_expand(v, b, slots, y), reps)
            out = torch.zeros(T, rank)
            loop_s = cpu_time(lambda: baseline_loop_shrink(x, a, sl, scl, rl, out), reps)
            loop_e = cpu_time(lambda: baseline_loop_expand(v, b, sl, rl, y), reps)
            for op, ours, bmm, loop in (("sgmv_shrink", ours_s, bmm_s, loop_s), ("sgmv_expand", ours_e, bmm_e, loop_e)):
                print(json.dumps({
                    "device": "cpu", "threads": torch.get_num_threads(), "op": op, "workload": "prefill_4x128",
                    "tokens": T, "distinct_adapters": 4, "hidden": hidden, "rank": rank, "dtype": "float32",
                    "us": round(ours, 1), "gather_bmm_us": round(bmm, 1), "loop_us": round(loop, 1),
                    "speedup_vs_gather_bmm": round(bmm / ours, 2), "speedup_vs_loop": round(loop / ours, 2),
                }), flush=True)
    decode_step_lora()
    decode_step_int8()


def decode_step_int8(layers: int = 30) -> None:
    """The base weights of one SmolLM2 decode step in the int8 format (30 layers x q/k/v, o,
    gate/up, down; 104 MB, each layer its own) at 1, 2 and 4 rows: the engine's C kernel on its
    blocked copy (engine.backends.cpu.int8) against torch's `_weight_int8pack_mm`."""
    from engine.backends.cpu import int8 as cpu_int8

    if cpu_int8.library() is None:
        return
    gen = torch.Generator().manual_seed(2)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * layers
    ws = [torch.randint(-127, 128, s, dtype=torch.int8, generator=gen) for s in shapes]
    blocked = [cpu_int8.block_weight(w) for w in ws]
    scales = [torch.rand(s[0], generator=gen) / 100 for s in shapes]
    scales_bf16 = [s.bfloat16() for s in scales]
    nbytes = sum(w.numel() for w in ws)
    for m in (1, 2, 4):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        xbs = {k: x.bfloat16() for k, x in xs.items()}
        ours = cpu_time(lambda: [cpu_int8.int8_linear(xs[w.shape[1]], b, s) for w, b, s in zip(ws, blocked, scales)], 4)
        theirs = cpu_time(lambda: [torch._weight_int8pack_mm(xbs[w.shape[1]], w, s) for w, s in zip(ws, scales_bf16)], 4)
        print(json.dumps({
            "device": "cpu", "threads": torch.get_num_threads(), "op": "decode_step_int8", "rows": m,
            "weight_mb": round(nbytes / 1e6), "ms": round(ours / 1000, 2), "gb_s": round(nbytes / ours / 1e3, 1),
            "torch_int8pack_ms": round(theirs / 1000, 2), "speedup_vs_torch": round(theirs / ours, 2),
        }), flush=True)
    if cpu_int8.amx_library() is None:
        return
    # Wide decode batches: the AMX kernel on the int8 weights against the path it replaces, oneDNN's
    # GEMM on packed bf16 dense copies of the same weights (activations cast to bf16 and back).
    tiled = [cpu_int8.tile_weight(w) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight((w.float() * s[:, None]).bfloat16(), 32)
              for w, s in zip(ws, scales)]
    for m in (8, 32, 64):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        ours = cpu_time(lambda: [cpu_int8.int8_linear_amx(xs[w.shape[1]], t, s) for w, t, s in zip(ws, tiled, scales)], 4)
        theirs = cpu_time(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]].bfloat16(), p, None, "none", [], "").float()
                                   for w, p in zip(ws, packed)], 4)
        print(json.dumps({
            "device": "cpu", "threads": torch.get_num_threads(), "op": "decode_step_int8_amx", "rows": m,
            "weight_mb": round(nbytes / 1e6), "ms": round(ours / 1000, 2), "gb_s": round(nbytes / ours / 1e3, 1),
            "onednn_bf16_dense_ms": round(theirs / 1000, 2), "speedup_vs_bf16_dense": round(theirs / ours, 2),
        }), flush=True)


@contextlib.contextmanager
def torch_plan_only():
    """The CPU add_lora without the C kernel (punica_kernels.cpu_native), i.e. the torch plan."""
    saved = cpu_native.library
    cpu_native.library = lambda: None
    try:
        yield
    finally:
        cpu_native.library = saved


def decode_step_lora(layers: int = 30, tokens: int = 32, rank: int = 16) -> None:
    """The LoRA work of one SmolLM2 decode step: 30 layers x the engine's four fused groups
    (q/k/v, o, gate/up, down), `tokens` tokens on as many adapters, rank 16, fp32, every layer
    with its own stacks (625 MB in all, read once per step). Against: the torch plan, and a
    plain sum() over the same tensors (what reading them costs at best); then the same adapters
    as bf16 and as int8 stacks (the engine's storage where the kernel is built)."""
    gen = torch.Generator().manual_seed(1)
    S, K = tokens, 576
    groups = [((576, 192, 192), K), ((576,), K), ((1536, 1536), K), ((576,), 1536)]
    stacks = [[([torch.randn(S, rank, k, generator=gen) for _ in ns], [torch.randn(S, n, rank, generator=gen) for n in ns])
               for ns, k in groups] for _ in range(layers)]
    flat = [t for layer in stacks for a, b in layer for t in a + b]
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    ranks, scales = torch.full((S,), rank, dtype=torch.int64), torch.rand(S, generator=gen)
    meta = pk.build_lora_metadata(list(range(tokens)), num_slots=S)
    xs = [torch.randn(tokens, k, generator=gen) for _, k in groups]
    ys = [torch.zeros(tokens, sum(ns)) for ns, _ in groups]

    def step():
        for layer in stacks:
            for (a, b), x, y in zip(layer, xs, ys):
                pk.add_lora(y, x, a, b, scales, ranks, meta=meta)

    ours = cpu_time(step, 8)
    with torch_plan_only():
        plan = cpu_time(step, 8)
    floor = cpu_time(lambda: [t.sum() for t in flat], 8)
    # The engine's storage where the kernel is built: the same adapters as bf16 stacks.
    fp32_stacks = stacks
    stacks = [[([a.bfloat16() for a in aa], [b.bfloat16() for b in bb]) for aa, bb in layer] for layer in fp32_stacks]
    bf16 = cpu_time(step, 8) if cpu_native.library() is not None else None
    # The engine's default storage there: int8 rows with fp32 scales (every slot at the stack's
    # rank; each slot's B in the int8 stacks' rank-pair order, pk.int8_b_write).
    int8 = None
    if cpu_native.library() is not None:
        int8_stacks = []
        for layer in fp32_stacks:
            row = []
            for aa, bb in layer:
                qa, qb = [pk.quantize_rows(a) for a in aa], [pk.quantize_rows(b) for b in bb]
                for q, _ in qb:
                    for s in range(q.shape[0]):
                        pk.int8_b_write(q, s, q[s].clone())
                row.append(pk.lora_stack([q for q, _ in qa], [q for q, _ in qb], scales, ranks,
                                         a_row_scales=[r for _, r in qa], b_row_scales=[r for _, r in qb]))
            int8_stacks.append(row)

        def step_int8():
            for layer in int8_stacks:
                for st, x, y in zip(layer, xs, ys):
                    pk.add_lora(y, x, st, meta=meta)

        int8 = cpu_time(step_int8, 8)
    print(json.dumps({
        "device": "cpu", "threads": torch.get_num_threads(), "op": "decode_step_lora", "layers": layers,
        "tokens": tokens, "distinct_adapters": tokens, "rank": rank, "weight_mb": round(nbytes / 1e6),
        "kernel": "c" if cpu_native.library() is not None else "torch", "ms": round(ours / 1000, 2),
        "torch_plan_ms": round(plan / 1000, 2), "sum_same_tensors_ms": round(floor / 1000, 2),
        "gb_s": round(nbytes / ours / 1e3, 1), "speedup_vs_torch_plan": round(plan / ours, 2),
        "bf16_stacks_ms": None if bf16 is None else round(bf16 / 1000, 2),
        "int8_stacks_ms": None if int8 is None else round(int8 / 1000, 2),
    }), flush=True)


# ----------------------------------------------------------------------------- CUDA


def cuda_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy GB/s (read + write counted), the roofline the kernels are held to."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 20 / (start.elapsed_time(end) / 1e3) / 1e9


def cuda_time(fn_per_buffer, rotate: int, iters: int) -> float:
    """us per call: one CUDA graph replays iters calls cycling over `rotate` input buffers."""
    for i in range(rotate):  # warm up: compile the kernels, fill the pointer-table cache
        fn_per_buffer(i)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(iters):
            fn_per_buffer(i % rotate)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * iters)


def cuda_time_eager(fn_per_buffer, rotate: int, iters: int) -> float:
    """For baselines that sync (the per-adapter loop builds index tensors on the host)."""
    for i in range(rotate):
        fn_per_buffer(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn_per_buffer(i % rotate)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def run_cuda(args) -> float:
    """BGMV at Punica's decode shapes; returns the measured device copy GB/s."""
    dev = "cuda"
    dtype = torch.float16
    elem = 2
    copy_gbps = cuda_copy_bandwidth()
    print(json.dumps({"device": torch.cuda.get_device_name(), "d2d_copy_GBps": round(copy_gbps, 1),
                      "torch": torch.__version__, "triton": _triton_version()}), flush=True)
    gen = torch.Generator().manual_seed(0)
    S = 256
    rotate = args.rotate
    hiddens, ranks_grid = ((4096,), (16,)) if args.quick else ((4096, 11008), (8, 16, 32, 64))
    batches = (1, 8, 32, 64, 256) if args.quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    for hidden in hiddens:
        for rank in ranks_grid:
            # rotate copies of the stacks: each copy is S * R * hidden * 2 bytes, far past L2 together
            a = [torch.randn(S, rank, 4096, device=dev, dtype=dtype) / 64 for _ in range(rotate)]
            b = [torch.randn(S, hidden, rank, device=dev, dtype=dtype) / rank ** 0.5 for _ in range(rotate)]
            ranks = torch.full((S,), rank, dtype=torch.int32, device=dev)
            scales = torch.ones(S, device=dev)
            for workload in WORKLOADS:
                for T in batches:
                    slots_cpu = make_slots(workload, T, S, gen)
                    meta = pk.build_lora_metadata(slots_cpu, num_slots=S, device=dev)
                    ts, sl = meta.token_slots, slots_cpu.tolist()
                    slots_dev = slots_cpu.to(dev)
                    x = [torch.randn(T, 4096, device=dev, dtype=dtype) for _ in range(rotate)]
                    v = [torch.randn(T, rank, device=dev) for _ in range(rotate)]
                    y = [torch.zeros(T, hidden, device=dev, dtype=dtype) for _ in range(rotate)]
                    vout = [torch.zeros(T, rank, device=dev) for _ in range(rotate)]
                    rl, scl = [rank] * S, [1.0] * S
                    cases = {
                        "shrink": (
                            lambda i: pk.bgmv_shrink(x[i], a[i], ts, scales, ranks, out=vout[i]),
                            lambda i: baseline_gather_bmm_shrink(x[i], a[i], slots_dev, scales),
                            lambda i: baseline_loop_shrink(x[i], a[i], sl, scl, rl, vout[i]),
                            4096,
                        ),
                        "expand": (
                            lambda i: pk.bgmv_expand(v[i], b[i], ts, ranks, y[i]),
                            lambda i: baseline_gather_bmm_expand(v[i], b[i], slots_dev, y[i]),
                            lambda i: baseline_loop_expand(v[i], b[i], sl, rl, y[i]),
                            hidden,
                        ),
                    }
                    for op, (ours, bmm, loop, n_out) in cases.items():
                        if op == "shrink" and hidden != 4096:
                            continue  # shrink's input width is the model's hidden size; one is enough
                        us = cuda_time(ours, rotate, args.iters)
                        us_bmm = cuda_time(bmm, rotate, args.iters)
                        us_loop = cuda_time_eager(loop, rotate, max(3, args.iters // 10))
                        nbytes = unique_bytes(op, T, 4096, n_out, rank, slots_cpu, rl, elem)
                        gbps = nbytes / (us * 1e-6) / 1e9
                        print(json.dumps({
                            "device": "cuda", "op": f"bgmv_{op}", "workload": workload, "batch": T,
                            "distinct_adapters": len(meta.distinct_slots_list), "hidden": n_out, "rank": rank,
                            "dtype": "float16", "us": round(us, 2), "GBps": round(gbps, 1),
                            "frac_of_copy_bw": round(gbps / copy_gbps, 3),
                            "speedup_vs_gather_bmm": round(us_bmm / us, 2), "speedup_vs_loop": round(us_loop / us, 2),
                        }), flush=True)
    return copy_gbps


def run_cuda_sgmv(args, copy_gbps: float) -> None:
    """SGMV at prefill shapes: 512 tokens in `n_seg` equal segments, each its own adapter (slot),
    hidden 4096 (rank 16 with --quick, else 8-64), shrink and expand, against gather+bmm over the
    same tokens (which copies each token's adapter matrix) and a loop of one matmul per segment."""
    dev, dtype, elem, S, T = "cuda", torch.float16, 2, 256, 512
    gen = torch.Generator().manual_seed(3)
    rotate = args.rotate
    for rank in ((16,) if args.quick else (8, 16, 32, 64)):
        a = [torch.randn(S, rank, 4096, device=dev, dtype=dtype) / 64 for _ in range(rotate)]
        b = [torch.randn(S, 4096, rank, device=dev, dtype=dtype) / rank ** 0.5 for _ in range(rotate)]
        ranks = torch.full((S,), rank, dtype=torch.int32, device=dev)
        scales = torch.ones(S, device=dev)
        for n_seg in (1, 4, 16, 64):
            seg_slots_cpu = torch.randperm(S, generator=gen)[:n_seg]
            slots_cpu = seg_slots_cpu.repeat_interleave(T // n_seg)
            meta = pk.build_lora_metadata(slots_cpu, num_slots=S, device=dev)
            slots_dev, sl, rl, scl = slots_cpu.to(dev), slots_cpu.tolist(), [rank] * S, [1.0] * S
            x = [torch.randn(T, 4096, device=dev, dtype=dtype) for _ in range(rotate)]
            v = [torch.randn(T, rank, device=dev) for _ in range(rotate)]
            y = [torch.zeros(T, 4096, device=dev, dtype=dtype) for _ in range(rotate)]
            vout = [torch.zeros(T, rank, device=dev) for _ in range(rotate)]
            seg = (meta.seg_starts, meta.seg_slots)
            cases = {
                "shrink": (lambda i: pk.sgmv_shrink(x[i], a[i], *seg, scales, ranks,
                                                    max_segment_len=meta.max_segment_len, out=vout[i]),
                           lambda i: baseline_gather_bmm_shrink(x[i], a[i], slots_dev, scales),
                           lambda i: baseline_loop_shrink(x[i], a[i], sl, scl, rl, vout[i])),
                "expand": (lambda i: pk.sgmv_expand(v[i], b[i], *seg, ranks, y[i],
                                                    max_segment_len=meta.max_segment_len),
                           lambda i: baseline_gather_bmm_expand(v[i], b[i], slots_dev, y[i]),
                           lambda i: baseline_loop_expand(v[i], b[i], sl, rl, y[i])),
            }
            for op, (ours, bmm, loop) in cases.items():
                us = cuda_time(ours, rotate, args.iters)
                us_bmm = cuda_time(bmm, rotate, args.iters)
                us_loop = cuda_time_eager(loop, rotate, max(3, args.iters // 10))
                gbps = unique_bytes(op, T, 4096, 4096, rank, slots_cpu, rl, elem) / (us * 1e-6) / 1e9
                print(json.dumps({
                    "device": "cuda", "op": f"sgmv_{op}", "workload": f"prefill_{n_seg}x{T // n_seg}", "tokens": T,
                    "distinct_adapters": n_seg, "hidden": 4096, "rank": rank, "dtype": "float16",
                    "us": round(us, 2), "GBps": round(gbps, 1), "frac_of_copy_bw": round(gbps / copy_gbps, 3),
                    "gather_bmm_us": round(us_bmm, 2), "loop_us": round(us_loop, 2),
                    "speedup_vs_gather_bmm": round(us_bmm / us, 2), "speedup_vs_loop": round(us_loop / us, 2),
                }), flush=True)


def run_cuda_w4a16(args, copy_gbps: float) -> None:
    """The Triton backend's W4A16 matmul (engine/backends/triton/w4a16.py) at decode widths: M 1..16
    rows of bf16 activations, K 4096, N 4096 and 14336, for GGUF-block weights (group 32) and
    load-time quantized ones (group 128). Reported per shape: microseconds (a CUDA-graph replay over
    enough weight copies that L2 does not hold the call's weights, rotation_copies), GB/s on the bytes the
    kernel must read (4-bit nibbles, fp16 scales and mins, x, y written) and its ratio to the
    device-to-device copy bandwidth, the path and config taken, torch's dense bf16 matmul of the
    same (dequantized) weights for comparison, and the largest error of each against the fp32
    product of the dequantized weights, relative to that product's largest element."""
    from engine.backends.triton import w4a16

    dev = "cuda"
    gen = torch.Generator().manual_seed(4)
    rows = (1, 4, 16) if args.quick else (1, 2, 3, 4, 8, 12, 16)
    K = 4096
    for N in (4096, 14336):
        dense = torch.randn(N, K, generator=gen) * 0.02
        for fmt in ("g32", "g128"):
            base = w4a16.quantize(dense, 32 if fmt == "g32" else 128)
            copies = rotation_copies(base.nbytes(), args.rotate)
            dense_copies = rotation_copies(N * K * 2, args.rotate)
            ws = [base.to(dev) for _ in range(copies)]  # the same weights, in distinct memory
            w_ref = w4a16.dequantize(ws[0])  # fp32 [N, K] on the device
            w_bf16 = [w_ref.bfloat16() for _ in range(dense_copies)]
            for M in rows:
                x = [torch.randn(M, K, device=dev).bfloat16() for _ in range(copies)]
                us = cuda_time(lambda i: w4a16.w4a16_matmul(x[i], ws[i]), copies, max(args.iters, copies))
                us_dense = cuda_time(lambda i: x[i] @ w_bf16[i].T, dense_copies, max(args.iters, dense_copies))
                ref = x[0].float() @ w_ref.T
                scale = ref.abs().max().item()
                err = (w4a16.w4a16_matmul(x[0], ws[0]).float() - ref).abs().max().item() / scale
                err_dense = ((x[0] @ w_bf16[0].T).float() - ref).abs().max().item() / scale
                nbytes = base.nbytes() + M * K * 2 + M * N * 2
                gbps = nbytes / (us * 1e-6) / 1e9
                plan = w4a16.launch_plan(M, N, K, x[0].device)
                print(json.dumps({
                    "device": "cuda", "op": "w4a16_matmul", "format": fmt, "M": M, "N": N, "K": K,
                    "dtype": "bfloat16", "launch": plan.__dict__, "us": round(us, 2),
                    "weight_MB": round(base.nbytes() / 1e6, 2), "GBps": round(gbps, 1),
                    "frac_of_copy_bw": round(gbps / copy_gbps, 3), "dense_bf16_us": round(us_dense, 2),
                    "speedup_vs_dense_bf16": round(us_dense / us, 2), "rel_err": float(f"{err:.3g}"),
                    "dense_bf16_rel_err": float(f"{err_dense:.3g}"),
                }), flush=True)


# ----------------------------------------------------------------------------- quantized formats


#: Bytes one rotation of weight copies spans: a call's weights were last read this many bytes of
#: other weights ago, several times an H100's or H200's 50 MB L2, so no call finds them there.
ROTATE_BYTES = 256 << 20
#: Most weight copies one rotation holds (a small weight would otherwise need hundreds).
ROTATE_MAX_COPIES = 64


def rotation_copies(nbytes: int, least: int, most: int = ROTATE_MAX_COPIES) -> int:
    """Copies of an `nbytes` weight to cycle over so together they span ROTATE_BYTES: at least
    `least` (the --rotate given), at most `most`."""
    return max(least, min(most, -(-ROTATE_BYTES // max(1, nbytes))))


@dataclasses.dataclass(frozen=True)
class QuantForm:
    """The QuantizedWeight one kind of checkpoint loads into (engine/loader/gguf_quants.py,
    hf_quantized.py and w4a16.quantize are what produce each): what the kernels read for it."""

    name: str  # the rows' "format"
    checkpoints: str  # the checkpoints whose layer weights take this form
    bits: int  # 4: W4A16Linear; 8: W8A16Linear
    group_size: int | None  # inputs per scale; None: per output channel (one group of all K)
    scale_dtype: torch.dtype  # scales' (and mins') dtype
    mins: bool  # whether the form has per-group mins (asymmetric formats)
    act_order: bool = False  # an input permutation (GPTQ desc_act): one gather of x a call
    code_format: str = "int"  # "e4m3": FP8 codes (compressed-tensors float-quantized)
    super_size: int = 0  # > 0: two levels, integer scales and mins (scale_dtype) x fp16 factors per super_size inputs


QUANT_FORMS = (
    QuantForm("w4_fp16_g32", "gguf q4_0 / q4_1", 4, 32, torch.float16, True),
    QuantForm("w4_fp16_g128", "dense checkpoint quantized at load", 4, 128, torch.float16, True),
    QuantForm("w4_kquant_g32", "gguf q4_k", 4, 32, torch.uint8, True, super_size=256),
    QuantForm("w4_fp32_g128_perm", "gptq 4-bit g128 act-order", 4, 128, torch.float32, True, act_order=True),
    QuantForm("w8_fp16_g32", "gguf q8_0", 8, 32, torch.float16, False),
    QuantForm("w8_kquant_g16", "gguf q6_k / q3_k", 8, 16, torch.int8, False, super_size=256),
    QuantForm("w8_kquant_g32_mins", "gguf q5_k", 8, 32, torch.uint8, True, super_size=256),
    QuantForm("w8_fp32_channel", "compressed-tensors w8a16 channel (bf16 scales)", 8, None, torch.float32, False),
    QuantForm("fp8_fp32_channel", "compressed-tensors fp8 e4m3 channel", 8, None, torch.float32, False,
              code_format="e4m3"),
    QuantForm("fp8_fp32_block128", "compressed-tensors fp8 e4m3 128x128 blocks", 8, 128, torch.float32, False,
              code_format="e4m3"),
)

#: Llama-3.1-8B's decode linears as the decoder fuses them: (site, N outputs, K inputs).
LLAMA31_8B_LINEARS = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
                      ("down_proj", 4096, 14336))
LLAMA31_8B_LAYERS = 32
#: --tiny: the same four sites at widths the interpreter runs in seconds (K 160: a last group of
#: 32 inputs at g128, and per-channel groups of two widths, as at the real shape).
TINY_LINEARS = (("qkv_proj", 96, 64), ("o_proj", 64, 64), ("gate_up_proj", 320, 64), ("down_proj", 64, 160))
#: Activation rows: the GEMV path (one row: w4a16.GEMV_MAX_M, w8a16.GEMV_MAX_M) and the GEMM.
QUANT_ROWS = (1, 4, 16, 64)
TINY_ROWS = (1, 64)


def random_quantized(form: QuantForm, n: int, k: int, device: torch.device, gen: torch.Generator):
    """A QuantizedWeight of `form`, N x K, with uniformly random codes and scales on `device`
    (no checkpoint needed: the kernels' time does not depend on the values). Scales are set so
    the weights have standard deviation ~1/sqrt(K) and mean ~0, as a trained layer's, so y stays
    O(|x|) and the error figure is relative to a typical output."""
    from engine.loader.quantized import QuantizedWeight

    g = k if form.group_size is None else form.group_size
    groups = -(-k // g)
    if form.bits == 4:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        code_mean, code_std = 7.5, math.sqrt((16 ** 2 - 1) / 12)
    elif form.code_format == "e4m3":  # finite FP8 numbers of magnitude 2^-3 .. 2^3 (bytes 0x30..0x57)
        mag = torch.randint(0x30, 0x58, (n, k), dtype=torch.int32, device=device, generator=gen)
        sign = torch.randint(0, 2, (n, k), dtype=torch.int32, device=device, generator=gen) << 7
        codes = (mag | sign).to(torch.uint8).view(torch.int8)
        code_mean, code_std = 0.0, 2.0
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device, generator=gen)
        code_mean, code_std = -0.5, math.sqrt((256 ** 2 - 1) / 12)
    # One permutation per K (drawn on the host: a checkpoint's g_idx order is read at load).
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)).to(device) if form.act_order else None
    if form.super_size:
        # Two levels (a K-quant): 6-bit sub-block values around 36 times fp16 factors, scale and
        # min per group as the one-level forms' below.
        supers = -(-k // form.super_size)
        factor = (torch.rand(n, supers, device=device, generator=gen) + 0.5) / (36 * code_std * math.sqrt(k))
        sub = lambda: torch.randint(24, 49, (n, groups), device=device, generator=gen).to(form.scale_dtype)
        mins = sub() if form.mins else None
        return QuantizedWeight(form.bits, codes, sub(), mins, g, perm, form.checkpoints, form.code_format,
                               super_scales=factor.half(),
                               super_mins=(-code_mean * factor).half() if form.mins else None,
                               super_size=form.super_size)
    scales = (torch.rand(n, groups, device=device, generator=gen) + 0.5) / (code_std * math.sqrt(k))
    mins = (-code_mean * scales).to(form.scale_dtype) if form.mins else None
    return QuantizedWeight(form.bits, codes, scales.to(form.scale_dtype), mins, g, perm, form.checkpoints,
                           form.code_format)


def quantized_linear(qw, device: torch.device) -> torch.nn.Module:
    """The Triton backend's module for a checkpoint's QuantizedWeight, chosen as
    TritonBackend._quantized_linear chooses it (by bit width), with bf16 activations."""
    from engine.backends.triton import w4a16, w8a16

    if qw.bits == 4:
        return w4a16.W4A16Linear(qw, device=device, dtype=torch.bfloat16)
    return w8a16.W8A16Linear(qw, device=device, dtype=torch.bfloat16)


def kernel_weight(lin: torch.nn.Module):
    """The weight a quantized linear's kernel reads (W4Weight or QuantizedWeight), whose nbytes()
    are the bytes each call must read."""
    return lin.weight4 if hasattr(lin, "weight4") else lin.weight8


def launch_of(lin: torch.nn.Module, m: int, device: torch.device):
    """The LaunchPlan a call of `lin` on m rows takes."""
    from engine.backends.triton import w4a16, w8a16

    if hasattr(lin, "weight4"):
        return w4a16.launch_plan(m, lin.out_features, lin.in_features, device)
    return w8a16.plan(m, lin.out_features, lin.in_features, device)


def time_per_call(fn_per_buffer, copies: int, iters: int, device: torch.device) -> float:
    """us per call: on CUDA cuda_time (a graph replay cycling over the copies); on CPU (the
    interpreter, --tiny: nothing to compile or warm) `iters` calls timed, a figure that only
    shows the code ran."""
    if device.type == "cuda":
        return cuda_time(fn_per_buffer, copies, iters)
    t0 = time.perf_counter()
    for i in range(iters):
        fn_per_buffer(i % copies)
    return (time.perf_counter() - t0) * 1e6 / iters


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy GB/s (read + write counted): cuda_copy_bandwidth on CUDA, a 16 MB
    host copy on CPU."""
    if device.type == "cuda":
        return cuda_copy_bandwidth()
    src = torch.empty(1 << 24, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * src.numel() * 5 / (time.perf_counter() - t0) / 1e9


def run_quant(args, device: torch.device, copy_gbps: float) -> None:
    """The Triton backend's quantized linears (W4A16Linear, W8A16Linear) for every QuantForm at
    Llama-3.1-8B's decode shapes (--tiny: TINY_LINEARS, on CPU under the interpreter), M = 1, 4,
    16 (GEMV) and 64 (GEMM) rows of bf16 activations. One JSON line per (format, site, M):
    microseconds per call (each a replay over enough weight copies that L2 never holds the
    call's weights, rotation_copies), the bytes its kernel reads for the weight (codes, scales,
    mins), those bytes per second and their ratio to the device copy bandwidth, the launch taken,
    torch's dense bf16 matmul at the same shape (weights 2 bytes each) as the peer, and the
    largest error against the fp32 product with QuantizedWeight.dequantize(), relative to that
    product's largest element. Then one line per (format, M) for the four linears of a decoder
    layer together, with the 32 layers' linears per decode step."""
    sites = TINY_LINEARS if args.tiny else LLAMA31_8B_LINEARS
    # --tiny: one GEMV and one GEMM width, one copy, each call timed once (the interpreter's
    # figures mean nothing; the point is that every form's rows come out).
    rows = TINY_ROWS if args.tiny else QUANT_ROWS
    least, most = (1, 1) if args.tiny else (args.rotate, ROTATE_MAX_COPIES)
    where = "interpreter" if device.type == "cpu" else "cuda"
    gen = torch.Generator(device=device).manual_seed(5)
    layer = {}  # (format, M) -> [us, weight bytes, dense us] summed over the sites
    for site, n, k in sites:
        copies = rotation_copies(n * k * 2, least, most)
        iters = copies if args.tiny else max(args.iters, copies)
        xs = {m: [torch.randn(m, k, device=device, generator=gen).bfloat16() for _ in range(copies)]
              for m in rows}
        dense = [(torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).bfloat16() for _ in range(copies)]
        dense_us = {m: time_per_call(lambda i, x=xs[m], w=dense: x[i] @ w[i].T, copies, iters, device) for m in rows}
        del dense
        for form in QUANT_FORMS:
            first = random_quantized(form, n, k, device, gen)
            probe = quantized_linear(first, device)
            nbytes = kernel_weight(probe).nbytes()
            copies_q = rotation_copies(nbytes, least, most)
            qws = [random_quantized(form, n, k, device, gen) for _ in range(copies_q - 1)]
            lins = [probe] + [quantized_linear(qw, device) for qw in qws]
            del qws
            ref_w = first.dequantize()  # fp32 [N, K], original input order: the format's reference
            iters_q = copies_q if args.tiny else max(args.iters, copies_q)
            for m in rows:
                x = [xs[m][i % copies] for i in range(copies_q)]
                us = time_per_call(lambda i, x=x, lins=lins: lins[i](x[i]), copies_q, iters_q, device)
                ref = x[0].float() @ ref_w.T
                err = (lins[0](x[0]).float() - ref).abs().max().item() / ref.abs().max().item()
                gbps = nbytes / (us * 1e-6) / 1e9
                row = {
                    "device": where, "op": "quant_linear", "format": form.name, "checkpoints": form.checkpoints,
                    "site": site, "M": m, "N": n, "K": k, "bits": form.bits, "group_size": probe.group_size,
                    "scales": str(probe.scales.dtype).removeprefix("torch."), "mins": form.mins,
                    "act_order": form.act_order, "codes": form.code_format, "activations": "bfloat16",
                    "launch": dataclasses.asdict(launch_of(probe, m, device)), "rotated_copies": copies_q,
                    "us": round(us, 2), "weight_bytes": nbytes, "weight_GBps": round(gbps, 1),
                    "frac_of_copy_bw": round(gbps / copy_gbps, 3), "dense_bf16_us": round(dense_us[m], 2),
                    "dense_bf16_bytes": n * k * 2, "speedup_vs_dense_bf16": round(dense_us[m] / us, 2),
                    "rel_err": float(f"{err:.3g}"),
                }
                print(json.dumps(row), flush=True)
                acc = layer.setdefault((form.name, m), [0.0, 0, 0.0])
                acc[0] += us
                acc[1] += nbytes
                acc[2] += dense_us[m]
            del lins, probe, first, ref_w
    for (name, m), (us, nbytes, dense_us) in layer.items():
        gbps = nbytes / (us * 1e-6) / 1e9
        print(json.dumps({
            "device": where, "op": "quant_layer_linears", "format": name, "M": m,
            "sites": [s for s, _, _ in sites], "us": round(us, 2), "weight_bytes": nbytes,
            "weight_GBps": round(gbps, 1), "frac_of_copy_bw": round(gbps / copy_gbps, 3),
            "dense_bf16_us": round(dense_us, 2), "speedup_vs_dense_bf16": round(dense_us / us, 2),
            "layers": LLAMA31_8B_LAYERS, "step_linears_ms": round(us * LLAMA31_8B_LAYERS / 1e3, 3),
        }), flush=True)


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true", default=None, help="run the CUDA benchmark (default: if available)")
    p.add_argument("--cpu", action="store_true", help="run the CPU benchmark even when a GPU is present")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cpu: the same as --cpu; cuda: the same as --cuda")
    p.add_argument("--quick", action="store_true",
                   help="CUDA: hidden 4096, rank 16, batches 1/8/32/64/256 only (minutes, not tens of minutes)")
    p.add_argument("--rotate", type=int, default=4, help="input buffer copies cycled to defeat L2")
    p.add_argument("--iters", type=int, default=50, help="calls per CUDA graph")
    p.add_argument("--only", choices=("lora", "w4a16", "quant"), default=None,
                   help="CUDA: only the LoRA kernels (BGMV, SGMV), only the W4A16 matmul, or only the "
                        "quantized formats' linears at Llama-3.1-8B shapes (W4A16Linear / W8A16Linear)")
    # The quantized formats' section at tiny shapes on CPU tensors under the Triton interpreter
    # (TRITON_INTERPRET=1): a check that it runs (tests/engine/test_bench_quant_kernels.py), no figures.
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tiny:
        from engine.backends.triton import w4a16

        if args.only != "quant":
            p.error("--tiny runs only the quantized formats' section: add --only quant")
        if not w4a16.INTERPRETED:
            p.error("--tiny runs the kernels on CPU tensors under the Triton interpreter: set TRITON_INTERPRET=1")
        device = torch.device("cpu")
        copy_gbps = copy_bandwidth(device)
        print(json.dumps({"device": "interpreter", "host_copy_GBps": round(copy_gbps, 1),
                          "torch": torch.__version__, "triton": _triton_version()}), flush=True)
        run_quant(args, device, copy_gbps)
        return
    if args.device == "cpu":
        args.cpu = True
    elif args.device == "cuda":
        args.cuda = True
    use_cuda = torch.cuda.is_available() if args.cuda is None else args.cuda
    if args.cpu or not use_cuda:
        run_cpu(args)
    if use_cuda and not args.cpu:
        if args.only in ("w4a16", "quant"):
            copy_gbps = cuda_copy_bandwidth()
            print(json.dumps({"device": torch.cuda.get_device_name(), "d2d_copy_GBps": round(copy_gbps, 1),
                              "torch": torch.__version__, "triton": _triton_version()}), flush=True)
        else:
            copy_gbps = run_cuda(args)
            run_cuda_sgmv(args, copy_gbps)
        if args.only in (None, "w4a16"):
            run_cuda_w4a16(args, copy_gbps)
        # The quantized formats' section: with --only quant, or in the full (not --quick) run.
        if args.only == "quant" or (args.only is None and not args.quick):
            run_quant(args, torch.device("cuda"), copy_gbps)


if __name__ == "__main__":
    main()

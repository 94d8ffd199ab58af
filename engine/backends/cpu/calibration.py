"""Measurements behind the CPU backend's format rules (engine.backends.cpu.formats): which dense
dtype serves wide decode batches fastest, up to how many rows the int8 and Q4_1 kernels win, and
how much faster the fast copy's prefill GEMMs are than fp32's. The engine never runs them (a
timing varies with the machine's load, and the choice changes numerics); run

    python -m engine.backends.cpu.calibration

to measure them on this machine's embedded SmolLM2 beside what the rules choose, when checking or
adding a rule for a CPU kind. Each function measures on the layers as loaded (PendingInt8Linear,
before CpuBackend.prepare_model composes them) and returns what it found."""
from __future__ import annotations

import time

import torch
from torch import nn

from engine.backends.cpu.linear import (AmxInt8Linear, DenseLinear, Int8KernelLinear, Int8Parts, Int8TorchLinear,
                                        PendingInt8Linear, Q4Linear)


def _min_time(fns: list, reps: int) -> list[float]:
    """Best-of-`reps` seconds of each function, run interleaved (after one warm-up call each).
    The minimum, not a mean: other work on a shared 2-core machine only ever adds time, and a
    burst of it (seconds long) can cover several consecutive runs of one candidate; interleaving
    gives every candidate runs on both sides of such a burst."""
    for f in fns:
        f()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def choose_dense_dtype(layers: list[PendingInt8Linear], rows: int = 64, reps: int = 7, max_layers: int = 12,
                       candidates=(torch.float32, torch.bfloat16)) -> tuple[torch.dtype, dict[str, float]]:
    """Measure a dense GEMM of `rows` rows over (up to `max_layers` of) these int8 layers' weights
    in each candidate dtype (fp32 activations cast to it and back, as DenseLinear does) and return
    (the fastest, {dtype name: ms}): the dense copy decode-only wide batches would take.

    bf16 is several times faster than fp32 where the CPU has AMX or is an AMD core with
    avx512_bf16, slower on an Intel core with avx512_bf16 but no AMX, and several times slower
    where it has only AVX2. A wide batch is compute bound, so a sample of the layers is enough
    (the int8 crossover streams all of them)."""
    if not layers:
        return torch.float32, {}
    sample = layers[:max_layers]
    with torch.inference_mode():
        xs = {k: torch.randn(rows, k) for k in {layer.in_features for layer in sample}}
        copies = {dt: [DenseLinear(layer.dense, dt) for layer in sample] for dt in candidates}

        def run(dt):
            def f():
                for lin in copies[dt]:
                    lin(xs[lin.in_features])
            return f

        best = _min_time([run(dt) for dt in candidates], reps)
    times = {str(dt).removeprefix("torch."): round(t * 1000, 3) for dt, t in zip(candidates, best)}
    return candidates[min(range(len(candidates)), key=best.__getitem__)], times


#: The prefill rule (formats): steps that prefill are worth taking the decode path (the AMX kernel,
#: else the fast dense copy) instead of the fp32 copy only where the fast copy's GEMMs are at least
#: this many times fp32's at prefill width (measured only with AMX).
#: bf16 prefill rounds the activations, which can flip a first token that is a near-tie in fp32;
#: that is worth it only where bf16 GEMMs are far faster (AMX), and not where they are merely
#: faster (avx512_bf16 alone), where a test prompt's near-tie did flip (bench/RESULTS.md).
FAST_PREFILL_MIN_SPEEDUP = 4.0


def measure_prefill_speedup(layers: list[PendingInt8Linear], fast: torch.dtype, *, pack: bool = True,
                            rows: int = 512, reps: int = 5, max_layers: int = 8) -> float:
    """fp32 time / `fast` time of the dense GEMMs alone (activations already in each copy's dtype)
    at `rows` rows over (up to `max_layers` of) the largest of these int8 layers (most of a
    prefill's FLOPs), oneDNN-packed where `pack`. 1.0 where `fast` is fp32."""
    if fast == torch.float32 or not layers:
        return 1.0
    sample = sorted(layers, key=lambda layer: -layer.dense.numel())[:max_layers]
    with torch.inference_mode():
        def run(dt):
            lins = [DenseLinear(layer.dense, dt, pack=pack) for layer in sample]
            xs = [torch.randn(rows, lin.in_features).to(dt) for lin in lins]

            def f():
                for lin, x in zip(lins, xs):
                    lin(x)
            return f

        t_exact, t_fast = _min_time([run(torch.float32), run(fast)], reps)
    return t_exact / t_fast


def _largest_winning_rows(pairs: list[tuple[nn.Module, nn.Module]], candidates, reps: int) -> int:
    """The largest row count among `candidates` (ascending; stops at the first loss) for which
    the first module of every pair, over all the pairs, takes no longer than the second, each
    timed over all the pairs in turn (weights from memory, as in a real step), interleaved after
    a warm-up, best of `reps`. 0 if the first loses at the first candidate."""
    best = 0
    with torch.inference_mode():
        for m in candidates:
            xs = {k: torch.randn(m, k) for k in {ours.in_features for ours, _ in pairs}}

            def run(side):
                def f():
                    for pair in pairs:
                        pair[side](xs[pair[side].in_features])
                return f

            t_ours, t_theirs = _min_time([run(0), run(1)], reps)
            if t_ours > t_theirs:
                break
            best = m
    return best


def calibrate_q4_rows(layers: list[PendingInt8Linear], parts: Int8Parts, candidates=(1, 2, 4), reps: int = 5) -> int:
    """The largest batch (rows) for which the Q4_1 kernel, on the layers that keep Q4_1 blocks
    and can take it (`parts`), is at least as fast as the int8 kernel (0: never, or nothing to
    measure). Q4_1 reads 0.625 bytes a weight against int8's 1 but does more work per weight:
    whether it wins at one row depends on the CPU's vector units (bench/RESULTS.md), and past a
    few rows the int8 kernel (which shares each widened weight between rows) wins on all."""
    q4 = [layer for layer in layers if parts.q4(layer)]
    if not q4:
        return 0
    return _largest_winning_rows([(Q4Linear(layer.q4_1), Int8KernelLinear(layer.q, layer.scales)) for layer in q4],
                                 candidates, reps)


def calibrate_int8_rows(layers: list[PendingInt8Linear], parts: Int8Parts, dense: torch.dtype,
                        candidates=(1, 2, 4, 8, 12, 16, 24, 32), reps: int = 5) -> int:
    """The largest batch (rows) for which the int8 kernel (the C one where it takes the layer,
    else torch's) beats the decode-time wide path (the AMX kernel where it takes the layer, else
    the `dense` copy, packed as `parts` says) on these layers' own weights (0: the wide path is
    faster even for one row)."""
    if not layers:
        return 0
    pairs = [((Int8KernelLinear if parts.int8(layer) else Int8TorchLinear)(layer.q, layer.scales),
              AmxInt8Linear(layer.q, layer.scales) if parts.amx(layer)
              else DenseLinear(layer.dense, dense, pack=parts.onednn)) for layer in layers]
    return _largest_winning_rows(pairs, candidates, reps)


def main() -> None:
    """Print one JSON object: the rules' choice for this CPU and the measured winners, on the
    embedded SmolLM2's layers as the engine loads them."""
    import json

    from engine.backends.cpu import CpuBackend, formats
    from engine.config import EngineConfig
    from engine.loader import default_model_path, load_gguf
    from engine.model.decoder import DecoderModel

    cfg, weights, _ = load_gguf(default_model_path())
    backend = CpuBackend(EngineConfig(weight_format="int8"))
    model = DecoderModel(cfg, weights, backend=backend)
    parts = backend.int8_parts()
    layers = [m for m in model.layers.modules() if isinstance(m, PendingInt8Linear)]
    head = model.lm_head
    rows = (1, 2, 4, 6, 8, 12, 16, 24, 32)
    dense, dense_ms = choose_dense_dtype(layers, reps=15)
    measured = {"dense": str(dense).removeprefix("torch."), "dense_ms": dense_ms,
                "q4_1_max_rows": calibrate_q4_rows(layers, parts, reps=15),
                "int8_max_rows": calibrate_int8_rows(layers, parts, dense, candidates=rows, reps=15),
                "lm_head_int8_max_rows": calibrate_int8_rows([head], parts, dense, candidates=rows, reps=15),
                "prefill_fast_speedup": round(measure_prefill_speedup(layers, dense, pack=parts.onednn, reps=9), 2)}
    chosen = backend.prepare_model(model)
    print(json.dumps({"cpu": formats.detect_cpu().describe(), "rules": chosen, "measured": measured}))


if __name__ == "__main__":
    main()

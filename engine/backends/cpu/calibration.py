"""Measurements behind the CPU backend's format rules (engine.backends.cpu.formats): which dense
dtype serves wide decode batches fastest, up to how many rows the int8 and Q4_1 kernels win, and
how much faster the fast copy's prefill GEMMs are than fp32's. The engine never runs them (a
timing varies with the machine's load, and the choice changes numerics); run

    python -m engine.backends.cpu.calibration

to measure them on this machine's embedded SmolLM2 beside what the rules choose, when checking or
adding a rule for a CPU kind. Each function sets what it measured on the layers it was given."""
from __future__ import annotations

import time

import torch

from engine.backends.cpu import int8 as cpu_int8
from engine.backends.cpu import q4 as cpu_q4
from engine.backends.cpu.linear import CpuLinear


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


def choose_dense_dtype(layers: list[CpuLinear], rows: int = 64, reps: int = 7, max_layers: int = 12,
                       candidates=(torch.float32, torch.bfloat16)) -> tuple[torch.dtype, dict[str, float]]:
    """Measure a dense GEMM of `rows` rows over (up to `max_layers` of) these int8 layers' weights
    in each candidate dtype (fp32 activations cast to it and back, as forward does), make the
    fastest every layer's `dense_fast` dtype (decode-only wide batches), and return
    (dtype, {dtype name: ms}).

    bf16 is several times faster than fp32 where the CPU has avx512_bf16 and several times slower
    where it has only AVX2, so the choice is timed on this CPU, never assumed. A wide batch is compute bound, so a sample of the
    layers is enough (the int8 crossover, measured after this, streams all of them)."""
    if not layers:
        return torch.float32, {}
    sample = layers[:max_layers]
    times: dict[str, float] = {}
    with torch.inference_mode():
        xs = {k: torch.randn(rows, k) for k in {layer.in_features for layer in sample}}
        copies = {dt: [layer.dense if dt == torch.float32 else layer.dense.to(dt) for layer in sample]
                  for dt in candidates}

        def run(dt):
            def f():
                for layer, w in zip(sample, copies[dt]):
                    torch.nn.functional.linear(xs[layer.in_features].to(dt), w).float()
            return f

        best = _min_time([run(dt) for dt in candidates], reps)
    for dt, t in zip(candidates, best):
        times[str(dt).removeprefix("torch.")] = round(t * 1000, 3)
    choice = candidates[min(range(len(candidates)), key=best.__getitem__)]
    for layer in layers:
        layer.set_fast_dtype(choice)
    return choice, times


#: The prefill rule (formats): steps that prefill are worth taking the decode path (the AMX kernel,
#: else the fast dense copy) instead of the fp32 copy only where the fast copy's GEMMs are at least
#: this many times fp32's at prefill width (measured only with AMX).
#: bf16 prefill rounds the activations, which can flip a first token that is a near-tie in fp32;
#: that is worth it only where bf16 GEMMs are far faster (AMX), and not where they are merely
#: faster (avx512_bf16 alone), where a test prompt's near-tie did flip (bench/RESULTS.md).
FAST_PREFILL_MIN_SPEEDUP = 4.0


def measure_prefill_speedup(layers: list[CpuLinear], rows: int = 512, reps: int = 5, max_layers: int = 8) -> float:
    """fp32 time / fast-copy time of the GEMMs alone (activations already in each copy's dtype) at
    `rows` rows over (up to `max_layers` of) the largest of these int8 layers (most of a prefill's
    FLOPs), packed where packed. 1.0 where the layers keep no fast copy. Set the dtype
    (choose_dense_dtype) and pack first."""
    fast = [layer for layer in layers if layer.dense_fast is not None]
    sample = sorted(fast, key=lambda layer: -layer.weight.numel())[:max_layers]
    if not sample:
        return 1.0
    with torch.inference_mode():
        def run(exact):
            w = [layer.dense if exact else layer.dense_fast for layer in sample]
            xs = [torch.randn(rows, layer.in_features).to(wi.dtype) for layer, wi in zip(sample, w)]

            def f():
                for layer, x in zip(sample, xs):
                    layer.dense_linear(x, exact)
            return f

        t_exact, t_fast = _min_time([run(True), run(False)], reps)
    return t_exact / t_fast


def _largest_winning_rows(layers: list[CpuLinear], candidates, reps: int, ours, theirs) -> int:
    """The largest row count among `candidates` (ascending; stops at the first loss) for which
    `ours(layer, x)` over all the layers takes no longer than `theirs(layer, x)`, each timed over
    all the layers in turn (weights from memory, as in a real step), interleaved after a warm-up,
    best of `reps`. 0 if ours loses at the first candidate."""
    best = 0
    with torch.inference_mode():
        for m in candidates:
            xs = {k: torch.randn(m, k) for k in {layer.in_features for layer in layers}}

            def run(fn):
                def f():
                    for layer in layers:
                        fn(layer, xs[layer.in_features])
                return f

            t_ours, t_theirs = _min_time([run(ours), run(theirs)], reps)
            if t_ours > t_theirs:
                break
            best = m
    return best


def calibrate_q4_rows(layers: list[CpuLinear], candidates=(1, 2, 4), reps: int = 5) -> int:
    """Measure, on the layers that keep Q4_1 blocks, the largest batch (rows) for which the Q4_1
    kernel is at least as fast as the int8 kernel, and set it as their `q4_max_rows` (0: never).
    Q4_1 reads 0.625 bytes a weight against int8's 1 but does more work per weight: whether it
    wins at one row depends on the CPU's vector units (bench/RESULTS.md), and past a few
    rows the int8 kernel (which shares each widened weight between rows) wins on both. Returns the
    threshold; nothing to measure (no Q4_1 layers) returns 0."""
    q4 = [layer for layer in layers if layer.q4_blocked is not None]
    if not q4:
        return 0
    best = _largest_winning_rows(q4, candidates, reps,
                                 lambda layer, x: cpu_q4.q4_linear(x, layer.q4_blocked),
                                 lambda layer, x: cpu_int8.int8_linear(x, layer.int8_blocked, layer.int8_scales))
    for layer in q4:
        layer.q4_max_rows = best
    return best


def calibrate_int8_rows(layers: list[CpuLinear], candidates=(1, 2, 4, 8, 12, 16, 24, 32), reps: int = 5) -> int:
    """Measure, on these int8 layers' own weights, the largest batch (rows) for which the int8
    kernel beats each layer's decode-time wide path (`wide_linear`: choose the dtype and pack
    first), and set it as every layer's `int8_max_rows` (`_largest_winning_rows`). Returns the
    threshold (0: the wide path is faster even for one row)."""
    if not layers:
        return 0
    best = _largest_winning_rows(layers, candidates, reps, lambda layer, x: layer.int8_linear(x),
                                 lambda layer, x: layer.wide_linear(x, exact=False))
    for layer in layers:
        layer.int8_max_rows = best
    return best


def main() -> None:
    """Print one JSON object: the rules' choice for this CPU and the measured winners, on the
    embedded SmolLM2's layers packed as the engine packs them."""
    import json

    from engine.backends.cpu import CpuBackend, formats
    from engine.config import EngineConfig
    from engine.loader import default_model_path, load_gguf
    from engine.model.decoder import DecoderModel

    cfg, weights, _ = load_gguf(default_model_path())
    backend = CpuBackend(EngineConfig(weight_format="int8"))
    model = DecoderModel(cfg, weights, backend=backend)
    chosen = backend.prepare_model(model)
    layers = [m for m in model.layers.modules() if isinstance(m, CpuLinear)]
    head = model.lm_head
    dense, dense_ms = choose_dense_dtype(layers, reps=15)
    for layer in layers + [head]:
        layer.set_fast_dtype(dense)
        layer.pack_dense()
    measured = {"dense": str(dense).removeprefix("torch."), "dense_ms": dense_ms,
                "q4_1_max_rows": calibrate_q4_rows(layers, reps=15),
                "int8_max_rows": calibrate_int8_rows(layers, candidates=(1, 2, 4, 6, 8, 12, 16, 24, 32), reps=15),
                "lm_head_int8_max_rows": calibrate_int8_rows([head], candidates=(1, 2, 4, 6, 8, 12, 16, 24, 32),
                                                             reps=15),
                "prefill_fast_speedup": round(measure_prefill_speedup(layers, reps=9), 2)}
    print(json.dumps({"cpu": formats.detect_cpu().describe(), "rules": chosen, "measured": measured}))


if __name__ == "__main__":
    main()

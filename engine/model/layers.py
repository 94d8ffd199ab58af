"""Building blocks of the decoder: RMSNorm, rotary embedding, and base linear weights in the
storage format chosen by measurement (fp32, bf16, or int8 weight-only)."""
from __future__ import annotations

import functools
import time

import torch
from torch import nn

from engine.model import cpu_int8, cpu_ops, cpu_q4


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def add_and_norm(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, norm(x + a)) for the residual stream x [T, H]; x may be updated in place."""
        h = cpu_ops.add_rms_norm(x, a, self.weight, self.eps)
        if h is not None:
            return x, h
        x = x + a
        return x, self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        h = cpu_ops.rms_norm(x, self.weight, self.eps)
        if h is not None:
            return h
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op instead of seven: per-op dispatch is a visible share of a decode step.
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in fp32 whatever the activation dtype, as HF's LlamaRMSNorm does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(self.weight.dtype)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """HF-layout (rotate-half) RoPE with cos/sin precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)  # [P, D]
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin) [T, 1, D], computed once per step for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (q and k heads side by side, rotated in one pass) -> rotated x."""
        cos, sin = cos_sin
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class BaseLinear(nn.Module):
    """y = x @ W.T for a frozen base weight W [out, in], stored as `fmt`.

    fmt "fp32"/"bf16": a dense weight in that dtype (activations are cast to it).
    fmt "int8": per-output-channel symmetric int8 with bf16 scales, read 1 byte per weight for
    skinny batches (M <= int8_max_rows) by `int8_linear`: the C kernel on a blocked copy
    (`pack_int8`, fp32 activations, each block of rows one linear stream) or torch's fused weight-only
    kernel (`_weight_int8pack_mm`, bf16 activations); wider batches use a dense copy, because a
    dense GEMM beats those there:
      - `dense` (fp32) for `exact=True` calls, which the model makes for steps that prefill:
        a prompt's first token comes from (near) fp32 numerics, as with the exact format;
      - `dense_fast` (bf16, or None = use `dense`) for decode-only steps wider than the int8
        crossover: bf16 GEMMs beat fp32 where the CPU has avx512_bf16 and lose to it where it has
        only AVX2, so bf16 is kept only where it was faster when the engine started.
    Both the crossover and the fast dtype depend on the CPU: `calibrate_int8_rows` and
    `choose_dense_dtype` measure them on the loaded weights at engine start.
    `pack_dense` (CPU with oneDNN) adds oneDNN-blocked copies of those dense weights, which
    `dense_linear` then uses: the same dtype and numerics, without the per-call reorder of a
    plain weight (faster at 1-100 rows; bench/RESULTS.md).
    The output has the activation dtype.
    """

    INT8_MAX_ROWS = 32

    def __init__(self, weight: torch.Tensor, fmt: str, q4_1: torch.Tensor | None = None):
        """weight: fp32-convertible [out, in]; q4_1: the checkpoint's raw Q4_1 rows of the same
        weight where it has them (kept for the int8 format's smallest batches, see pack_int8)."""
        super().__init__()
        self.fmt = fmt
        self.q4_1_raw = q4_1 if fmt == "int8" else None
        self.q4_blocked: torch.Tensor | None = None  # the Q4_1 kernel's layout of q4_1_raw (pack_int8)
        self.q4_max_rows = 1  # batches up to this many rows take the Q4_1 kernel (calibrate_q4_rows)
        self.int8_max_rows = self.INT8_MAX_ROWS
        self.out_features, self.in_features = weight.shape
        self.dense_fast: torch.Tensor | None = None
        self.packed: dict[torch.dtype, torch.Tensor] = {}  # oneDNN-blocked dense copies (pack_dense)
        self.int8_blocked: torch.Tensor | None = None  # the C kernel's layout of `weight` (pack_int8)
        self.int8_scales: torch.Tensor | None = None   # fp32 copy of `scales` for it
        self.int8_tiled: torch.Tensor | None = None    # the AMX kernel's layout of `weight` (pack_int8)
        w = weight.float()
        if fmt == "fp32":
            self.register_buffer("weight", w.contiguous())
        elif fmt == "bf16":
            self.register_buffer("weight", w.to(torch.bfloat16).contiguous())
        elif fmt == "int8":
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("weight", q.contiguous())
            self.register_buffer("scales", scale.to(torch.bfloat16))
            self.register_buffer("dense", w.contiguous())
        else:
            raise ValueError(f"unknown weight format {fmt!r}")

    def set_fast_dtype(self, dtype: torch.dtype) -> None:
        """Decode-only wide batches of an int8 layer multiply by the dense weight in `dtype`
        (fp32: the exact copy itself; bf16: a second, rounded copy)."""
        if self.fmt != "int8":
            raise ValueError("only int8 layers keep dense copies")
        self.dense_fast = None if dtype == torch.float32 else self.dense.to(dtype).contiguous()

    def pack_dense(self) -> bool:
        """Add oneDNN-blocked copies of the int8 format's dense weights (fp32 `dense`, and
        `dense_fast` if set) for `dense_linear`. False (nothing packed) where oneDNN packing is
        unavailable (not a CPU tensor, or a torch build without it)."""
        if self.fmt != "int8" or not _onednn_packing():
            return False
        self.packed = {w.dtype: torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
                       for w in (self.dense, self.dense_fast) if w is not None}
        return True

    def pack_int8(self) -> bool:
        """Add the CPU int8 kernel's blocked copy of the int8 weight (engine.model.cpu_int8) for
        `int8_linear`, and on CPUs with AMX the tiled copy for `wide_linear`. False (nothing
        added) where the kernel cannot take it."""
        if self.fmt != "int8" or not cpu_int8.supports(self.weight):
            return False
        self.int8_blocked = cpu_int8.block_weight(self.weight)
        self.int8_scales = self.scales.float()
        if cpu_int8.supports_amx(self.weight):
            self.int8_tiled = cpu_int8.tile_weight(self.weight)
        if self.q4_1_raw is not None and cpu_q4.supports(self.q4_1_raw):
            self.q4_blocked = cpu_q4.block_weight(self.q4_1_raw)
        self.q4_1_raw = None  # the blocked copy (or nothing) from here on
        return True

    def int8_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for decode-sized batches, in x's dtype: with fp32 activations, the Q4_1 kernel on
        the checkpoint's own blocks where packed and the batch has at most `q4_max_rows` rows
        (exactly the fp32 weights), else the int8 C kernel; otherwise torch's
        `_weight_int8pack_mm` (bf16 activations). The int8 paths multiply by the int8 weight * scales."""
        if self.q4_blocked is not None and x.shape[0] <= self.q4_max_rows and x.dtype == torch.float32:
            return cpu_q4.q4_linear(x, self.q4_blocked)
        if self.int8_blocked is not None and x.dtype == torch.float32:
            return cpu_int8.int8_linear(x, self.int8_blocked, self.int8_scales)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales).to(x.dtype)

    def dense_linear(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        """x @ dense.T for the int8 format's wide batches: the fp32 copy when `exact`, else
        `dense_fast` (if set); the oneDNN-blocked copy when packed. Output in x's dtype."""
        w = self.dense if exact or self.dense_fast is None else self.dense_fast
        packed = self.packed.get(w.dtype)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), packed, None, "none", [], "").to(x.dtype)
        return torch.nn.functional.linear(x.to(w.dtype), w).to(x.dtype)

    def wide_linear(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        """The int8 format's batches wider than `int8_max_rows`: decode batches (not `exact`) on
        the AMX kernel where packed (the int8 weights themselves, bf16 activations, half the
        bytes of the bf16 dense copy), else `dense_linear`. Output in x's dtype."""
        if not exact and self.int8_tiled is not None and x.dtype == torch.float32:
            return cpu_int8.int8_linear_amx(x, self.int8_tiled, self.int8_scales)
        return self.dense_linear(x, exact)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.fmt == "int8":
            if x.shape[0] <= self.int8_max_rows:
                return self.int8_linear(x)
            return self.wide_linear(x, exact)
        w = self.weight
        if x.dtype != w.dtype:
            return torch.nn.functional.linear(x.to(w.dtype), w).to(x.dtype)
        return torch.nn.functional.linear(x, w)

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (for references and tests)."""
        if self.fmt == "int8":
            return self.weight.float() * self.scales.float()[:, None]
        return self.weight.float()


#: The row count oneDNN blocks packed weights for (a hint: any row count works).
_PACK_ROWS = 32


@functools.lru_cache(maxsize=1)
def _onednn_packing() -> bool:
    """Whether this torch build packs linear weights with oneDNN and gets the same result as
    F.linear from them (checked once, on a small weight, in fp32 and bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        for dt in (torch.float32, torch.bfloat16):
            w, x = torch.randn(48, 64).to(dt), torch.randn(5, 64).to(dt)
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS),
                                                   None, "none", [], "")
            if not torch.allclose(y.float(), torch.nn.functional.linear(x, w).float(), rtol=2e-2, atol=2e-2):
                return False
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


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


def choose_dense_dtype(layers: list[BaseLinear], rows: int = 64, reps: int = 7, max_layers: int = 12,
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


#: Steps that prefill take the decode path (the AMX kernel, else the fast dense copy) instead of the
#: fp32 copy only where the fast copy's GEMMs are at least this many times fp32's at prefill width.
#: bf16 prefill rounds the activations, which can flip a first token that is a near-tie in fp32;
#: that is worth it only where bf16 GEMMs are far faster (AMX), and not where they are merely
#: faster (avx512_bf16 alone), where a test prompt's near-tie did flip (bench/RESULTS.md).
FAST_PREFILL_MIN_SPEEDUP = 4.0


def measure_prefill_speedup(layers: list[BaseLinear], rows: int = 512, reps: int = 5, max_layers: int = 8) -> float:
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


def _largest_winning_rows(layers: list[BaseLinear], candidates, reps: int, ours, theirs) -> int:
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


def calibrate_q4_rows(layers: list[BaseLinear], candidates=(1, 2, 4), reps: int = 5) -> int:
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


def calibrate_int8_rows(layers: list[BaseLinear], candidates=(1, 2, 4, 8, 12, 16, 24, 32), reps: int = 5) -> int:
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

"""Static GPU measurements: every Triton kernel variant the engine launches at real model shapes,
compiled for sm_90 (H100) with the installed Triton and read from its SASS. Needs no GPU; prints
one JSON object (figures, never pass/fail).

    python bench/sass.py                                   # llama3.1-8b, qwen2.5-7b, gemma2-9b
    python bench/sass.py --families llama3.1-8b --batches 1 --kernels w4_gemv,decode

How the variants are found: the backend's own launchers run at each shape on CPU tensors (never
read: empty tensors of the real sizes) with the device-dependent choices answered as on the GPU
(the launch-config tables' device name, the SM count, no interpreter), and every `kernel[grid](...)`
they make is recorded instead of launched. Each recorded launch is then compiled exactly as
Triton's launcher would compile it (its own argument specialization: dtypes, 16-byte alignment,
integers equal to 1 or divisible by 16; engine.backends.triton.variants), for
`GPUTarget("cuda", 90, 32)`, by a stand-in driver that reports that target; nothing is launched.
Launches of one specialization share a variant.

The sites, per family and per decode batch B (`--batches`; one token per sequence, each of
`--context` keys): the decode layer's launches in the order DecoderLayer.forward makes them
(norms, the four W4A16 linears with K split where the grid is small, decode attention with RoPE
and the KV write fused in, the gated activation, where it is its own launch), once without LoRA
("{family} decode T=B", whose one-row down projection takes the gated activation as its input)
and once with every token on an adapter of rank `--rank` ("{family} decode+lora T=B": the four
LoRA groups' grouped shrink + expand); and one prefill chunk of `--prefill` tokens (the W4A16
GEMM path, RoPE + KV write, prefill attention, SGMV). The lm_head is a dense torch matmul (not
Triton): it enters the per-token estimate as its bytes at the bandwidth bound. Beside them, the
four linears of one family (`--formats-family`, Llama-3.1-8B) on the weights of each checkpoint
format in `--formats` (QUANT_FORMATS: the W4A16 kernels with Q4_K's two-level scales, the W8A16
kernels for 8-bit integer or FP8 codes, with Q6_K's and Q5_K's two levels), at the same batches
and prefill chunk; their sites are named "{family} {format} decode T=..." and stay out of the
per-token figures (which are the engine's default 4-bit layer).

Per variant (from `cuobjdump -res-usage` and `-sass` of the cubin Triton built): registers,
spill stores / loads (STL / LDL instructions; Triton kernels use local memory only to spill) and
local bytes, shared memory, instructions in all, and for the main loop (the widest backward
branch's body) its instructions per warp per iteration with an opcode summary: global loads by
width (LDG.E = 32 bit, .64, .128, narrower .U8/.U16/...; LDGSTS: asynchronous copies to shared
memory), int-to-float (I2F, I2FP) and float-to-float (F2F, F2FP) conversions, shuffles (SHFL),
barriers (BAR), tensor-core (HMMA, HGMMA) and fp32 (FFMA, FADD, FMUL) instructions.

Per launch (a site): its grid, warps, loop trips, the bytes it must move (the streamed operand:
4-bit weights with their scales and mins, K/V, LoRA A/B rows up to the rank; plus activations in
and out) and a roofline estimate of its H100 time:
    t_mem   = bytes / 3.35e12                                        (H100 SXM HBM3)
    t_issue = max(warps x programs x (loop_instr x trips + other) / (4 x 132 x 1.7e9),
                  (loop_instr x max_trips + other) / 1.7e9)
    t_est   = max(t_mem, t_issue)
(4 warp schedulers per SM, 132 SMs, ~1.7 GHz boost, one instruction per scheduler per cycle; the
second term is one warp issuing its own instructions back to back.) `other` counts the
instructions outside the main loop once for every program that does work (an upper bound: not
every branch runs; programs that return at once, as a grouped LoRA kernel's for a slot without
rows or a decode split a short row does not use, are left out). The issue term
is a lower bound on issue time: it assumes every scheduler issues every cycle (no stall on
latency, enough warps resident). The per-token figure sums a decode layer's launches, times the
layer count, plus the lm_head: an estimate from SASS, never a GPU measurement.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import inspect
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: H100 SXM: HBM3 bandwidth, SMs, warp schedulers per SM, boost clock.
HBM_BYTES_PER_S = 3.35e12
NUM_SMS = 132
SCHEDULERS_PER_SM = 4
CLOCK_HZ = 1.7e9
#: What torch.cuda.get_device_name gives on an H100 SXM: the launch-config tables' key.
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
DEFAULT_FAMILIES = ("llama3.1-8b", "qwen2.5-7b", "gemma2-9b")
#: Checkpoint formats whose layer linears are compiled beside the default 4-bit layer (`--formats`):
#: name -> (code bits, group size (0: one group a row, G = K), scale and min dtype, mins or none
#: [, code format [, super-block size: two levels, integer sub-block values x fp16 factors]]).
QUANT_FORMATS = {
    "q4_k": (4, 32, "uint8", True, "int", 256),  # GGUF Q4_K: 6-bit sc, m per 32 inputs x fp16 d, -dmin per 256
    "q8_0": (8, 32, "float16", False),  # GGUF Q8_0: fp16 d per 32, int8 codes
    "q6_k": (8, 16, "int8", False, "int", 256),  # GGUF Q6_K: int8 sc per 16 x fp16 d per 256, codes -32..31
    "q5_k": (8, 32, "uint8", True, "int", 256),  # GGUF Q5_K: codes 0..31, 6-bit sc, m per 32 x fp16 d, -dmin
    "w8-channel": (8, 0, "float16", False),  # compressed-tensors W8A16: one scale a row
    "fp8-channel": (8, 0, "float32", False, "e4m3"),  # compressed-tensors FP8: E4M3 codes, one scale a row
    "fp8-block": (8, 128, "float32", False, "e4m3"),  # FP8 in 128 x 128 blocks: a scale per 128 inputs
}


# ----------------------------------------------------------------------------- recording


@dataclasses.dataclass
class Launch:
    """One recorded `kernel[grid](*args, **kwargs)` of a launcher, at a site."""

    site: str  # "llama3.1-8b decode B=1 qkv_proj"
    fn: object  # the JITFunction
    args: tuple
    kwargs: dict
    grid: tuple
    variant: str | None = None  # the compiled kernel's hash, once compiled
    share: float = 1.0  # the fraction of the model's layers that make this launch (attention by window)

    @property
    def kernel(self) -> str:
        return self.fn.__name__.lstrip("_")

    def bound(self) -> dict:
        """Every kernel argument by name (constexprs included), as the launcher passed them."""
        sig = inspect.signature(self.fn.fn)
        kw = {k: v for k, v in self.kwargs.items() if k in sig.parameters}
        return dict(sig.bind(*self.args, **kw).arguments)

    @property
    def num_warps(self) -> int:
        return int(self.kwargs.get("num_warps", 4))

    @property
    def programs(self) -> int:
        return math.prod(int(g) for g in self.grid)


class _Recorder:
    def __init__(self):
        self.launches: list[Launch] = []
        self.site = "?"
        self.share = 1.0


@contextlib.contextmanager
def recording(device_name: str = DEVICE_NAME, num_sms: int = NUM_SMS):
    """Within: the backend's launchers take CPU tensors as a GPU's (device checks pass, launch
    configs and split counts are the GPU's) and every Triton launch is recorded, not run."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench/sass.py compiles for sm_90: run it without TRITON_INTERPRET=1")
    from triton.runtime.jit import JITFunction

    import engine.backends.triton.norms
    import engine.backends.triton.w4a16
    import engine.backends.triton.w8a16  # noqa: F401
    import punica_kernels.kernels  # noqa: F401
    from engine.backends.triton import attention
    from punica_kernels.kernels import _common

    rec = _Recorder()
    fakes = {
        _common.check_runnable: lambda *a, **k: None,
        _common.device_name: lambda device: device_name,
        attention._num_sms: lambda device: num_sms,
    }
    # Every module of the backend that bound one of these functions by name gets the GPU answer.
    saved = []
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "") or ""
        if not (name.startswith(("engine.", "punica_kernels"))):
            continue
        for attr, value in list(vars(mod).items()):
            try:
                fake = fakes.get(value)
            except TypeError:  # unhashable module attribute
                continue
            if fake is not None:
                saved.append((mod, attr, value))
                setattr(mod, attr, fake)

    def run(self, *args, grid, warmup=False, **kwargs):
        rec.launches.append(Launch(rec.site, self, args, dict(kwargs), tuple(grid), share=rec.share))

    original = JITFunction.run
    JITFunction.run = run
    try:
        yield rec
    finally:
        JITFunction.run = original
        for mod, attr, value in saved:
            setattr(mod, attr, value)


# ----------------------------------------------------------------------------- the sites


def _shapes(name: str):
    from engine.loader.synthetic import family_model_config

    return family_model_config(name)


def record_family(rec: _Recorder, family: str, *, batches, prefill: int, context: int, rank: int,
                  group_size: int, block_size: int = 16, num_slots: int = 4, lora: bool = True) -> None:
    """Run the backend's launchers for one family's decode layer at each batch (without LoRA, and
    with it as its own layer, "decode+lora", where `lora`), and one prefill chunk (its LoRA sites
    named " lora ")."""
    import torch

    import punica_kernels as pk
    from engine.backends.triton import attention as tk
    from engine.backends.triton import norms, w4a16

    cfg = _shapes(family)
    dt = torch.bfloat16
    H, I, Hq, Hkv, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_size, kv_size = Hq * D, Hkv * D
    width = q_size + 2 * kv_size

    def w4(n: int, k: int) -> w4a16.W4Weight:
        groups = -(-k // group_size)
        return w4a16.W4Weight(torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, groups, dtype=torch.float16),
                              torch.empty(n, groups, dtype=torch.float16), group_size)

    linears = {"qkv_proj": w4(width, H), "o_proj": w4(H, q_size), "gate_up_proj": w4(2 * I, H),
               "down_proj": w4(H, I)}
    S, R = num_slots, rank
    stacks = {
        "qkv": pk.lora_stack([torch.empty(S, R, H, dtype=dt)] * 3,
                             [torch.empty(S, q_size, R, dtype=dt)] + [torch.empty(S, kv_size, R, dtype=dt)] * 2,
                             torch.ones(S), torch.full((S,), R), offsets=[0, q_size, q_size + kv_size]),
        "o": pk.lora_stack(torch.empty(S, R, q_size, dtype=dt), torch.empty(S, H, R, dtype=dt), torch.ones(S),
                           torch.full((S,), R)),
        "gate_up": pk.lora_stack([torch.empty(S, R, H, dtype=dt)] * 2, [torch.empty(S, I, R, dtype=dt)] * 2,
                                 torch.ones(S), torch.full((S,), R), offsets=[0, I]),
        "down": pk.lora_stack(torch.empty(S, R, I, dtype=dt), torch.empty(S, H, R, dtype=dt), torch.ones(S),
                              torch.full((S,), R)),
    }
    norm_w = torch.empty(H, dtype=dt)
    act = "gelu_tanh" if cfg.hidden_act == "gelu_tanh" else "silu"
    layer_windows = [cfg.window(i) for i in range(cfg.num_layers)]
    windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))

    def layer(kind: str, T: int, keys: int, with_lora: bool):
        tag = f"{family} {kind}{'+lora' if with_lora and kind == 'decode' else ''} T={T}"
        # A cache of exactly the keys these sequences hold, plus the sink block (the engine's).
        seqs = T if kind == "decode" else 1
        blocks = -(-keys // block_size)
        slots_n = (seqs * blocks + 1) * block_size
        k_cache = torch.empty(slots_n, Hkv, D, dtype=dt)
        v_cache = torch.empty(slots_n, Hkv, D, dtype=dt)
        tables = torch.arange(seqs * blocks, dtype=torch.int32).reshape(seqs, blocks)
        cos = torch.empty(max(keys, T) + 1, D, dtype=dt)
        positions = torch.full((T,), keys - 1, dtype=torch.int64) if kind == "decode" else torch.arange(T)
        slot_mapping = torch.arange(T, dtype=torch.int64)
        # Decode rows take the slots in turn; a prefill chunk is one sequence, so one adapter (one segment).
        token_slots = [i % S for i in range(T)] if kind == "decode" else [0] * T
        meta = pk.build_lora_metadata(token_slots, num_slots=S, num_decode=T if kind == "decode" else 0)

        def at(op, share=1.0):
            rec.site = f"{tag} {op}"
            rec.share = share

        x = torch.empty(T, H, dtype=dt)
        at("input_norm")
        h = norms.rms_norm(x, norm_w, 1e-5)
        at("qkv_proj")
        qkv = w4a16.w4a16_matmul(h, linears["qkv_proj"])
        if with_lora:
            at("lora qkv")
            pk.add_lora(qkv, h, stacks["qkv"], meta=meta, impl="triton")
        if cfg.qk_norm:
            at("qk_norm")
            norms.rms_norm(torch.empty(T * Hq, D, dtype=dt), torch.empty(D, dtype=dt), 1e-6)
        if kind == "prefill":
            at("rope_kv_write")
            q = tk.rope_kv_write(qkv, cos, cos, positions, k_cache, v_cache, slot_mapping, Hq, Hkv, D)
        for w in windows:
            # Layers alternate windows (Gemma 2): each layer makes one of these launches.
            at("attention" + ("" if w is None else f" window={w}"), layer_windows.count(w) / cfg.num_layers)
            extra = {"sliding_window": w, "softcap": cfg.attn_logit_softcap}
            if kind == "decode":
                # RoPE and the new tokens' K/V write fused in (TritonBackend.attention's decode rows).
                lens = torch.full((T,), keys, dtype=torch.int32)
                tk.paged_decode_attention_rope(qkv, cos, cos, positions, k_cache, v_cache, slot_mapping, tables, lens,
                                               block_size, 0.1, Hq, Hkv, D, **extra)
            else:
                tk.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, T], dtype=torch.int32),
                                           torch.tensor([keys], dtype=torch.int32), block_size, 0.1, T, **extra)
        o = torch.empty(T, q_size, dtype=dt)
        at("o_proj")
        out = w4a16.w4a16_matmul(o, linears["o_proj"])
        if with_lora:
            at("lora o")
            pk.add_lora(out, o, stacks["o"], meta=meta, impl="triton")
        if cfg.sandwich_norms:
            at("attn_out_norm")
            norms.rms_norm(out, norm_w, 1e-6)
        at("add_rms_norm")
        x, h = norms.add_rms_norm(x, out, norm_w, 1e-5)
        at("gate_up_proj")
        gu = w4a16.w4a16_matmul(h, linears["gate_up_proj"])
        if with_lora:
            at("lora gate_up")
            pk.add_lora(gu, h, stacks["gate_up"], meta=meta, impl="triton")
        if not with_lora and T <= w4a16.GATED_MAX_M:
            # The engine's down projection without LoRA (TritonBackend.gated_linear): the gated
            # activation computed as the matmul loads its input, no launch of its own.
            at("down_proj")
            d = w4a16.w4a16_matmul(gu, linears["down_proj"], act=act)
        else:
            at(act + "_mul")
            m = norms.gelu_tanh_mul(gu) if act == "gelu_tanh" else norms.silu_mul(gu)
            at("down_proj")
            d = w4a16.w4a16_matmul(m, linears["down_proj"])
            if with_lora:
                at("lora down")
                pk.add_lora(d, m, stacks["down"], meta=meta, impl="triton")
        if cfg.sandwich_norms:
            at("mlp_out_norm")
            norms.rms_norm(d, norm_w, 1e-6)

    for b in batches:
        layer("decode", b, context, False)
        if lora:
            layer("decode", b, context, True)
    if prefill:
        layer("prefill", prefill, prefill, lora)


def record_quantized_linears(rec: _Recorder, family: str, fmt: str, *, batches, prefill: int) -> None:
    """The four linears of one family's decode layer at each batch, and of one prefill chunk, on
    weights of checkpoint format `fmt` (QUANT_FORMATS) through the launchers the Triton backend
    gives them: w4a16_matmul for 4-bit codes, w8a16_matmul for 8-bit."""
    import torch

    from engine.backends.triton import w4a16, w8a16
    from engine.loader.quantized import QuantizedWeight

    bits, group, scale_dtype, has_mins, *rest = QUANT_FORMATS[fmt]
    code_format = rest[0] if rest else "int"
    super_size = rest[1] if len(rest) > 1 else 0
    sd = getattr(torch, scale_dtype)
    cfg = _shapes(family)
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = {"qkv_proj": (q_size + 2 * kv_size, H), "o_proj": (H, q_size), "gate_up_proj": (2 * I, H),
              "down_proj": (H, I)}

    def weight(n: int, k: int):
        g = group or k
        scales = torch.empty(n, -(-k // g), dtype=sd)
        mins = torch.empty_like(scales) if has_mins else None
        two = {}
        if super_size:
            factors = torch.empty(n, -(-k // super_size), dtype=torch.float16)
            two = {"super_scales": factors, "super_mins": torch.empty_like(factors) if has_mins or bits == 4 else None,
                   "super_size": super_size}
        if bits == 4:
            return w4a16.W4Weight(torch.empty(n, k // 2, dtype=torch.uint8), scales,
                                  torch.zeros_like(scales) if mins is None else mins, g, **two)
        return QuantizedWeight(8, torch.empty(n, k, dtype=torch.int8), scales, mins, g, source=fmt,
                               code_format=code_format, **two)

    matmul = w4a16.w4a16_matmul if bits == 4 else w8a16.w8a16_matmul
    weights = {name: weight(n, k) for name, (n, k) in shapes.items()}
    steps = [("decode", b) for b in batches] + ([("prefill", prefill)] if prefill else [])
    for kind, T in steps:
        for name, (_, k) in shapes.items():
            rec.site = f"{family} {fmt} {kind} T={T} {name}"
            rec.share = 1.0
            matmul(torch.empty(T, k, dtype=torch.bfloat16), weights[name])


# ----------------------------------------------------------------------------- compiling


def compile_launches(launches: list[Launch], capability: int = 90) -> dict[str, object]:
    """Compile each launch as Triton's launcher would for sm_`capability`
    (engine.backends.triton.variants.compile_launch); -> {variant hash: kernel}."""
    from triton.backends.compiler import GPUTarget

    from engine.backends.triton.variants import compile_launch, compiling_for

    kernels: dict[str, object] = {}
    with compiling_for(GPUTarget("cuda", capability, 32)):
        for launch in launches:
            k = compile_launch(launch.fn, launch.args, launch.kwargs, launch.grid)
            launch.variant = k.hash
            kernels.setdefault(k.hash, k)
    return kernels


# ----------------------------------------------------------------------------- reading SASS


def tool(name: str) -> Path:
    """A CUDA tool Triton ships (ptxas, cuobjdump) in its nvidia backend."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this Triton has no bundled {name}")
    return path


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def parse_sass(text: str) -> list[tuple[int, str]]:
    """cuobjdump -sass text -> [(address, instruction text, predicate guard included)]."""
    out = []
    for line in text.splitlines():
        m = _INSTR.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _opcode(ins: str) -> str:
    parts = ins.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def _branch_target(ins: str) -> int | None:
    """The address a BRA jumps to (cuobjdump writes it as `(.L_x_N) or 0x...), or None."""
    if _opcode(ins).split(".")[0] != "BRA":
        return None
    m = re.search(r"0x([0-9a-f]+)", ins)
    return int(m.group(1), 16) if m else None


def main_loop(instrs: list[tuple[int, str]]) -> tuple[int, int] | None:
    """(first, last) index of the widest loop: a branch to an earlier address, with its target."""
    addr_index = {a: i for i, (a, _) in enumerate(instrs)}
    best = None
    for i, (addr, ins) in enumerate(instrs):
        t = _branch_target(ins)
        if t is not None and t <= addr and t in addr_index:
            span = (addr_index[t], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    return best


def summarize(ops: list[str]) -> dict:
    """The opcode figures the report names, over a list of instructions."""
    c = collections.Counter()
    loads = collections.Counter()
    for ins in ops:
        op = _opcode(ins)
        base = op.split(".")[0]
        c[base] += 1
        if base in ("LDG", "LDGSTS"):
            width = next((s for s in op.split(".")[1:] if s in ("64", "128", "U8", "S8", "U16", "S16")), "32")
            loads[f"{base}.{width}"] += 1
    return {
        "global_loads": dict(sorted(loads.items())),
        "global_load_bytes_per_thread": sum(n * {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}.get(
            k.split(".")[1], 4) for k, n in loads.items()),
        "int_to_float": c["I2F"] + c["I2FP"],
        "float_to_float": c["F2F"] + c["F2FP"],
        "float_to_int": c["F2I"],
        "shuffles": c["SHFL"],
        "barriers": c["BAR"],
        "tensor_core": c["HMMA"] + c["HGMMA"] + c["WGMMA"],
        "fp32": c["FFMA"] + c["FADD"] + c["FMUL"] + c["FMNMX"],
        "shared_loads": c["LDS"] + c["LDSM"],
        "shared_stores": c["STS"],
    }


def analyze(kernel) -> dict:
    """Registers, spills, shared memory and SASS figures of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        res = subprocess.run([str(tool("cuobjdump")), "-res-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([str(tool("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    usage = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    instrs = parse_sass(sass)
    # Drop the padding after the last EXIT/BRA-to-self.
    while instrs and _opcode(instrs[-1][1]) in ("NOP", "BRA"):
        instrs.pop()
    body = [i for _, i in instrs if _opcode(i) != "NOP"]
    loop = main_loop(instrs)
    loop_ops = [] if loop is None else [i for _, i in instrs[loop[0]:loop[1] + 1] if _opcode(i) != "NOP"]
    md = kernel.metadata
    shared = md.shared if hasattr(md, "shared") else md["shared"]
    warps = md.num_warps if hasattr(md, "num_warps") else md["num_warps"]
    return {
        "name": kernel.name if hasattr(kernel, "name") else md.name,
        "num_warps": warps,
        "num_stages": md.num_stages if hasattr(md, "num_stages") else md.get("num_stages"),
        "registers": usage.get("reg"),
        "spill_stores": sum(1 for i in body if _opcode(i).startswith("STL")),
        "spill_loads": sum(1 for i in body if _opcode(i).startswith("LDL")),
        "local_bytes": usage.get("local", 0),
        "shared_bytes": max(int(shared), usage.get("shared", 0)),
        "instructions": len(body),
        "loop_instructions": len(loop_ops),
        "other_instructions": len(body) - len(loop_ops),
        "loop": summarize(loop_ops),
        "whole": summarize(body),
    }


# ----------------------------------------------------------------------------- per-launch models


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def launch_model(launch: Launch) -> dict:
    """Bytes a launch must move (streamed operand and the rest) and its main-loop trips (total over
    its programs, most in one program), from the launcher's arguments. See the module docstring."""
    a = launch.bound()
    k = launch.kernel
    programs = launch.programs
    cdiv = lambda p, q: -(-int(p) // int(q))
    if k in ("w4_gemv_kernel", "w4_gemm_kernel", "w8_gemv_kernel", "w8_gemm_kernel"):
        # Without mins (HAS_MIN off) the W8A16 kernels read none: m_ptr (and sm_ptr) stand-ins.
        has_min = a.get("HAS_MIN", True)
        weights = _nbytes(a["q_ptr"]) + _nbytes(a["s_ptr"]) + (_nbytes(a["m_ptr"]) if has_min else 0)
        if a.get("SUPER", 0):  # two levels: the super-block factors too (sm_ptr only with mins)
            weights += _nbytes(a["ss_ptr"]) + (_nbytes(a["sm_ptr"]) if has_min else 0)
        # x (gate | up for a gated input: twice the K columns), y; with K split, each chunk's fp32
        # partial tile written and read back once by the tile's last program.
        gated = a.get("ACT", "none") != "none"
        other = int(a["M"]) * int(a["K"]) * a["x_ptr"].element_size() * (2 if gated else 1) + _nbytes(a["y_ptr"])
        if a.get("SPLIT"):
            other += 2 * _nbytes(a["out_ptr"])
        # The last K chunk may be shorter: all chunks together hold cdiv(K, BLOCK_K) tiles.
        tiles = cdiv(a["K"], a["BLOCK_K"]) * (programs // int(launch.grid[-1]))
        return {"weight_bytes": weights, "other_bytes": other, "max_trips": cdiv(a["K_CHUNK"], a["BLOCK_K"]),
                    "total_trips": tiles}
    if k == "rms_norm_kernel":
        T, H, item = int(a["T"]), int(a["H"]), a["x_ptr"].element_size()
        moved = T * H * item * (4 if a["ADD"] else 2) + H * item
        trips = 0 if a["SINGLE"] else 2 * cdiv(H, a["BLOCK"])  # two passes, each its own loop
        return {"weight_bytes": 0, "other_bytes": moved, "max_trips": trips, "total_trips": trips * programs}
    if k == "gated_mul_kernel":
        return {"weight_bytes": 0, "other_bytes": int(a["T"]) * int(a["I"]) * 3 * a["gu_ptr"].element_size(),
                    "max_trips": 0, "total_trips": 0}
    if k == "rope_kv_write_kernel":
        T, item = int(a["T"]), a["qkv_ptr"].element_size()
        D, hq, hkv = int(a["HEAD_DIM"]), int(a["NUM_HEADS"]), int(a["NUM_KV_HEADS"])
        return {"weight_bytes": 0, "other_bytes": T * D * item * (hq + 2 * hkv) * 2, "max_trips": 0, "total_trips": 0}
    if k == "decode_kernel":
        lens = a["lens_ptr"]
        hkv = a["k_ptr"].shape[1]
        D, item, splits, bn = int(a["HEAD_DIM"]), a["k_ptr"].element_size(), int(a["NUM_SPLITS"]), int(a["BLOCK_N"])
        window = int(a["window"]) if a["SLIDING"] else None
        keys = [min(int(n), window) if window else int(n) for n in lens.tolist()]
        rope = bool(a.get("ROPE", False))
        # With RoPE fused in, each row's new key and value come from its qkv row (read once, then
        # written to the cache) instead of the cache.
        kv = (sum(keys) - (len(keys) if rope else 0)) * hkv * D * 2 * item
        new_kv = 4 * len(keys) * hkv * D * item if rope else 0
        # Each row uses the splits its own length needs (at most the grid's); a split row's
        # partials (fp32 o, m, l per head) are written once and read back once by its last split.
        used = [1 if splits == 1 else min(splits, max(1, cdiv(n, a["split_min_tokens"]))) for n in keys]
        per = [cdiv(cdiv(n, u), bn) for n, u in zip(keys, used)]
        partials = sum(u for u in used if u > 1) * int(a["NUM_HEADS"]) * (D + 2) * 4 * 2
        return {"weight_bytes": kv, "other_bytes": 2 * len(keys) * int(a["NUM_HEADS"]) * D * item + partials + new_kv,
                    "max_trips": max(per), "total_trips": sum(p * u for p, u in zip(per, used)) * hkv,
                    "active_programs": sum(used) * hkv}
    if k == "prefill_kernel":
        ctx = [int(n) for n in a["ctx_ptr"].tolist()]
        qs = a["qs_ptr"].tolist()
        hkv, D, item = a["k_ptr"].shape[1], int(a["HEAD_DIM"]), a["k_ptr"].element_size()
        bm, bn, hq = int(a["BLOCK_M"]), int(a["BLOCK_N"]), launch.grid[1]
        trips = []
        for s, c in enumerate(ctx):
            q_len = qs[s + 1] - qs[s]
            trips += [cdiv(min(c - q_len + min(m0 + bm, q_len), c), bn) for m0 in range(0, q_len, bm)]
        return {"weight_bytes": sum(ctx) * hkv * D * 2 * item, "other_bytes": 2 * _nbytes(a["q_ptr"]),
                    "max_trips": max(trips), "total_trips": sum(trips) * hq}
    if k in ("bgmv_shrink_kernel", "sgmv_shrink_kernel", "bgmv_expand_kernel", "sgmv_expand_kernel"):
        # Every token/segment on an adapter of the stack's full rank R (the sites' choice).
        shrink = "shrink" in k
        item = a["a0_ptr" if shrink else "b0_ptr"].element_size()
        L = launch.grid[2]
        R = int(a["stride_as"]) // int(a["K"]) if shrink else int(a["R"])
        slots = a["slot_ptr"] if "slot_ptr" in a else a["seg_slot_ptr"]
        used = len({int(s) for s in slots.tolist() if s >= 0})
        if shrink:
            K = int(a["K"])
            weights = used * L * R * K * item
            T = a["v_ptr"].shape[1] if a["v_ptr"].dim() == 3 else a["v_ptr"].shape[0]
            other = T * K * a["x_ptr"].element_size() + T * L * R * 4
            if k == "bgmv_shrink_kernel":
                split = int(a["SPLIT_K"])
                trips = cdiv(cdiv(K, split * a["BLOCK_K"]) * a["BLOCK_K"], a["BLOCK_K"])
                active = T * cdiv(R, a["BLOCK_R"]) * split * L
            else:
                trips = cdiv(K, a["BLOCK_K"])
                active = programs
        else:
            widths = [int(w) for w in a["geo_ptr"].flatten()[:L].tolist()]
            weights = used * sum(widths) * R * item
            T = a["v_ptr"].shape[1]
            other = T * L * R * 4 + 2 * T * sum(widths) * a["y_ptr"].element_size()
            trips = cdiv(R, a["BLOCK_R"])
            active = programs
        return {"weight_bytes": weights, "other_bytes": other, "max_trips": trips, "total_trips": trips * active}
    if k in ("grouped_shrink_kernel", "grouped_expand_kernel"):
        # Decode rows grouped by slot: each slot with rows reads its A (B) once, every row tile of
        # it in one program's loop; programs of slots without rows return at once.
        bounds = [int(b) for b in a["bounds_ptr"].tolist()]
        S = len(bounds) - 2
        rows = [bounds[s + 1] - bounds[s] for s in range(S) if bounds[s + 1] > bounds[s]]
        L, T, bm = launch.grid[2], bounds[-1], int(a["BLOCK_M"])
        tiles = [cdiv(r, bm) for r in rows]
        if k == "grouped_shrink_kernel":
            K, split = int(a["K"]), int(a["SPLIT_K"])
            R = int(a["stride_as"]) // K
            weights = len(rows) * L * R * K * a["a0_ptr"].element_size()
            other = T * K * a["x_ptr"].element_size() + T * L * R * 4
            if split > 1:
                other += 2 * split * L * T * int(a["BLOCK_R"]) * 4
            k_trips = cdiv(cdiv(K, split), a["BLOCK_K"])
            return {"weight_bytes": weights, "other_bytes": other, "max_trips": k_trips * max(tiles, default=0),
                    "total_trips": k_trips * sum(tiles) * split * L,
                    "active_programs": (len(rows) * split + (1 if T > sum(rows) else 0)) * L}
        widths = [int(w) for w in a["geo_ptr"].flatten()[:L].tolist()]
        R = int(a["R"])
        weights = len(rows) * sum(widths) * R * a["b0_ptr"].element_size()
        other = T * L * R * 4 + 2 * T * sum(widths) * a["y_ptr"].element_size()
        r_trips = cdiv(R, a["BLOCK_R"])
        return {"weight_bytes": weights, "other_bytes": other, "max_trips": r_trips * max(tiles, default=0),
                "total_trips": r_trips * sum(tiles) * launch.grid[1] * L,
                "active_programs": len(rows) * launch.grid[1] * L}
    return {"weight_bytes": 0, "other_bytes": 0, "max_trips": 0, "total_trips": 0}


def estimate(stats: dict, model: dict, launch: Launch) -> dict:
    """The roofline figures of one launch (formula: the module docstring)."""
    moved = model["weight_bytes"] + model["other_bytes"]
    t_mem = moved / HBM_BYTES_PER_S
    loop, other, warps = stats["loop_instructions"], stats["other_instructions"], stats["num_warps"]
    # Programs that return at once (a slot without rows, a split a short row does not use) are
    # left out of the `other` term: their few instructions are not the body's.
    warp_instr = warps * (loop * model["total_trips"] + other * model.get("active_programs", launch.programs))
    t_all = warp_instr / (SCHEDULERS_PER_SM * NUM_SMS * CLOCK_HZ)
    t_chain = (loop * model["max_trips"] + other) / CLOCK_HZ
    t_issue = max(t_all, t_chain)
    per_iter = None
    if model["total_trips"]:
        per_iter = round(model["weight_bytes"] / model["total_trips"], 1)
    return {
        "bytes": moved, "weight_bytes": model["weight_bytes"], "weight_bytes_per_iteration": per_iter,
        "max_trips": model["max_trips"], "total_trips": model["total_trips"],
        "t_mem_us": round(t_mem * 1e6, 3), "t_issue_us": round(t_issue * 1e6, 3),
        "t_est_us": round(max(t_mem, t_issue) * 1e6, 3),
        "bound": "memory" if t_mem >= t_issue else "issue",
    }


# ----------------------------------------------------------------------------- main


def machine() -> dict:
    import torch
    import triton

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ptxas = subprocess.run([str(tool("ptxas")), "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return {"cpu": cpu, "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "ptxas": ptxas.splitlines()[-1] if ptxas else None, "target": "cuda sm_90 (GPUTarget('cuda', 90, 32))",
            "device_name_for_configs": DEVICE_NAME}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                   help="synthetic families at real shapes (engine.loader.synthetic.FAMILIES), comma-separated")
    p.add_argument("--batches", default="1,8,16", help="decode batch sizes (tokens), comma-separated")
    p.add_argument("--prefill", type=int, default=256, help="prefill chunk tokens (0: no prefill sites)")
    p.add_argument("--context", type=int, default=1024, help="keys each decoding sequence attends to")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapter stacks")
    p.add_argument("--group-size", type=int, default=32,
                   help="4-bit group size: 32 for GGUF Q4_0/Q4_1 files (bench/gpu.sh's), 128 for quantizing at load")
    p.add_argument("--formats", default=",".join(QUANT_FORMATS),
                   help="checkpoint formats (QUANT_FORMATS) whose linears are compiled too, comma-separated "
                        "(empty: none)")
    p.add_argument("--formats-family", default="llama3.1-8b", help="the family whose shapes the --formats linears take")
    p.add_argument("--kernels", default="", help="only kernels whose name contains one of these, comma-separated")
    p.add_argument("--no-lora", action="store_true", help="leave out the LoRA launches")
    p.add_argument("--count-only", action="store_true",
                   help="only list the recorded launches (site, kernel, grid), compiling nothing")
    args = p.parse_args(argv)

    from engine.loader.synthetic import FAMILIES

    families = [f for f in args.families.split(",") if f]
    for f in families + [args.formats_family]:
        if f not in FAMILIES:
            print(f"unknown family {f!r}; one of {', '.join(sorted(FAMILIES))}", file=sys.stderr)
            return 2
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in QUANT_FORMATS:
            print(f"unknown format {f!r}; one of {', '.join(QUANT_FORMATS)}", file=sys.stderr)
            return 2
    batches = _ints(args.batches)
    wanted = [k for k in args.kernels.split(",") if k]
    t0 = time.perf_counter()
    with recording() as rec:
        for f in families:
            record_family(rec, f, batches=batches, prefill=args.prefill, context=args.context, rank=args.rank,
                          group_size=args.group_size, lora=not args.no_lora)
        for fmt in formats:
            record_quantized_linears(rec, args.formats_family, fmt, batches=batches, prefill=args.prefill)
    launches = [x for x in rec.launches if not wanted or any(w in x.kernel for w in wanted)]
    if args.count_only:
        print(json.dumps({"tool": "bench/sass.py --count-only", "device_name_for_configs": DEVICE_NAME,
                          "launches": [{"site": x.site, "kernel": x.kernel, "grid": list(x.grid), "share_of_layers": x.share}
                                       for x in launches]}))
        return 0
    try:
        tool("cuobjdump")
    except FileNotFoundError as e:
        print(str(e), file=sys.stderr)
        return 2
    kernels = compile_launches(launches)
    variants = {h: analyze(k) for h, k in kernels.items()}
    rows = []
    for x in launches:
        st = variants[x.variant]
        est = estimate(st, launch_model(x), x)
        rows.append({"site": x.site, "kernel": x.kernel, "variant": x.variant[:12], "grid": list(x.grid),
                     "programs": x.programs, "num_warps": st["num_warps"], "share_of_layers": x.share, **est})
    # Per family and decode batch: the decode layer's estimate (each launch weighted by the share
    # of layers making it), and tokens/s with the lm_head at the bandwidth bound (only where every
    # kernel was selected).
    per_token = []
    if not wanted:
        for f in families:
            cfg = _shapes(f)
            lm_head = cfg.vocab_size * cfg.hidden_size * 2 / HBM_BYTES_PER_S * 1e6
            for b in batches:
                for lora in (False, True):
                    tag = f"{f} decode{'+lora' if lora else ''} T={b} "
                    sel = [r for r in rows if r["site"].startswith(tag)]
                    if not sel:
                        continue
                    layer = sum(r["t_est_us"] * r["share_of_layers"] for r in sel)
                    mem = sum(r["t_mem_us"] * r["share_of_layers"] for r in sel)
                    step = layer * cfg.num_layers + lm_head
                    per_token.append({"family": f, "batch": b, "lora": lora, "launches_per_layer": round(sum(r["share_of_layers"] for r in sel), 2),
                                      "layer_est_us": round(layer, 2), "layer_mem_bound_us": round(mem, 2),
                                      "layers": cfg.num_layers, "lm_head_mem_us": round(lm_head, 2),
                                      "step_est_ms": round(step / 1e3, 3),
                                      "step_mem_bound_ms": round((mem * cfg.num_layers + lm_head) / 1e3, 3),
                                      "tok_s_est": round(b / step * 1e6, 1),
                                      "tok_s_mem_bound": round(b / (mem * cfg.num_layers + lm_head) * 1e6, 1)})
    vlist = []
    for h, st in variants.items():
        sites = [x.site for x in launches if x.variant == h]
        vlist.append({"variant": h[:12], "kernel": st["name"], "launches": len(sites), "example_site": sites[0], **st})
    out = {"tool": "bench/sass.py", "machine": machine(),
           "args": {k: v for k, v in vars(args).items()},
           "roofline": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "sms": NUM_SMS, "schedulers_per_sm": SCHEDULERS_PER_SM,
                        "clock_hz": CLOCK_HZ},
           "variants": vlist, "launches": rows, "per_token": per_token,
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

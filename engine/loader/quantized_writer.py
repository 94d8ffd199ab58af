"""Quantized checkpoints written from a dense HF checkpoint directory, as AutoAWQ, GPTQModel and
llm-compressor (compressed-tensors) lay them out: what tests and benchmarks load in place of
downloads (engine.loader.hf_quantized reads them back).

Every decoder-layer linear (`model.layers.{i}.{self_attn,mlp}.*_proj.weight`, Phi-3's fused
qkv_proj / gate_up_proj included) is quantized round-to-nearest per group of inputs from its
fp32 values, no calibration; every other tensor (embeddings, lm_head, norms, biases) is copied as
stored. config.json gains the `quantization_config` the format's tool writes; shards keep their
names (an index's weight_map is rewritten), other files (tokenizer, generation config) are
copied. Tensors are converted shard by shard.

The layouts are those engine.loader.hf_quantized documents; the rounding follows each tool's
RTN quantizer (AWQ: min/max with zero point; GPTQ: min/max including 0, or symmetric around
2^(bits-1); compressed-tensors: absmax / ((2^bits - 1) / 2), or min/max with a signed zero point).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader.hf_quantized import AWQ_ORDER
from engine.loader.safetensors_loader import INDEX_FILE, shard_files

#: The dense tensors quantized: decoder-layer linear weights.
LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values (0..2^bits-1) packed along `dim`, 32/bits per int32 word, value i of a
    word at bit bits*i (the inverse of hf_quantized.unpack_int32). `dim`'s size must be a
    multiple of 32/bits."""
    per = 32 // bits
    dim = dim % values.dim()
    if values.shape[dim] % per:
        raise ValueError(f"{values.shape[dim]} values along dim {dim} do not fill {bits}-bit words")
    v = values.to(torch.int64)
    v = v.unflatten(dim, (v.shape[dim] // per, per))
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view([per] + [1] * (v.dim() - dim - 2))
    words = (v << shifts).sum(dim=dim + 1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def scale_at_least(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales stored as `dtype`, rounded up where rounding to nearest would shrink them, so
    a group's range still fits the codes (an fp16/bf16 rounding down would clamp its extremes)."""
    s = x.to(dtype)
    return torch.where(s.float() < x, torch.nextafter(s, torch.full_like(s, float("inf"))), s)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] as [N, K / G, G]."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"{k} inputs are not whole groups of {group_size}")
    return w.view(n, k // group_size, group_size)


def awq_tensors(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A dense weight [N, K] as AWQ GEMM qweight/qzeros/scales (4-bit, zero point)."""
    n, k = w.shape
    wg = _groups(w.float(), group_size)
    hi, lo = wg.amax(dim=2), wg.amin(dim=2)
    s = scale_at_least((hi - lo).clamp(min=1e-5) / 15, torch.float16)
    z = (-torch.round(lo / s.float())).clamp(0, 15)
    q = (torch.round(wg / s.float()[..., None]) + z[..., None]).clamp(0, 15).view(n, k)
    order = list(AWQ_ORDER)
    q_awq = q.t().reshape(k, n // 8, 8)[:, :, order].reshape(k, n)
    z_awq = z.t().reshape(-1, n // 8, 8)[:, :, order].reshape(-1, n)
    return {"qweight": pack_int32(q_awq, 4, dim=1), "qzeros": pack_int32(z_awq, 4, dim=1),
            "scales": s.t().contiguous()}


def act_order(w: torch.Tensor) -> torch.Tensor:
    """A non-trivial act-order: inputs by descending column norm (GPTQ orders them by the
    Hessian's diagonal, which calibration provides and a writer without data does not)."""
    return torch.argsort(w.float().norm(dim=0), descending=True, stable=True)


def gptq_tensors(w: torch.Tensor, *, bits: int, group_size: int, sym: bool, desc_act: bool,
                 v1: bool) -> dict[str, torch.Tensor]:
    """A dense weight [N, K] as GPTQ qweight/qzeros/scales/g_idx. `group_size` -1: one group of
    all inputs. `desc_act`: groups formed in `act_order`, g_idx[k] = position of k // G. `v1`
    stores z - 1, so an asymmetric zero point is at least 1 (v1 cannot hold 0)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    perm = act_order(w) if desc_act else torch.arange(k)
    wg = _groups(w.float()[:, perm], g)
    lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    s = scale_at_least((hi - lo) / maxq, torch.float16)
    if sym:
        z = torch.full_like(s, (maxq + 1) // 2, dtype=torch.float32)
    else:
        z = torch.round(-lo / s.float()).clamp(1 if v1 else 0, maxq)
    qp = (torch.round(wg / s.float()[..., None]) + z[..., None]).clamp(0, maxq).view(n, k)
    q = torch.empty_like(qp)
    q[:, perm] = qp
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    stored_z = z.t() - (1 if v1 else 0)
    return {"qweight": pack_int32(q.t(), bits, dim=0), "qzeros": pack_int32(stored_z, bits, dim=1),
            "scales": s.t().contiguous(), "g_idx": g_idx}


def compressed_tensors(w: torch.Tensor, *, bits: int, group_size: int | None, symmetric: bool,
                       scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A dense weight [N, K] as compressed-tensors pack-quantized weight_packed / weight_scale /
    weight_shape (+ weight_zero_point packed along outputs when asymmetric). `group_size` None:
    strategy "channel"."""
    n, k = w.shape
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    wg = _groups(w.float(), k if group_size is None else group_size)
    if symmetric:
        absmax = wg.abs().amax(dim=2)
        s = scale_at_least((absmax / ((qmax - qmin) / 2)).clamp(min=1e-8), scale_dtype)
        zp = torch.zeros_like(s, dtype=torch.float32)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        s = scale_at_least(((hi - lo) / (qmax - qmin)).clamp(min=1e-8), scale_dtype)
        zp = (qmin - torch.round(lo / s.float())).clamp(qmin, qmax)
    q = (torch.round(wg / s.float()[..., None]) + zp[..., None]).clamp(qmin, qmax).view(n, k)
    offset = 1 << (bits - 1)
    out = {"weight_packed": pack_int32((q + offset), bits, dim=1), "weight_scale": s.contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = pack_int32(zp + offset, bits, dim=0)
    return out


def _write(dense_dir, out_dir, quantization_config: dict, quantize) -> Path:
    """Copy `dense_dir` to `out_dir` with every LAYER_LINEAR weight replaced by quantize(w)'s
    tensors (named module + "." + key) and `quantization_config` in config.json."""
    src, out = Path(dense_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in shard_files(src):
        tensors = {}
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if LAYER_LINEAR.fullmatch(key):
                    module = key.removesuffix(".weight")
                    tensors.update((f"{module}.{part}", v) for part, v in quantize(t).items())
                else:
                    tensors[key] = t.contiguous()
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
        weight_map.update((key, shard.name) for key in tensors)
    if (src / INDEX_FILE).is_file():
        index = json.loads((src / INDEX_FILE).read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX_FILE):
            shutil.copy2(extra, out / extra.name)
    return out


def write_awq(dense_dir, out_dir, group_size: int = 128) -> Path:
    """An AWQ GEMM 4-bit checkpoint of `dense_dir` in `out_dir` (config as AutoAWQ writes it)."""
    config = {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
              "modules_to_not_convert": None}
    return _write(dense_dir, out_dir, config, lambda w: awq_tensors(w, group_size))


def write_gptq(dense_dir, out_dir, *, bits: int, group_size: int, sym: bool, desc_act: bool,
               checkpoint_format: str = "gptq") -> Path:
    """A GPTQ checkpoint of `dense_dir` in `out_dir` (config as GPTQModel writes it);
    `checkpoint_format` "gptq" (v1, zeros stored - 1) or "gptq_v2"."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', not {checkpoint_format!r}")
    config = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, "lm_head": False,
              "quant_method": "gptq", "checkpoint_format": checkpoint_format, "pack_dtype": "int32",
              "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
              "meta": {"quantizer": ["tessera-rtn"]}}
    v1 = checkpoint_format == "gptq"
    return _write(dense_dir, out_dir, config, lambda w: gptq_tensors(w, bits=bits, group_size=group_size, sym=sym,
                                                                       desc_act=desc_act, v1=v1))


def write_compressed(dense_dir, out_dir, *, bits: int, strategy: str, group_size: int | None = None,
                     symmetric: bool = True, scale_dtype: torch.dtype = torch.bfloat16) -> Path:
    """A compressed-tensors pack-quantized checkpoint of `dense_dir` in `out_dir` (config as
    llm-compressor saves it: targets "Linear", lm_head ignored). `strategy` "group" (with
    `group_size`) or "channel"."""
    if strategy not in ("group", "channel"):
        raise ValueError(f"strategy must be 'group' or 'channel', not {strategy!r}")
    g = group_size if strategy == "group" else None
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": g, "strategy": strategy,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}}
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                            "output_activations": None, "format": "pack-quantized"}},
              "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": "pack-quantized",
              "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ["lm_head"],
              "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}
    return _write(dense_dir, out_dir, config, lambda w: compressed_tensors(w, bits=bits, group_size=g,
                                                                           symmetric=symmetric,
                                                                           scale_dtype=scale_dtype))


#: The largest finite FP8 E4M3 (float8_e4m3fn) value.
E4M3_MAX = 448.0


def compressed_fp8(w: torch.Tensor, *, strategy: str, group_size: int | None = None,
                   block: tuple[int, int] | None = None, scale_dtype: torch.dtype = torch.bfloat16
                   ) -> dict[str, torch.Tensor]:
    """A dense weight [N, K] as compressed-tensors float-quantized `weight` (float8_e4m3fn) and
    `weight_scale` (absmax / 448 per tensor [1], channel [N, 1], group [N, K/G] or block
    [N/bn, K/bk]), quantized as the package does: w / s clamped to +-448, rounded to E4M3."""
    n, k = w.shape
    wf = w.float()
    if strategy == "tensor":
        absmax = wf.abs().amax().reshape(1)
    elif strategy == "channel":
        absmax = wf.abs().amax(dim=1, keepdim=True)
    elif strategy == "group":
        absmax = _groups(wf, group_size).abs().amax(dim=2)
    elif strategy == "block":
        bn, bk = block  # edge blocks cover what is left (the package pads with zeros)
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(wf, (0, cols * bk - k, 0, rows * bn - n))
        absmax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    else:
        raise ValueError(f"strategy must be tensor, channel, group or block, not {strategy!r}")
    s = scale_at_least((absmax / E4M3_MAX).clamp(min=1e-12), scale_dtype)
    full = s.float()
    if strategy == "tensor":
        full = full.reshape(1, 1).expand(n, k)
    elif strategy == "channel":
        full = full.expand(n, k)
    elif strategy == "group":
        full = full.repeat_interleave(group_size, dim=1)[:, :k]
    else:
        full = full.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:n, :k]
    q = (wf / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": q.contiguous(), "weight_scale": s.contiguous()}


def write_compressed_fp8(dense_dir, out_dir, *, strategy: str, group_size: int | None = None,
                         block: tuple[int, int] | None = None, scale_dtype: torch.dtype = torch.bfloat16,
                         dynamic_activations: bool = True) -> Path:
    """A compressed-tensors float-quantized (FP8 e4m3) checkpoint of `dense_dir` in `out_dir`, its
    config as llm-compressor saves FP8 schemes (targets "Linear", lm_head ignored); with
    `dynamic_activations` the FP8_DYNAMIC scheme's per-token FP8 input activations, which the
    engine does not apply (engine.loader.hf_quantized)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": group_size if strategy == "group" else None,
               "block_structure": list(block) if strategy == "block" else None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token",
            "group_size": None, "block_structure": None, "actorder": None, "observer": None,
            "observer_kwargs": {}} if dynamic_activations else None
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                            "output_activations": None, "format": "float-quantized"}},
              "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": "float-quantized",
              "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ["lm_head"],
              "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}
    return _write(dense_dir, out_dir, config, lambda w: compressed_fp8(w, strategy=strategy, group_size=group_size,
                                                                       block=block, scale_dtype=scale_dtype))

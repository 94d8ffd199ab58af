"""Quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors): config.json's
`quantization_config` read into a scheme, and each quantized module's tensors converted into an
engine.loader.quantized.QuantizedWeight, codes and scales as stored (never dequantized).

A scheme says which tensors make up a quantized module (`parts`, found by the `marker` tensor
`<module>.<marker>`) and converts them (`convert`). Every conversion is exact: the QuantizedWeight's
`dequantize()` equals the format's own (q - z) * s bit for bit in fp32, and rounded to fp16/bf16
it equals what the format's fp16/bf16 dequantization computes.

Formats (N outputs, K inputs, G inputs per group):

- AWQ GEMM (`quant_method` "awq", `version` "gemm", 4-bit, zero point): `qweight` int32 [K, N/8]
  packed along outputs, nibble i of word c holding output 8c + AWQ_ORDER[i]; `qzeros` int32
  [K/G, N/8] packed alike; `scales` fp16 [K/G, N]. W[n, k] = (q - z) * s.
- GPTQ (`quant_method` "gptq", 4 or 8 bits): `qweight` int32 [K*bits/32, N] packed along inputs
  (word r holds inputs r*32/bits + i at bit bits*i); `qzeros` int32 [groups, N*bits/32] packed
  along outputs; `scales` fp16 [groups, N]; `g_idx` int32 [K], input k's group. Checkpoint format
  "gptq" (v1) stores z - 1, "gptq_v2" stores z. W[n, k] = (q - z[g_idx[k]]) * s[g_idx[k]].
  Act-order (`desc_act`): g_idx is not k // G; the inputs sorted by group (a stable argsort) must
  form groups of G contiguous inputs, and that order becomes QuantizedWeight.perm.
- compressed-tensors (`quant_method` "compressed-tensors"), format "pack-quantized" (int 4/8-bit
  weights, `weight_packed` int32 [N, K*bits/32] packed along inputs, values stored + 2^(bits-1),
  `weight_scale` [N, groups], `weight_zero_point` when asymmetric (int32 packed along outputs the
  same way, or int8 [N, groups]), optional `weight_g_idx`) and "naive-quantized" (`weight` int8
  [N, K] as is). W = (q - zp) * s with q, zp signed. Format "float-quantized": FP8 E4M3 `weight`
  (float8_e4m3fn [N, K]) with `weight_scale` per tensor ([1]), per channel ([N, 1]), per group
  ([N, K/G]) or per block ([ceil(N/bn), ceil(K/bk)]); W = w * s. FP8 input activations in the
  config (dynamic, or static with `input_scale` tensors) are not applied: the engine runs such a
  checkpoint weight-only, activations in its own dtype.

Which modules are quantized is what the checkpoint holds (a module with the marker tensor); a
quantized module outside the decoder layers (a quantized lm_head or embedding) is refused, since
the engine keeps those dense. Anything else these formats can state that is not served (other
kernels' layouts, bit widths, int activation or KV-cache quantization, transforms) is one
UnsupportedQuantizationError line naming it and what is supported.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from engine.loader.quantized import QuantizedWeight, UnsupportedQuantizationError, pack_nibbles

#: Nibble i of an AWQ word holds output 8c + AWQ_ORDER[i] (AutoAWQ's GEMM packing).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Output j of an AWQ word sits in nibble AWQ_NIBBLE_OF[j] (the inverse of AWQ_ORDER).
AWQ_NIBBLE_OF = tuple(AWQ_ORDER.index(j) for j in range(8))

#: Where a quantized module may sit: the decoder layers' linears (the engine keeps the rest dense).
_LAYER_MODULE = re.compile(r"model\.layers\.\d+\.")

_SERVED = ("served are AWQ gemm 4-bit with zero point; GPTQ 4/8-bit (gptq, gptq_v2 checkpoint formats, act-order); "
           "compressed-tensors pack-quantized / naive-quantized int 4/8-bit group or channel weights, "
           "float-quantized FP8 e4m3 tensor/channel/group/block weights")


def _refuse(what: str, where: str = "") -> UnsupportedQuantizationError:
    verb = "are" if what.endswith("weights") else "is"
    return UnsupportedQuantizationError(f"{what} {verb} not served{where}: {_SERVED}")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits values each (value i at bit bits*i) -> uint8 values, `dim`
    expanded: out[..., w*(32/bits) + i, ...] = (packed[..., w, ...] >> bits*i) & (2^bits - 1)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensors must be int32, not {packed.dtype}")
    dim = dim % packed.dim()
    mask = (1 << bits) - 1
    values = [((packed >> (bits * i)) & mask).to(torch.uint8) for i in range(32 // bits)]
    return torch.stack(values, dim=dim + 1).flatten(dim, dim + 1)


def _codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [N, K] (0..2^bits-1) as QuantizedWeight codes: 4-bit nibbles packed,
    8-bit shifted by -128 into int8 (the caller folds the shift into mins)."""
    if bits == 4:
        return pack_nibbles(u.contiguous())
    return (u.to(torch.int16) - 128).to(torch.int8)


def _mins(zero_units: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """-(zero_units * scales) in fp32: exact, both factors being small integers and fp16/bf16 values."""
    return -(zero_units.float() * scales.float())


def _group_perm(g_idx: torch.Tensor, group_size: int, what: str) -> torch.Tensor | None:
    """The input order that makes each group G contiguous inputs (act-order), None when g_idx is
    already k // G. UnsupportedQuantizationError when sorting cannot make every group contiguous."""
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    expected = torch.arange(k) // group_size
    if torch.equal(g_idx, expected):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], expected):
        raise _refuse(f"{what} with g_idx whose groups are not {group_size} inputs each")
    return perm


def _weight(what: str, **fields) -> QuantizedWeight:
    """A QuantizedWeight, its shape errors (a K or group that the codes layout cannot hold) as
    UnsupportedQuantizationError naming the module."""
    try:
        return QuantizedWeight(**fields)
    except ValueError as e:
        raise _refuse(f"{what}: {e}") from None


@dataclasses.dataclass(frozen=True)
class AwqScheme:
    """AWQ GEMM: 4-bit, zero point, `group_size` inputs per group."""

    group_size: int
    marker = "qweight"
    parts = ("qweight", "qzeros", "scales")

    @property
    def source(self) -> str:
        return f"awq g{self.group_size}"

    def convert(self, module: str, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The module's qweight/qzeros/scales as a 4-bit QuantizedWeight: scales fp32 = s,
        mins fp32 = -(z * s)."""
        what = f"{module} ({self.source})"
        qweight, qzeros, scales = _require(t, self.parts, what)
        k, n = qweight.shape[0], qweight.shape[1] * 8
        groups = -(-k // self.group_size)
        if tuple(qzeros.shape) != (groups, n // 8) or tuple(scales.shape) != (groups, n):
            raise ValueError(f"{what}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                             f"scales {tuple(scales.shape)} do not fit group size {self.group_size}")
        order = list(AWQ_NIBBLE_OF)
        # Transposed while packed (a quarter of the unpacked bytes), unpacked straight into [N, K].
        q = unpack_int32(qweight.t().contiguous(), 4, dim=0).view(n // 8, 8, k)[:, order].reshape(n, k)
        z = unpack_int32(qzeros.t().contiguous(), 4, dim=0).view(n // 8, 8, groups)[:, order].reshape(n, groups)
        s = scales.t().float().contiguous()
        return _weight(what, bits=4, codes=_codes(q, 4), scales=s, mins=_mins(z, s),
                       group_size=self.group_size, source=self.source)


@dataclasses.dataclass(frozen=True)
class GptqScheme:
    """GPTQ: `bits` 4 or 8, `group_size` (-1: one group of all inputs), `v1` when stored zeros
    are z - 1 (checkpoint format "gptq")."""

    bits: int
    group_size: int
    v1: bool
    desc_act: bool
    marker = "qweight"
    parts = ("qweight", "qzeros", "scales", "g_idx")

    @property
    def source(self) -> str:
        g = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"gptq{'' if self.v1 else '_v2'} {self.bits}-bit {g}" + (" act-order" if self.desc_act else "")

    def convert(self, module: str, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The module's tensors as a QuantizedWeight: 4-bit codes as stored with mins fp32 -(z * s);
        8-bit codes - 128 with mins (128 - z) * s, or no mins and the fp16 scales as stored when
        every z is 128 (symmetric)."""
        what = f"{module} ({self.source})"
        qweight, qzeros, scales = _require(t, self.parts[:3], what)
        per = 32 // self.bits
        k, n = qweight.shape[0] * per, qweight.shape[1]
        g = k if self.group_size == -1 else self.group_size
        groups = -(-k // g)
        if tuple(qzeros.shape) != (groups, n // per) or tuple(scales.shape) != (groups, n):
            raise ValueError(f"{what}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                             f"scales {tuple(scales.shape)} do not fit group size {self.group_size}")
        g_idx = t.get("g_idx")
        if g_idx is not None and g_idx.numel() != k:
            raise ValueError(f"{what}: g_idx has {g_idx.numel()} entries for {k} inputs")
        perm = None if g_idx is None else _group_perm(g_idx, g, what)
        q = unpack_int32(qweight.t().contiguous(), self.bits, dim=1)  # [N, K]
        if perm is not None:
            q = q[:, perm]
        z = unpack_int32(qzeros, self.bits, dim=1).t().to(torch.int32) + (1 if self.v1 else 0)  # [N, groups]
        s = scales.t().contiguous()
        if self.bits == 4:
            s32 = s.float()
            return _weight(what, bits=4, codes=_codes(q, 4), scales=s32, mins=_mins(z, s32), group_size=g,
                           perm=perm, source=self.source)
        mid = 1 << (self.bits - 1)
        if bool((z == mid).all()) and s.dtype == torch.float16:
            return _weight(what, bits=8, codes=_codes(q, 8), scales=s, mins=None, group_size=g, perm=perm,
                           source=self.source)
        s32 = s.float()
        return _weight(what, bits=8, codes=_codes(q, 8), scales=s32, mins=_mins(z - mid, s32), group_size=g,
                       perm=perm, source=self.source)


@dataclasses.dataclass(frozen=True)
class WeightArgs:
    """One compressed-tensors config group's weight quantization (static)."""

    bits: int
    symmetric: bool
    group_size: int | None  # None: strategy "channel" (one group of all inputs)
    targets: tuple[str, ...]
    kind: str = "int"  # "int", or "float" (FP8 e4m3, float-quantized)
    strategy: str = ""  # float: "tensor", "channel", "group" or "block"
    block: tuple[int, int] | None = None  # float, strategy "block": (outputs, inputs) a scale covers


@dataclasses.dataclass(frozen=True)
class CompressedScheme:
    """compressed-tensors "pack-quantized" or "naive-quantized" int weights; which config group
    applies to a module is the first whose targets match it ("Linear", "re:<regex>", or a
    module name) and that `ignore` does not."""

    packed: bool
    groups: tuple[WeightArgs, ...]
    ignore: tuple[str, ...]
    float_weights: bool = False  # float-quantized (FP8 e4m3 `weight`, never packed)

    @property
    def source(self) -> str:
        if self.float_weights:
            return "compressed-tensors float-quantized"
        return "compressed-tensors " + ("pack-quantized" if self.packed else "naive-quantized")

    @property
    def marker(self) -> str:
        return "weight_packed" if self.packed else "weight_scale"

    @property
    def parts(self) -> tuple[str, ...]:
        if self.float_weights:  # input_scale: a static FP8 activation scale, read and not applied
            return "weight", "weight_scale", "input_scale"
        return (("weight_packed", "weight_shape") if self.packed else ("weight",)) + \
            ("weight_scale", "weight_zero_point", "weight_g_idx")

    def args_of(self, module: str) -> WeightArgs:
        """The config group that quantizes `module`; UnsupportedQuantizationError when the
        config says it is not quantized (ignored, or no group targets it)."""
        if any(_target_matches(x, module) for x in self.ignore):
            raise _refuse(f"{module}: quantized in the checkpoint but in compressed-tensors' ignore list")
        for args in self.groups:
            if any(_target_matches(x, module) for x in args.targets):
                return args
        raise _refuse(f"{module}: quantized in the checkpoint but no compressed-tensors config group targets it")

    def convert(self, module: str, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The module's tensors as a QuantizedWeight. 4-bit: codes the stored values (q + 8),
        mins fp32 -(8 + zp) * s. 8-bit: codes q, mins fp32 -zp * s, or none when symmetric (fp16
        scales kept, bf16 scales as fp32: exact)."""
        args = self.args_of(module)
        if args.kind == "float":
            return self._convert_fp8(module, args, t)
        g_name = "channel" if args.group_size is None else f"g{args.group_size}"
        source = f"{self.source} {args.bits}-bit {g_name}" + ("" if args.symmetric else " asym")
        what = f"{module} ({source})"
        (scale,) = _require(t, ("weight_scale",), what)
        if self.packed:
            packed, shape = _require(t, ("weight_packed", "weight_shape"), what)
            n, k = (int(x) for x in shape.tolist())
            if packed.shape[0] != n or packed.shape[1] * (32 // args.bits) < k:
                raise ValueError(f"{what}: weight_packed {tuple(packed.shape)} does not hold weight_shape {(n, k)}")
            u = unpack_int32(packed, args.bits, dim=1)[:, :k]  # q + 2^(bits-1)
        else:
            (w,) = _require(t, ("weight",), what)
            if w.dtype != torch.int8:
                raise ValueError(f"{what}: weight must be int8, not {w.dtype}")
            n, k = w.shape
            u = (w.to(torch.int16) + (1 << (args.bits - 1))).to(torch.uint8)
        g = k if args.group_size is None else args.group_size
        groups = -(-k // g)
        if tuple(scale.shape) != (n, groups):
            raise ValueError(f"{what}: weight_scale {tuple(scale.shape)}, expected {(n, groups)}")
        zp = None if args.symmetric else self._zero_point(t.get("weight_zero_point"), args.bits, n, groups, what)
        perm = None
        if "weight_g_idx" in t:
            perm = _group_perm(t["weight_g_idx"], g, what)
            if perm is not None:
                u = u[:, perm]
        s = _exact_scale(scale, what)
        if args.bits == 4:
            s32 = s.float()
            units = torch.full((n, groups), 8, dtype=torch.int32) + (0 if zp is None else zp)
            return _weight(what, bits=4, codes=_codes(u, 4), scales=s32, mins=_mins(units, s32), group_size=g,
                           perm=perm, source=source)
        if zp is None:
            return _weight(what, bits=8, codes=_codes(u, 8), scales=s if s.dtype == torch.float16 else s.float(),
                           mins=None, group_size=g, perm=perm, source=source)
        s32 = s.float()
        return _weight(what, bits=8, codes=_codes(u, 8), scales=s32, mins=_mins(zp, s32), group_size=g, perm=perm,
                       source=source)

    def _convert_fp8(self, module: str, args: WeightArgs, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        """An FP8 E4M3 weight as e4m3 codes (its bytes) with fp32 scales per row and group: per
        tensor and per channel one group of all K inputs, per block each row repeating its block
        row's scales (exact: the same values)."""
        strategy = args.strategy + ("" if args.group_size is None or args.strategy != "group" else f" g{args.group_size}")
        source = f"{self.source} fp8 e4m3 {strategy}"
        what = f"{module} ({source})"
        w, scale = _require(t, ("weight", "weight_scale"), what)
        if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
            raise ValueError(f"{what}: weight must be float8_e4m3fn [N, K], not {w.dtype} {tuple(w.shape)}")
        n, k = w.shape
        codes = w.contiguous().view(torch.int8)
        if ((codes & 0x7F) == 0x7F).any():
            raise ValueError(f"{what}: the weight holds NaN (FP8 bit pattern 0x7F / 0xFF)")
        s = scale.float()
        if args.strategy == "tensor":
            if s.numel() != 1:
                raise ValueError(f"{what}: weight_scale {tuple(s.shape)}, expected one value")
            s, g = s.reshape(1, 1).expand(n, 1), k
        elif args.strategy == "channel":
            if tuple(s.shape) not in ((n, 1), (n,)):
                raise ValueError(f"{what}: weight_scale {tuple(s.shape)}, expected {(n, 1)}")
            s, g = s.reshape(n, 1), k
        elif args.strategy == "group":
            g = args.group_size
            if tuple(s.shape) != (n, -(-k // g)):
                raise ValueError(f"{what}: weight_scale {tuple(s.shape)}, expected {(n, -(-k // g))}")
        else:  # block
            bn, g = args.block
            if tuple(s.shape) != (-(-n // bn), -(-k // g)):
                raise ValueError(f"{what}: weight_scale {tuple(s.shape)}, expected {(-(-n // bn), -(-k // g))}")
            s = s.repeat_interleave(bn, dim=0)[:n]
        return _weight(what, bits=8, codes=codes, scales=s.contiguous(), mins=None, group_size=g, source=source,
                       code_format="e4m3")

    def _zero_point(self, zp: torch.Tensor | None, bits: int, n: int, groups: int, what: str) -> torch.Tensor:
        """Signed zero points int32 [N, groups] from either stored form."""
        if zp is None:
            raise ValueError(f"{what}: asymmetric but no weight_zero_point")
        if zp.dtype == torch.int32 and self.packed:
            zp = unpack_int32(zp, bits, dim=0)[:n].to(torch.int32) - (1 << (bits - 1))
        zp = zp.to(torch.int32)
        if tuple(zp.shape) != (n, groups):
            raise ValueError(f"{what}: weight_zero_point {tuple(zp.shape)}, expected {(n, groups)}")
        return zp


Scheme = AwqScheme | GptqScheme | CompressedScheme


def _require(t: dict[str, torch.Tensor], names, what: str) -> list[torch.Tensor]:
    missing = [x for x in names if x not in t]
    if missing:
        raise ValueError(f"{what}: missing tensor {missing[0]}")
    return [t[x] for x in names]


def _exact_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    """compressed-tensors scales as fp16/bf16 values, whose products with 9-bit integers are
    exact in fp32; fp32 scales are accepted when they are bf16 values (a bf16 model saved as fp32)."""
    if scale.dtype in (torch.float16, torch.bfloat16):
        return scale
    if scale.dtype == torch.float32 and torch.equal(scale, scale.to(torch.bfloat16).float()):
        return scale.to(torch.bfloat16)
    raise _refuse(f"{what}: {scale.dtype} weight_scale (only fp16/bf16 scales dequantize exactly)")


def _target_matches(target: str, module: str) -> bool:
    """compressed-tensors' rule for a target: "re:<regex>" matched at the name's start, a class
    name (every quantizable module here is a "Linear"), or the exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


def quantization_of(config: dict) -> Scheme | None:
    """The scheme of a config.json (None when it has no `quantization_config`).
    UnsupportedQuantizationError, one line naming the format and what is served, for anything
    not served."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "awq":
        return _awq_scheme(q)
    if method == "gptq":
        return _gptq_scheme(q)
    if method == "compressed-tensors":
        return _compressed_scheme(q)
    raise _refuse(f"quant_method {method or '(missing)'!r}")


def _group_size(q: dict, what: str, bits: int, allow_channel: bool) -> int:
    g = int(q.get("group_size", q.get("q_group_size", 128)))
    if g == -1 and allow_channel:
        return g
    if g <= 0 or g % (32 if bits == 4 else 16):
        raise _refuse(f"{what} group_size {g} (4-bit groups are multiples of 32, 8-bit of 16)")
    return g


def _awq_scheme(q: dict) -> AwqScheme:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r} (its packing is the {version} kernels')")
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        raise _refuse(f"AWQ {bits}-bit")
    if not q.get("zero_point", True):
        raise _refuse("AWQ without zero_point")
    return AwqScheme(group_size=_group_size(q, "AWQ", 4, allow_channel=False))


def _gptq_scheme(q: dict) -> GptqScheme:
    bits = int(q.get("bits", 4))
    if bits not in (4, 8):
        raise _refuse(f"GPTQ {bits}-bit")
    fmt = str(q.get("checkpoint_format") or q.get("format") or "gptq").lower()
    if q.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r}")
    pack = str(q.get("pack_dtype", "int32"))
    if pack != "int32":
        raise _refuse(f"GPTQ pack_dtype {pack!r}")
    overrides = [k for k in (q.get("dynamic") or {}) if not str(k).startswith("-:")]
    if overrides:
        raise _refuse(f"GPTQ per-module `dynamic` overrides ({overrides[0]!r})")
    return GptqScheme(bits=bits, group_size=_group_size(q, "GPTQ", bits, allow_channel=True),
                      v1=fmt == "gptq", desc_act=bool(q.get("desc_act")))


def _compressed_scheme(q: dict) -> CompressedScheme:
    fmt = str(q.get("format") or "dense")
    status = str(q.get("quantization_status") or "compressed")
    if status != "compressed":
        raise _refuse(f"compressed-tensors quantization_status {status!r} (weights not compressed)")
    if q.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme (KV-cache quantization)")
    if q.get("transform_config"):
        raise _refuse("compressed-tensors transform_config (rotated weights)")
    sparsity = q.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")) != "dense":
        raise _refuse(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    groups, formats = [], set()
    for name, group in (q.get("config_groups") or {}).items():
        gfmt = str(group.get("format") or fmt)
        formats.add(gfmt)
        if gfmt == "float-quantized":
            groups.append(_fp8_weight_args(name, group))
            continue
        if gfmt not in ("pack-quantized", "naive-quantized"):
            raise _refuse(f"compressed-tensors format {gfmt!r}")
        if group.get("input_activations") or group.get("output_activations"):
            raise _refuse(f"compressed-tensors activation quantization (config group {name!r})")
        w = group.get("weights")
        if not w:
            raise _refuse(f"compressed-tensors config group {name!r} without weight quantization")
        bits, kind, strategy = int(w.get("num_bits", 0)), str(w.get("type", "int")), str(w.get("strategy"))
        what = f"compressed-tensors {gfmt} {kind} {bits}-bit {strategy}"
        if kind != "int":
            raise _refuse(f"{what} weights (type {kind!r})")
        if bits not in (4, 8) or (bits == 4 and gfmt == "naive-quantized"):
            raise _refuse(f"{what} weights")
        if w.get("dynamic"):
            raise _refuse(f"{what} dynamic weights")
        if strategy == "channel":
            g = None
        elif strategy == "group":
            g = _group_size({"group_size": w.get("group_size")}, what, bits, allow_channel=False)
        else:
            raise _refuse(f"{what} weights (strategy {strategy!r})")
        groups.append(WeightArgs(bits=bits, symmetric=bool(w.get("symmetric", True)), group_size=g,
                                 targets=tuple(group.get("targets") or ())))
    if not groups:
        raise _refuse("compressed-tensors config without config_groups")
    if len(formats) > 1:
        raise _refuse(f"compressed-tensors mixed formats {sorted(formats)}")
    return CompressedScheme(packed=formats == {"pack-quantized"}, groups=tuple(groups),
                            ignore=tuple(q.get("ignore") or ()), float_weights=formats == {"float-quantized"})


def _fp8_weight_args(name: str, group: dict) -> WeightArgs:
    """A float-quantized config group: FP8 e4m3 weights (static, symmetric); FP8 input
    activations are accepted and not applied (module docstring), any other activation scheme refused."""
    w = group.get("weights")
    if not w:
        raise _refuse(f"compressed-tensors config group {name!r} without weight quantization")
    bits, kind, strategy = int(w.get("num_bits", 0)), str(w.get("type", "int")), str(w.get("strategy"))
    what = f"compressed-tensors float-quantized {kind} {bits}-bit {strategy}"
    if kind != "float" or bits != 8:
        raise _refuse(f"{what} weights")
    if w.get("dynamic") or not w.get("symmetric", True):
        raise _refuse(f"{what} {'dynamic' if w.get('dynamic') else 'asymmetric'} weights")
    act = group.get("input_activations")
    if act and (str(act.get("type")) != "float" or int(act.get("num_bits", 0)) != 8):
        raise _refuse(f"compressed-tensors activation quantization {act.get('type')} {act.get('num_bits')}-bit "
                      f"(config group {name!r})")
    if group.get("output_activations"):
        raise _refuse(f"compressed-tensors output activation quantization (config group {name!r})")
    g, block = None, None
    if strategy == "group":
        g = int(w.get("group_size") or 0)
        if g <= 0 or g % 16:
            raise _refuse(f"{what} weights with group size {g} (a multiple of 16 is)")
    elif strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(int(b) > 0 for b in bs)) or int(bs[1]) % 16:
            raise _refuse(f"{what} weights with block_structure {bs!r} (blocks of [rows, a multiple of 16 inputs] are)")
        block = (int(bs[0]), int(bs[1]))
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"{what} weights (strategy {strategy!r})")
    return WeightArgs(bits=8, symmetric=True, group_size=g, targets=tuple(group.get("targets") or ()), kind="float",
                      strategy=strategy, block=block)


def check_module(scheme: Scheme, module: str) -> None:
    """UnsupportedQuantizationError for a quantized module the engine keeps dense (lm_head,
    embeddings: anything outside the decoder layers)."""
    if not _LAYER_MODULE.match(module):
        raise _refuse(f"{module} quantized ({scheme.source}): only decoder-layer linears may be quantized")

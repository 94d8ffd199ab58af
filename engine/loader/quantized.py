"""A checkpoint's quantized layer weight in one form every format converts into and every backend
reads: integer codes with per-group scales (and mins), never dequantized on the way in.

Semantics (`QuantizedWeight`, N outputs x K inputs):

    Wp[n, j] = codes[n, j] * scale[n, j // group_size] + min[n, j // group_size]     # fp32
    W[:, perm] = Wp            (perm None: W = Wp)
    y = x @ W.T = x[:, perm] @ Wp.T

    one level (super_size 0):  scale = scales, min = mins
    two levels (super_size S): R = S // group_size groups a super-block, for group g
        scale[n, g] = super_scales[n, g // R] * scales[n, g]          # fp32, scales uint8 or int8
        min[n, g]   = super_mins[n, g // R] * mins[n, g]

- `bits` 4: `codes` uint8 [N, K/2], values 0..15 packed as engine.backends.triton.w4a16's W4Weight
  (per 32 inputs, byte j holds input j in its low nibble and input j + 16 in its high nibble), so
  the W4A16 kernels read them as they are. `bits` 8: `codes` int8 [N, K], values -128..127 (formats
  with unsigned 8-bit or 5-/6-bit codes shift them into this range and fold the shift into `mins`,
  exactly: code * scale and the folded min are exact in fp32 for every format converted here).
- `code_format` "e4m3" (bits 8 only): `codes` hold FP8 E4M3 bit patterns (torch.float8_e4m3fn's,
  viewed as int8; compressed-tensors float-quantized checkpoints) instead of integers: a code's
  value is the FP8 number it encodes. Never NaN (0x7F / 0xFF): the converter refuses those.
- `scales`, `mins` (one level): fp16 or fp32 [N, ceil(K / group_size)]; `mins` None means zero
  (symmetric formats). fp16 where the format's own values are fp16 (GGUF Q4_0/Q4_1/Q8_0, AWQ/GPTQ
  scales), fp32 where the format multiplies two of them (a zero point times a scale; a K-quant's
  super-block d times a sub-block's scale, in its `one_level()` form): the product is exact in
  fp32 and not in fp16. Readers that want the values whatever the form call `group_scales()` / `group_mins()`.
- Two levels (`super_size` > 0, a multiple of `group_size`): `scales` and `mins` are integer
  sub-block values as the file stores them, uint8 (a K-quant's unsigned 6-bit or 4-bit sc and m:
  Q4_K, Q5_K, Q2_K) or int8 (signed scales: Q6_K's int8, Q3_K's 6-bit minus 32; both the same
  dtype), and `super_scales`, `super_mins` fp16 or fp32 [N, ceil(K / super_size)] the
  super-block's factors (a K-quant's d and -dmin: the minus folded into the factor, exact, since
  -(dmin m) = (-dmin) m in IEEE arithmetic, zeros included). With fp16 factors the products are
  exact in fp32 (an 11-bit significand times an integer of at most 8 bits), so the weights are bit
  for bit those of the one-level fp32 form (`group_scales`, `group_mins`), which costs 4 bytes
  a group for each of scale and min where this costs 1 plus 2 a super-block: Q4_K reads 4.625
  bits a weight instead of 6, Q6_K (int8 codes, 16-input groups) 8.5625 instead of 10.
  `super_mins` is None exactly when `mins` is (symmetric formats keep no mins: a zero added to
  a -0.0 product would make it +0.0). A super-block may end inside K (the last one partial),
  like a group.
- `group_size`: inputs per scale, a multiple of 16 (K-quant Q6_K/Q3_K sub-blocks are 16 inputs);
  bits 4 needs a multiple of 32 (a byte's two nibbles share a group).
- `perm`: GPTQ act-order (`desc_act` with `g_idx`): inputs are sorted once at load so each
  group's inputs are contiguous; the kernels then read x through `perm` (x[:, perm]).

`dequantize()` is the reference (fp32, computed as the semantics say, in the original input
order) that every converter is checked against bit for bit, and what a backend without a kernel
for the form (the CPU backend) multiplies by. `source` names the checkpoint's own format
("gguf q4_k", "awq g128", "gptq g128 act-order", ...), for logs and errors.
"""
from __future__ import annotations

import dataclasses

import torch

from engine.loader.architectures import UnsupportedModelError

#: Inputs per 4-bit packing block (byte j: input j low nibble, input j + 16 high nibble).
PACK = 32
#: The dtypes of a two-level weight's integer sub-block scales and mins (both the same).
SUB_SCALE_DTYPES = (torch.uint8, torch.int8)


class UnsupportedQuantizationError(UnsupportedModelError):
    """A checkpoint's quantization (a type, a bit width, a group size, a scheme) that no backend
    serves; the message names it and what is supported."""


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """See the module docstring."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int
    perm: torch.Tensor | None = None
    source: str = ""
    code_format: str = "int"  # "int", or "e4m3" (bits 8): FP8 E4M3 bit patterns
    super_scales: torch.Tensor | None = None  # two levels: fp16/fp32 [N, ceil(K / super_size)]
    super_mins: torch.Tensor | None = None  # two levels: super_scales' dtype and shape, None iff mins is
    super_size: int = 0  # inputs per super-block (a multiple of group_size); 0: one level

    def __post_init__(self):
        c, s, m, g = self.codes, self.scales, self.mins, self.group_size
        if self.code_format not in ("int", "e4m3") or (self.code_format == "e4m3" and self.bits != 8):
            raise ValueError(f"code_format must be 'int', or 'e4m3' with bits 8; not {self.code_format!r} "
                             f"with bits {self.bits}")
        if self.bits == 4:
            if c.dtype != torch.uint8 or c.dim() != 2 or c.shape[1] % (PACK // 2):
                raise ValueError(f"4-bit codes must be uint8 [N, K/2] with K a multiple of {PACK}, "
                                 f"not {c.dtype} {tuple(c.shape)}")
            if g % PACK:
                raise ValueError(f"4-bit group_size must be a multiple of {PACK}, not {g}")
        elif self.bits == 8:
            if c.dtype != torch.int8 or c.dim() != 2:
                raise ValueError(f"8-bit codes must be int8 [N, K], not {c.dtype} {tuple(c.shape)}")
        else:
            raise ValueError(f"bits must be 4 or 8, not {self.bits}")
        if g <= 0 or g % 16:
            raise ValueError(f"group_size must be a positive multiple of 16, not {g}")
        groups = -(-self.K // g)
        two = self.super_size != 0
        if two and (self.super_size < 0 or self.super_size % g):
            raise ValueError(f"super_size must be a positive multiple of group_size {g}, not {self.super_size}")
        kinds = SUB_SCALE_DTYPES if two else (torch.float16, torch.float32)
        for name, t in (("scales", s), ("mins", m)):
            if t is None:
                continue
            if t.dtype not in kinds or tuple(t.shape) != (self.N, groups):
                what = "uint8/int8 (two levels)" if two else "float16/float32"
                raise ValueError(f"{name} must be {what} [{self.N}, {groups}], not {t.dtype} {tuple(t.shape)}")
        if m is not None and m.dtype != s.dtype:
            raise ValueError(f"scales ({s.dtype}) and mins ({m.dtype}) must share a dtype")
        ss, sm = self.super_scales, self.super_mins
        if not two and (ss is not None or sm is not None):
            raise ValueError("super_scales and super_mins need a super_size (two levels)")
        if two:
            supers = -(-self.K // self.super_size)
            if (sm is None) != (m is None):
                raise ValueError("super_mins must be given exactly when mins are")
            for name, t in [("super_scales", ss)] + ([] if sm is None else [("super_mins", sm)]):
                if t is None or t.dtype not in (torch.float16, torch.float32) or tuple(t.shape) != (self.N, supers):
                    got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
                    raise ValueError(f"{name} must be float16/float32 [{self.N}, {supers}], not {got}")
            if sm is not None and sm.dtype != ss.dtype:
                raise ValueError(f"super_scales ({ss.dtype}) and super_mins ({sm.dtype}) must share a dtype")
        if self.perm is not None and (self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (self.K,)):
            raise ValueError(f"perm must be int64 [{self.K}], not {self.perm.dtype} {tuple(self.perm.shape)}")

    @property
    def N(self) -> int:
        return self.codes.shape[0]

    @property
    def K(self) -> int:
        return self.codes.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def shape(self) -> torch.Size:
        """(N, K): the dense weight's shape, as a torch.Tensor's."""
        return torch.Size((self.N, self.K))

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        """The per-row tensors by field name (what rows, permute_rows, cat_rows and to move)."""
        return {"codes": self.codes, "scales": self.scales, "mins": self.mins,
                "super_scales": self.super_scales, "super_mins": self.super_mins}

    def _map_rows(self, f) -> dict[str, torch.Tensor | None]:
        return {name: None if t is None else f(t) for name, t in self._tensors().items()}

    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight: codes, scales, mins (and super-block factors)."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values() if t is not None)

    def group_scales(self) -> torch.Tensor:
        """Each group's scale, fp32 [N, ceil(K / group_size)] (two levels: the exact products)."""
        return per_group_values(self.scales, self.super_scales, self.group_size, self.super_size)

    def group_mins(self) -> torch.Tensor | None:
        """Each group's min, fp32 [N, ceil(K / group_size)], or None (no mins)."""
        return None if self.mins is None else per_group_values(self.mins, self.super_mins, self.group_size,
                                                                 self.super_size)

    def one_level(self) -> QuantizedWeight:
        """The same weights with fp32 per-group scales and mins (itself when already one level)."""
        if not self.super_size:
            return self
        return dataclasses.replace(self, scales=self.group_scales(), mins=self.group_mins(), super_scales=None,
                                   super_mins=None, super_size=0)

    def int_codes(self) -> torch.Tensor:
        """The codes as int32 [N, K] in the stored (permuted) input order (integer codes only)."""
        if self.code_format != "int":
            raise ValueError(f"{self.source or 'this weight'}: {self.code_format} codes are not integers")
        if self.bits == 8:
            return self.codes.to(torch.int32)
        c = self.codes.view(self.N, -1, PACK // 2).to(torch.int32)
        return torch.cat([c & 0xF, c >> 4], dim=2).reshape(self.N, self.K)

    def code_values(self) -> torch.Tensor:
        """What each code stands for, fp32 [N, K] in the stored (permuted) input order."""
        if self.code_format == "e4m3":
            return self.codes.view(torch.float8_e4m3fn).float()
        return self.int_codes().float()

    def dequantize(self) -> torch.Tensor:
        """The reference: fp32 [N, K] in the original input order (module docstring)."""
        g = self.group_size
        scale = self.group_scales().repeat_interleave(g, dim=1)[:, :self.K]
        w = self.code_values() * scale
        if self.mins is not None:
            w = w + self.group_mins().repeat_interleave(g, dim=1)[:, :self.K]
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows start..stop (a fused tensor's part), sharing nothing mutable."""
        return dataclasses.replace(self, **self._map_rows(lambda t: t[start:stop].contiguous()))

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Output rows reordered (row i of the result is row order[i])."""
        return dataclasses.replace(self, **self._map_rows(lambda t: t[order].contiguous()))

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return dataclasses.replace(self, **self._map_rows(lambda t: t.to(device)),
                                   perm=None if self.perm is None else self.perm.to(device))


def per_group_values(values: torch.Tensor, factors: torch.Tensor | None, group_size: int,
                     super_size: int) -> torch.Tensor:
    """fp32 per-group scales (or mins) [N, groups] of either form: `values` as they are (one
    level, super_size 0), or each group's integer value times its super-block's factor (exact)."""
    if not super_size:
        return values.float()
    r = super_size // group_size
    return factors.float().repeat_interleave(r, dim=1)[:, :values.shape[1]] * values.float()


def same_form(parts: list[QuantizedWeight]) -> bool:
    """Whether these weights can be one matmul (rows stacked): same bits and code format, group, scale dtype,
    mins present alike, same super-block size and factor dtype (or both one level), same input permutation."""
    a = parts[0]

    def super_dtype(q: QuantizedWeight):
        return None if q.super_scales is None else q.super_scales.dtype

    return all(p.bits == a.bits and p.code_format == a.code_format and p.group_size == a.group_size and p.scales.dtype == a.scales.dtype
               and (p.mins is None) == (a.mins is None) and p.K == a.K
               and p.super_size == a.super_size and super_dtype(p) == super_dtype(a)
               and ((p.perm is None and a.perm is None)
                    or (p.perm is not None and a.perm is not None and torch.equal(p.perm, a.perm)))
               for p in parts[1:])


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row-stacked weights of one form (`same_form`), as torch.cat of their dense forms would be."""
    if not same_form(parts):
        raise ValueError("only weights of one form stack: " + ", ".join(p.source or f"{p.bits}-bit" for p in parts))
    a = parts[0]
    stacked = {name: None if t is None else torch.cat([p._tensors()[name] for p in parts])
               for name, t in a._tensors().items()}
    return dataclasses.replace(a, **stacked,
                               source=a.source if all(p.source == a.source for p in parts) else
                               "+".join(dict.fromkeys(p.source for p in parts)))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int codes 0..15 [N, K] (K % 32 == 0) -> the 4-bit `codes` layout uint8 [N, K/2]."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n, k // PACK, 2, PACK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def dense(weight) -> torch.Tensor:
    """A loader tensor as a dense fp32/float tensor: QuantizedWeight dequantized, a tensor as is."""
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight

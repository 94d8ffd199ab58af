"""Which copy of an int8-format layer serves which batch on the CPU: chosen by fixed rules over
the CPU's instruction sets and the kernels that could be packed, never by a timing.

The choices change numerics (int8 weights against the checkpoint's Q4_1 blocks against dense
fp32 or bf16 copies), so a choice timed at start-up would make an engine's greedy answers depend on
how busy the machine was when it started, and two workers of one deployment disagree. Rules make every
engine on one kind of CPU choose alike, cost nothing at start and need no writable cache. A
calibration cached on disk would still freeze whatever the load was during its first start, differ
between hosts of one kind behind one gateway, and need a cache directory in read-only deployments.
What a rule can lose is speed near a crossover, where the two paths are within a few percent of each
other by definition. The rules come from best-of-N interleaved measurements on each CPU kind met so
far (bench/RESULTS.md); `python -m engine.backends.cpu.calibration` measures the same crossovers on
this machine beside what the rules choose, for checking a rule on a new CPU kind.

Rules (rows = a step's tokens through one linear):
- decode-only batches past the int8 crossover: the AMX int8 kernel where it is packed, else a
  dense copy: bf16 where the CPU has AMX, or avx512_bf16 on an AMD core (oneDNN's bf16 GEMM ~3x
  fp32 there); fp32 on an Intel core with avx512_bf16 but no AMX (its bf16 GEMMs measured 1.5x
  slower than fp32's on an Emerald Rapids whose hypervisor hides AMX; likely because a bf16 dot
  product gains less over Intel's two full-width 512-bit FMA units than over Zen 4's, which split
  a 512-bit FMA in two, and no flag tells the two apart) and without avx512_bf16 (bf16 ~5x slower
  with AVX2 alone);
- int8 crossover, layers / lm_head: 1 / 1 where the AMX int8 kernel is packed (it wins from 2
  rows); 8 / 4 with a bf16 dense copy (the C int8 kernel against the packed bf16 copy); 12 / 8
  with AVX-512 and an fp32 dense copy, with avx512_bf16 or without (against the fp32 copy); 32 /
  32 with AVX2 alone (the row-pair kernel against fp32 GEMMs); 8 / 8 where the C int8 kernel is
  not packed (torch's `_weight_int8pack_mm`: 8-16 rows measured against bf16 copies, not
  measured against fp32);
- Q4_1 blocks for 1-row batches wherever packed (faster with AMX and AVX-512, a tie on AVX2; the
  int8 kernel wins from 2 rows on all three);
- steps that prefill stay on the exact fp32 copy unless the CPU has AMX (bf16 GEMMs 6x fp32 there,
  worth the rounding; 2-3x with avx512_bf16 alone, where a test prompt's near-tie flipped); with
  AMX they take what wide decode batches take.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from pathlib import Path

import torch

#: The logger the choice is reported on, one line per engine (`show_on_stderr` makes it visible).
log = logging.getLogger("engine.backends.cpu.formats")

#: Flag names as /proc/cpuinfo spells them -> as torch's cpuinfo capability dict does.
_PROC_FLAGS = {"avx2": "avx2", "avx512f": "avx512_f", "avx512_bf16": "avx512_bf16", "amx_bf16": "amx_bf16",
               "amx_int8": "amx_int8", "amx_tile": "amx_tile"}


@dataclasses.dataclass(frozen=True)
class CpuKind:
    """The instruction sets that decide which of the int8 format's kernels is fastest."""
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool  # amx_tile + amx_bf16 + amx_int8
    #: "intel", "amd" or "" (not known): where avx512_bf16 comes without AMX, whose bf16 GEMMs
    #: beat fp32's depends on the cores' FMA width, which no flag tells (module docstring)
    vendor: str = ""

    @property
    def fast_bf16_gemm(self) -> bool:
        """Whether oneDNN's bf16 GEMMs beat fp32's on this kind (the dense copy's dtype)."""
        return self.amx or (self.avx512_bf16 and self.vendor != "intel")

    def describe(self) -> str:
        """E.g. "AVX-512 + avx512_bf16, no AMX" ("..., no AMX, Intel" where the vendor decides)."""
        if self.amx:
            return "AMX"
        if self.avx512:
            return ("AVX-512" + (" + avx512_bf16" if self.avx512_bf16 else "") + ", no AMX"
                    + (", Intel" if self.avx512_bf16 and self.vendor == "intel" else ""))
        return "AVX2, no AVX-512" if self.avx2 else "no AVX2"


@functools.lru_cache(maxsize=1)
def detect_cpu() -> CpuKind:
    """This CPU's kind, from torch's cpuinfo capabilities (Linux's /proc/cpuinfo flags where this
    torch does not expose them; no flags known: the plainest kind)."""
    caps, cpuinfo = _torch_caps(), _proc_cpuinfo()
    flags = {k: bool(v) for k, v in caps.items() if isinstance(v, bool)} or _proc_flags(cpuinfo)
    return CpuKind(avx2=flags.get("avx2", False), avx512=flags.get("avx512_f", False),
                   avx512_bf16=flags.get("avx512_bf16", False),
                   amx=all(flags.get(f, False) for f in ("amx_tile", "amx_bf16", "amx_int8")),
                   vendor=vendor_of(cpuinfo, str(caps.get("cpu_name", ""))))


def _torch_caps() -> dict:
    """torch's cpuinfo capabilities (flags as bools, "cpu_name", cache sizes); {} where this torch
    has none."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError):
        return {}


def _proc_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _proc_flags(cpuinfo: str) -> dict[str, bool]:
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    return {name: flag in present for flag, name in _PROC_FLAGS.items()}


_VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def vendor_of(cpuinfo: str, cpu_name: str = "") -> str:
    """"intel", "amd" or "": from a /proc/cpuinfo text's vendor_id, else from a CPU name as
    torch's cpuinfo gives it ("Intel Xeon", "AMD EPYC ...")."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("vendor_id")), "")
    vendor = _VENDORS.get(line.partition(":")[2].strip(), "")
    if vendor:
        return vendor
    first = (cpu_name.split() or [""])[0].lower()
    return first if first in ("intel", "amd") else ""


_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclasses.dataclass(frozen=True)
class FormatChoice:
    """What CpuBackend.prepare_model applies to every int8 layer (engine.backends.cpu.linear)."""
    cpu: CpuKind
    dense: torch.dtype         # the dense copy of decode-only batches past the int8 crossover
    int8_max_rows: int         # layers: batches up to this many rows take the int8 kernels
    head_int8_max_rows: int    # the same for the lm_head
    q4_max_rows: int           # batches up to this many rows read the checkpoint's Q4_1 blocks
    exact_prefill: bool        # steps that prefill take the exact fp32 copy
    amx_kernel: bool = False   # the AMX int8 kernel takes what the dense copy would (linear.compose_int8)

    def summary(self) -> str:
        """The one log line: the rule's CPU kind and what each batch width takes."""
        wide = "int8 on AMX" if self.amx_kernel else f"dense {_SHORT[self.dense]}"
        return (f"CPU weight formats ({self.cpu.describe()}): Q4_1 blocks up to {self.q4_max_rows} row(s), "
                f"int8 up to {self.int8_max_rows} rows (lm_head {self.head_int8_max_rows}), {wide} "
                f"beyond in decode steps, {'fp32' if self.exact_prefill else wide} in steps that prefill")

    def as_dict(self) -> dict:
        """The choice as plain values (benchmarks print it)."""
        return {"cpu": self.cpu.describe(), "dense": str(self.dense).removeprefix("torch."),
                "int8_max_rows": self.int8_max_rows, "lm_head_int8_max_rows": self.head_int8_max_rows,
                "q4_1_max_rows": self.q4_max_rows, "exact_prefill": self.exact_prefill, "amx_kernel": self.amx_kernel}


def dense_dtype(cpu: CpuKind) -> torch.dtype:
    """The dense copy's dtype for decode-only batches past the int8 crossover on this kind of CPU."""
    return torch.bfloat16 if cpu.fast_bf16_gemm else torch.float32


def choose_formats(cpu: CpuKind, *, int8_kernel: bool, amx_kernel: bool, q4_kernel: bool,
                   exact_prefill: bool | None = None) -> FormatChoice:
    """The rules of the module docstring for a CPU of kind `cpu` on which the C int8 kernel
    (`int8_kernel`), the AMX kernel (`amx_kernel`) and the Q4_1 kernel (`q4_kernel`) were packed;
    `exact_prefill` (EngineConfig's) overrides the prefill rule where not None."""
    dense = dense_dtype(cpu)
    if amx_kernel:
        rows = (1, 1)
    elif not int8_kernel:
        rows = (8, 8)
    elif cpu.avx512:
        rows = (8, 4) if dense == torch.bfloat16 else (12, 8)
    elif cpu.avx2:
        rows = (32, 32)
    else:
        rows = (8, 8)
    return FormatChoice(cpu=cpu, dense=dense, int8_max_rows=rows[0], head_int8_max_rows=rows[1],
                        q4_max_rows=1 if q4_kernel else 0,
                        exact_prefill=(not cpu.amx) if exact_prefill is None else exact_prefill, amx_kernel=amx_kernel)


def show_on_stderr() -> None:
    """Print the choice line of every engine this process starts on stderr (the CLI commands
    call it; the rest of the engine's logging is left as it is)."""
    if not any(getattr(h, "_tessera_formats", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tessera: %(message)s"))
        handler._tessera_formats = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

"""The CPU backend: hand-written C kernels (csrc/, built on first use for this CPU by
punica_kernels.cbuild) where they can take a call, torch (engine.backends.torch_ops) where not.

- Linears (`linear`: one module per weight format, the int8 format a width dispatch composed of
  them by prepare_model): weight formats chosen by rules over the CPU's instruction sets
  and the kernels packed (`formats`), never by a timing, so greedy outputs do not depend on the
  load at start-up: int8 weight-only for decode-sized batches (the C int8 kernel, the Q4_1
  kernel on the checkpoint's own blocks for the smallest, the AMX kernel for wide ones where the
  CPU has AMX), dense fp32/bf16 copies packed for oneDNN for wider batches, the exact fp32
  copy for steps that prefill unless the fast copy is far faster.
- Norms, the SwiGLU gate and decode attention: one C call each (`decode_ops`), fp32 only.
- LoRA: punica_kernels' CPU path (its own C kernel, or torch) over slot-major runs, so the
  step's decode tokens are laid out by slot (`lora_batch`: the batch's `layout` is a reordered
  copy of the SchedulerOutput; the scheduler's lists are left as they are). Where a linear's
  batch takes the C int8, Q4_1 or AMX kernel, the LoRA kernel's term is added inside that kernel's
  call (`CpuLoRABatch.linear`: one call and one parallel region instead of two each; the same
  bits as the two calls).
- A step's inputs: slot lists and masks (engine.backends.inputs.slot_inputs), used where they
  are built (no upload), and host sampling (engine.backends.step_sampling.HostSampling).
Which kernels are used is EngineConfig's `cpu_*` fields; the outputs are the torch paths'
within the tolerances ARCHITECTURE.md states.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

import punica_kernels
from engine.backends import torch_ops
from engine.backends.base import Backend, LoRABatch, dense_rows
from engine.backends.cpu import decode_ops, formats
from engine.backends.cpu.linear import (DenseLinear, Int8Parts, PendingInt8Linear, StepKind, compose_int8,
                                        onednn_packing)
from engine.loader import gguf_quants
from engine.loader.quantized import QuantizedWeight
from engine.model.attention import AttentionMetadata
from engine.scheduler import SchedulerOutput
from punica_kernels import cpu_native

#: EngineConfig field -> the environment variable that may switch it off at the CLI edge.
SWITCHES = {"cpu_decode_ops": "TESSERA_CPU_DECODE_OPS", "cpu_int8_kernel": "TESSERA_CPU_INT8_KERNEL",
            "cpu_q4_kernel": "TESSERA_CPU_Q4_KERNEL", "cpu_amx_kernel": "TESSERA_CPU_AMX_KERNEL",
            "cpu_fused_lora": "TESSERA_CPU_FUSED_LORA"}


def switches_from_env(environ=os.environ) -> dict[str, bool]:
    """The EngineConfig kernel switches the environment turns off ("0"), for the CLI edge."""
    return {field: False for field, var in SWITCHES.items() if environ.get(var) == "0"}


def kernel_stacks_of(slots) -> list[dict[str, tuple]]:
    """Per layer, group -> (its LoRAStack, cpu_native.kernel_stack of it)."""
    per_layer: list[dict[str, tuple]] = [{} for _ in range(1 + max(layer for layer, _ in slots.stacks))]
    for (layer, group), stack in slots.stacks.items():
        per_layer[layer][group] = (stack, cpu_native.kernel_stack(stack))
    return per_layer


class CpuLoRABatch(LoRABatch):
    """One fused shrink + expand (`punica_kernels.add_lora`) per (layer, group) for the whole
    mixed batch; tokens without an adapter (slot -1) cost nothing. Calls the C kernel takes go to
    it directly through the step's `cpu_native.StepCall`, bound to the token slots once per step
    (the per-call checks of add_lora, ~3 us each, and building a LoRAMetadata, ~100 us a step,
    are a share of a single-stream step); the rest through add_lora, on the step's metadata (and
    the CPU path's slot-major token plan, cached for it by punica_kernels.cpu), built the first
    time one needs it and shared by every layer. Through `linear`, a call the C int8, Q4_1 or AMX
    kernel's batch would precede is made inside that kernel's call instead."""

    def __init__(self, slots, token_slots: list[int], layout: SchedulerOutput,
                 kernel_stacks: list[dict[str, tuple]] | None = None, *, fused: bool = True):
        self.slots = slots
        self._layout = layout
        self._token_slots = token_slots
        self._meta = None
        self.native = cpu_native.StepCall.for_slots(token_slots, slots.num_slots)
        #: Whether `linear` may hand the term to a base kernel's fused entry (EngineConfig.cpu_fused_lora).
        self.fused = fused and self.native is not None
        #: kernel_stacks_of(slots), which CpuBackend.lora_batch passes (built once per slots
        #: object), so a call looks up nothing else.
        self._kernel_stacks = kernel_stacks if kernel_stacks is not None else kernel_stacks_of(slots)

    @property
    def meta(self):
        """The step's punica_kernels.LoRAMetadata (built on first use)."""
        if self._meta is None:
            self._meta = punica_kernels.build_lora_metadata(self._token_slots, num_slots=self.slots.num_slots)
        return self._meta

    def layout(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The step with its decodes ordered by slot (built by CpuBackend.lora_batch)."""
        return self._layout

    def linear(self, layer: int, group: str, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """lin(x) + the group's term in one call of lin's kernel where the batch takes the C int8,
        Q4_1 or AMX kernel (WidthDispatch.lora_forward) and the LoRA kernel takes the call; else lin(x),
        then `apply`."""
        if self.fused:
            fused = getattr(lin, "lora_forward", None)
            if fused is not None:
                args = self.native.fused(self._kernel_stacks[layer][group][1], x, lin.out_features)
                if args is not None:
                    y = fused(x, args)
                    if y is not None:
                        return y
        y = lin(x)
        self.apply(layer, group, x, y)
        return y

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        native = self.native
        stack, ks = self._kernel_stacks[layer][group]
        if native is not None and native.run(ks, x, y):
            return
        x = x if x.is_contiguous() else x.contiguous()
        if native is None or not native(stack, x, y):
            punica_kernels.add_lora(y, x, stack, meta=self.meta)


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, config):
        super().__init__(config)
        self.decode_ops = config.cpu_decode_ops and decode_ops.library() is not None
        #: Whether the step being run prefills (begin_step), for the int8 layers' prefill copy.
        self.step = StepKind()
        #: What prepare_model chose for the int8 format (formats.FormatChoice); None before, or
        #: for the fp32/bf16 formats.
        self.formats: formats.FormatChoice | None = None
        #: (the LoRA slots, kernel_stacks_of them), for lora_batch
        self._kernel_stacks: tuple | None = None

    @property
    def exact_prefill(self) -> bool:
        """Whether steps that prefill take the int8 layers' exact fp32 copy (the format choice)."""
        return self.formats is None or self.formats.exact_prefill

    @property
    def int8_max_rows(self) -> tuple[int, int] | None:
        """(layers, lm_head) row counts up to which the int8 kernels serve; None unless int8."""
        return None if self.formats is None else (self.formats.int8_max_rows, self.formats.head_int8_max_rows)

    # -- weights ------------------------------------------------------------------------------

    def weight_format(self) -> str:
        """"auto": "int8", i.e. int8 weight-only for decode-sized batches and dense copies for
        wider ones (fp32 in steps that prefill; fp32 or bf16 in decode-only steps), with fp32
        activations; the fast dense dtype and the int8 crossover follow the CPU's kind
        (prepare_model, `formats`), because the fastest differ by CPU (bench/RESULTS.md)."""
        fmt = self.config.weight_format
        return "int8" if fmt == "auto" else fmt

    def linear(self, parts, *, lm_head: bool = False) -> nn.Module:
        """The "fp32"/"bf16" formats: a DenseLinear of the parts' dense weight (QuantizedWeights
        dequantized: this backend's formats are its own). The int8 format: a PendingInt8Linear,
        composed by prepare_model; where every part is a GGUF Q4_0/Q4_1-form weight it also
        keeps their Q4_1 blocks (its Q4_1 kernel's format)."""
        fmt = self.weight_format()
        if fmt in ("fp32", "bf16"):
            return DenseLinear(dense_rows(parts), torch.float32 if fmt == "fp32" else torch.bfloat16)
        if fmt != "int8":
            raise ValueError(f"unknown weight format {fmt!r}")
        blocks = [gguf_quants.q4_1_blocks(p) if isinstance(p, QuantizedWeight) else None for p in parts]
        q4_1 = None if any(b is None for b in blocks) else torch.from_numpy(np.concatenate(blocks))
        return PendingInt8Linear(dense_rows(parts), q4_1=q4_1)

    def int8_parts(self) -> Int8Parts:
        """The kernels an int8 layer may be composed of here: EngineConfig's switches, and the
        oneDNN packing this torch build has."""
        ec = self.config
        return Int8Parts(int8_kernel=ec.cpu_int8_kernel, amx_kernel=ec.cpu_amx_kernel, q4_kernel=ec.cpu_q4_kernel,
                         onednn=onednn_packing(), activations=self.dtype)

    def prepare_model(self, model: nn.Module) -> dict:
        """For the int8 format: choose by the rules of `formats.choose_formats` over this CPU's
        kind and the kernels its layers can take (never by a timing: the same CPU kind always
        gives the same numerics), compose every layer (`apply_formats`) and log the choice in
        one line. Returns the choice (`FormatChoice.as_dict`) and which kernels were packed."""
        if self.weight_format() != "int8":
            return {}
        parts = self.int8_parts()
        layers = [m for m in model.layers.modules() if isinstance(m, PendingInt8Linear)]
        head = model.lm_head
        packed = {"onednn_packed": parts.onednn,
                  "int8_kernel": all(parts.int8(layer) for layer in layers + [head])}
        choice = formats.choose_formats(formats.detect_cpu(), int8_kernel=packed["int8_kernel"],
                                        amx_kernel=packed["int8_kernel"] and all(parts.amx(layer) for layer in layers),
                                        q4_kernel=any(parts.q4(layer) for layer in layers),
                                        exact_prefill=self.config.exact_prefill)
        self.apply_formats(model, choice, parts)
        formats.log.info("%s", choice.summary())
        return {**choice.as_dict(), **packed, "summary": choice.summary()}

    def apply_formats(self, model: nn.Module, choice: formats.FormatChoice, parts: Int8Parts | None = None) -> None:
        """Replace every PendingInt8Linear of `model` with the WidthDispatch `choice` composes from
        `parts` (default: int8_parts()); the lm_head takes the head's crossover. Once per model."""
        parts = parts or self.int8_parts()
        pending = [(name, m) for name, m in model.named_modules() if isinstance(m, PendingInt8Linear)]
        while pending:  # each pending layer (its fp32 and int8 copies) freed as it is replaced
            name, layer = pending.pop()
            rows = choice.head_int8_max_rows if layer is model.lm_head else choice.int8_max_rows
            composed = compose_int8(layer, parts, int8_max_rows=rows, q4_max_rows=choice.q4_max_rows,
                                    dense=choice.dense, exact_prefill=choice.exact_prefill, step=self.step)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, composed)
        self.formats = choice

    def upload_inputs(self, inputs, lora):
        """Nothing moves: the host-built inputs are the step's tensors."""
        return inputs.input_ids, inputs.positions, inputs.meta, inputs.logit_rows

    def begin_step(self, attn: AttentionMetadata) -> None:
        """Steps that prefill take the int8 layers' prefill copy (the exact fp32 weights) for
        batches past the int8 crossover, where the choice keeps one."""
        self.step.prefills = bool(attn.prefills)

    # -- elementwise --------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps):
        h = decode_ops.rms_norm(x, weight, eps) if self.decode_ops else None
        return h if h is not None else torch_ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, a, weight, eps):
        h = decode_ops.add_rms_norm(x, a, weight, eps) if self.decode_ops else None
        return (x, h) if h is not None else torch_ops.add_rms_norm(x, a, weight, eps)

    def silu_mul(self, gu):
        m = decode_ops.silu_mul(gu) if self.decode_ops else None
        return m if m is not None else torch_ops.silu_mul(gu)

    # -- attention ----------------------------------------------------------------------------

    def attention(self, qkv, rope, cos_sin, k_cache, v_cache, meta, spec):
        """Decode tokens through the C kernel (RoPE, cache write and GQA attention over each
        sequence's own slots in one call, cached rows read in place) where it takes them (full
        attention without a soft-cap); prefill chunks, and decode tokens where it cannot, through
        torch_ops.attention."""
        H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        out = torch.empty(qkv.shape[0], H * D, dtype=qkv.dtype)
        nd, first = meta.num_decode, 0
        plain = spec.sliding_window is None and spec.softcap is None
        if nd and plain and self.decode_ops and meta.decode_lens is not None and decode_ops.decode_attention(
                qkv, nd, H, Hkv, D, cos_sin[0][:nd], cos_sin[1][:nd], k_cache, v_cache,
                meta.decode_slots, meta.decode_lens, spec.scale, out):
            first = nd
        return torch_ops.attention(qkv, cos_sin, k_cache, v_cache, meta, H, Hkv, D, spec.scale,
                                   sliding_window=spec.sliding_window, softcap=spec.softcap, first=first, out=out)

    # -- LoRA ---------------------------------------------------------------------------------

    def lora_dtype(self) -> torch.dtype:
        """EngineConfig.lora_dtype, or int8 stacks (rows with fp32 scales) where the C LoRA kernel
        reads them: the int8 format with fp32 activations, max_lora_rank within the kernel's, the
        kernel built (the exact "fp32" format keeps fp32 adapters)."""
        ec = self.config
        if ec.lora_dtype is not None:
            return ec.lora_dtype
        if (self.weight_format() == "int8" and ec.dtype == torch.float32
                and ec.max_lora_rank <= cpu_native.MAX_RANK and cpu_native.library() is not None):
            return torch.int8
        return ec.dtype

    def lora_batch(self, slots, sched, slot_of):
        """A batch whose `layout` orders the decodes by slot (no adapter first; stable
        otherwise; a new SchedulerOutput, `sched` untouched), so that each adapter's decode
        tokens are one contiguous run and the CPU LoRA path reads and writes them through views
        instead of a gather and a scatter per layer."""
        def slot(seq) -> int:
            return -1 if seq.adapter is None else slot_of[seq.adapter]

        decodes = sorted(sched.decodes, key=lambda s: slot(s.seq))
        token_slots = [slot(s.seq) for s in decodes]
        for s in sched.prefills:
            token_slots.extend([slot(s.seq)] * s.num_tokens)
        layout = SchedulerOutput(decodes=decodes, prefills=list(sched.prefills), preempted=list(sched.preempted))
        if self._kernel_stacks is None or self._kernel_stacks[0] is not slots:  # its stacks are never reallocated
            self._kernel_stacks = (slots, kernel_stacks_of(slots))
        return CpuLoRABatch(slots, token_slots, layout, self._kernel_stacks[1], fused=self.config.cpu_fused_lora)

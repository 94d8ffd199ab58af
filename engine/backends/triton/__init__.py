"""The Triton backend: punica_kernels' Triton SGMV (prefill segments) and grouped (decode tokens)
kernels for the LoRA term; W4A16 and W8A16 matmuls on quantized base weights (w4a16.py, w8a16.py),
paged attention with a fused RoPE + KV write (attention.py) and fused norms (norms.py) in
Triton; the lm_head and "fp32"/"bf16" layers as dense torch matmuls. A step's inputs are block
tables (engine.backends.inputs.paged_inputs) uploaded in one transfer; decode-only steps on
CUDA replay the CUDA graphs this backend builds (`decode_graphs`, cuda_graphs.py); sampling runs
on the device with one device-to-host copy (engine.backends.step_sampling.DeviceSampling).
On CUDA tensors it is the GPU engine; on CPU tensors the Triton kernels run only under the
interpreter (TRITON_INTERPRET=1, set before triton is imported; sampling then takes the host
pipeline), which is how the whole engine on this backend is tested on a machine without a GPU.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

import punica_kernels
from engine.backends import torch_ops
from engine.backends.base import Backend, LoRABatch, RowsLinear, dense_rows
from engine.backends.inputs import paged_inputs
from engine.loader.quantized import QuantizedWeight, cat_rows, same_form


class DenseLinear(nn.Module):
    """y = x @ W.T for a frozen base weight W [out, in] kept dense in the activation dtype on the
    device: the lm_head, and every linear of the "fp32"/"bf16" formats or of shapes the 4-bit
    format cannot take."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.register_buffer("weight", weight.to(device=device, dtype=dtype).contiguous())
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class TritonLoRABatch(LoRABatch):
    """The step's LoRA metadata, built on the host and uploaded with the step's other inputs
    (one copy); each (layer, group) is one `punica_kernels.add_lora(impl="triton")`: the grouped
    shrink and expand over the decode tokens, SGMV over the prefill chunks' segments.

    The decode rows' grouping by slot (`punica_kernels.group_decode_tokens`) is computed on the
    device from the uploaded slots once per forward, at its first `apply`, and shared by every
    layer and group: a captured decode graph replays that computation from its static slot buffer
    (the first (layer, group) of a forward starts each forward, capture's warm-up run included)."""

    def __init__(self, slots, token_slots: list[int], num_decode: int):
        self.slots = slots
        self.meta = punica_kernels.build_lora_metadata(token_slots, num_slots=slots.num_slots, num_decode=num_decode)
        self._fields = [f.name for f in dataclasses.fields(self.meta)
                        if isinstance(getattr(self.meta, f.name), torch.Tensor)]
        self._first_apply: tuple[int, str] | None = None  # the (layer, group) a forward starts with

    def host_tensors(self) -> list[torch.Tensor]:
        return [getattr(self.meta, name) for name in self._fields]

    def bind_device_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.meta = dataclasses.replace(self.meta, **dict(zip(self._fields, tensors)))

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if self._first_apply in (None, (layer, group)) and self.meta.num_decode:
            self._first_apply = (layer, group)
            self.meta.decode_groups = punica_kernels.group_decode_tokens(self.meta.decode_slots,
                                                                         self.slots.num_slots)
        x = x if x.is_contiguous() else x.contiguous()
        punica_kernels.add_lora(y, x, self.slots.stacks[(layer, group)], meta=self.meta, impl="triton")


class TritonBackend(Backend):
    """See the module docstring. Formats: "auto" and "w4a16" keep layer weights quantized on the device
    (a quantized checkpoint's own codes and scales, 4- or 8-bit; a dense one's quantized to 4 bits
    at load) with the lm_head dense;
    "fp32"/"bf16" keep every weight dense in the activation dtype. Attention, RoPE + KV write and
    the norms are Triton kernels (engine.backends.triton.attention, norms) reading K/V through
    block tables; decode-only steps on CUDA replay CUDA graphs (cuda_graphs)."""

    name = "triton"
    #: This backend's attention kernels read K/V through block tables (PagedMetadata).
    paged_attention = True

    def __init__(self, config):
        super().__init__(config)
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend on device cpu runs only under the Triton interpreter: "
                             "set TRITON_INTERPRET=1 (or use --device cuda)")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but torch sees no CUDA device")
        self.weight_format()  # refuse a CPU-only format before any weight is loaded

    # -- weights ------------------------------------------------------------------------------

    def weight_format(self) -> str:
        fmt = self.config.weight_format
        if fmt == "int8":
            raise ValueError("weight_format int8 is a CPU backend format; the triton backend keeps "
                             "4-bit (auto, w4a16) or dense (fp32, bf16) weights")
        return "w4a16" if fmt == "auto" else fmt

    def linear(self, parts, *, lm_head=False):
        """For the 4-bit format: a checkpoint's QuantizedWeights stay as they are on the device (4-bit
        codes: W4A16Linear, 8-bit: W8A16Linear), parts of one form as one matmul, of several forms
        as a RowsLinear; dense layer weights are quantized at load (W4A16Linear) where the shape
        fits (K % 32 == 0). DenseLinear otherwise, and always for the lm_head (it may be the tied
        embedding, read once per token)."""
        if self.weight_format() != "w4a16" or lm_head:
            return DenseLinear(dense_rows(parts), self.dtype, self.device)
        from engine.backends.triton import w4a16

        if not any(isinstance(p, QuantizedWeight) for p in parts):
            weight = dense_rows(parts)
            if w4a16.supported(weight):
                return w4a16.W4A16Linear(weight, device=self.device, dtype=self.dtype)
            return DenseLinear(weight, self.dtype, self.device)
        if all(isinstance(p, QuantizedWeight) for p in parts) and same_form(parts):
            return self._quantized_linear(cat_rows(list(parts)))
        return RowsLinear([self.linear([p]) for p in parts])

    def _quantized_linear(self, weight: QuantizedWeight) -> nn.Module:
        if weight.bits == 4:
            from engine.backends.triton import w4a16

            return w4a16.W4A16Linear(weight, device=self.device, dtype=self.dtype)
        from engine.backends.triton import w8a16

        return w8a16.W8A16Linear(weight, device=self.device, dtype=self.dtype)

    def prepare_model(self, model):
        return {"weight_format": self.weight_format()}

    # -- a step's execution -------------------------------------------------------------------

    def build_inputs(self, sched, block_size):
        """Block tables and lengths for the paged kernels (engine.backends.inputs.paged_inputs)."""
        return paged_inputs(sched, block_size)

    # -- elementwise --------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps):
        from engine.backends.triton import norms

        return norms.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, a, weight, eps):
        from engine.backends.triton import norms

        return norms.add_rms_norm(x, a, weight, eps)

    def silu_mul(self, gu):
        from engine.backends.triton import norms

        return norms.silu_mul(gu)

    def gelu_tanh_mul(self, gu):
        from engine.backends.triton import norms

        return norms.gelu_tanh_mul(gu)

    def gated_linear(self, linear, gu, act):
        """One launch where the linear's kernels take the gated input (W4A16Linear and
        W8A16Linear's `forward_gated`) and the rows are few enough that recomputing the
        activation in every N tile's program costs no more than its own launch
        (w4a16.GATED_MAX_M); else the activation kernel, then the linear."""
        from engine.backends.triton import w4a16

        fused = getattr(linear, "forward_gated", None)
        if fused is not None and gu.shape[0] <= w4a16.GATED_MAX_M:
            return fused(gu, act)
        return linear(self.act_mul(gu, act))

    # -- attention ----------------------------------------------------------------------------

    def attention(self, qkv, rope, cos_sin, k_cache, v_cache, meta, spec):
        """With block tables (ModelRunner's paged form): the decode rows in one launch (RoPE, their
        K/V write and decode attention fused: paged_decode_attention_rope), the prefill chunks in
        two (the fused RoPE + KV write, then paged prefill attention), each reading the layer's
        rope tables by position; a pure-decode step (a CUDA graph's, padding rows included: their
        writes go to the sink block) is one launch. With slot lists (a caller that built them):
        torch_ops."""
        H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        paged = meta.paged
        if paged is None:
            return torch_ops.attention(qkv, cos_sin, k_cache, v_cache, meta, H, Hkv, D, spec.scale,
                                       sliding_window=spec.sliding_window, softcap=spec.softcap)
        from engine.backends.triton import attention as tk

        T, nd, bs = qkv.shape[0], meta.num_decode, self.config.block_size
        out = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
        extra = {"sliding_window": spec.sliding_window, "softcap": spec.softcap}
        # Each kernel writes its rows of `out` in place (no copy launch). Decode and prefill rows
        # belong to different sequences: neither launch reads the other's cache writes.
        if nd:
            tk.paged_decode_attention_rope(qkv[:nd], rope.cos, rope.sin, paged.positions[:nd], k_cache, v_cache,
                                           meta.slot_mapping[:nd], paged.decode_block_tables, paged.decode_seq_lens,
                                           bs, spec.scale, H, Hkv, D, out=out[:nd], **extra)
        if nd < T:
            q = tk.rope_kv_write(qkv[nd:], rope.cos, rope.sin, paged.positions[nd:], k_cache, v_cache,
                                 meta.slot_mapping[nd:], H, Hkv, D)
            tk.paged_prefill_attention(q, k_cache, v_cache, paged.prefill_block_tables,
                                       paged.prefill_query_start, paged.prefill_context_lens, bs, spec.scale,
                                       paged.prefill_max_query_len, out=out[nd:], **extra)
        return out.view(T, H * D)

    # -- LoRA ---------------------------------------------------------------------------------

    def lora_dtype(self) -> torch.dtype:
        ld = self.config.lora_dtype
        if ld == torch.int8:
            raise ValueError("int8 adapter stacks are a CPU backend form")
        return ld or self.dtype

    def lora_batch(self, slots, sched, slot_of):
        def slot(seq) -> int:
            return -1 if seq.adapter is None else slot_of[seq.adapter]

        token_slots = [slot(s.seq) for s in sched.decodes]
        for s in sched.prefills:
            token_slots.extend([slot(s.seq)] * s.num_tokens)
        return TritonLoRABatch(slots, token_slots, num_decode=len(sched.decodes))

    def graph_lora_batch(self, slots, token_slots: torch.Tensor) -> TritonLoRABatch:
        """The LoRA batch of a captured decode graph: every row a decode row, its slots read from
        `token_slots` (a static device buffer rewritten before each replay)."""
        batch = TritonLoRABatch(slots, [-1] * token_slots.shape[0], num_decode=token_slots.shape[0])
        batch.meta = dataclasses.replace(batch.meta, token_slots=token_slots)
        return batch

    # -- CUDA graphs --------------------------------------------------------------------------

    def decode_graphs(self, runner, *, max_batch, block_width, sink_block, lora_slots=None):
        """A DecodeGraphs over `runner` (cuda_graphs.py): decode-only steps replay captured graphs
        on CUDA, unless EngineConfig.cuda_graphs is off (None: every step runs eagerly)."""
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return None
        from engine.backends.triton.cuda_graphs import DecodeGraphs

        return DecodeGraphs(runner, max_batch=max_batch, block_width=block_width, sink_block=sink_block,
                            lora_slots=lora_slots)

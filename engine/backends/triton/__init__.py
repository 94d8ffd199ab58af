"""The Triton backend: punica_kernels' Triton SGMV (prefill segments) and BGMV (decode tokens)
for the LoRA term, torch ops (engine.backends.torch_ops) for the rest, dense base weights in the
activation dtype (bf16 on CUDA). On CUDA tensors it is the GPU engine; on CPU tensors the Triton
kernels run only under the interpreter (TRITON_INTERPRET=1, set before triton is imported),
which is how the whole engine on this backend is tested on a machine without a GPU.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

import punica_kernels
from engine.backends import torch_ops
from engine.backends.base import Backend, LoRABatch


class DenseLinear(nn.Module):
    """y = x @ W.T for a frozen base weight W [out, in] kept dense in the activation dtype on the
    device (the 4-bit GPU format is the next kernels' work)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.register_buffer("weight", weight.to(device=device, dtype=dtype).contiguous())
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class TritonLoRABatch(LoRABatch):
    """The step's LoRA metadata, built on the host and uploaded with the step's other inputs
    (one copy); each (layer, group) is one `punica_kernels.add_lora(impl="triton")`: BGMV shrink
    and expand over the decode tokens, SGMV over the prefill chunks' segments."""

    def __init__(self, slots, token_slots: list[int], num_decode: int):
        self.slots = slots
        self.meta = punica_kernels.build_lora_metadata(token_slots, num_slots=slots.num_slots, num_decode=num_decode)
        self._fields = [f.name for f in dataclasses.fields(self.meta)
                        if isinstance(getattr(self.meta, f.name), torch.Tensor)]

    def host_tensors(self) -> list[torch.Tensor]:
        return [getattr(self.meta, name) for name in self._fields]

    def bind_device_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.meta = dataclasses.replace(self.meta, **dict(zip(self._fields, tensors)))

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x if x.is_contiguous() else x.contiguous()
        punica_kernels.add_lora(y, x, self.slots.stacks[(layer, group)], meta=self.meta, impl="triton")


class TritonBackend(Backend):
    name = "triton"

    def __init__(self, config):
        super().__init__(config)
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend on device cpu runs only under the Triton interpreter: "
                             "set TRITON_INTERPRET=1 (or use --device cuda)")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but torch sees no CUDA device")

    def weight_format(self) -> str:
        """Dense weights in the activation dtype; "int8" is a CPU backend format."""
        if self.config.weight_format == "int8":
            raise ValueError("weight_format int8 is a CPU backend format; the triton backend keeps dense weights")
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, "fp16")

    def linear(self, weight, *, q4_1=None):
        return DenseLinear(weight, self.dtype, self.device)

    def rms_norm(self, x, weight, eps):
        return torch_ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, a, weight, eps):
        return torch_ops.add_rms_norm(x, a, weight, eps)

    def silu_mul(self, gu):
        return torch_ops.silu_mul(gu)

    def attention(self, qkv, cos_sin, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim, scale):
        return torch_ops.attention(qkv, cos_sin, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim, scale)

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

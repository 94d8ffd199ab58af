"""The seam between the engine and its kernels.

The model code (engine/model/decoder.py, engine/lora) and the step (engine.model_runner,
engine.step_executor) call one `Backend` object, chosen once from `EngineConfig.backend`
(engine.backends.create_backend), for everything whose implementation depends on the hardware:
norms, RoPE + KV write + prefill/decode attention, the base linears (and their weight formats),
SiLU*mul, the LoRA term; and a step's execution around the model: its input builder
(`build_inputs`: slot lists and masks, or block tables), their upload (`upload_inputs`), its
decode graphs (`decode_graphs`) and its sampling pipeline (`step_sampler`: host or device,
producing a `StepResult`). Nothing outside engine/backends imports a backend's own modules
(tests/engine/test_engine_layering.py). The seam knows nothing of C, AVX or CUDA; backends keep
their own state (calibrated weight formats, kernel plans) and never put it in the shared types
(AttentionMetadata, LoRASlots, LoRAMetadata).

Contract of every op: the same result as engine.backends.torch_ops within the backend's stated
tolerance; inputs and outputs on `backend.device`; activations in `backend.dtype`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn

from engine.config import EngineConfig
from engine.loader.quantized import QuantizedWeight, dense
from engine.backends import torch_ops
from engine.backends.inputs import StepInputs, slot_inputs, upload_step
from engine.backends.step_sampling import DeviceSampling, HostSampling
from engine.model.attention import AttentionMetadata, AttentionSpec
from engine.model.layers import RotaryEmbedding

if TYPE_CHECKING:  # imported for annotations only: engine.lora imports nothing from here
    from engine.lora.layers import LoRASlots
    from engine.scheduler import SchedulerOutput


class LoRABatch(ABC):
    """The adapter term of one step: `apply(layer, group, x, y)` adds, for every token t with slot
    s != -1, `scale[s] * x[t] @ A[s].T @ B[s].T` into y[t] for each slice of the fused group."""

    @abstractmethod
    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None: ...

    def linear(self, layer: int, group: str, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """lin(x) with the group's adapter term added: `apply` on lin's output. A backend whose
        base kernels can add the term in the same call overrides it."""
        y = lin(x)
        self.apply(layer, group, x, y)
        return y

    def host_tensors(self) -> list[torch.Tensor]:
        """The batch's host-built index tensors, uploaded with the step's inputs (ModelRunner)."""
        return []

    def bind_device_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Take the device copies of `host_tensors()`, in the same order."""

    def layout(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The step as this batch lays its tokens out (the runner builds the inputs and the
        logits rows in this order): `sched` (the SchedulerOutput the batch was built for)
        itself, or a new SchedulerOutput with the decodes in another order. `sched` is never
        modified."""
        return sched


class RowsLinear(nn.Module):
    """One linear made of several whose outputs are its rows in order (a fused projection whose
    parts a checkpoint stores in different forms, e.g. a GGUF Q4_K_M layer's Q4_K q/k and Q6_K
    v): each part's matmul gives its columns of the output."""

    def __init__(self, parts: Sequence[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def dense_rows(parts: Sequence[torch.Tensor | QuantizedWeight]) -> torch.Tensor:
    """The parts stacked by rows as one dense tensor (QuantizedWeights dequantized: fp32)."""
    tensors = [dense(p) for p in parts]
    if len({t.dtype for t in tensors}) > 1:
        tensors = [t.float() for t in tensors]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class Backend(ABC):
    """One engine's kernels. Built from its EngineConfig; `device` and `dtype` are where and in
    what the activations live."""

    name: str = ""
    #: Whether the attention kernels read K/V through block tables (`build_inputs` gives
    #: PagedMetadata, and the KV cache keeps one extra block no sequence owns: the sink padded
    #: rows of a captured decode graph write into).
    paged_attention: bool = False

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.dtype

    @property
    def kv_sink_blocks(self) -> int:
        """KV blocks the cache keeps beyond the block manager's, owned by no sequence: 1 where
        the attention is paged (the sink a captured decode graph's padded rows write into, at
        the index of the block manager's block count), else 0."""
        return 1 if self.paged_attention else 0

    # -- weights ------------------------------------------------------------------------------

    def weight_format(self) -> str:
        """The storage format of the base linears (EngineConfig.weight_format, "auto" resolved)."""
        return self.config.weight_format

    @abstractmethod
    def linear(self, parts: Sequence[torch.Tensor | QuantizedWeight], *, lm_head: bool = False) -> nn.Module:
        """A frozen base linear whose weight [out, in] is `parts` stacked by rows (the fused
        projections: q | k | v, gate | up), each a host tensor or a checkpoint's QuantizedWeight
        (engine.loader.quantized; a backend keeps it quantized where it has a kernel for its form):
        a module called as `lin(x [T, in]) -> [T, out]` in x's dtype, one module per weight form
        (a reference or parity run builds reference modules; nothing is switched per call).
        `lm_head`: the output projection (a backend may keep it dense)."""

    def prepare_model(self, model: nn.Module) -> dict:
        """Called once after the model is built (weights on the device): measure or pack what the
        backend needs. Returns what it chose, for logs and benchmarks."""
        return {}

    def begin_step(self, attn: AttentionMetadata) -> None:
        """Called by the model as a forward starts, before any linear: a backend whose linears
        serve steps that prefill from another weight copy (the CPU's int8 format) notes which
        kind of step this is. The logits of that forward (compute_logits) belong to the same step."""

    # -- elementwise --------------------------------------------------------------------------

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, rms_norm(x + a)); x (the residual stream) may be updated in place."""

    @abstractmethod
    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""

    def gelu_tanh_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (gate | up) -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU)."""
        return torch_ops.gelu_tanh_mul(gu)

    def act_mul(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        """The gated MLP activation `act` (engine.config.ACTIVATIONS) by this backend's op for it."""
        if act == "silu":
            return self.silu_mul(gu)
        if act == "gelu_tanh":
            return self.gelu_tanh_mul(gu)
        raise ValueError(f"unknown activation {act!r}")

    def gated_linear(self, linear: nn.Module, gu: torch.Tensor, act: str) -> torch.Tensor:
        """`linear` (a module of this backend's `linear`) applied to the gated activation of gu
        [T, 2I] (gate | up): linear(act_mul(gu, act)) -> [T, out], the MLP's down projection. A
        backend may compute it without materializing the activation, with the same result."""
        return linear(self.act_mul(gu, act))

    # -- attention ----------------------------------------------------------------------------

    @abstractmethod
    def attention(self, qkv: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  spec: AttentionSpec) -> torch.Tensor:
        """RoPE on the unrotated q | k heads of qkv [T, (Hq + 2 Hkv) D] (`rope`: the layer's
        tables [P, D]; `cos_sin`: their rows at this step's positions, [T, 1, D] each), K/V
        written to their slots, then attention over each sequence's cached keys as `spec`
        states (heads, scale, sliding window, soft-cap) -> [T, Hq * D] (see torch_ops)."""

    # -- LoRA ---------------------------------------------------------------------------------

    def lora_dtype(self) -> torch.dtype:
        """Storage dtype of adapters (CPU tier and slots) when EngineConfig.lora_dtype is None."""
        return self.config.lora_dtype or self.dtype

    @abstractmethod
    def lora_batch(self, slots: LoRASlots, sched: SchedulerOutput, slot_of: dict[str, int]) -> LoRABatch:
        """The step's LoRA batch for `sched` (every adapter already has its slot in `slot_of`).
        A backend that wants the decode tokens in another order says so in the batch's
        `layout`; `sched` is never modified."""

    # -- memory and transfers -----------------------------------------------------------------

    def kv_cache_bytes(self, reserved_bytes: int = 0) -> int:
        """Bytes for the KV cache when EngineConfig.num_kv_blocks is None: kv_cache_bytes if set;
        else on CUDA `kv_cache_memory_fraction` of the device memory free now (weights and LoRA
        slots are loaded first) less `reserved_bytes` for the step's activations; else 512 MiB."""
        ec = self.config
        if ec.kv_cache_bytes is not None:
            return ec.kv_cache_bytes
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return max(0, int((free - reserved_bytes) * ec.kv_cache_memory_fraction))
        return 512 << 20

    # -- a step's execution -------------------------------------------------------------------

    def build_inputs(self, sched: SchedulerOutput, block_size: int) -> StepInputs:
        """The step's host-built model inputs in the form this backend's attention reads: by
        default slot lists and masks (engine.backends.inputs.slot_inputs, the torch path)."""
        return slot_inputs(sched, block_size)

    def upload_inputs(self, inputs: StepInputs, lora: LoRABatch | None):
        """(input ids, positions, metadata, logit rows) on the device: every host tensor of the
        step, the LoRA batch's included, in one `upload` (engine.backends.inputs.upload_step)."""
        return upload_step(inputs, lora, self.upload)

    def decode_graphs(self, runner, *, max_batch: int, block_width: int, sink_block: int, lora_slots=None):
        """The object that runs decode-only steps of `runner` as captured graphs (`takes(sched)`,
        `run(sched, token_slots)`), or None (every step runs eagerly)."""
        return None

    def step_sampler(self):
        """The step's sampling pipeline (engine.backends.step_sampling): `DeviceSampling` where
        the logits live off the host (one device-to-host copy per step), `HostSampling` where
        they are host tensors."""
        if self.device.type == "cpu":
            return HostSampling()
        return DeviceSampling(self.upload, self.to_host, self.start_to_host)

    def upload(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors -> the same tensors on the device. On CPU they are returned as they are;
        elsewhere they are packed into one pinned host buffer and copied with one transfer, the
        device tensors being views into it, each at an offset that is a multiple of 16 bytes
        (the buffer itself starts 256-byte aligned): Triton specializes a pointer argument on
        16-byte alignment, so a view that started 8 bytes off in one step and aligned in the
        next would be a second variant of the same kernel, compiled mid-serving."""
        if self.device.type == "cpu":
            return tensors
        offsets, nbytes = [], 0
        for t in tensors:
            offsets.append(nbytes)
            nbytes += -(-t.numel() * t.element_size() // 16) * 16
        staging = torch.empty(max(nbytes, 16), dtype=torch.uint8, pin_memory=True)
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            if n:
                staging[off:off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        dev = staging.to(self.device, non_blocking=True)
        return [dev[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, off in zip(tensors, offsets)]

    def to_host(self, t: torch.Tensor) -> list:
        """One device-to-host copy of a small tensor, as a Python list."""
        return t.tolist()

    def start_to_host(self, t: torch.Tensor) -> Callable[[], list]:
        """`to_host(t)` started now and finished by the returned call: on CUDA a non-blocking copy
        into pinned memory behind the work already queued, whose event the call waits for, so
        the host goes on (preparing the next step) while the device works; elsewhere the copy is
        made by the call."""
        if self.device.type != "cuda":
            return lambda: self.to_host(t)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # the stream the copy was queued on

        def wait() -> list:
            done.synchronize()
            return host.tolist()

        return wait

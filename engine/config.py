"""Configuration of the model (read from weights metadata) and of the engine (chosen by the caller)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


#: RoPE variants a checkpoint may state (HF `rope_scaling` / `rope_parameters` "rope_type").
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
#: Gated MLP activations: SiLU (Llama, Qwen, Mistral, Phi-3) and tanh-approximated GELU (Gemma).
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding as the checkpoint states it (engine.model.rope computes its tables).

    `rope_type` default: inv_freq = 1 / theta^(2i/d); linear: / factor; dynamic: NTK-scaled theta
    at the full scaled length (max_position x factor); llama3: Llama 3.1's smooth per-frequency
    scaling (factor, low/high_freq_factor, original_max_position); yarn: interpolation ramped
    between beta_fast and beta_slow rotations, cos/sin times attention_factor; longrope: Phi-3's
    per-frequency short_factor below original_max_position and long_factor from there on, cos/sin
    times attention_factor. `freq_factors`: llama.cpp's `rope_freqs` tensor (inv_freq divided by
    it), the form Llama 3.1 GGUF files carry their llama3 scaling in."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and architecture of a decoder-only model, as read from GGUF metadata or a HF
    config.json (engine.model.architectures). Every family (Llama 2/3.x, Mistral, Qwen2/2.5,
    Qwen3, Gemma 2/3, Phi-3) is these fields: the model code (engine.model.decoder) has no branch
    on the family's name.

    Norm weights are stored as the model multiplies by them: Gemma's (1 + w) is folded into w at
    load, so one RMSNorm serves every family."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: The family, by its Hugging Face model_type ("llama", "mistral", "qwen2", "qwen3", "gemma2",
    #: "gemma3_text", "phi3"): for logs, /v1/models and refusals; nothing branches on it.
    architecture: str = "llama"
    #: The RoPE of full-attention layers (and of every layer unless `local_rope` is set).
    rope: RopeConfig = RopeConfig()
    #: The RoPE of sliding-window layers where it differs (Gemma 3: theta 10000 locally).
    local_rope: RopeConfig | None = None
    #: Gated MLP activation (ACTIVATIONS): act(gate) * up.
    hidden_act: str = "silu"
    #: q/k/v projections carry a bias (Qwen2/2.5).
    attention_bias: bool = False
    #: RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3): `self_attn.q_norm` / `k_norm`.
    qk_norm: bool = False
    #: Gemma 2/3's four norms a layer: the attention and MLP outputs are normed before their
    #: residual add (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP input
    #: by `pre_feedforward_layernorm`. Without: Llama's two (`post_attention_layernorm` is the
    #: MLP's input norm).
    sandwich_norms: bool = False
    #: Embeddings are multiplied by this (Gemma: sqrt(hidden), rounded to the activation dtype).
    embedding_multiplier: float | None = None
    #: Attention scores are scaled by query_pre_attn_scalar^-0.5 (Gemma) instead of head_dim^-0.5.
    query_pre_attn_scalar: float | None = None
    #: tanh soft-capping of attention scores (Gemma 2: cap * tanh(s / cap)), None: none.
    attn_logit_softcap: float | None = None
    #: tanh soft-capping of the final logits (Gemma 2), None: none.
    final_logit_softcap: float | None = None
    #: Sliding window of each layer in tokens (a query sees the keys of the last `w` positions,
    #: itself included), None for a full-attention layer; () means every layer is full.
    layer_windows: tuple[int | None, ...] = ()
    #: The checkpoint fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (Phi-3):
    #: the loader splits the weights, and LoRA adapters name the fused modules.
    fused_projections: bool = False

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def attention_scale(self) -> float:
        """The factor on q @ k.T: query_pre_attn_scalar^-0.5 where the family sets it, else head_dim^-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_layers * self.kv_size * torch.tensor([], dtype=dtype).element_size()


WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int8", "w4a16")
BACKENDS = ("cpu", "triton")


@dataclass
class EngineConfig:
    """Knobs of one engine instance. Defaults suit the embedded CPU mode."""

    #: Paged KV cache block size in tokens.
    block_size: int = 16
    #: Number of KV blocks; None sizes the cache from `kv_cache_bytes`.
    num_kv_blocks: int | None = None
    #: Memory for the KV cache when `num_kv_blocks` is None; None: on CUDA
    #: `kv_cache_memory_fraction` of the device memory free once weights and LoRA slots are
    #: loaded (less an activation reserve), elsewhere 512 MiB (Backend.kv_cache_bytes).
    kv_cache_bytes: int | None = None
    #: Share of free device memory the KV cache takes when sized from it (CUDA).
    kv_cache_memory_fraction: float = 0.9
    #: Token budget of one step (decode tokens + prefill chunk tokens).
    max_num_batched_tokens: int = 512
    #: Most sequences running at once.
    max_num_seqs: int = 64
    #: Longest prompt + completion; None takes the model's context length.
    max_model_len: int | None = None
    #: Activation, KV-cache and LoRA-slot dtype (on CUDA, bf16: the CLI and settings choose it
    #: for --device cuda). fp32 is exact (and the fastest on CPU:
    #: the base matmuls cast to bf16 inside the CPU backend's linears where that is faster; bf16 elementwise
    #: ops, attention and small batched matmuls are slower than fp32 on CPU).
    dtype: torch.dtype = torch.float32
    #: Weight storage for the base model's linear layers: "auto" (CPU: int8 weight-only up to a
    #: batch size set by the CPU's kind, fp32 dense for steps that prefill, bf16 dense for wider
    #: decode-only batches on CPUs whose bf16 GEMMs beat fp32's (else fp32; see
    #: engine.backends.cpu.formats), "fp32" (exact), "bf16", "int8" (same as "auto" on CPU). The
    #: triton backend: "auto"/"w4a16" keep layer weights 4-bit on the device (the checkpoint's
    #: Q4_0/Q4_1 blocks, else quantized at load), "fp32"/"bf16" dense in `dtype`; "int8" is
    #: CPU-only and "w4a16" triton-only.
    weight_format: str = "auto"
    #: Whether steps that prefill use the int8 format's exact fp32 dense copy (True) or its decode
    #: path (False: the AMX kernel, else the bf16 copy); None: the decode path on CPUs with AMX
    #: (bf16 GEMMs far faster than fp32's there; engine.backends.cpu.formats), else fp32.
    exact_prefill: bool | None = None
    #: Seconds a waiting request needs to be promoted one priority class (prevents starvation).
    aging_seconds: float = 10.0
    #: A request whose prompt + max_tokens needs more than this share of the KV blocks is big:
    #: it waits behind other tenants' requests of its class and is preempted for them, never the
    #: reverse (engine.scheduler), so one context-length prompt cannot evict everyone else.
    big_request_kv_fraction: float = 0.5
    #: Distinct LoRA adapters in one step (device slots).
    max_loras: int = 8
    #: Largest LoRA rank the slots hold.
    max_lora_rank: int = 64
    #: Storage dtype of loaded adapters (CPU tier and slots): float32, bfloat16, float16, or int8
    #: (rows quantized with fp32 scales; CPU with fp32 activations). None: int8 where the step
    #: reads them through the C LoRA kernel (CPU, "auto"/"int8" format with fp32 activations,
    #: max_lora_rank <= its 64, kernel built): a quarter of fp32's bytes, which a many-adapter
    #: decode step is bound by; else `dtype`.
    lora_dtype: torch.dtype | None = None
    #: CPU-tier budget for loaded adapters, in bytes.
    lora_cpu_cache_bytes: int = 1 << 30
    #: Torch intra-op threads; None leaves torch's default.
    num_threads: int | None = None
    #: Which kernels run the model (engine.backends): "cpu" (the hand-written C kernels of
    #: engine/backends/cpu, torch where they cannot take a call) or "triton" (Triton kernels for
    #: the 4- and 8-bit linears, norms, RoPE + KV writes, paged attention and punica_kernels'
    #: SGMV/BGMV LoRA, decode steps in CUDA graphs; on CPU tensors only under
    #: TRITON_INTERPRET=1, which is how it is tested without a GPU).
    backend: str = "cpu"
    #: Where weights, KV cache, LoRA slots and sampling live: "cpu", "cuda" or "cuda:N".
    device: str = "cpu"
    #: Reuse the KV of full blocks across requests with the same cache salt, adapter version and
    #: token prefix (engine.block_manager); cached blocks are evicted LRU only when needed.
    enable_prefix_caching: bool = True
    #: Triton backend on CUDA: decode-only steps replay CUDA graphs captured per batch-size bucket.
    cuda_graphs: bool = True
    #: Triton backend: when the engine is built, capture every decode graph and run warm-up
    #: forwards over the KV cache's sink block that compile every kernel variant serving can
    #: launch (engine.engine_builder.warm_up), so no request waits for a compile; None: on CUDA
    #: only (under the interpreter it compiles nothing and runs every warm-up forward's kernels
    #: through the interpreter: minutes).
    startup_warmup: bool | None = None
    #: Overlapped steps: the next step is scheduled, built and launched before the host has the
    #: tokens of the one before (engine.llm_engine), so host work runs while the device computes;
    #: None: on CUDA only (elsewhere a step runs while it is called and nothing would overlap).
    overlap_steps: bool | None = None
    #: CPU backend: the C decode-step ops (RMSNorm, residual + RMSNorm, SwiGLU gate, decode
    #: attention); off: their torch paths (same results). TESSERA_CPU_DECODE_OPS=0 at the CLI.
    cpu_decode_ops: bool = True
    #: CPU backend: the C int8 weight-only kernel for decode batches; off: torch's
    #: `_weight_int8pack_mm` (bf16 activations). TESSERA_CPU_INT8_KERNEL=0 at the CLI.
    cpu_int8_kernel: bool = True
    #: CPU backend: the C kernel on the checkpoint's own Q4_1 blocks for the smallest batches
    #: (needs cpu_int8_kernel); off: the int8 kernel. TESSERA_CPU_Q4_KERNEL=0 at the CLI.
    cpu_q4_kernel: bool = True
    #: CPU backend: the AMX int8 kernel for wide decode batches where the CPU has AMX (needs
    #: cpu_int8_kernel); off: the dense copies. TESSERA_CPU_AMX_KERNEL=0 at the CLI.
    cpu_amx_kernel: bool = True
    #: CPU backend: the LoRA term added inside the C int8 and Q4_1 kernels' calls (one call and
    #: one parallel region for both); off: a LoRA kernel call after each (same results).
    #: TESSERA_CPU_FUSED_LORA=0 at the CLI.
    cpu_fused_lora: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        if self.device != "cpu" and not (self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError("device must be cpu, cuda or cuda:N")
        if self.device != "cpu" and self.backend == "cpu":
            raise ValueError("the cpu backend runs on device cpu; use backend triton for cuda")
        if not 0 < self.big_request_kv_fraction <= 1:
            raise ValueError("big_request_kv_fraction must be in (0, 1]")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}")
        if self.weight_format == "w4a16" and self.backend != "triton":
            raise ValueError("weight_format w4a16 is the triton backend's 4-bit format")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError("dtype must be float32, bfloat16 or float16")
        if self.lora_dtype is not None and self.lora_dtype not in (torch.float32, torch.bfloat16, torch.float16,
                                                                   torch.int8):
            raise ValueError("lora_dtype must be float32, bfloat16, float16 or int8")
        if self.startup_warmup and self.backend != "triton":
            raise ValueError("startup_warmup is the triton backend's (its warm-up writes only to the "
                             "paged KV cache's sink block)")
        if self.lora_dtype == torch.int8 and (self.dtype != torch.float32 or self.backend != "cpu"):
            raise ValueError("lora_dtype int8 needs float32 activations on the cpu backend (dtype float32)")

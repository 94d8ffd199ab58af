"""CUDA graphs for decode-only steps: one graph per batch-size bucket, replayed over static buffers.

A captured graph replays the kernels it recorded with the pointers they had at capture, so every
per-step input lives in a static buffer that is rewritten before each replay, never in a tensor
made for the step: token ids, positions, slot mapping, block tables (a fixed width: the longest
sequence's blocks), sequence lengths, and the LoRA token slots. The LoRA stacks, their ranks and
scales are the engine's LoRASlots tensors, written in place when an adapter is loaded, so a
replay reads the slots' current adapters. Everything the capture decided on the host (launch
grids, the metadata objects the kernels were handed) is frozen with the graph: `_capture` builds
those objects once from views of the static buffers and the replay reuses them, so no replay can
read a previous step's LoRA metadata (the stale-metadata bug SGLang shipped): the only way in is
the static buffers, and `run` rewrites all of them, padding rows included, before every replay.

A batch of n sequences runs in the smallest bucket b >= n: rows [n, b) are padding (token 0,
position 0, no adapter, length 1 over the KV cache's sink block, which no sequence owns, so
their K/V writes land there) and their logits are dropped.

`capture_all` captures every bucket when the engine starts (engine.engine_builder), with all
rows padding, so no capture (and no kernel compile inside one) happens while serving; a bucket
not captured then is captured the first time a step needs it.

`capture` is the one call into CUDA (a `CudaGraphCapture`); tests pass a stand-in that runs the
recorded closure again at each replay, which replays exactly the frozen host decisions.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.backends.inputs import decode_rows
from engine.model.attention import AttentionMetadata, PagedMetadata

#: Batch sizes captured by default (those above the engine's max_num_seqs are dropped, and
#: max_num_seqs itself is added): small steps exact, larger ones within 1.5x of their size.
DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets_for(max_batch: int, buckets=DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The captured sizes for an engine running at most `max_batch` sequences."""
    return tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))


class CudaGraphCapture:
    """Captures a closure into a CUDA graph (after one warm-up call on a side stream, which
    compiles Triton kernels and settles the allocator); calling it returns the graph's replay.

    One instance per engine (DecodeGraphs makes its own): every bucket's graph shares the
    instance's memory pool, since graphs replay one at a time and what one graph's kernels leave
    in its temporaries is never read by another (outputs are copied into buffers allocated
    outside the graphs), so the pool holds about one bucket's activations, which the KV cache's
    activation reserve (engine.engine_builder.activation_reserve_bytes) already leaves free. The pool is not
    shared across engines: capturing into a pool whose graphs a discarded engine freed trips the
    caching allocator's internal assert (seen on an H200 with torch 2.11: a second engine in one
    process could not capture)."""

    def __init__(self):
        self.pool = None

    def __call__(self, run: Callable[[], None]) -> Callable[[], None]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        return graph.replay


class DecodeGraphs:
    """Decode steps of `runner`'s model through captured graphs (see the module docstring).

    runner: the ModelRunner (its model, KV cache, block size, backend); block_width: the static
    block tables' width (blocks of the longest sequence the engine allows); sink_block: a KV block
    no sequence owns; lora_slots: the LoRASlots (None without adapters); capture: see above."""

    def __init__(self, runner, *, max_batch: int, block_width: int, sink_block: int, lora_slots=None,
                 capture: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
                 buckets=DEFAULT_BUCKETS):
        self.runner = runner
        self.buckets = buckets_for(max_batch, buckets)
        self.block_width = block_width
        self.sink_block = sink_block
        self.lora_slots = lora_slots
        self.capture = capture if capture is not None else CudaGraphCapture()
        dev, bmax = runner.device, self.buckets[-1]
        vocab = runner.model.cfg.vocab_size
        self.input_ids = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(bmax, block_width, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, device=dev)
        self.token_slots = torch.full((bmax,), -1, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(bmax, vocab, dtype=torch.float32, device=dev)
        self.replays: dict[int, Callable[[], None]] = {}
        self.capturing: int | None = None
        self.stats = {"captures": 0, "replays": 0}

    def bucket(self, n: int) -> int | None:
        """The smallest captured size >= n, or None (n is larger than every bucket)."""
        return next((b for b in self.buckets if b >= n), None)

    def takes(self, sched) -> bool:
        """Whether this step runs as a graph: decode tokens only, at most the largest bucket, every
        block table within the static width."""
        return (not sched.prefills and 0 < len(sched.decodes) <= self.buckets[-1]
                and all(len(s.seq.block_table) <= self.block_width for s in sched.decodes))

    def _host_inputs(self, decodes, token_slots: list[int] | None, b: int) -> list[torch.Tensor]:
        """The inputs of the decode rows `decodes` (a step's ScheduledSequences) padded to `b`
        rows, as host tensors in the static buffers' order."""
        bs, n = self.runner.block_size, len(decodes)
        pad = b - n
        sink = self.sink_block
        ids, pos, slots, lens = decode_rows(decodes, bs)
        tables = torch.full((b, self.block_width), sink, dtype=torch.int32)
        for i, s in enumerate(decodes):
            tables[i, :len(s.seq.block_table)] = torch.tensor(s.seq.block_table, dtype=torch.int32)
        ids += [0] * pad
        pos += [0] * pad
        slots += [sink * bs] * pad
        lens += [1] * pad
        lora = (list(token_slots) if token_slots is not None else [-1] * n) + [-1] * pad
        return [torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64), tables, torch.tensor(lens, dtype=torch.int32),
                torch.tensor(lora, dtype=torch.int32)]

    def _write(self, host: list[torch.Tensor], b: int) -> None:
        """Rewrite every static buffer's first b rows (one upload, then device-side copies)."""
        dev = self.runner.backend.upload(host)
        for static, t in zip((self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                              self.seq_lens, self.token_slots), dev):
            static[:b].copy_(t)

    def _capture(self, b: int) -> Callable[[], None]:
        """Build the step's objects once over views of the static buffers and capture the forward."""
        paged = PagedMetadata(self.positions[:b], self.block_tables[:b], self.seq_lens[:b], None, None, None, 0)
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:b], num_decode=b, decode_slots=None,
                                 decode_mask=None, prefills=[], paged=paged)
        lora = None
        if self.lora_slots is not None:
            lora = self.runner.backend.graph_lora_batch(self.lora_slots, self.token_slots[:b])
        model, kv, out = self.runner.model, self.runner.kv, self.logits[:b]
        ids = self.input_ids[:b]

        def forward() -> None:
            hidden = model(ids, paged.positions, kv, meta, lora)
            out.copy_(model.compute_logits(hidden))

        self.stats["captures"] += 1
        self.capturing = b  # which bucket a capture call is for (stand-ins in tests read it)
        return self.capture(forward)

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every bucket not captured yet, largest first (the shared pool is sized by the
        widest graph once; the smaller ones fit in it), each with its static buffers holding
        padding rows only (as `run` pads: their K/V writes land in the sink block). Returns how
        many graphs were captured."""
        done = 0
        for b in sorted(self.buckets, reverse=True):
            if b not in self.replays:
                self._write(self._host_inputs([], None, b), b)
                self.replays[b] = self._capture(b)
                done += 1
        return done

    @torch.inference_mode()
    def run(self, sched, token_slots: list[int] | None,
            fill_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [n, V] (a view of the static output) of the decode step `sched` (`takes` it);
        token_slots: each decode row's LoRA slot (-1: none), in sched.decodes' order, or None;
        fill_ids: writes the rows whose input token is still on the device into the static
        input ids (ModelRunner's pending tokens), after the upload and before the replay."""
        n = len(sched.decodes)
        b = self.bucket(n)
        self._write(self._host_inputs(sched.decodes, token_slots, b), b)
        if fill_ids is not None:
            fill_ids(self.input_ids)
        replay = self.replays.get(b)
        if replay is None:
            replay = self.replays[b] = self._capture(b)
        replay()
        self.stats["replays"] += 1
        return self.logits[:n]

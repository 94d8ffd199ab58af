"""Runs the model on one step's work: SchedulerOutput (+ the LoRA batch) -> last-token logits.

    sched = lora.layout(sched)                        # the token order the LoRA batch wants
    graphs.run(sched, ...)                            # decode-only steps a backend captured, or
    inputs = backend.build_inputs(sched, block_size)  # slot lists + masks, or block tables
    ids, pos, meta, rows = backend.upload_inputs(inputs, lora)   # one transfer (none on CPU)
    logits = model.compute_logits(model(ids, pos, kv, meta, lora)[rows])

The input form, the upload and the graphs are the backend's (engine.backends.base.Backend);
the runner holds no backend or device branch and never modifies the SchedulerOutput.

A decode row whose input token was sampled by the step before and is not on the host yet (an
overlapped engine: Sequence.num_pending, PENDING_TOKEN in its token_ids) reads it from that
step's tokens on the device (`PendingTokens`): one gather into the uploaded input ids, after the
upload and before the forward (or the graph's replay)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.attention import KVCache
from engine.model.decoder import DecoderModel
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


@dataclass
class PendingTokens:
    """The tokens the step before sampled, still on the device: `tokens` int64 [n], row
    `row_of[seq.seq_id]` the one drawn for that sequence."""

    tokens: torch.Tensor
    row_of: dict[int, int]

    def patch(self, decodes) -> tuple[list[int], list[int]] | None:
        """(rows of `decodes` whose input is pending, the rows of `tokens` they read), or None.
        A sequence not in `row_of` (its row failed before it was sampled) reads row 0: any id
        will do, the engine finishes it before it samples again."""
        dst = [i for i, s in enumerate(decodes) if s.seq.num_pending]
        if not dst:
            return None
        return dst, [self.row_of.get(decodes[i].seq.seq_id, 0) for i in dst]


class ModelRunner:
    def __init__(self, model: DecoderModel, kv: KVCache, block_size: int, backend):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.backend = backend
        self.device = backend.device
        #: Decode-only steps through graphs the backend captured (Backend.decode_graphs), if set.
        self.graphs = None

    @torch.inference_mode()
    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero the K/V of `blocks` in every layer. Called for a sequence that failed in a step:
        its cache may hold non-finite values, and a later owner of the blocks must not read them
        even as masked padding."""
        if not blocks:
            return
        bs = self.block_size
        slots = (torch.tensor(blocks, dtype=torch.int64)[:, None] * bs + torch.arange(bs)).reshape(-1).to(self.device)
        for k, v in zip(self.kv.k, self.kv.v):
            k.index_fill_(0, slots, 0.0)
            v.index_fill_(0, slots, 0.0)

    @torch.inference_mode()
    def clear_cache(self) -> None:
        """Zero the whole KV cache (the engine's reset)."""
        for k, v in zip(self.kv.k, self.kv.v):
            k.zero_()
            v.zero_()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, lora=None, pending: PendingTokens | None = None
                ) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step. Returns (fp32 logits [N, V] on the device for `seqs` that sample, seqs),
        rows in the order `lora.layout(sched)` lays the tokens out. `pending`: the step before's
        tokens, for decode rows whose input is one of them (module docstring)."""
        if lora is not None:
            sched = lora.layout(sched)
        patch = pending.patch(sched.decodes) if pending is not None else None
        if patch is None and any(s.seq.num_pending for s in sched.decodes):
            raise RuntimeError("a decode row's input token is pending but no step's tokens were given")
        if self.graphs is not None and self.graphs.takes(sched):
            slots = lora.meta.token_slots.tolist() if lora is not None else None  # host: built, not uploaded
            fill = None if patch is None else lambda ids: self._fill_pending(ids, patch, pending)
            return self.graphs.run(sched, slots, fill), [s.seq for s in sched.decodes]
        inputs = self.backend.build_inputs(sched, self.block_size)
        ids, pos, meta, rows_idx = self.backend.upload_inputs(inputs, lora)
        if patch is not None:
            self._fill_pending(ids, patch, pending)
        hidden = self.model(ids, pos, self.kv, meta, lora)
        if not inputs.logit_rows:
            return torch.empty(0, self.model.cfg.vocab_size, device=self.device), []
        return self.model.compute_logits(hidden[rows_idx]), inputs.seqs

    def _fill_pending(self, ids: torch.Tensor, patch: tuple[list[int], list[int]], pending: PendingTokens) -> None:
        """ids[dst] = pending.tokens[src] on the device (decode rows lead the input ids)."""
        dst, src = self.backend.upload([torch.tensor(patch[0], dtype=torch.int64),
                                        torch.tensor(patch[1], dtype=torch.int64)])
        ids.index_copy_(0, dst, pending.tokens.index_select(0, src))

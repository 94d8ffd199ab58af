"""Turns a SchedulerOutput into model inputs, runs the model, returns last-token logits.

The step's index tensors (token ids, positions, cache slots, masks, logit rows, the LoRA batch's
metadata) are built on the host and reach the device in one transfer (Backend.upload); on the
CPU they are used as built."""
from __future__ import annotations

import torch

from engine.model.attention import AttentionMetadata, KVCache, PrefillChunk
from engine.model.llama import LlamaModel
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, block_size: int, backend):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.backend = backend
        self.device = backend.device

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache slots of positions [start, end) of a sequence."""
        bs = self.block_size
        pos = torch.arange(start, end)
        bt = torch.tensor(block_table, dtype=torch.int64)
        return bt[pos // bs] * bs + pos % bs

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        """Build (input_ids [T], positions [T], attention metadata, logit row indices, sampled seqs)."""
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        bs = self.block_size

        decodes = sched.decodes
        decode_slots = decode_mask = None
        if decodes:
            ctx = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes])
            max_blocks = max(len(s.seq.block_table) for s in decodes)
            bt = torch.zeros(len(decodes), max_blocks, dtype=torch.int64)
            for i, s in enumerate(decodes):
                bt[i, :len(s.seq.block_table)] = torch.tensor(s.seq.block_table)
                # Pad with the row's own first block, not block 0: the torch attention path
                # reads padded slots (masked, but 0 * NaN is NaN), and they must never be
                # another sequence's, which may hold a failing request's non-finite values.
                bt[i, len(s.seq.block_table):] = s.seq.block_table[0]
            lmax = int(ctx.max())
            decode_slots = (bt[:, :, None] * bs + torch.arange(bs)).reshape(len(decodes), -1)[:, :lmax].contiguous()
            decode_mask = (torch.arange(lmax)[None, :] < ctx[:, None])[:, None, None, :]
            positions = ctx - 1
            slot_parts.append(decode_slots.gather(1, positions[:, None]).squeeze(1))
            pos.append(positions)
            for i, s in enumerate(decodes):
                ids.append(s.seq.token_ids[-1])
                logit_rows.append(i)
                sampled.append(s.seq)

        prefills: list[PrefillChunk] = []
        start = len(decodes)
        for s in sched.prefills:
            seq, n = s.seq, s.num_tokens
            c0 = seq.num_computed_tokens
            c1 = c0 + n
            ids.extend(seq.token_ids[c0:c1])
            pos.append(torch.arange(c0, c1))
            slots = self._slots(seq.block_table, 0, c1)
            slot_parts.append(slots[c0:c1])
            if c0 == 0:
                chunk = PrefillChunk(start, n, c1, None, None)
            else:
                # Query i (position c0 + i) attends keys 0..c0 + i.
                mask = torch.arange(c1)[None, :] <= (c0 + torch.arange(n))[:, None]
                chunk = PrefillChunk(start, n, c1, slots, mask)
            prefills.append(chunk)
            if c1 == seq.num_tokens:  # the chunk reaches the end: sample the next token
                logit_rows.append(start + n - 1)
                sampled.append(seq)
            start += n

        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts),
            num_decode=len(decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_lens=ctx if decodes else None,
        )
        return torch.tensor(ids, dtype=torch.int64), torch.cat(pos), meta, logit_rows, sampled

    def _upload(self, ids, pos, meta: AttentionMetadata, rows: list[int], lora):
        """The step's host tensors on the device, in one transfer (nothing moves on the CPU)."""
        if self.device.type == "cpu":
            return ids, pos, meta, rows
        chunk_tensors = [t for p in meta.prefills for t in (p.context_slots, p.mask) if t is not None]
        head = [ids, pos, torch.tensor(rows, dtype=torch.int64), meta.slot_mapping]
        head += [t for t in (meta.decode_slots, meta.decode_mask, meta.decode_lens) if t is not None]
        lora_host = lora.host_tensors() if lora is not None else []
        dev = self.backend.upload(head + chunk_tensors + lora_host)
        ids, pos, rows_t, slot_mapping = dev[:4]
        it = iter(dev[4:])
        meta.slot_mapping = slot_mapping
        if meta.decode_slots is not None:
            meta.decode_slots = next(it)
        if meta.decode_mask is not None:
            meta.decode_mask = next(it)
        if meta.decode_lens is not None:
            meta.decode_lens = next(it)
        for p in meta.prefills:
            if p.context_slots is not None:
                p.context_slots = next(it)
            if p.mask is not None:
                p.mask = next(it)
        if lora is not None:
            lora.bind_device_tensors(list(it))
        return ids, pos, meta, rows_t

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
    def execute(self, sched: SchedulerOutput, lora=None) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step. Returns (fp32 logits [N, V] on the device for `seqs` that sample, seqs)."""
        ids, pos, meta, rows, sampled = self.prepare(sched)
        ids, pos, meta, rows_idx = self._upload(ids, pos, meta, rows, lora)
        hidden = self.model(ids, pos, self.kv, meta, lora)
        if not rows:
            return torch.empty(0, self.model.cfg.vocab_size, device=self.device), []
        return self.model.compute_logits(hidden[rows_idx], exact=self.backend.exact_step(meta)), sampled

"""Turns a SchedulerOutput into model inputs, runs the model, returns last-token logits.

The step's index tensors (token ids, positions, cache slots, masks, logit rows, the LoRA batch's
metadata) are built on the host and reach the device in one transfer (Backend.upload); on the
CPU they are used as built."""
from __future__ import annotations

import torch

from engine.model.attention import AttentionMetadata, KVCache, PagedMetadata, PrefillChunk
from engine.model.decoder import DecoderModel
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: DecoderModel, kv: KVCache, block_size: int, backend):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.backend = backend
        self.device = backend.device
        #: Decode-only steps through captured CUDA graphs (engine.backends.triton.cuda_graphs), if set.
        self.graphs = None

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache slots of positions [start, end) of a sequence."""
        bs = self.block_size
        pos = torch.arange(start, end)
        bt = torch.tensor(block_table, dtype=torch.int64)
        return bt[pos // bs] * bs + pos % bs

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        """Build (input_ids [T], positions [T], attention metadata, logit row indices, sampled seqs):
        the block-table form where the backend's kernels read K/V through block tables, else slot
        lists and masks (the torch and C paths)."""
        if self.backend.paged_attention:
            return self.prepare_paged(sched)
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

    @staticmethod
    def block_table_rows(tables: list[list[int]], width: int) -> torch.Tensor:
        """[len(tables), width] int32, each row a sequence's blocks padded with its own first
        block (never another sequence's)."""
        out = torch.empty(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            out[i, len(t):] = t[0]
        return out

    def decode_rows(self, decodes) -> tuple[list[int], list[int], list[int], list[int]]:
        """(token ids, positions, cache slots, context lengths) of decode rows: each sequence's
        last token, at position num_computed_tokens, its slot from the block table, and the
        context including it."""
        bs = self.block_size
        ids, pos, slots, lens = [], [], [], []
        for s in decodes:
            seq = s.seq
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[-1])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
        return ids, pos, slots, lens

    def prepare_paged(self, sched: SchedulerOutput):
        """`prepare` for paged-attention backends: block tables and lengths, no slot lists or masks."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        decodes = sched.decodes
        d_tables = d_lens = None
        if decodes:
            ids, pos, slots, lens = self.decode_rows(decodes)
            logit_rows.extend(range(len(decodes)))
            sampled.extend(s.seq for s in decodes)
            d_tables = self.block_table_rows([s.seq.block_table for s in decodes],
                                             max(len(s.seq.block_table) for s in decodes))
            d_lens = torch.tensor(lens, dtype=torch.int32)
        prefills: list[PrefillChunk] = []
        p_tables = p_start = p_lens = None
        start = len(decodes)
        if sched.prefills:
            q_start, ctx_lens = [0], []
            for s in sched.prefills:
                seq, n = s.seq, s.num_tokens
                c0, c1 = seq.num_computed_tokens, seq.num_computed_tokens + n
                ids.extend(seq.token_ids[c0:c1])
                pos.extend(range(c0, c1))
                bt = seq.block_table
                slots.extend(bt[q // bs] * bs + q % bs for q in range(c0, c1))
                prefills.append(PrefillChunk(start, n, c1, None, None))
                q_start.append(q_start[-1] + n)
                ctx_lens.append(c1)
                if c1 == seq.num_tokens:
                    logit_rows.append(start + n - 1)
                    sampled.append(seq)
                start += n
            p_tables = self.block_table_rows([s.seq.block_table for s in sched.prefills],
                                             max(len(s.seq.block_table) for s in sched.prefills))
            p_start = torch.tensor(q_start, dtype=torch.int32)
            p_lens = torch.tensor(ctx_lens, dtype=torch.int32)
        positions = torch.tensor(pos, dtype=torch.int64)
        paged = PagedMetadata(positions, d_tables, d_lens, p_tables, p_start, p_lens,
                              max((s.num_tokens for s in sched.prefills), default=0))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decode=len(decodes),
                                 decode_slots=None, decode_mask=None, prefills=prefills, paged=paged)
        return torch.tensor(ids, dtype=torch.int64), positions, meta, logit_rows, sampled

    def _upload(self, ids, pos, meta: AttentionMetadata, rows: list[int], lora):
        """The step's host tensors on the device, in one transfer (nothing moves on the CPU)."""
        if self.device.type == "cpu":
            return ids, pos, meta, rows
        # (object, attribute) of every host tensor the step reads, uploaded together.
        holders = [(meta, "slot_mapping"), (meta, "decode_slots"), (meta, "decode_mask"), (meta, "decode_lens")]
        holders += [(p, name) for p in meta.prefills for name in ("context_slots", "mask")]
        if meta.paged is not None:
            holders += [(meta.paged, name) for name in ("decode_block_tables", "decode_seq_lens",
                                                        "prefill_block_tables", "prefill_query_start",
                                                        "prefill_context_lens")]
        holders = [(o, a) for o, a in holders if getattr(o, a) is not None]
        lora_host = lora.host_tensors() if lora is not None else []
        head = [ids, pos, torch.tensor(rows, dtype=torch.int64)]
        dev = self.backend.upload(head + [getattr(o, a) for o, a in holders] + lora_host)
        ids, pos, rows_t = dev[:3]
        for (o, a), t in zip(holders, dev[3:3 + len(holders)]):
            setattr(o, a, t)
        if meta.paged is not None:
            meta.paged.positions = pos
        if lora is not None:
            lora.bind_device_tensors(dev[3 + len(holders):])
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
        if self.graphs is not None and self.graphs.takes(sched):
            slots = lora.meta.token_slots.tolist() if lora is not None else None  # host: built, not uploaded
            return self.graphs.run(sched, slots), [s.seq for s in sched.decodes]
        ids, pos, meta, rows, sampled = self.prepare(sched)
        ids, pos, meta, rows_idx = self._upload(ids, pos, meta, rows, lora)
        hidden = self.model(ids, pos, self.kv, meta, lora)
        if not rows:
            return torch.empty(0, self.model.cfg.vocab_size, device=self.device), []
        return self.model.compute_logits(hidden[rows_idx], exact=self.backend.exact_step(meta)), sampled

"""A step's model inputs, built on the host from a SchedulerOutput: the two forms the backends'
attention reads, and their one upload.

    inputs = backend.build_inputs(sched, block_size)   # StepInputs
    ids, positions, meta, rows = backend.upload_inputs(inputs, lora)

- `slot_inputs`: slot lists and masks (the torch and C attention paths: the CPU backend).
- `paged_inputs`: block tables and lengths, no slot lists or masks (the paged kernels: Triton).
- `upload_step`: every host tensor of a step (the inputs and the LoRA batch's metadata) on the
  device in one transfer (`Backend.upload`); the CPU backend skips it (nothing moves).

Tokens are laid out decodes first (in `sched.decodes`' order), then each prefill chunk; a
backend whose LoRA batch wants another decode order hands the runner a reordered copy of the
SchedulerOutput (`LoRABatch.layout`), never the scheduler's own lists rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.model.attention import AttentionMetadata, PagedMetadata, PrefillChunk
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.backends.base import LoRABatch
    from engine.scheduler import ScheduledSequence, SchedulerOutput


@dataclass
class StepInputs:
    """One step's host-built model inputs."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_rows: list[int]  # the token rows whose logits are sampled, one per entry of `seqs`
    seqs: list[Sequence]  # the sequences that sample this step, in logits-row order


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [start, end) of a sequence."""
    pos = torch.arange(start, end)
    bt = torch.tensor(block_table, dtype=torch.int64)
    return bt[pos // block_size] * block_size + pos % block_size


def slot_inputs(sched: SchedulerOutput, block_size: int) -> StepInputs:
    """Slot lists and masks: each decode row's cache slots padded to the longest context with a
    mask, each prefill chunk's context slots and causal mask (None for a chunk from position 0)."""
    ids: list[int] = []
    pos: list[torch.Tensor] = []
    slot_parts: list[torch.Tensor] = []
    logit_rows: list[int] = []
    sampled: list[Sequence] = []
    bs = block_size

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
        slots = _slots(seq.block_table, 0, c1, bs)
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
    return StepInputs(torch.tensor(ids, dtype=torch.int64), torch.cat(pos), meta, logit_rows, sampled)


def block_table_rows(tables: list[list[int]], width: int) -> torch.Tensor:
    """[len(tables), width] int32, each row a sequence's blocks padded with its own first
    block (never another sequence's)."""
    out = torch.empty(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        out[i, len(t):] = t[0]
    return out


def decode_rows(decodes: list[ScheduledSequence], block_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(token ids, positions, cache slots, context lengths) of decode rows: each sequence's
    last token, at position num_computed_tokens, its slot from the block table, and the
    context including it."""
    bs = block_size
    ids, pos, slots, lens = [], [], [], []
    for s in decodes:
        seq = s.seq
        p = seq.num_computed_tokens
        ids.append(seq.token_ids[-1])
        pos.append(p)
        slots.append(seq.block_table[p // bs] * bs + p % bs)
        lens.append(p + 1)
    return ids, pos, slots, lens


def paged_inputs(sched: SchedulerOutput, block_size: int) -> StepInputs:
    """Block tables and lengths (PagedMetadata) for paged-attention kernels; no slot lists or masks."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    sampled: list[Sequence] = []
    decodes = sched.decodes
    d_tables = d_lens = None
    if decodes:
        ids, pos, slots, lens = decode_rows(decodes, bs)
        logit_rows.extend(range(len(decodes)))
        sampled.extend(s.seq for s in decodes)
        d_tables = block_table_rows([s.seq.block_table for s in decodes],
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
        p_tables = block_table_rows([s.seq.block_table for s in sched.prefills],
                                    max(len(s.seq.block_table) for s in sched.prefills))
        p_start = torch.tensor(q_start, dtype=torch.int32)
        p_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    positions = torch.tensor(pos, dtype=torch.int64)
    paged = PagedMetadata(positions, d_tables, d_lens, p_tables, p_start, p_lens,
                          max((s.num_tokens for s in sched.prefills), default=0))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decode=len(decodes),
                             decode_slots=None, decode_mask=None, prefills=prefills, paged=paged)
    return StepInputs(torch.tensor(ids, dtype=torch.int64), positions, meta, logit_rows, sampled)


def upload_step(inputs: StepInputs, lora: LoRABatch | None,
                upload: Callable[[list[torch.Tensor]], list[torch.Tensor]]):
    """(input ids, positions, metadata, logit row index) on the device: every host tensor of the
    step, `lora`'s metadata included (bound back into it), through one `upload` call."""
    meta = inputs.meta
    # (object, attribute) of every host tensor the step reads, uploaded together.
    holders = [(meta, "slot_mapping"), (meta, "decode_slots"), (meta, "decode_mask"), (meta, "decode_lens")]
    holders += [(p, name) for p in meta.prefills for name in ("context_slots", "mask")]
    if meta.paged is not None:
        holders += [(meta.paged, name) for name in ("decode_block_tables", "decode_seq_lens",
                                                    "prefill_block_tables", "prefill_query_start",
                                                    "prefill_context_lens")]
    holders = [(o, a) for o, a in holders if getattr(o, a) is not None]
    lora_host = lora.host_tensors() if lora is not None else []
    head = [inputs.input_ids, inputs.positions, torch.tensor(inputs.logit_rows, dtype=torch.int64)]
    dev = upload(head + [getattr(o, a) for o, a in holders] + lora_host)
    ids, pos, rows = dev[:3]
    for (o, a), t in zip(holders, dev[3:3 + len(holders)]):
        setattr(o, a, t)
    if meta.paged is not None:
        meta.paged.positions = pos
    if lora is not None:
        lora.bind_device_tensors(dev[3 + len(holders):])
    return ids, pos, meta, rows

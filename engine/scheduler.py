"""Continuous batching with chunked prefill, priority classes, per-tenant fairness and aging.

Each step:
1. Running sequences are served first, in priority order: one token per decoding sequence, and
   prefill chunks of sequences still prefilling, all within the step's token budget. When the
   KV cache has no block for a sequence, the lowest-priority, latest-arrived running sequence
   is preempted (its blocks freed, recomputed later).
2. If nothing was preempted, waiting sequences are admitted in order of (effective class,
   tenant's recent share, arrival). The effective class of a waiting request improves by one
   for every `aging_seconds` it has waited, so batch work is never starved. Inside a class the
   tenant that received the fewest tokens recently goes first (fair share).
3. A sequence admitted with a cached prefix (engine.block_manager) starts after it: only its
   uncached tokens take step budget and new blocks.
4. Adapters: at most `max_loras` distinct adapters run in one step; a waiting request whose
   adapter is not ready on this engine (still loading) or would exceed that bound is skipped,
   not blocking the requests behind it. So that busy adapters cannot hold every slot forever:
   once a request skipped for a slot has waited `aging_seconds`, the running adapter with the
   fewest running sequences takes no new ones until it has drained and its slot is free.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  #: tokens of `seq` computed this step, starting at seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    """The contract between the scheduler and the model runner for one step."""

    #: Decoding sequences (exactly one token each), in the batch's leading positions.
    decodes: list[ScheduledSequence] = field(default_factory=list)
    #: Prefill chunks (one or more tokens each), after the decodes.
    prefills: list[ScheduledSequence] = field(default_factory=list)
    #: Sequences preempted this step (their blocks are already freed).
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        """Schedule `num_tokens` of `seq`: a decode if it has exactly one token left to compute."""
        (self.decodes if seq.num_uncomputed_tokens == 1 else self.prefills).append(ScheduledSequence(seq, num_tokens))

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_tokens for s in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 aging_seconds: float = 10.0, max_loras: int = 8,
                 adapter_ready: Callable[[str], bool] | None = None,
                 fairness_halflife_s: float = 30.0):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.aging_seconds = aging_seconds
        self.max_loras = max_loras
        self.adapter_ready = adapter_ready or (lambda _a: True)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # Decayed tokens served per tenant: the fair-share signal.
        self._served: dict[str, float] = defaultdict(float)
        self._served_at = time.monotonic()
        self._halflife = fairness_halflife_s

    # -- queue management ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reset(self) -> None:
        """Drop every queued and running sequence and the fair-share history; every KV block is
        free again (the engine's reset after its step loop died)."""
        self.waiting.clear()
        self.running.clear()
        self._served.clear()
        self._served_at = time.monotonic()
        self.block_manager.reset()

    # -- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._decay_served()
        now = time.monotonic()

        # 1. Running sequences, highest priority first; preempt from the other end when short.
        self.running.sort(key=lambda s: (s.priority, s.arrival_time))
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = self._pick_victim(scheduled_ids)
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue  # seq itself was preempted; self.running shrank at i
            i = self.running.index(seq)  # victims before it may have shifted it
            self.block_manager.allocate(seq, n)
            out.add(seq, n)
            scheduled_ids.add(seq.seq_id)
            self._served[seq.tenant_id] += n
            budget -= n
            i += 1

        # 2. Admit waiting sequences (not in a step that had to preempt: memory is short).
        if not out.preempted:
            active_adapters = {s.adapter for s in self.running if s.adapter is not None}
            skipped: set[int] = set()
            draining: str | None = None  # a running adapter held back for a request starved of a slot
            while budget > 0 and len(self.running) < self.max_num_seqs:
                # Re-pick after every admission: the tokens just granted count against the
                # tenant's share, so a flood from one tenant interleaves with the others.
                candidates = [s for s in self.waiting if s.seq_id not in skipped]
                if not candidates:
                    break
                seq = min(candidates, key=lambda s: self._admission_key(s, now))
                if seq.adapter is not None:
                    no_slot = seq.adapter not in active_adapters and len(active_adapters) >= self.max_loras
                    if seq.adapter == draining or no_slot or not self.adapter_ready(seq.adapter):
                        skipped.add(seq.seq_id)  # wait for a slot, the load or a drain, not blocking others
                        if (no_slot and draining is None and self.aging_seconds > 0
                                and now - seq.arrival_time >= self.aging_seconds and self.adapter_ready(seq.adapter)):
                            draining = self._adapter_to_drain()
                        continue
                # Blocks whose KV is already cached (prefix caching) count as computed.
                hit = self.block_manager.cached_prefix(seq)
                n = min(seq.num_uncomputed_tokens - len(hit) * self.block_manager.block_size, budget)
                if not self.block_manager.can_allocate(seq, n, hit):
                    break  # keep order: a later, smaller request must not overtake on memory
                self.block_manager.allocate(seq, n, hit)
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
                self.running.append(seq)
                if seq.adapter is not None:
                    active_adapters.add(seq.adapter)
                out.add(seq, n)
                self._served[seq.tenant_id] += n
                budget -= n

        return out

    # -- helpers ------------------------------------------------------------------------------

    def effective_class(self, seq: Sequence, now: float) -> int:
        """Priority class after aging: one class better per `aging_seconds` waited."""
        waited = now - seq.arrival_time
        return max(0, int(seq.priority) - int(waited // self.aging_seconds)) if self.aging_seconds > 0 else int(seq.priority)

    def _adapter_to_drain(self) -> str:
        """The running adapter that frees its slot soonest if it takes no new sequences: the one
        with the fewest running (then the first by name, so consecutive steps agree)."""
        counts: dict[str, int] = defaultdict(int)
        for s in self.running:
            if s.adapter is not None:
                counts[s.adapter] += 1
        return min(counts, key=lambda a: (counts[a], a))

    def _admission_key(self, seq: Sequence, now: float) -> tuple:
        return (self.effective_class(seq, now), self._served[seq.tenant_id], seq.arrival_time)

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        # Lowest class, latest arrival; prefer sequences not yet scheduled in this step.
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids] or self.running
        return max(candidates, key=lambda s: (s.priority, s.arrival_time))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free `seq`'s blocks and send it back to waiting; returns step tokens given back."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.append(seq)
        out.preempted.append(seq)
        reclaimed = 0
        for lst in (out.decodes, out.prefills):
            for s in list(lst):
                if s.seq is seq:
                    lst.remove(s)
                    reclaimed += s.num_tokens
        return reclaimed

    def _decay_served(self) -> None:
        now = time.monotonic()
        dt = now - self._served_at
        if dt > 1.0:
            f = 0.5 ** (dt / self._halflife)
            for k in list(self._served):
                self._served[k] *= f
                if self._served[k] < 1e-3:
                    del self._served[k]
            self._served_at = now

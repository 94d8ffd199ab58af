"""Continuous batching with chunked prefill, priority classes, per-tenant fairness and aging.

Each step:
1. Running sequences are served first, in order of (priority class, rank, arrival): one token
   per decoding sequence, and prefill chunks of sequences still prefilling, within the step's
   token budget (a chunk leaves one token to each decode after it). When the KV cache has no
   block for a sequence, the running sequence last in that order is preempted (its blocks
   freed, recomputed later).
2. If nothing was preempted, waiting sequences are admitted in order of (effective class,
   rank, tenant's recent share, arrival). The effective class of a waiting request improves by
   one for every `aging_seconds` it has waited, so batch work is never starved. Inside a class
   the tenant that received the fewest tokens recently goes first (fair share).
3. A sequence admitted with a cached prefix (engine.block_manager) starts after it: only its
   uncached tokens take step budget and new blocks.
4. A running sequence whose last allowed token (max_tokens) is sampled but still on the device
   (an overlapped engine: Sequence.num_pending) is not scheduled: it finishes when the engine
   has the token. A waiting sequence with a pending token (preempted while it was sampled) is
   admitted once the token is in.
5. Adapters: at most `max_loras` distinct adapters run in one step; a waiting request whose
   adapter is not ready on this engine (still loading) or would exceed that bound is skipped,
   not blocking the requests behind it. So that busy adapters cannot hold every slot forever:
   once a request skipped for a slot has waited `aging_seconds`, the running adapter with the
   fewest running sequences takes no new ones until it has drained and its slot is free.

Fairness on the scarce resources applies inside a priority class while two or more tenants
contend there (have a running or waiting sequence of that class); classes are served in order
as above, and a tenant alone in its class is scheduled exactly as without it. Each tenant has a
weight (GenerationRequest.tenant_weight: the gateway passes its plan's scheduling_weight).
- Rank: a sequence is *big* if its prompt + max_tokens needs more than `big_request_fraction`
  of the KV blocks; its tenant is *over its share* if it holds more blocks in the class than
  num_blocks x its weight / the class's total weight. Rank (big, over its share) orders the
  class: a big or over-share sequence *yields*, coming after the others in both orders above,
  so it is preempted first and never preempts them.
- KV blocks: a waiting request that does not yield and finds no room preempts running
  yielding sequences of other tenants in its class or below (the last in the step's order
  first) if that frees enough; else it waits and so does everything after it (a later, smaller
  request does not overtake on memory). A yielding request never preempts to be admitted and
  never holds up the requests behind it: it is passed over until it fits, a big one until all
  it may need (prompt + max_tokens) is free, so it is not started only to be preempted; and
  when another tenant's request is admitted beside a running big one that then no longer has
  room for all it may need, the big one is preempted at once (it would be when it grows, and
  its prefill would meanwhile slow the other's steps). So a tenant holds blocks beyond its
  share only while no other tenant's request of its class waits for them.
- Prefill tokens: while two or more tenants of a class have prefill work (waiting, or running
  with more than one token to compute), each takes at most the step's budget x its weight /
  their total weight in prefill chunks first; budget left after every running sequence and
  admission had its share goes to the capped prefills in the same order, then to admission
  without caps (the step stays full).
Preempted sequences recompute from their committed blocks (still cached unless evicted since),
so preempting a long prompt costs mostly its uncommitted tail. With prefix caching off it costs
the whole prompt again: a big request then progresses only in the gaps between other tenants'
requests, as it also does when they never leave room for it.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from engine.block_manager import BlockManager
from engine.sampling_params import InvalidRequestError
from engine.sequence import Sequence, SequenceStatus

#: Largest tenant weight (plans' scheduling_weight); the smallest is any positive number.
MAX_TENANT_WEIGHT = 1000.0


def check_tenant_weight(weight) -> float:
    """`weight` as a float if it is a number in (0, MAX_TENANT_WEIGHT], else InvalidRequestError."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_TENANT_WEIGHT:
        raise InvalidRequestError(f"tenant_weight must be a number in (0, {MAX_TENANT_WEIGHT:g}]", "tenant_weight")
    return float(weight)


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


class _Shares:
    """One step's fairness state (module docstring): weights and contending tenants per class,
    blocks held per (tenant, class), and what is left of each tenant's prefill allowance."""

    def __init__(self, running: list[Sequence], waiting: list[Sequence], *, num_blocks: int, budget: int):
        self.num_blocks = num_blocks
        self.weights: dict[int, dict[str, float]] = defaultdict(dict)  # class -> tenant -> weight
        prefill: dict[int, dict[str, float]] = defaultdict(dict)
        self.held: dict[tuple[str, int], int] = defaultdict(int)
        for s in running + waiting:
            c, t = int(s.priority), s.tenant_id
            self.weights[c][t] = max(self.weights[c].get(t, 0.0), s.tenant_weight)
            if s.status == SequenceStatus.WAITING or s.num_uncomputed_tokens > 1:
                prefill[c][t] = self.weights[c][t]
        for s in running:
            self.held[(s.tenant_id, int(s.priority))] += len(s.block_table)
        self.total = {c: sum(ws.values()) for c, ws in self.weights.items()}
        #: Prefill tokens left to each (tenant, class) in the capped pass; absent: no cap.
        self.allowance: dict[tuple[str, int], int] = {}
        for c, ws in prefill.items():
            if len(ws) > 1:
                total = sum(ws.values())
                for t, w in ws.items():
                    self.allowance[(t, c)] = max(1, math.ceil(budget * w / total))

    def contended(self, cls: int) -> bool:
        """Whether two or more tenants have sequences in class `cls`."""
        return len(self.weights.get(cls, ())) > 1

    def over_share(self, tenant: str, cls: int) -> bool:
        """Whether `tenant` holds more blocks in `cls` than its share (never when alone there)."""
        ws = self.weights.get(cls, {})
        if len(ws) < 2 or tenant not in ws:
            return False
        return self.held[(tenant, cls)] > self.num_blocks * ws[tenant] / self.total[cls]

    def cap(self, seq: Sequence, n: int) -> int:
        """`n` prefill tokens of `seq` bounded by its tenant's allowance left."""
        left = self.allowance.get((seq.tenant_id, int(seq.priority)))
        return n if left is None else min(n, left)

    def granted(self, seq: Sequence, prefill_tokens: int, blocks: int) -> None:
        """`seq` was given `blocks` more blocks and `prefill_tokens` prefill tokens."""
        key = (seq.tenant_id, int(seq.priority))
        self.held[key] += blocks
        if key in self.allowance:
            self.allowance[key] = max(0, self.allowance[key] - prefill_tokens)

    def released(self, seq: Sequence, blocks: int) -> None:
        self.held[(seq.tenant_id, int(seq.priority))] -= blocks


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 aging_seconds: float = 10.0, max_loras: int = 8,
                 adapter_ready: Callable[[str], bool] | None = None,
                 fairness_halflife_s: float = 30.0, big_request_fraction: float = 0.5):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.aging_seconds = aging_seconds
        self.max_loras = max_loras
        self.adapter_ready = adapter_ready or (lambda _a: True)
        #: A request needing more than this share of the KV blocks is big (module docstring).
        self.big_request_fraction = big_request_fraction
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # Decayed tokens served per tenant: the fair-share signal.
        self._served: dict[str, float] = defaultdict(float)
        self._served_at = time.monotonic()
        self._halflife = fairness_halflife_s
        self._shares: _Shares | None = None

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
        shares = self._shares = _Shares(self.running, self.waiting, num_blocks=self.block_manager.num_blocks,
                                        budget=budget)

        # 1. Running sequences, highest priority first and yielding ones last in their class;
        # preempt from the other end when short.
        order = {s.seq_id: (s.priority, *self._rank(s), s.arrival_time) for s in self.running}
        self.running.sort(key=lambda s: order[s.seq_id])
        scheduled_ids: set[int] = set()
        capped: list[Sequence] = []  # prefills held below their need by the tenant's allowance
        # A prefill chunk leaves a token of the budget to every decode after it in the order.
        decodes_left = sum(1 for s in self.running if s.num_uncomputed_tokens == 1 and not self._ends_pending(s))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._ends_pending(seq):
                i += 1  # its last token is sampled: it finishes when the engine has it
                continue
            if seq.num_uncomputed_tokens == 1:
                decodes_left -= 1
                want = n = 1
            else:
                want = min(seq.num_uncomputed_tokens, budget - decodes_left)
                n = shares.cap(seq, want)
                if n < want or want <= 0:
                    capped.append(seq)
                if n <= 0:
                    i += 1
                    continue
            while not self.block_manager.can_allocate(seq, n):
                victim = self._pick_victim(scheduled_ids, order)
                if victim is not seq and victim.num_uncomputed_tokens == 1:
                    decodes_left -= 1  # (it is after seq: unscheduled)
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue  # seq itself was preempted; self.running shrank at i
            i = self.running.index(seq)  # victims before it may have shifted it
            self._grant(seq, n, out)
            scheduled_ids.add(seq.seq_id)
            budget -= n
            i += 1

        # 2. Admit waiting sequences (not in a step that had to preempt: memory is short), each
        # tenant within its prefill allowance; then what budget is left goes to the capped.
        if not out.preempted:
            budget = self._admit(out, budget, now, capped)
            budget = self._uncapped(out, budget, capped)
            if budget > 0:
                self._admit(out, budget, now, capped, uncapped=True)
        self._shares = None
        return out

    def _admit(self, out: SchedulerOutput, budget: int, now: float, capped: list[Sequence], *,
               uncapped: bool = False) -> int:
        """Admit waiting sequences into `budget` (step 2); returns the budget left."""
        shares = self._shares
        active_adapters = {s.adapter for s in self.running if s.adapter is not None}
        skipped: set[int] = {s.seq_id for s in out.preempted}  # not back in the step they left
        draining: str | None = None  # a running adapter held back for a request starved of a slot
        while budget > 0 and len(self.running) < self.max_num_seqs:
            # Re-pick after every admission: the tokens and blocks just granted count against
            # the tenant's share, so a flood from one tenant interleaves with the others.
            candidates = [s for s in self.waiting if s.seq_id not in skipped and not s.num_pending]
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
            hit, bs = self.block_manager.cached_prefix(seq), self.block_manager.block_size
            want = min(seq.num_uncomputed_tokens - len(hit) * bs, budget)
            n = want if uncapped else shares.cap(seq, want)
            if n == 0:
                skipped.add(seq.seq_id)  # its tenant's allowance is spent: the uncapped pass
                continue
            big, over = self._rank(seq)
            # A yielding request that does not fit waits without holding up the others (a big
            # one until all it may need fits: started earlier, it would only be preempted).
            if big and not self.block_manager.can_allocate(seq, self._max_len(seq) - len(hit) * bs, hit) \
                    or over and not self.block_manager.can_allocate(seq, n, hit):
                skipped.add(seq.seq_id)
                continue
            if not self.block_manager.can_allocate(seq, n, hit):
                reclaimed = self._make_room(seq, n, hit, out)
                if reclaimed is None:
                    break  # keep order: a later, smaller request must not overtake on memory
                budget += reclaimed
                skipped.update(s.seq_id for s in out.preempted)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            if seq.adapter is not None:
                active_adapters.add(seq.adapter)
            self._grant(seq, n, out, hit)
            if n < want:
                capped.append(seq)
            budget -= n
            if not (big or over):
                budget += self._crowd_out(seq, out)
                skipped.update(s.seq_id for s in out.preempted)
        return budget

    def _crowd_out(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt the running big sequences of other tenants in `seq`'s class or below that no
        longer have room for all they may need now that `seq` is admitted: they would be
        preempted when they grow, and meanwhile their prefill would slow `seq`'s steps. Returns
        the step tokens they give back."""
        bm, reclaimed = self.block_manager, 0
        bigs = [r for r in self.running if r.tenant_id != seq.tenant_id and r.priority >= seq.priority
                and self._rank(r)[0]]
        for r in sorted(bigs, key=lambda r: (r.priority, r.arrival_time), reverse=True):
            if bm.blocks_needed(r, self._max_len(r) - r.num_computed_tokens) > bm.num_free_blocks:
                reclaimed += self._preempt(r, out)
        return reclaimed

    def _uncapped(self, out: SchedulerOutput, budget: int, capped: list[Sequence]) -> int:
        """Give the budget left to the prefills `capped` held back, in order, as far as free
        blocks go (no preemption); returns the budget left."""
        for seq in capped:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue
            entry = next((s for s in out.prefills if s.seq is seq), None)
            done = entry.num_tokens if entry is not None else 0
            extra = min(seq.num_uncomputed_tokens - done, budget)
            if extra <= 0 or not self.block_manager.can_allocate(seq, done + extra):
                continue
            held = len(seq.block_table)
            self.block_manager.allocate(seq, done + extra)
            self._shares.granted(seq, 0, len(seq.block_table) - held)
            if entry is None:
                out.add(seq, extra)
            else:
                entry.num_tokens += extra
            self._served[seq.tenant_id] += extra
            budget -= extra
        return budget

    # -- helpers ------------------------------------------------------------------------------

    def effective_class(self, seq: Sequence, now: float) -> int:
        """Priority class after aging: one class better per `aging_seconds` waited."""
        waited = now - seq.arrival_time
        return max(0, int(seq.priority) - int(waited // self.aging_seconds)) if self.aging_seconds > 0 else int(seq.priority)

    @staticmethod
    def _ends_pending(seq: Sequence) -> bool:
        """Whether `seq` has sampled its last token (max_tokens) but the engine does not have it
        yet (an overlapped step): it finishes then, so no step computes past its end."""
        return seq.num_pending > 0 and seq.num_output_tokens >= seq.params.max_tokens

    @staticmethod
    def _max_len(seq: Sequence) -> int:
        """The most tokens `seq` can reach: its prompt and max_tokens (the engine checked they fit)."""
        return seq.num_prompt_tokens + seq.params.max_tokens

    def is_big(self, seq: Sequence) -> bool:
        """Whether `seq` may need more than `big_request_fraction` of the KV blocks."""
        bm = self.block_manager
        return -(-self._max_len(seq) // bm.block_size) > self.big_request_fraction * bm.num_blocks

    def _rank(self, seq: Sequence) -> tuple[bool, bool]:
        """(big, its tenant over its share), both only while another tenant contends in its
        class: where `seq` comes in its class, after the sequences with a smaller rank (module
        docstring). Either one true: it yields."""
        shares, cls = self._shares, int(seq.priority)
        if not shares.contended(cls):
            return False, False
        return self.is_big(seq), shares.over_share(seq.tenant_id, cls)

    def _grant(self, seq: Sequence, n: int, out: SchedulerOutput, hit: list[int] = ()) -> None:
        """Allocate and schedule `n` tokens of `seq` (can_allocate was true)."""
        held, prefill = len(seq.block_table), seq.num_uncomputed_tokens > 1
        self.block_manager.allocate(seq, n, hit)
        self._shares.granted(seq, n if prefill else 0, len(seq.block_table) - held)
        out.add(seq, n)
        self._served[seq.tenant_id] += n

    def _make_room(self, seq: Sequence, n: int, hit: list[int], out: SchedulerOutput) -> int | None:
        """Preempt yielding running sequences of other tenants in `seq`'s class or below until
        `seq` can take `n` tokens (module docstring); returns the step tokens the preempted
        give back, or None, preempting nothing, when even all of them would not free enough."""
        victims = [r for r in self.running
                   if r.tenant_id != seq.tenant_id and r.priority >= seq.priority and any(self._rank(r))]
        bm = self.block_manager
        if bm.blocks_needed(seq, n, hit) > bm.num_free_blocks - bm.num_unheld(hit) + sum(
                bm.num_exclusive_blocks(r) for r in victims):
            return None
        victims.sort(key=lambda r: (r.priority, *self._rank(r), r.arrival_time))
        reclaimed = 0
        while victims and not bm.can_allocate(seq, n, hit):
            reclaimed += self._preempt(victims.pop(), out)
        return reclaimed if bm.can_allocate(seq, n, hit) else None

    def _adapter_to_drain(self) -> str:
        """The running adapter that frees its slot soonest if it takes no new sequences: the one
        with the fewest running (then the first by name, so consecutive steps agree)."""
        counts: dict[str, int] = defaultdict(int)
        for s in self.running:
            if s.adapter is not None:
                counts[s.adapter] += 1
        return min(counts, key=lambda a: (counts[a], a))

    def _admission_key(self, seq: Sequence, now: float) -> tuple:
        return (self.effective_class(seq, now), *self._rank(seq), self._served[seq.tenant_id], seq.arrival_time)

    def _pick_victim(self, scheduled_ids: set[int], order: dict[int, tuple]) -> Sequence:
        # Last in the step's order (lowest class, big, over its share, latest arrival); prefer
        # sequences not yet scheduled in this step.
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids] or self.running
        return max(candidates, key=lambda s: order.get(s.seq_id, (s.priority, True, True, s.arrival_time)))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free `seq`'s blocks and send it back to waiting; returns step tokens given back."""
        self._shares.released(seq, len(seq.block_table))
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

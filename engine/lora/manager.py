"""LoRA manager: device slots, a CPU tier (LRU, bounded in bytes), and fetching off the step loop.

Tiers: the AdapterSource's on-disk files (fetched versions) -> the CPU tier (parsed and checked
`LoRAWeights`, held as the `SlotImage` a slot write copies: one buffer in the slots' layout,
pinned where the slots are on CUDA; budgeted by its real byte size, so rank matters) -> a device
slot used by the step. Lifecycle of one version:
  request_adapter(v)   at add_request: +1 reference (pins it in the CPU tier) and, if it is not
                       loaded, a background fetch + parse starts while the request waits;
  is_ready(v)          the scheduler admits the request only once it is loaded;
  batch_for(sched)     each step: every scheduled adapter gets a slot (an idle slot, or the
                       least recently used slot whose adapter is not in this step: it may be
                       one a running sequence left unscheduled this step uses, which then gets
                       a slot again, its weights rewritten from the CPU tier, when it is next
                       scheduled; the scheduler bounds distinct adapters among running
                       sequences by the slots, so this costs a reload, never correctness); off
                       the host a slot load is one asynchronous host-to-device copy of the image
                       and a few device copies (LoRASlots.write): the step thread does not wait;
  release(v)           at finish/abort: -1 reference; unreferenced versions may be evicted.
A load failure is remembered for the version (versions are immutable) and fails only the
requests naming it. A version the step traced a fault to (non-finite values, an exception in its
part of the batch) is quarantined with `mark_failed`: for the life of this engine every request
naming it fails at once with that reason, and the source is told (`report_fault`, if it has it)
from the manager's thread pool, never from the step loop.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine import omp_threads
from engine.config import ModelConfig
from engine.durations import ADAPTER_LOAD_BUCKETS_S, Durations
from engine.lora.layers import LoRASlots, SlotImage
from engine.lora.source import AdapterFetchError, AdapterSource
from engine.lora.weights import AdapterLoadError, load_lora_weights

log = logging.getLogger(__name__)

# A fetch that failed for a transient reason may be retried after this long.
_ERROR_TTL_S = 30.0


class LoRAManager:
    def __init__(self, source: AdapterSource, cfg: ModelConfig, *, num_slots: int, max_rank: int,
                 cpu_budget_bytes: int, backend, dtype: torch.dtype | None = None, load_workers: int = 2):
        """`backend` (engine.backends) holds the slots on its device and builds the step's batch;
        `dtype`: adapter storage (default: the backend's lora_dtype())."""
        dtype = dtype or backend.lora_dtype()
        self.source = source
        self.backend = backend
        self.cfg = cfg
        self.max_rank = max_rank
        self.dtype = dtype
        self.cpu_budget_bytes = cpu_budget_bytes
        self.slots = LoRASlots(cfg, num_slots, max_rank, dtype, backend.device)
        self._lock = threading.Lock()
        self._cpu: OrderedDict[str, SlotImage] = OrderedDict()  # LRU: oldest first
        self._loading: dict[str, Future] = {}
        self._errors: dict[str, tuple[str, float]] = {}
        self._quarantined: dict[str, str] = {}  # version -> reason; permanent (versions are immutable)
        self._refs: dict[str, int] = {}
        self._slot_of: dict[str, int] = {}
        self._slot_owner: list[str | None] = [None] * num_slots
        self._slot_used_at: list[float] = [0.0] * num_slots
        # The loaders run torch ops on their own thread only: an OpenMP pool per loader would slow
        # every parallel region of the step (engine.omp_threads).
        self._pool = ThreadPoolExecutor(max_workers=load_workers, thread_name_prefix="lora-load",
                                        initializer=omp_threads.serial_thread)
        #: slot_load_transfers: host-to-device copies made by slot loads (one per load off the host,
        #: none on CPU).
        self.stats = {"cpu_hits": 0, "cpu_misses": 0, "slot_hits": 0, "slot_loads": 0, "slot_load_transfers": 0,
                      "evictions": 0}
        #: Called (on the loader's thread, without arguments) after every load ends, loaded or
        #: failed: a step loop that waits while its requests wait for adapters wakes on it.
        self.load_listeners: list[Callable[[], None]] = []
        #: Successful loads into the CPU tier (fetch + parse), recorded under the lock.
        self.load_times = Durations(ADAPTER_LOAD_BUCKETS_S)
        #: version -> (start, end) in time.monotonic() of the load that put it in the CPU tier,
        #: while it is there: the adapter-load span of the requests that waited for it.
        self.load_spans: dict[str, tuple[float, float]] = {}

    # -- request lifecycle --------------------------------------------------------------------

    def request_adapter(self, version: str) -> bool:
        """Pin `version` for a new request and start loading it if it is not in the CPU tier.
        True when the request has to wait for a load (this one, or one already under way)."""
        with self._lock:
            self._refs[version] = self._refs.get(version, 0) + 1
            if version in self._quarantined:
                return False
            if version in self._cpu:
                self._cpu.move_to_end(version)
                self.stats["cpu_hits"] += 1
                return False
            err = self._errors.get(version)
            if err is not None and time.monotonic() - err[1] < _ERROR_TTL_S:
                return False
            self._errors.pop(version, None)
            if version not in self._loading:
                self.stats["cpu_misses"] += 1
                self._loading[version] = self._pool.submit(self._load, version)
            return True

    def release(self, version: str) -> None:
        with self._lock:
            n = self._refs.get(version, 0) - 1
            if n <= 0:
                self._refs.pop(version, None)
                if version in self._quarantined:
                    self._cpu.pop(version, None)  # never used again
                    self.load_spans.pop(version, None)
            else:
                self._refs[version] = n
            self._evict_cpu_locked()

    def is_ready(self, version: str) -> bool:
        return version in self._cpu and version not in self._quarantined

    def load_error(self, version: str) -> str | None:
        """Why requests naming `version` fail now (quarantine or load failure), or None."""
        reason = self._quarantined.get(version)
        if reason is not None:
            return reason
        err = self._errors.get(version)
        return err[0] if err is not None else None

    def is_quarantined(self, version: str) -> bool:
        return version in self._quarantined

    def mark_failed(self, version: str, reason: str) -> None:
        """Quarantine `version` (a step traced a fault to it): later requests naming it fail with
        `reason`; its slot is freed; the source's `report_fault(version, reason)`, where the source
        has one, runs on the manager's thread pool (it may write to a database)."""
        with self._lock:
            if version in self._quarantined:
                return
            self._quarantined[version] = reason
        slot = self._slot_of.pop(version, None)
        if slot is not None:
            self._slot_owner[slot] = None
            self.slots.clear(slot)
        report = getattr(self.source, "report_fault", None)
        if callable(report):
            self._pool.submit(self._report_fault, report, version, reason)

    @staticmethod
    def _report_fault(report, version: str, reason: str) -> None:
        try:
            report(version, reason)
        except Exception:  # noqa: BLE001 - the engine's own quarantine holds regardless
            log.exception("adapter source could not record the fault of adapter %s", version)

    def reset(self) -> None:
        """Forget every request's reference and slot assignment (the engine's reset after its step
        loop died). The CPU tier, load errors and quarantines stay: they describe immutable
        versions, not requests."""
        with self._lock:
            self._refs.clear()
            self._slot_of.clear()
            for slot in range(len(self._slot_owner)):
                self._slot_owner[slot] = None
                self.slots.clear(slot)
            self._evict_cpu_locked()

    def resident(self) -> tuple[frozenset[str], frozenset[str]]:
        """(versions in a device slot, versions in the CPU tier or loading into it): a snapshot for
        routers choosing the replica where an adapter is already hot."""
        device = frozenset(v for v in list(self._slot_owner) if v is not None)
        with self._lock:
            cpu = frozenset(self._cpu) | frozenset(self._loading)
        return device, cpu

    def wait_loaded(self, version: str, timeout: float = 30.0) -> None:
        """Block until a pending load of `version` finishes (tests, warm-up)."""
        fut = self._loading.get(version)
        if fut is not None:
            fut.result(timeout=timeout)

    # -- loading (background threads) ---------------------------------------------------------

    def _load(self, version: str) -> None:
        t0, started = time.perf_counter(), time.monotonic()
        try:
            path = self.source.fetch(version)
            weights = load_lora_weights(path, version, self.cfg, max_rank=self.max_rank, dtype=self.dtype)
            image = self.slots.prepare(weights)  # here, so the step thread only copies it
        except Exception as e:  # noqa: BLE001 - any failure fails only this adapter's requests
            known = isinstance(e, (AdapterFetchError, AdapterLoadError))
            msg = f"adapter {version} cannot be loaded: {e if known else f'{type(e).__name__}: {e}'}"
            with self._lock:
                self._errors[version] = (msg, time.monotonic())
                self._loading.pop(version, None)
            log.warning(msg, exc_info=not known)
            self._loads_ended()
            return
        with self._lock:
            self.load_spans[version] = (started, time.monotonic())  # before it can be scheduled
            self._cpu[version] = image
            self._loading.pop(version, None)
            self.load_times.record(time.perf_counter() - t0)
            self._evict_cpu_locked()
        self._loads_ended()

    def _loads_ended(self) -> None:
        for listener in list(self.load_listeners):
            listener()

    def _evict_cpu_locked(self) -> None:
        total = sum(w.nbytes for w in self._cpu.values())
        for version in list(self._cpu):
            if total <= self.cpu_budget_bytes:
                break
            if self._refs.get(version) or version in self._slot_of:
                continue  # pinned by a request, or resident in a slot
            total -= self._cpu.pop(version).nbytes
            self.load_spans.pop(version, None)
            self.stats["evictions"] += 1

    # -- per step -----------------------------------------------------------------------------

    def batch_for(self, sched):
        """Slots for this step's adapters and the backend's LoRABatch for the model (whose
        `layout` may order the decodes otherwise, see Backend.lora_batch; `sched` is only read);
        None if no token has one. The scheduler guarantees at most `num_slots` distinct adapters
        among running sequences; a slot taken here may be one whose adapter a running sequence
        not scheduled this step uses (see the module docstring).
        """
        seqs = [s.seq for s in sched.decodes] + [s.seq for s in sched.prefills]
        if all(seq.adapter is None for seq in seqs):
            return None
        now = time.monotonic()
        needed = {seq.adapter for seq in seqs if seq.adapter is not None}
        slot_of = {v: self._slot_for(v, needed, now) for v in dict.fromkeys(
            seq.adapter for seq in seqs if seq.adapter is not None)}

        return self.backend.lora_batch(self.slots, sched, slot_of)

    def _slot_for(self, version: str, needed: set[str], now: float) -> int:
        slot = self._slot_of.get(version)
        if slot is not None:
            self.stats["slot_hits"] += 1
        else:
            free = [i for i, o in enumerate(self._slot_owner) if o is None]
            if free:
                slot = free[0]
            else:
                # Least recently used slot whose adapter is not in this step (a running but
                # unscheduled sequence's adapter may lose its slot: it is written again when
                # that sequence is next scheduled).
                candidates = [i for i, o in enumerate(self._slot_owner) if o not in needed]
                if not candidates:
                    raise RuntimeError("more distinct adapters in one step than LoRA slots")
                slot = min(candidates, key=lambda i: self._slot_used_at[i])
                del self._slot_of[self._slot_owner[slot]]
            with self._lock:
                image = self._cpu[version]
                self._cpu.move_to_end(version)
            # Unowned while written: a write that raises leaves a free slot, not a stale owner.
            self._slot_owner[slot] = None
            transfers = self.slots.write(slot, image)
            self._slot_of[version] = slot
            self._slot_owner[slot] = version
            self.stats["slot_loads"] += 1
            self.stats["slot_load_transfers"] += transfers
        self._slot_used_at[slot] = now
        return slot

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

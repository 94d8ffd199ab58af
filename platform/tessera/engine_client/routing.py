"""Which engine replica serves a request: pure functions over the replicas' published state.

Every engine worker publishes a `ReplicaState` (GET /internal/state, worker.py); the gateway's
HTTP client keeps the latest one per replica, adds the requests it sent since (so a burst between
two polls does not all land on the replica that looked idle), and asks `route` for an order of
replicas to try. The same functions drive bench/routing.py's simulation.

Policy (`route`):
- Only replicas that are up and not draining take new requests.
- Sequences ahead of a request are those running and those waiting in the same or a more
  urgent class: a realtime request never counts a replica's batch backlog against it.
- An adapter request goes, among the replicas within the load bound (consistent hashing with
  bounded loads: load + 1 <= ceil(balance * (total load + 1) / n)), to the one where it would
  start soonest (`start_delay_s`): waiting for a seat (one seat turnover, the replica's measured
  mean seat time over its seats, per sequence ahead beyond the seats), plus its adapter's load
  when cold there (the fleet's measured mean load time). The load is counted in full although it
  runs while the request waits: it also evicts another adapter from that replica's CPU tier, which
  a later request pays for. So a request waits a few turnovers where its adapter is hot rather
  than load it cold elsewhere, and goes elsewhere once that wait would be longer. On equal delays:
  the adapter in a device slot, then in the CPU tier (or loading), then cold, each one step behind
  where every slot is held by a running sequence's adapter (it waits for one to finish); among
  replicas that hold it, the least loaded (a popular adapter held by several evens their load,
  which leaves its first replica room for its own cold adapters); among replicas where it is cold,
  the adapter's ring order, so every gateway sends a cold adapter to the same replica and its load
  spills to its next ring replicas only when the first is over the bound or would make it wait
  longer than a load: a popular adapter spreads as its load grows, a cold one stays put.
- A base-model request goes to the replica with the least load ahead of it, those that can
  admit it at once (fewer sequences ahead of it than seats) first, most free KV blocks on a tie,
  then a rotating start so ties spread.
The rest of the replicas follow in the same preference: where to retry when the first refuses
before anything was streamed.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache

from engine.sampling_params import Priority

#: Default load bound factor: no replica takes a request that would put it above 1.25x the mean.
DEFAULT_BALANCE = 1.25
#: Virtual nodes per replica on the hash ring (spreads each replica's share of the key space).
RING_VNODES = 64

# Cost of serving an adapter request on a replica, by where the adapter is there.
_COST_DEVICE, _COST_CPU, _COST_COLD = 0, 1, 3
#: Until replicas have measured them (no request finished, no adapter loaded yet): how long a
#: request holds a seat and how long a cold adapter takes to load, in seconds. Only their ratio
#: matters before then: a cold load counts as a few seat turnovers of a 64-seat replica.
PRIOR_SEAT_S, PRIOR_LOAD_S = 2.0, 0.1


@dataclass
class ReplicaState:
    """One engine replica as a worker publishes it (GET /internal/state) and the router reads it.

    `running`/`waiting`: sequences per priority class (Priority value -> count); `device_adapters`:
    adapter versions in a device slot; `cpu_adapters`: in the CPU tier (loaded, maybe also in a
    slot) or being loaded; `free_slots`: device slots no running sequence's adapter holds;
    `draining`: the worker admits nothing new (SIGTERM); `up`: it answered its last poll with a
    state ("ready"); `state`: its words for what it is ("ready", "draining", "restarting",
    "failed", "stopped", "unreachable", or the gateway's "wrong_model"); `model`: the base model it
    serves (None: not said); `restarts`: times its engine's step loop died and restarted;
    `seat_s`/`load_s`: its recent mean time a request held a seat / an adapter took to load into
    the CPU tier, in seconds (None until it has measured one)."""

    name: str
    up: bool = True
    draining: bool = False
    state: str = "ready"
    model: str | None = None
    running: dict[int, int] = field(default_factory=dict)
    waiting: dict[int, int] = field(default_factory=dict)
    max_num_seqs: int = 64
    num_slots: int = 8
    free_slots: int = 8
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    device_adapters: frozenset[str] | set[str] = frozenset()
    cpu_adapters: frozenset[str] | set[str] = frozenset()
    restarts: int = 0
    seat_s: float | None = None
    load_s: float | None = None

    @property
    def accepting(self) -> bool:
        """Whether new requests may be sent to it."""
        return self.up and not self.draining

    def load(self) -> int:
        """Sequences running or waiting, every class."""
        return sum(self.running.values()) + sum(self.waiting.values())

    def load_ahead(self, priority: int) -> int:
        """Sequences a new request of class `priority` would find ahead of it: every running one
        (a running sequence keeps its seat until it finishes) and those waiting in the same or a
        more urgent class."""
        return sum(self.running.values()) + sum(n for p, n in self.waiting.items() if p <= priority)

    def has_room(self, priority: int) -> bool:
        """Whether a request of class `priority` would be admitted at its next step."""
        return self.load_ahead(priority) < self.max_num_seqs

    def turnover_s(self) -> float:
        """Seconds between two of its seats freeing up while all are taken: the mean time a
        request holds a seat, over the seats."""
        return (self.seat_s if self.seat_s is not None else PRIOR_SEAT_S) / max(1, self.max_num_seqs)

    def start_delay_s(self, adapter: str, priority: int, load_s: float) -> float:
        """What a request of class `priority` for `adapter` costs here, in seconds: one seat
        turnover per sequence ahead of it beyond the seats, plus `load_s` when the adapter is
        cold here (counted in full, though the load overlaps the wait: see the module docstring)."""
        wait = max(0, self.load_ahead(priority) - self.max_num_seqs + 1) * self.turnover_s()
        if adapter in self.device_adapters or adapter in self.cpu_adapters:
            return wait
        return wait + load_s

    def adapter_cost(self, adapter: str) -> int:
        """What serving `adapter` here costs, lowest first: in a device slot, in the CPU tier or
        loading, cold; one more without a free slot (it waits for a running adapter to finish)."""
        if adapter in self.device_adapters:
            return _COST_DEVICE
        cost = _COST_CPU if adapter in self.cpu_adapters else _COST_COLD
        return cost + (self.free_slots <= 0)

    def to_dict(self) -> dict:
        """The wire form (GET /internal/state): priority classes by name, adapters as lists."""
        return {"name": self.name, "model": self.model, "state": self.state, "draining": self.draining,
                "running": {Priority(p).name: n for p, n in self.running.items()},
                "waiting": {Priority(p).name: n for p, n in self.waiting.items()},
                "max_num_seqs": self.max_num_seqs, "num_slots": self.num_slots, "free_slots": self.free_slots,
                "free_kv_blocks": self.free_kv_blocks, "total_kv_blocks": self.total_kv_blocks,
                "device_adapters": sorted(self.device_adapters), "cpu_adapters": sorted(self.cpu_adapters),
                "restarts": self.restarts, "seat_s": self.seat_s, "load_s": self.load_s}

    @classmethod
    def from_dict(cls, name: str, data: dict) -> "ReplicaState":
        """The state a worker published (`to_dict`'s form), under the gateway's `name` for it;
        ValueError/KeyError/TypeError when malformed."""
        state = str(data.get("state", "ready"))
        draining = bool(data.get("draining", False))
        model = data.get("model")
        return cls(
            name=name, model=None if model is None else str(model),
            up=state in ("ready", "draining"), draining=draining or state == "draining",
            state="draining" if draining else state,
            running={int(Priority.parse(p)): int(n) for p, n in (data.get("running") or {}).items()},
            waiting={int(Priority.parse(p)): int(n) for p, n in (data.get("waiting") or {}).items()},
            max_num_seqs=int(data["max_num_seqs"]), num_slots=int(data["num_slots"]),
            free_slots=int(data["free_slots"]), free_kv_blocks=int(data["free_kv_blocks"]),
            total_kv_blocks=int(data["total_kv_blocks"]),
            device_adapters=frozenset(map(str, data.get("device_adapters") or ())),
            cpu_adapters=frozenset(map(str, data.get("cpu_adapters") or ())), restarts=int(data.get("restarts", 0)),
            seat_s=_seconds(data.get("seat_s")), load_s=_seconds(data.get("load_s")))


def _seconds(value) -> float | None:
    """A published duration: None when absent; ValueError unless a finite number >= 0."""
    if value is None:
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"not a duration in seconds: {value!r}")
    return seconds


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over replica indices 0..n-1 (`vnodes` points each): `order(key)` is
    every index once, in the order the ring meets them clockwise from the key's hash. Adding or
    removing a replica moves only the keys whose first replica it was."""

    def __init__(self, names: list[str], vnodes: int = RING_VNODES):
        points = sorted((_hash64(f"{name}#{v}"), i) for i, name in enumerate(names) for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [i for _, i in points]
        self.size = len(names)
        self.order = lru_cache(maxsize=65536)(self._order)

    def _order(self, key: str) -> tuple[int, ...]:
        start = bisect.bisect(self._hashes, _hash64(key))
        seen: dict[int, None] = {}
        n = len(self._owners)
        for k in range(n):
            seen.setdefault(self._owners[(start + k) % n])
            if len(seen) == self.size:
                break
        return tuple(seen)


def load_bound(replicas: list[ReplicaState], balance: float = DEFAULT_BALANCE) -> int:
    """Most load a replica may carry after taking one more request: ceil(balance x the mean
    load with that request counted) over the replicas that accept requests."""
    live = [r for r in replicas if r.accepting]
    if not live:
        return 0
    return math.ceil(balance * (sum(r.load() for r in live) + 1) / len(live))


def route(replicas: list[ReplicaState], *, adapter: str | None, priority: int, ring: HashRing,
          balance: float = DEFAULT_BALANCE, tiebreak: int = 0) -> list[int]:
    """Indices of the replicas that accept requests, best first (see the module docstring);
    empty when none does. `ring` is over the same replicas in the same order; `tiebreak` rotates
    the start among equal base-model choices (a counter)."""
    n = len(replicas)
    live = [i for i in range(n) if replicas[i].accepting]
    if not live:
        return []
    if adapter is None:
        def key(i: int):
            r = replicas[i]
            return (not r.has_room(priority), r.load_ahead(priority), -r.free_kv_blocks, (i - tiebreak) % n)
        return sorted(live, key=key)
    bound = load_bound(replicas, balance)
    rank = {i: k for k, i in enumerate(ring.order(adapter))}
    # One load time for the whole fleet (the replicas load from the same store): per-replica
    # figures would send every cold adapter to the replica that happened to load fastest.
    measured = [replicas[i].load_s for i in live if replicas[i].load_s is not None]
    load_s = sum(measured) / len(measured) if measured else PRIOR_LOAD_S

    def key(i: int):
        r = replicas[i]
        over = r.load() + 1 > bound
        if over:  # the first element alone orders the two kinds: the rest never meet
            return (True, not r.has_room(priority), r.load(), rank[i])
        cost = r.adapter_cost(adapter)
        return (False, r.start_delay_s(adapter, priority, load_s), cost, r.load() if cost < _COST_COLD else 0, rank[i])
    return sorted(live, key=key)


def plain_hash(adapter: str, n: int) -> int:
    """The replica plain hashing sends `adapter` to (the policy before replica state: one
    replica per adapter whatever the load)."""
    return int(hashlib.sha256(adapter.encode()).hexdigest()[:8], 16) % n

"""Routing simulation: adapter affinity with bounded load vs round robin vs plain hashing.

Prints one JSON object. 10,000 adapters with Zipf popularity (exponent --zipf), `--replicas`
engine replicas with real device-slot counts (max_loras), seats (max_num_seqs) and CPU-tier
budgets (divided by one adapter's bytes for --model's shape at --rank and the tier's dtype):
`--sizes chart` (the default) takes them from the Helm chart's engine values
(infra/helm/tessera/values.yaml: the scale-out deployment, GPU engines keeping adapters in bf16),
`--sizes engine` from EngineConfig's defaults (the embedded engine: a 1 GiB tier, adapters in
--lora-dtype); --cpu-tier-mib and --max-loras override the tier and the slots. Poisson arrivals at 70% and 95% of the fleet's
seat capacity (replicas x seats / mean service time). The affinity policy is
the gateway's own code (tessera.engine_client.routing.route over ReplicaState objects the
simulation keeps current); plain hashing is routing.plain_hash (the policy before replica state).

Each replica, as the simulation models it:
- a request whose adapter is not in the CPU tier is a cold load: it waits --cold-load-ms (one
  load per adapter at a time; requests for an adapter being loaded wait for that load);
- then it waits for a seat (FIFO over `max_num_seqs` seats) and is served for an exponential
  time of mean --service-s;
- the CPU tier is an LRU of as many adapters as its budget holds; the device tier an LRU of
  `max_loras` adapters, touched when a request starts (a hit: its adapter was in a slot). By
  default the engine's rule that at most `max_loras` distinct adapters run at once is not a
  block (a request never waits for a slot), only the hit rate; with --slot-waits it is
  (SlotReplica: the engine's admission, slower to simulate when queues grow).
The gateway's view of the replicas is the HTTP client's own (tessera.engine_client.http._Replica):
each replica's state as of its last poll, every --poll-s (the gateway's default, 0.5 s; 0: an
exact view), plus the requests the gateway sent since; each replica publishes the recent mean
time its requests held a seat and its loads took, as an engine worker does (engine.durations).
`cold_loads_per_1k_lower_bound`: what no router reaches below with these tier sizes (all replicas'
CPU tiers holding the most popular adapters for good; see cold_load_lower_bound).
Measured over the requests after the first --warmup (cold caches excluded; a deployment serves for
days, and with tiers that hold most of the catalogue the first touches of the Zipf tail take a few
hundred thousand requests to fade, so the default leaves out 300,000): cold loads per 1,000
requests, device-tier hit rate, max/mean replica load (the busy seat-seconds each replica was
given), p50/p99 queueing delay (arrival to start of service, cold load included).

    .venv/bin/python bench/routing.py [--sizes chart|engine] [--cpu-tier-mib N] [--max-loras N]
        [--slot-waits] [--model smollm2|llama3-8b]
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import platform as _platform
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

# Run as a script, bench/ is first on the path and its engine.py would hide the engine package.
ROOT = Path(__file__).resolve().parents[1]
sys.path[0:1] = [str(ROOT), str(ROOT / "platform")]

from engine.config import EngineConfig  # noqa: E402
from engine.durations import Durations  # noqa: E402
from engine.loader.synthetic import SHAPES  # noqa: E402
from engine.sampling_params import Priority  # noqa: E402
from tessera.engine_client.http import _Replica  # noqa: E402
from tessera.engine_client.routing import DEFAULT_BALANCE, HashRing, ReplicaState, plain_hash, route  # noqa: E402

STD = int(Priority.standard)
CHART_VALUES = ROOT / "infra" / "helm" / "tessera" / "values.yaml"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def adapter_bytes(model: str, rank: int, dtype: str) -> int:
    """Bytes of one all-targets (q, k, v, o, gate, up, down) adapter of `rank` for `model`'s
    shape, as the engine's LoRAWeights hold it: A (rank x fan_in) and B (fan_out x rank) per
    module and layer; int8 adds an fp32 scale per row of each."""
    s = SHAPES[model]
    q, kv, h, i = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.hidden_size, s.intermediate_size
    dims = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # (fan_in, fan_out)
    per_layer = sum((fi + fo) * rank for fi, fo in dims) * _DTYPE_BYTES[dtype]
    if dtype == "int8":
        per_layer += sum(rank + fo for _, fo in dims) * 4
    return per_layer * s.num_layers


class Replica:
    """One simulated engine replica and the ReplicaState the router reads from it."""

    def __init__(self, name: str, seats: int, slots: int, cpu_capacity: int):
        self.state = ReplicaState(name=name, max_num_seqs=seats, num_slots=slots, free_slots=slots)
        self.seats = [0.0] * seats  # when each seat is next free (a heap)
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.device: OrderedDict[str, None] = OrderedDict()
        self.loading: dict[str, float] = {}  # adapter -> when its load ends
        self.cpu_capacity, self.slots = cpu_capacity, slots
        # (time, +1 start / -1 finish, adapter, the gateway view's token of the request, seat seconds)
        self.events: list[tuple[float, int, str, int, float]] = []
        # What the engine worker publishes for routing: recent mean seat and load times.
        self.seat_times, self.load_times = Durations(alpha=0.02), Durations()  # as LLMEngine, LoRAManager
        self.load_started: dict[str, float] = {}
        self.view = _Replica(name, url="")
        self.running_adapters: dict[str, int] = {}
        self.running = self.waiting = 0
        self.busy_s = 0.0
        self.state.device_adapters = self.device.keys()
        self.state.cpu_adapters = _Union(self.cpu, self.loading)

    def advance(self, now: float) -> None:
        """Apply every start and finish up to `now` to the published state."""
        ev = self.events
        while ev and ev[0][0] <= now:
            _, kind, adapter, token, seat_s = heapq.heappop(ev)
            if kind > 0:  # started
                self.waiting -= 1
                self.running += 1
                self.running_adapters[adapter] = self.running_adapters.get(adapter, 0) + 1
            else:
                self._finished(adapter, token, seat_s)
        for adapter in [a for a, t in self.loading.items() if t <= now]:
            self._loaded(adapter)
        self._publish(self.waiting)

    def _finished(self, adapter: str, token: int, seat_s: float) -> None:
        self.view.ended(token, STD)
        self.seat_times.record(seat_s)
        self.running -= 1
        n = self.running_adapters[adapter] - 1
        if n:
            self.running_adapters[adapter] = n
        else:
            del self.running_adapters[adapter]

    def _loaded(self, adapter: str) -> None:
        self.load_times.record(self.loading.pop(adapter) - self.load_started.pop(adapter))
        self._to_cpu(adapter)

    def _publish(self, waiting: int) -> None:
        """The state an engine worker would answer a poll with now."""
        st = self.state
        st.seat_s, st.load_s = self.seat_times.mean_s, self.load_times.mean_s
        st.running = {STD: self.running}
        st.waiting = {STD: waiting}
        st.free_slots = max(0, self.slots - len(self.running_adapters))

    def _to_cpu(self, adapter: str) -> None:
        self.cpu[adapter] = None
        self.cpu.move_to_end(adapter)
        while len(self.cpu) > self.cpu_capacity:
            self.cpu.popitem(last=False)

    def poll(self) -> None:
        """The gateway polls this replica (an answer with no delay): its view is the state now."""
        st = self.state
        generation = self.view.poll_started()
        self.view.polled(generation, ReplicaState(**{
            **vars(st), "running": dict(st.running), "waiting": dict(st.waiting),
            "device_adapters": frozenset(self.device), "cpu_adapters": frozenset(self.cpu) | frozenset(self.loading)}))

    def _fetch(self, now: float, adapter: str, cold_load_s: float) -> tuple[bool, float]:
        """A request for `adapter` arrives at `now`: (whether it is a cold load, when the adapter
        is in the CPU tier); a cold one starts loading."""
        if adapter in self.cpu:
            self.cpu.move_to_end(adapter)
            return False, now
        if adapter in self.loading:
            return False, self.loading[adapter]
        self.loading[adapter] = now + cold_load_s
        self.load_started[adapter] = now
        return True, now + cold_load_s

    def serve(self, now: float, adapter: str, service_s: float, cold_load_s: float) -> tuple[bool, bool, float]:
        """Take a request at `now`: (cold load, device-tier hit, queueing delay in seconds)."""
        cold, ready = self._fetch(now, adapter, cold_load_s)
        start = max(ready, self.seats[0])
        end = start + service_s
        heapq.heapreplace(self.seats, end)
        hit = adapter in self.device
        self.device[adapter] = None
        self.device.move_to_end(adapter)
        while len(self.device) > self.slots:
            self.device.popitem(last=False)
        self.waiting += 1
        token = self.view.sent(STD)
        heapq.heappush(self.events, (start, 1, adapter, token, 0.0))
        heapq.heappush(self.events, (end, -1, adapter, token, service_s))
        self.busy_s += service_s
        return cold, hit, start - now


class SlotReplica(Replica):
    """A replica whose requests also wait for a device slot (--slot-waits), as the engine's
    scheduler admits them: a waiting request starts once a seat is free, its adapter is loaded,
    and its adapter is running already or fewer than `slots` distinct adapters are; one that
    cannot start yet is passed over without holding back those behind it, the rest start in
    arrival order; once one passed over for a slot has waited the engine's `aging_seconds`, the
    running adapter with the fewest requests takes no new ones until it drains (the engine's
    guard against starving it). A slot's adapter is replaced least recently used first, never
    while it runs. Start times are known only as events unfold, so a request's figures go to its
    `record`."""

    def __init__(self, name: str, seats: int, slots: int, cpu_capacity: int):
        super().__init__(name, seats, slots, cpu_capacity)
        # Waiting requests in arrival order: [arrival, adapter, seat seconds, token, record].
        self.queue: list[list] = []
        # (time, order, adapter or None, token, seat seconds): finishes, and load ends (token -1).
        self.timeline: list[tuple[float, int, str, int, float]] = []
        self.order = 0
        self.aging_s = EngineConfig().aging_seconds

    def _push(self, t: float, adapter: str, token: int, seat_s: float) -> None:
        self.order += 1
        heapq.heappush(self.timeline, (t, self.order, adapter, token, seat_s))

    def advance(self, now: float) -> None:
        tl = self.timeline
        while tl and tl[0][0] <= now:
            t, _, adapter, token, seat_s = heapq.heappop(tl)
            if token < 0:  # a load ended
                self._loaded(adapter)
            else:
                self._finished(adapter, token, seat_s)
            self._admit(t)
        self._publish(len(self.queue))

    def _admit(self, t: float) -> None:
        if not self.queue or self.running >= self.state.max_num_seqs:
            return
        kept = []
        draining = None
        for item in self.queue:
            arrival, adapter, seat_s, token, record = item
            if self.running >= self.state.max_num_seqs or adapter in self.loading or adapter == draining:
                kept.append(item)
                continue
            if adapter not in self.running_adapters and len(self.running_adapters) >= self.slots:
                kept.append(item)
                if draining is None and t - arrival >= self.aging_s:
                    draining = min(self.running_adapters, key=lambda a: (self.running_adapters[a], a))
                continue
            self.running += 1
            self.running_adapters[adapter] = self.running_adapters.get(adapter, 0) + 1
            hit = adapter in self.device
            if not hit and len(self.device) >= self.slots:
                del self.device[next(a for a in self.device if a not in self.running_adapters)]
            self.device[adapter] = None
            self.device.move_to_end(adapter)
            self._push(t + seat_s, adapter, token, seat_s)
            if record is not None:
                record(hit, t - arrival)
        self.queue = kept

    def serve(self, now: float, adapter: str, service_s: float, cold_load_s: float, record=None) -> bool:
        """Take a request at `now`; whether it is a cold load. Its device-tier hit and queueing
        delay go to `record(hit, delay)` when it starts."""
        cold, ready = self._fetch(now, adapter, cold_load_s)
        if cold:
            self._push(ready, adapter, -1, 0.0)
        self.queue.append([now, adapter, service_s, self.view.sent(STD), record])
        self.busy_s += service_s
        self._admit(now)
        self._publish(len(self.queue))
        return cold


class _Union:
    """`in` over two mappings (the CPU tier and the loads under way) without copying them."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __contains__(self, key) -> bool:
        return key in self.a or key in self.b


def zipf_sampler(n: int, s: float, rng: random.Random):
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(weights)
    cum, acc = [], 0.0
    for w in weights:
        acc += w / total
        cum.append(acc)
    names = [f"adapter-{k:05d}" for k in range(n)]
    # Popularity rank is not the name order: shuffle so hashing sees arbitrary names.
    rng.shuffle(names)
    return lambda: names[min(bisect.bisect(cum, rng.random()), n - 1)]


def engine_sizes(which: str, lora_dtype: str) -> dict:
    """{"max_loras", "max_num_seqs", "cpu_tier_mib", "lora_dtype"} of one replica: the Helm
    chart's engine values (an empty value is the engine's default; GPU engines keep adapters in
    their bf16 activations' dtype) or EngineConfig's defaults with `lora_dtype`."""
    ec = EngineConfig()
    sizes = {"max_loras": ec.max_loras, "max_num_seqs": ec.max_num_seqs,
             "cpu_tier_mib": ec.lora_cpu_cache_bytes >> 20, "lora_dtype": lora_dtype}
    if which == "chart":
        import yaml

        engine = yaml.safe_load(CHART_VALUES.read_text())["engine"]
        for key, value in (("max_loras", "maxLoras"), ("max_num_seqs", "maxNumSeqs"), ("cpu_tier_mib", "loraCpuCacheMiB")):
            if engine.get(value) not in (None, ""):
                sizes[key] = int(engine[value])
        if engine.get("gpu", True):
            sizes["lora_dtype"] = "bfloat16"
    return sizes


def simulate(policy: str, *, load: float, args, sizes: dict, cpu_capacity: int, seed: int) -> dict:
    rng = random.Random(seed)
    draw = zipf_sampler(args.adapters, args.zipf, random.Random(seed + 1))
    seats = sizes["max_num_seqs"]
    kind = SlotReplica if args.slot_waits else Replica
    replicas = [kind(f"worker-{i}", seats, sizes["max_loras"], cpu_capacity) for i in range(args.replicas)]
    states = [r.state for r in replicas]
    ring = HashRing([s.name for s in states])
    capacity = args.replicas * seats / args.service_s  # requests per second
    rate = load * capacity
    now, cold, measured = 0.0, 0, 0
    started: list[tuple[bool, float]] = []  # (device-tier hit, queueing delay) of measured requests
    record = lambda hit, delay: started.append((hit, delay))  # noqa: E731
    busy_at_warmup = None
    next_poll = 0.0
    for n in range(args.requests):
        now += rng.expovariate(rate)
        adapter = draw()
        while args.poll_s and next_poll <= now:  # the polls due before this arrival
            for r in replicas:
                r.advance(next_poll)
                r.poll()
            next_poll += args.poll_s
        for r in replicas:
            r.advance(now)
        if policy == "affinity":
            views = [r.view.view() for r in replicas] if args.poll_s else states
            i = route(views, adapter=adapter, priority=STD, ring=ring, balance=args.balance, tiebreak=n)[0]
        elif policy == "round_robin":
            i = n % len(replicas)
        else:
            i = plain_hash(adapter, len(replicas))
        if n == args.warmup:
            busy_at_warmup = [r.busy_s for r in replicas]
        service_s, cold_s = rng.expovariate(1.0 / args.service_s), args.cold_load_ms / 1000
        if args.slot_waits:
            c = replicas[i].serve(now, adapter, service_s, cold_s, record if n >= args.warmup else None)
        else:
            c, h, d = replicas[i].serve(now, adapter, service_s, cold_s)
            if n >= args.warmup:
                record(h, d)
        if n >= args.warmup:
            measured += 1
            cold += c
    for r in replicas:  # the requests still waiting start
        r.advance(math.inf)
    busy = [r.busy_s - b for r, b in zip(replicas, busy_at_warmup)]
    delays = sorted(d for _, d in started)
    return {"cold_loads_per_1k": round(1000 * cold / measured, 1),
            "device_hit_rate": round(sum(h for h, _ in started) / len(started), 3),
            "max_over_mean_load": round(max(busy) / (sum(busy) / len(busy)), 3),
            "p50_queue_ms": round(1000 * delays[len(delays) // 2], 1),
            "p99_queue_ms": round(1000 * delays[min(len(delays) - 1, math.ceil(0.99 * len(delays)) - 1)], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400_000, help="requests per run (policy x load), warmup included")
    ap.add_argument("--warmup", type=int, default=300_000, help="first requests left out of the figures")
    ap.add_argument("--sizes", default="chart", choices=("chart", "engine"),
                    help="slots, seats and CPU tier of a replica: the Helm chart's engine values or EngineConfig's defaults")
    ap.add_argument("--cpu-tier-mib", type=int, default=None, help="CPU-tier budget of a replica (overrides --sizes)")
    ap.add_argument("--max-loras", type=int, default=None, help="device slots of a replica (overrides --sizes)")
    ap.add_argument("--adapters", type=int, default=10_000)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--model", default="smollm2", choices=sorted(set(SHAPES) - {"tiny"}), help="adapter shape")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-dtype", default="int8", choices=sorted(_DTYPE_BYTES),
                    help="adapter storage with --sizes engine (the CPU engine's default is int8 where its C "
                         "kernel is built; --sizes chart: bf16, as GPU engines keep them)")
    ap.add_argument("--service-s", type=float, default=2.0, help="mean time a request holds a seat")
    ap.add_argument("--slot-waits", action="store_true",
                    help="requests also wait for a device slot, as the engine admits them (at most max_loras "
                         "distinct adapters running); without it, slots only set the device-tier hit rate")
    ap.add_argument("--cold-load-ms", type=float, default=100.0, help="fetch + load of an adapter not in the CPU tier")
    ap.add_argument("--poll-s", type=float, default=0.5,
                    help="how often the gateway polls each replica's state (0: an exact view)")
    ap.add_argument("--balance", type=float, default=DEFAULT_BALANCE, help="affinity's load bound factor")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if not 0 <= args.warmup < args.requests:
        ap.error("--warmup must be below --requests")
    sizes = engine_sizes(args.sizes, args.lora_dtype)
    if args.cpu_tier_mib is not None:
        sizes["cpu_tier_mib"] = args.cpu_tier_mib
    if args.max_loras is not None:
        sizes["max_loras"] = args.max_loras
    nbytes = adapter_bytes(args.model, args.rank, sizes["lora_dtype"])
    cpu_capacity = max(1, (sizes["cpu_tier_mib"] << 20) // nbytes)
    t0 = time.perf_counter()
    out: dict = {"bench": "routing", "machine": _platform.machine(), "python": _platform.python_version(),
                 "adapters": args.adapters, "zipf": args.zipf, "replicas": args.replicas, "sizes": args.sizes,
                 "max_loras": sizes["max_loras"], "max_num_seqs": sizes["max_num_seqs"], "model": args.model,
                 "rank": args.rank, "lora_dtype": sizes["lora_dtype"], "adapter_mib": round(nbytes / 2**20, 2),
                 "cpu_tier_mib": sizes["cpu_tier_mib"], "cpu_tier_adapters": cpu_capacity,
                 "service_s": args.service_s, "cold_load_ms": args.cold_load_ms,
                 "balance": args.balance, "poll_s": args.poll_s, "requests": args.requests, "warmup": args.warmup,
                 "slot_waits": args.slot_waits,
                 "capacity_rps": round(args.replicas * sizes["max_num_seqs"] / args.service_s, 1)}
    prefix = {"affinity": "affinity", "round_robin": "round_robin", "hash": "hash"}
    for load, tag in ((0.70, "70"), (0.95, "95")):
        for policy in ("affinity", "round_robin", "hash"):
            res = simulate(policy, load=load, args=args, sizes=sizes, cpu_capacity=cpu_capacity, seed=args.seed)
            for k, v in res.items():
                # The headline keys are at 95%; every figure is also given at both loads.
                if tag == "95":
                    out[f"{prefix[policy]}_{k}"] = v
                out[f"{prefix[policy]}_{k}_at_{tag}"] = v
    out["affinity_over_round_robin_cold_loads"] = round(
        out["affinity_cold_loads_per_1k"] / max(out["round_robin_cold_loads_per_1k"], 1e-9), 3)
    bound = cold_load_lower_bound(args.adapters, args.zipf, args.replicas * cpu_capacity)
    out["cold_loads_per_1k_lower_bound"] = round(1000 * bound, 1)
    out["lower_bound_over_round_robin_cold_loads"] = round(
        1000 * bound / max(out["round_robin_cold_loads_per_1k"], 1e-9), 3)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


def cold_load_lower_bound(n: int, s: float, capacity: int) -> float:
    """The least share of requests any placement and any cache policy loads cold: requests are
    independent draws from the Zipf(s) popularity of `n` adapters and the fleet's CPU tiers hold
    `capacity` adapters in all, so at best they hold the `capacity` most popular ones for good
    (the optimal policy under independent references) and every other adapter's request is a
    cold load."""
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return sum(weights[capacity:]) / sum(weights)


if __name__ == "__main__":
    main()

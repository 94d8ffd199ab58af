"""The routing policy over fake replica states (tessera.engine_client.routing): adapter affinity
with bounded load, least load for base-model requests, priority classes across replicas, dead and
draining replicas out; and the view the HTTP client keeps between polls."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.sampling_params import Priority
from tessera.engine_client.http import _Replica
from tessera.engine_client.routing import HashRing, ReplicaState, load_bound, route

RT, STD, BATCH = int(Priority.realtime), int(Priority.standard), int(Priority.batch)


def replicas(n: int, **kw) -> list[ReplicaState]:
    return [ReplicaState(name=f"worker-{i}", free_kv_blocks=100, total_kv_blocks=100, **kw) for i in range(n)]


def ring_for(reps):
    return HashRing([r.name for r in reps])


def test_adapter_goes_where_it_is_hot_in_a_device_slot_then_the_cpu_tier():
    reps = replicas(4)
    ring = ring_for(reps)
    reps[2].device_adapters = {"a"}
    reps[1].cpu_adapters = {"a"}
    assert route(reps, adapter="a", priority=STD, ring=ring)[0] == 2
    reps[2].device_adapters = set()
    assert route(reps, adapter="a", priority=STD, ring=ring)[0] == 1


def test_an_adapter_held_by_several_replicas_goes_to_the_least_loaded_of_them():
    reps = replicas(4)
    ring = ring_for(reps)
    holders = [i for i in range(4) if i != ring.order("a")[0]][:2]
    for r in reps:
        r.running = {STD: 5}
    for i in holders:
        reps[i].device_adapters = {"a"}
    reps[holders[0]].running = {STD: 6}
    reps[holders[1]].running = {STD: 4}
    assert route(reps, adapter="a", priority=STD, ring=ring)[0] == holders[1]
    reps[holders[1]].running = {STD: 7}  # within the bound still, but busier
    assert route(reps, adapter="a", priority=STD, ring=ring)[0] == holders[0]


def test_cold_adapter_lands_by_ring_order_and_prefers_a_free_slot():
    reps = replicas(4)
    ring = ring_for(reps)
    first = ring.order("cold")[0]
    assert route(reps, adapter="cold", priority=STD, ring=ring)[0] == first
    # Every slot of its first ring replica is held by running adapters: loading there waits.
    reps[first].free_slots = 0
    assert route(reps, adapter="cold", priority=STD, ring=ring)[0] == ring.order("cold")[1]


def test_a_request_waits_a_few_seat_turnovers_where_its_adapter_is_hot_rather_than_load_it_elsewhere():
    # 64 seats held 2 s each: a seat frees every 31 ms when all are taken; a load takes 100 ms.
    reps = replicas(2, max_num_seqs=64, seat_s=2.0, load_s=0.1)
    ring = ring_for(reps)
    reps[0].device_adapters = {"a"}
    reps[0].running, reps[0].waiting = {STD: 64}, {STD: 1}  # 2nd in line: ~62 ms
    reps[1].running = {STD: 60}  # seats free, but "a" is cold there: ~100 ms
    assert route(reps, adapter="a", priority=STD, ring=ring)[0] == 0
    reps[0].waiting = {STD: 4}  # 5th in line: ~156 ms, longer than a load
    assert route(reps, adapter="a", priority=STD, ring=ring)[0] == 1
    # Slower seats make the same queue longer than a load.
    reps[0].waiting, reps[0].seat_s = {STD: 1}, 6.4
    assert route(reps, adapter="a", priority=STD, ring=ring)[0] == 1
    # Batch requests waiting there are not ahead of a realtime one.
    reps[0].seat_s, reps[0].waiting = 2.0, {BATCH: 10}
    assert route(reps, adapter="a", priority=RT, ring=ring)[0] == 0
    assert route(reps, adapter="a", priority=BATCH, ring=ring)[0] == 1


def test_cold_adapters_follow_the_ring_whatever_each_replica_measured_its_loads_at():
    reps = replicas(4)
    for i, r in enumerate(reps):
        r.load_s = 0.05 * (i + 1)
    ring = ring_for(reps)
    for k in range(20):
        assert route(reps, adapter=f"cold-{k}", priority=STD, ring=ring)[0] == ring.order(f"cold-{k}")[0]


def test_every_gateway_picks_the_same_replica_for_an_adapter():
    names = [f"worker-{i}" for i in range(5)]
    a, b = HashRing(names), HashRing(list(names))
    for k in range(200):
        assert a.order(f"adapter-{k}") == b.order(f"adapter-{k}")
        assert sorted(a.order(f"adapter-{k}")) == list(range(5))


def test_a_popular_adapter_spreads_with_its_load_and_no_replica_exceeds_the_bound():
    reps = replicas(4, max_num_seqs=1000)
    ring = ring_for(reps)
    reps[0].device_adapters = {"hot"}
    picked = Counter()
    for _ in range(200):  # each request stays running: the load only grows
        i = route(reps, adapter="hot", priority=STD, ring=ring)[0]
        picked[i] += 1
        reps[i].running[STD] = reps[i].running.get(STD, 0) + 1
        loads = [r.load() for r in reps]
        assert max(loads) <= load_bound(reps) and max(loads) <= 1.25 * (sum(loads) / 4) + 1
    assert len(picked) == 4 and picked[0] == max(picked.values())


def test_bounded_load_on_zipf_traffic_keeps_replicas_near_the_mean():
    rng = random.Random(7)
    reps = replicas(8, max_num_seqs=10**6)
    ring = ring_for(reps)
    weights = [1 / (k + 1) for k in range(500)]
    for adapter in rng.choices([f"a{k}" for k in range(500)], weights, k=4000):
        i = route(reps, adapter=adapter, priority=STD, ring=ring)[0]
        reps[i].running[STD] = reps[i].running.get(STD, 0) + 1
    loads = [r.load() for r in reps]
    assert max(loads) / (sum(loads) / len(loads)) <= 1.25 + 8 / 4000


def test_base_request_goes_to_the_least_loaded_replica_and_ties_rotate():
    reps = replicas(3)
    reps[0].running = {STD: 5}
    reps[1].running = {STD: 1}
    reps[2].running = {STD: 3}
    ring = ring_for(reps)
    assert route(reps, adapter=None, priority=STD, ring=ring) == [1, 2, 0]
    reps[1].running = {STD: 3}
    firsts = {route(reps, adapter=None, priority=STD, ring=ring, tiebreak=t)[0] for t in range(3)}
    assert firsts == {1, 2}


def test_realtime_never_queues_behind_a_batch_backlog_while_another_replica_has_room():
    reps = replicas(2, max_num_seqs=4)
    ring = ring_for(reps)
    reps[0].running, reps[0].waiting = {BATCH: 4}, {BATCH: 50}  # full, and a backlog
    reps[0].device_adapters = {"a"}
    reps[1].running = {STD: 3}
    assert route(reps, adapter=None, priority=RT, ring=ring)[0] == 1
    # Even when the adapter is hot only on the busy one.
    assert route(reps, adapter="a", priority=RT, ring=ring)[0] == 1
    # Batch waiting does not count ahead of a realtime request on a replica with seats free.
    reps[0].running = {BATCH: 1}
    reps[1].running = {STD: 2}
    assert route(reps, adapter=None, priority=RT, ring=ring)[0] == 0
    assert route(reps, adapter=None, priority=BATCH, ring=ring)[0] == 1


def test_dead_and_draining_replicas_take_nothing():
    reps = replicas(3)
    ring = ring_for(reps)
    reps[0].device_adapters = {"a"}
    reps[0].draining = True
    reps[1].up = False
    assert route(reps, adapter="a", priority=STD, ring=ring) == [2]
    assert route(reps, adapter=None, priority=STD, ring=ring) == [2]
    reps[2].up = False
    assert route(reps, adapter=None, priority=STD, ring=ring) == []


def test_state_wire_form_round_trips():
    s = ReplicaState(name="", running={RT: 1, BATCH: 2}, waiting={STD: 3}, free_slots=5, free_kv_blocks=9,
                     total_kv_blocks=20, device_adapters=frozenset({"v1"}), cpu_adapters=frozenset({"v1", "v2"}),
                     draining=True, state="draining", restarts=2, seat_s=1.5, load_s=0.02, model="Qwen/Qwen2.5-7B")
    wire = s.to_dict()
    assert wire["running"] == {"realtime": 1, "batch": 2}
    back = ReplicaState.from_dict("worker-3", wire)
    assert back.name == "worker-3" and not back.accepting and back.up
    assert (back.running, back.waiting, back.device_adapters, back.cpu_adapters, back.restarts) == (
        s.running, s.waiting, s.device_adapters, s.cpu_adapters, 2)
    assert (back.seat_s, back.load_s, back.model) == (1.5, 0.02, "Qwen/Qwen2.5-7B")
    assert ReplicaState.from_dict("w", {k: v for k, v in wire.items() if k != "model"}).model is None  # an older worker
    # A worker that has measured nothing yet, or an older one that publishes no times.
    assert ReplicaState.from_dict("w", {**wire, "seat_s": None}).seat_s is None
    assert ReplicaState.from_dict("w", {k: v for k, v in wire.items() if k != "load_s"}).load_s is None
    for bad in (-1.0, float("nan"), "slow"):
        with pytest.raises(ValueError):
            ReplicaState.from_dict("w", {**wire, "seat_s": bad})


def test_client_view_counts_its_sends_until_a_poll_counts_them():
    r = _Replica("worker-0", "http://x")
    r.published = ReplicaState(name="worker-0", waiting={STD: 1})
    t1 = r.sent(STD)
    assert r.view().waiting[STD] == 2
    gen = r.poll_started()
    t2 = r.sent(RT)  # sent while the poll is under way: its answer may miss it
    r.polled(gen, ReplicaState(name="worker-0", waiting={STD: 2}))
    assert r.view().waiting == {STD: 2, RT: 1}
    r.ended(t1, STD)  # the poll counted it; its end shows in the next poll, not twice
    r.ended(t2, RT)
    assert r.view().waiting == {STD: 2}
    r.take_out("unreachable")
    assert not r.view().accepting

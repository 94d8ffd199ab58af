"""Per-tenant fairness on KV blocks and prefill tokens (engine.scheduler's module docstring):
shares bounded while another tenant waits, weighted, preemption of the tenant over its share
first, and a big request that waits behind others' short ones instead of evicting them. Steps
are driven by hand (as the engine would: computed tokens advance, a finished prefill samples a
token), so every outcome is deterministic."""
import time

import pytest

from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import InvalidRequestError, Priority, SamplingParams
from engine.scheduler import Scheduler, check_tenant_weight
from engine.sequence import Sequence

BS = 16


def _seq(tok, rid, n_prompt, tenant, *, max_tokens=8, weight=1.0, prio=Priority.standard, arrival=None):
    s = Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                 IncrementalDetokenizer(tok), tenant_id=tenant, priority=prio, tenant_weight=weight)
    s.arrival_time = time.monotonic() if arrival is None else arrival
    return s


def _sched(blocks, budget=64, seqs=64):
    return Scheduler(BlockManager(blocks, BS, enable_prefix_caching=False), max_num_batched_tokens=budget,
                     max_num_seqs=seqs, aging_seconds=0)


def _step(s: Scheduler):
    """One step as the engine runs it: schedule, compute, sample where a prefill completed,
    finish what reached max_tokens. Returns the output."""
    out = s.schedule()
    for x in out.scheduled:
        x.seq.num_computed_tokens += x.num_tokens
        if x.seq.num_uncomputed_tokens == 0:
            x.seq.append_token(7)
            if len(x.seq.output_token_ids) >= x.seq.params.max_tokens:
                s.remove(x.seq)
                x.seq.finish_reason = "length"
    return out


def _held(s: Scheduler, tenant: str) -> int:
    return sum(len(q.block_table) for q in s.running if q.tenant_id == tenant)


def test_a_tenant_filling_the_cache_gives_another_its_room_at_once(tokenizer):
    """Tenant A's four prompts fill the 16-block cache. B's short request, arriving after them,
    is admitted in the next step by preempting A's latest (A is over its half); while B's
    requests wait A never holds more than its share plus one chunk, and everything finishes."""
    s = _sched(16)
    t0 = time.monotonic()
    heavy = [_seq(tokenizer, f"a{i}", 120, "A", arrival=t0 + i) for i in range(4)]  # 8 blocks each
    for q in heavy:
        s.add(q)
    for _ in range(4):
        _step(s)
    assert _held(s, "A") == 16 and s.block_manager.num_free_blocks == 0  # A's while no one else asks
    light = _seq(tokenizer, "b0", 10, "B", arrival=t0 + 10)
    s.add(light)
    out = _step(s)
    assert light in [x.seq for x in out.scheduled]
    assert [q.request_id for q in out.preempted] == ["a1"]
    steps, more = 0, [_seq(tokenizer, f"b{i}", 10, "B", arrival=t0 + 10 + i) for i in range(1, 4)]
    for q in more:
        s.add(q)
    while s.has_work():
        _step(s)
        steps += 1
        if any(q.tenant_id == "B" for q in s.waiting):
            assert _held(s, "A") <= 8 + 64 // BS
        assert steps < 500
    assert all(q.finish_reason == "length" for q in heavy + [light] + more)
    assert all(q.num_preemptions == 0 for q in [light] + more)


def test_the_prefill_budget_is_split_by_weight_while_both_prefill(tokenizer):
    """Two long prompts of tenants weighted 1 and 3 share each step's 64 tokens 16/48 while both
    prefill; alone, a tenant takes the whole budget again."""
    s = _sched(64)
    t0 = time.monotonic()
    a = _seq(tokenizer, "a", 300, "A", weight=1.0, arrival=t0)
    b = _seq(tokenizer, "b", 150, "B", weight=3.0, arrival=t0 + 1)
    s.add(a)
    s.add(b)
    for _ in range(3):
        out = _step(s)
        assert {x.seq.request_id: x.num_tokens for x in out.prefills} == {"a": 16, "b": 48}
    out = _step(s)  # b: 6 tokens left; a takes the rest of the budget
    assert {x.seq.request_id: x.num_tokens for x in out.prefills} == {"a": 58, "b": 6}
    out = _step(s)  # b decodes; a, the only tenant prefilling, is not capped
    assert [x.seq.request_id for x in out.decodes] == ["b"] and out.prefills[0].num_tokens == 63


def test_a_big_request_waits_behind_short_ones_and_never_evicts_them(tokenizer):
    """A's request needs most of the cache (and arrived first); B's short requests, running and
    growing, take the blocks they need from it, never the reverse: B is never preempted, A's big
    request is, and finishes once B's are done."""
    s = _sched(16)
    t0 = time.monotonic()
    big = _seq(tokenizer, "big", 180, "A", max_tokens=20, arrival=t0)  # 13 blocks of 16
    shorts = [_seq(tokenizer, f"b{i}", 30, "B", max_tokens=40, arrival=t0 + 1 + i) for i in range(3)]  # 5 blocks
    s.add(big)
    for q in shorts:
        s.add(q)
    steps = 0
    while s.has_work():
        out = _step(s)
        assert not any(q.tenant_id == "B" for q in out.preempted), out.preempted
        steps += 1
        assert steps < 500
    assert all(q.finish_reason == "length" for q in shorts + [big])
    assert big.num_preemptions >= 1


@pytest.mark.parametrize("weight_a, victim", [(1.0, "a1"), (3.0, "b0")])
def test_preemption_picks_the_tenant_over_its_weighted_share_first(tokenizer, weight_a, victim):
    """Eight blocks, every running sequence at a block boundary and none free. With equal
    weights A (6 blocks, share 4) is over its share, so its latest sequence is preempted although
    B's arrived after it; weighted 3:1, A's share is 6 and the latest arrival, B's, goes."""
    s = _sched(8, budget=256)
    t0 = time.monotonic()
    seqs = [_seq(tokenizer, "a0", 48, "A", weight=weight_a, arrival=t0),
            _seq(tokenizer, "a1", 48, "A", weight=weight_a, arrival=t0 + 1),
            _seq(tokenizer, "b0", 32, "B", arrival=t0 + 2)]
    for q in seqs:
        s.add(q)
    _step(s)
    assert s.block_manager.num_free_blocks == 0 and len(s.running) == 3
    # Each prompt filled its last block: the next token of each needs a new one.
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == [victim]


def test_priority_classes_still_come_first(tokenizer):
    """A realtime request holding the whole cache (big, its tenant far over any share) is not
    preempted for a standard one: fairness applies inside a class."""
    s = _sched(8)
    t0 = time.monotonic()
    s.add(_seq(tokenizer, "r", 120, "R", prio=Priority.realtime, arrival=t0))  # all 8 blocks
    _step(s)
    _step(s)
    assert s.block_manager.num_free_blocks == 0
    s.add(_seq(tokenizer, "b", 8, "B", arrival=t0 + 5))
    out = s.schedule()
    assert not out.preempted and "b" not in [x.seq.request_id for x in out.scheduled]


@pytest.mark.parametrize("weight", [0, -1, 1e9, float("nan"), "2", True])
def test_tenant_weight_must_be_a_positive_bounded_number(weight):
    with pytest.raises(InvalidRequestError) as e:
        check_tenant_weight(weight)
    assert e.value.param == "tenant_weight"

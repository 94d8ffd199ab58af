"""Scheduling policy: priority classes, tenant fair share, aging, chunked prefill."""
import time

from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import Priority, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def _seq(tok, rid, n_prompt=8, tenant="t", prio=Priority.standard, arrival=None, adapter=None):
    s = Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(temperature=0), IncrementalDetokenizer(tok),
                 tenant_id=tenant, priority=prio, adapter=adapter)
    if arrival is not None:
        s.arrival_time = arrival
    return s


def _sched(**kw):
    bm = BlockManager(kw.pop("blocks", 64), 16)
    return Scheduler(bm, **{"max_num_batched_tokens": 64, "max_num_seqs": 8, **kw})


def test_realtime_is_admitted_before_batch(tokenizer):
    s = _sched(max_num_seqs=1)
    now = time.monotonic()
    batch = _seq(tokenizer, "b", prio=Priority.batch, arrival=now - 1)
    rt = _seq(tokenizer, "r", prio=Priority.realtime, arrival=now)
    s.add(batch)
    s.add(rt)
    out = s.schedule()
    assert [x.seq.request_id for x in out.scheduled] == ["r"]


def test_tenants_share_fairly_inside_a_class(tokenizer):
    """A heavy tenant that queued first cannot starve light ones: admission interleaves the
    tenants (the one served the fewest tokens goes next), and a tenant already served many
    tokens waits behind one that arrived after it."""
    s = _sched(max_num_seqs=7, max_num_batched_tokens=7 * 8, aging_seconds=0)
    now = time.monotonic()
    # Tenant A floods first with ten requests; B (three) and C (two) arrive later.
    for i in range(10):
        s.add(_seq(tokenizer, f"a{i}", tenant="A", arrival=now - 10 + i * 0.01))
    for i in range(3):
        s.add(_seq(tokenizer, f"b{i}", tenant="B", arrival=now - 1 + i * 0.01))
    for i in range(2):
        s.add(_seq(tokenizer, f"c{i}", tenant="C", arrival=now + i * 0.01))
    order = [x.seq.request_id for x in s.schedule().scheduled]
    # Round robin among the tenants still waiting (equal shares: the earlier arrival first);
    # first come, first served would have admitted a0..a6.
    assert order == ["a0", "b0", "c0", "a1", "b1", "c1", "a2"]

    # Next step: the seven running prompts finished their prefill, A has been served more
    # tokens than B (three prompts to two), and B's requests, one that arrived after all of
    # A's queue included, go before A's.
    for x in s.running:
        x.num_computed_tokens = x.num_prompt_tokens
        x.append_token(7)
    s.add(_seq(tokenizer, "b-late", tenant="B", arrival=now + 1))
    s.max_num_seqs = 9
    order = [x.seq.request_id for x in s.schedule().scheduled if x.seq.request_id[0] in "abc"]
    admitted = order[-2:]  # after the seven decodes
    assert admitted == ["b2", "b-late"], order


def test_aging_prevents_starvation(tokenizer):
    s = _sched(max_num_seqs=1, aging_seconds=5.0)
    now = time.monotonic()
    old_batch = _seq(tokenizer, "old", prio=Priority.batch, arrival=now - 11)  # aged two classes
    new_std = _seq(tokenizer, "new", prio=Priority.standard, arrival=now)
    s.add(new_std)
    s.add(old_batch)
    assert [x.seq.request_id for x in s.schedule().scheduled] == ["old"]


def test_busy_adapters_cannot_keep_a_request_from_a_slot_forever(tokenizer):
    """Both slots are held by adapters that keep receiving requests. A request for a third
    adapter that has waited `aging_seconds` makes the running adapter with the fewest sequences
    take no new ones; once it drains, the waiting request takes its slot."""
    s = _sched(max_num_seqs=8, max_loras=2, aging_seconds=5.0)
    now = time.monotonic()
    first = [_seq(tokenizer, rid, adapter=ad, arrival=now - 1) for rid, ad in (("a-0", "a"), ("b-0", "b"), ("b-1", "b"))]
    for q in first:
        s.add(q)
    assert {x.seq.request_id for x in s.schedule().scheduled} == {"a-0", "b-0", "b-1"}

    # Waiting for a slot for less than aging_seconds: the busy adapters go on taking requests.
    patient = _seq(tokenizer, "c-0", adapter="c", arrival=now - 1)
    s.add(patient)
    s.add(_seq(tokenizer, "a-1", adapter="a", arrival=now))
    assert "a-1" in {x.seq.request_id for x in s.schedule().scheduled} and patient in s.waiting

    # Once it has waited that long, adapter a (two running against b's two, first by name)
    # takes no new sequence; b still does.
    patient.arrival_time = now - 6
    s.add(_seq(tokenizer, "a-2", adapter="a", arrival=now))
    s.add(_seq(tokenizer, "b-2", adapter="b", arrival=now))
    admitted = {x.seq.request_id for x in s.schedule().scheduled}
    assert "b-2" in admitted and "a-2" not in admitted and "c-0" not in admitted
    # a drains; its slot goes to the request that waited, not to a's next one.
    for q in [q for q in s.running if q.adapter == "a"]:
        s.remove(q)
    admitted = {x.seq.request_id for x in s.schedule().scheduled}
    assert "c-0" in admitted and "a-2" not in admitted


def test_long_prompt_is_chunked_and_decodes_keep_going(tokenizer):
    s = _sched(max_num_batched_tokens=32, blocks=64)
    short = _seq(tokenizer, "short", n_prompt=4)
    s.add(short)
    out = s.schedule()
    short.num_computed_tokens += 4
    short.append_token(7)  # now decoding
    long = _seq(tokenizer, "long", n_prompt=100)
    s.add(long)
    chunks = []
    for _ in range(4):
        out = s.schedule()
        assert [x.seq.request_id for x in out.decodes] == ["short"]  # a decode every step
        for x in out.scheduled:
            x.seq.num_computed_tokens += x.num_tokens
        short.append_token(7)
        chunks += [x.num_tokens for x in out.prefills]
    assert chunks == [31, 31, 31, 7]
    assert out.num_tokens <= 32


def test_preemption_picks_lowest_priority_latest(tokenizer):
    s = _sched(blocks=2, max_num_batched_tokens=64)
    now = time.monotonic()
    hi = _seq(tokenizer, "hi", n_prompt=16, prio=Priority.realtime, arrival=now - 2)
    lo = _seq(tokenizer, "lo", n_prompt=16, prio=Priority.batch, arrival=now - 1)
    s.add(hi)
    s.add(lo)
    s.schedule()
    for x in (hi, lo):
        x.num_computed_tokens = 16
        x.append_token(5)  # both need a second block now; only the realtime one gets it
    out = s.schedule()
    assert [x.seq.request_id for x in out.decodes] == ["hi"]
    assert [x.request_id for x in out.preempted] == ["lo"]
    assert lo.num_computed_tokens == 0 and not lo.block_table

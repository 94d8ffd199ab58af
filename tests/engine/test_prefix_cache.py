"""Prefix caching (engine.block_manager): cached KV blocks are reused only for the same cache salt,
adapter version and token prefix, give the same tokens as recomputing them, and are counted
exactly through finishes, aborts, preemptions and failures."""
import random

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.source import LocalDirectoryAdapterSource
from engine.lora.weights import base_shape_of
from engine.loader import load_checkpoint
from engine.loader.synthetic import write_synthetic_gguf
from engine.sampling_params import GenerationRequest, SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import TextTokenizer

from .lora_fixtures import write_random_adapter

BS = 16  # block size of these engines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-prefix")
    path = write_synthetic_gguf(root / "tiny.gguf", "tiny", seed=5)
    checkpoint = load_checkpoint(path)
    for i, name in enumerate(("a", "b")):
        write_random_adapter(root / "adapters" / name, 8, base=base_shape_of(checkpoint[0]), seed=20 + i, std=0.08)
    return path, checkpoint, TextTokenizer.from_gguf_metadata(checkpoint[2]), root / "adapters"


def make(tiny, **overrides) -> LLMEngine:
    path, checkpoint, tokenizer, adapters = tiny
    cfg = EngineConfig(**{"weight_format": "fp32", "block_size": BS, "num_kv_blocks": 64, "max_num_batched_tokens": 48,
                          "max_num_seqs": 8, "max_loras": 2, "max_lora_rank": 8, **overrides})
    return LLMEngine(path, cfg, checkpoint=checkpoint, tokenizer=tokenizer,
                     adapter_source=LocalDirectoryAdapterSource(adapters))


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(3, 3 + 5 * BS + 7))  # a shared "system prompt": 5 full blocks and a bit


def req(rid, tail, adapter=None, *, salt=None, params=GREEDY, prefix=SYSTEM):
    return GenerationRequest(rid, prompt_token_ids=prefix + tail, params=params, adapter=adapter, cache_salt=salt)


def run(engine, requests):
    out = engine.generate(requests)
    engine.block_manager.check_consistency([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return out


def mixed_batch():
    """Base and two adapters, each on the shared prefix with different tails (the longest
    prefills in chunks: the token budget is 48)."""
    return [req(f"m{i}", [40 + i, 41 + i, 7 * i % 50 + 3], adapter)
            for i, adapter in enumerate([None, "a", "b", None, "a", "b", None])]


def test_same_greedy_tokens_with_and_without_prefix_caching(tiny):
    off = make(tiny, enable_prefix_caching=False)
    on = make(tiny)
    # Warm the cache with one request per adapter (and the base), then the mixed batch.
    warm = [req(f"w{i}", [60 + i], a) for i, a in enumerate([None, "a", "b"])]
    run(off, warm), run(on, warm)
    expected, got = run(off, mixed_batch()), run(on, mixed_batch())
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in expected.items()}
    # Caching did happen: every request of the batch found the warm prefix (5 full blocks).
    assert all(o.cached_tokens == 5 * BS for o in got.values())
    assert all(o.cached_tokens == 0 for o in expected.values())
    # A repeat of a whole request hits all its full blocks but its last token is computed again.
    again = run(on, [req("again", [40, 41, 3])])["again"]
    assert again.cached_tokens == (len(SYSTEM) + 3 - 1) // BS * BS
    assert again.token_ids == expected["m0"].token_ids


def test_adapters_the_base_and_salts_never_share_blocks(tiny):
    fresh = {a: run(make(tiny), [req("x", [9, 9], a)])["x"] for a in (None, "a", "b")}
    engine = make(tiny)
    first = run(engine, [req("first", [9, 9], "a")])["first"]
    assert first.cached_tokens == 0
    # The same tokens under another adapter, the base, or another salt: no hit, and the same
    # output as on an engine that never cached anything (shared KV would change it).
    for rid, adapter, salt in (("b", "b", None), ("base", None, None), ("a-other-tenant", "a", "tenant:2")):
        out = run(engine, [req(rid, [9, 9], adapter, salt=salt)])[rid]
        assert out.cached_tokens == 0, rid
        assert out.token_ids == fresh[adapter].token_ids, rid
    # While two adapters' requests with one prompt run side by side, their tables are disjoint.
    engine.add_request(req("pa", [1, 2], "a", salt="s"))
    engine.add_request(req("pb", [1, 2], "b", salt="s"))
    while any(engine.requests[r].num_computed_tokens < len(SYSTEM) for r in ("pa", "pb")):
        engine.step()
    tables = [set(engine.requests[r].block_table) for r in ("pa", "pb")]
    assert tables[0] and tables[1] and not tables[0] & tables[1]
    while engine.has_unfinished():
        engine.step()
    # Same adapter, same salt: shared.
    assert run(engine, [req("a2", [9, 9, 9], "a")])["a2"].cached_tokens == 5 * BS


def test_choices_started_after_the_first_share_its_prompt_blocks(tiny):
    engine = make(tiny)
    engine.add_request(req("c0", [5, 6]))
    while not engine.requests["c0"].output_token_ids:
        engine.step()
    for i in (1, 2):
        engine.add_request(req(f"c{i}", [5, 6]))
    engine.step()
    tables = [engine.requests[f"c{i}"].block_table for i in range(3)]
    assert tables[0][:5] == tables[1][:5] == tables[2][:5]  # the 5 full prompt blocks, shared
    assert len({t[5] for t in tables}) == 3                 # the partial last block is each one's own
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_consistency([])


def test_cached_blocks_are_evicted_least_recently_used_and_only_when_needed(tiny):
    engine = make(tiny, num_kv_blocks=16)
    bm = engine.block_manager
    a, b = [list(range(100, 100 + 4 * BS))], [list(range(300, 300 + 4 * BS))]
    run(engine, [req("pa", [1], prefix=a[0])])
    run(engine, [req("pb", [1], prefix=b[0])])
    assert bm.num_cached_free_blocks == 8  # both prefixes kept while nothing needs the room
    run(engine, [req("pa2", [2], prefix=a[0])])  # a is now the most recently used
    # A request that needs 11 blocks takes the 7 empty ones, then evicts from b (least recent).
    run(engine, [req("big", [7] * (10 * BS), params=SamplingParams(max_tokens=2, temperature=0.0), prefix=[])])
    assert run(engine, [req("pa3", [3], prefix=a[0])])["pa3"].cached_tokens == 4 * BS
    assert run(engine, [req("pb2", [3], prefix=b[0])])["pb2"].cached_tokens < 4 * BS


def test_a_failed_sequence_leaves_nothing_cached(tiny):
    bm = BlockManager(8, 4)
    seq = Sequence("s", list(range(1, 12)), GREEDY, detokenizer=None)
    bm.allocate(seq, 11)
    seq.num_computed_tokens = 11
    bm.commit(seq)  # two full blocks offered to the cache
    other = Sequence("o", list(range(1, 12)), GREEDY, detokenizer=None)
    assert len(bm.cached_prefix(other)) == 2
    assert bm.discard(seq) == seq.block_table  # it alone holds them: all to be zeroed
    bm.free(seq)
    assert bm.cached_prefix(other) == []
    bm.check_consistency([])


def test_no_leaked_or_double_freed_blocks_after_thousands_of_mixed_requests(tiny):
    """2,000 requests over shared prefixes, adapters and salts on a cache small enough to preempt,
    a fifth aborted at random points: after every step the reference counts equal the live block
    tables, and at the end every block is free."""
    engine = make(tiny, num_kv_blocks=24, max_num_seqs=12, max_num_batched_tokens=64)
    bm, rng = engine.block_manager, random.Random(7)
    prefixes = [list(range(s, s + n)) for s, n in ((3, 2 * BS), (200, 3 * BS + 5), (400, BS - 1))]
    sent = aborted = 0
    live: dict[str, object] = {}
    while sent < 2000 or engine.has_unfinished():
        while sent < 2000 and len(engine.requests) < 16:
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]),
                                    seed=sent, ignore_eos=True)
            r = req(f"r{sent}", [rng.randint(3, 90) for _ in range(rng.randint(1, 20))],
                    rng.choice([None, None, "a", "b"]), salt=rng.choice([None, "t1"]), params=params,
                    prefix=rng.choice(prefixes))
            engine.add_request(r)
            sent += 1
        for out in engine.step():
            assert out.error is None, out.error
        if engine.requests and rng.random() < 0.15:
            engine.abort(rng.choice(sorted(engine.requests)))
            aborted += 1
        bm.check_consistency([s for s in engine.requests.values() if s.block_table])
    assert engine.stats["preemptions"] > 0 and aborted > 100
    assert bm.stats["hit_tokens"] > 0
    bm.check_consistency([])
    assert bm.num_free_blocks == bm.num_blocks


def computed_tokens(engine) -> list[int]:
    """Counts, per step, the tokens `engine` computes from now on (its runner, wrapped)."""
    counts, execute = [], engine.runner.execute

    def counting(sched, lora=None, *pending):
        counts.append(sched.num_tokens)
        return execute(sched, lora, *pending)
    engine.runner.execute = counting
    return counts


def test_a_preempted_sequence_recomputes_only_what_was_evicted(tiny):
    params = SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True)  # 4 blocks each, 16 > 14
    reqs = [req(f"p{i}", [i + 3] * 20, params=params, prefix=[]) for i in range(4)]
    off = make(tiny, enable_prefix_caching=False, num_kv_blocks=14, max_num_seqs=4)
    on = make(tiny, num_kv_blocks=14, max_num_seqs=4)
    work_off, work_on = computed_tokens(off), computed_tokens(on)
    expected, got = run(off, reqs), run(on, reqs)
    assert on.stats["preemptions"] > 0 and off.stats["preemptions"] > 0
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in expected.items()}
    assert sum(work_on) < sum(work_off)  # the recompute found the victim's own blocks
    # Reported cached tokens are the first scheduling's only (none here): preemption does not
    # change what a request is billed.
    assert all(o.cached_tokens == 0 for o in got.values())


def test_prefix_hits_on_the_triton_backend_give_the_cpu_tokens(tiny):
    """The paged kernels read shared blocks through the block tables (interpreter on CPU)."""
    params, prefix = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), SYSTEM[:2 * BS + 3]
    reqs = [req("t0", [5, 6, 7], "a", params=params, prefix=prefix), req("t1", [8, 9], params=params, prefix=prefix)]
    cpu = run(make(tiny), reqs)
    engine = make(tiny, backend="triton", weight_format="auto")
    run(engine, [req("warm", [1], "a", params=params, prefix=prefix)])
    got = run(engine, reqs[:1]) | run(engine, reqs[1:])
    assert got["t0"].cached_tokens == 2 * BS and got["t1"].cached_tokens == 0
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in cpu.items()}

"""Engine metrics as Prometheus sees them (the default registry, as /metrics renders it): per-step
histograms and preemptions move with the steps the engine ran, queue and KV cache gauges show
the state at scrape time, and adapter cache hits, misses and loads follow the LoRA tiers."""
from __future__ import annotations

import gc

import pytest
from prometheus_client import REGISTRY

from engine.lora.source import LocalDirectoryAdapterSource
from engine.sampling_params import GenerationRequest, Priority, SamplingParams

from .helpers import PROMPTS, greedy
from .lora_fixtures import write_random_adapter


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def small(make_engine, tmp_path_factory):
    """One engine for this module: a KV cache of 4 blocks (64 tokens, so three requests of ~40
    tokens preempt each other) and two random adapters in a local adapter source."""
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in (("aaa", 1), ("bbb", 2)):
        write_random_adapter(root / name, rank=4, seed=seed, targets=("q_proj", "v_proj"))
    return make_engine(adapter_source=LocalDirectoryAdapterSource(root), num_kv_blocks=4,
                       max_num_batched_tokens=32, max_loras=2)


def test_step_histograms_and_preemptions_follow_the_steps(small):
    steps0, pre0 = small.stats["steps"], small.stats["preemptions"]
    before = {n: sample(n) for n in ("tessera_engine_step_seconds_count", "tessera_engine_batch_tokens_sum",
                                     "tessera_engine_batch_sequences_count", "tessera_engine_preemptions_total")}
    zero_adapters = sample("tessera_engine_step_adapters_bucket", le="0.0")
    out = small.generate([greedy(f"m{i}", p, 24, ignore_eos=True) for i, p in enumerate(PROMPTS[:3])])
    steps = small.stats["steps"] - steps0

    assert steps > 0 and small.stats["preemptions"] - pre0 > 0
    assert sample("tessera_engine_step_seconds_count") - before["tessera_engine_step_seconds_count"] == steps
    assert sample("tessera_engine_batch_sequences_count") - before["tessera_engine_batch_sequences_count"] == steps
    assert (sample("tessera_engine_preemptions_total") - before["tessera_engine_preemptions_total"]
            == small.stats["preemptions"] - pre0)
    # Every prompt token and every fed-back output token was computed at least once (more after
    # a preemption: recomputation).
    needed = sum(o.prompt_tokens + o.completion_tokens - 1 for o in out.values())
    assert sample("tessera_engine_batch_tokens_sum") - before["tessera_engine_batch_tokens_sum"] >= needed
    # No adapter in any of these steps.
    assert sample("tessera_engine_step_adapters_bucket", le="0.0") - zero_adapters == steps


def test_queue_and_kv_cache_gauges_are_read_at_scrape_time(engine):
    gc.collect()  # engines of earlier tests that are gone must not be reported
    wait0 = {p: sample("tessera_engine_waiting_sequences", priority=p) for p in ("realtime", "standard", "batch")}
    run0 = sample("tessera_engine_running_sequences", priority="batch")
    used0 = sample("tessera_engine_kv_cache_blocks", state="used")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = []
    for i, prio in enumerate([Priority.realtime, Priority.batch, Priority.batch]):
        ids.append(f"gauge{i}")
        engine.add_request(GenerationRequest(ids[-1], prompt=PROMPTS[i], params=params, priority=prio))
    try:
        assert sample("tessera_engine_waiting_sequences", priority="realtime") - wait0["realtime"] == 1
        assert sample("tessera_engine_waiting_sequences", priority="batch") - wait0["batch"] == 2
        assert sample("tessera_engine_waiting_sequences", priority="standard") == wait0["standard"]
        engine.step()
        assert sample("tessera_engine_running_sequences", priority="batch") - run0 == 2
        assert sample("tessera_engine_kv_cache_blocks", state="used") > used0
        assert 0 < sample("tessera_engine_kv_cache_usage_ratio") <= 1
    finally:
        for rid in ids:
            engine.abort(rid)
    assert sample("tessera_engine_kv_cache_blocks", state="used") == used0
    assert sample("tessera_engine_running_sequences", priority="batch") == run0


def test_adapter_cache_hits_misses_and_loads(small):
    eng = small
    names = ("cpu", "hit"), ("cpu", "miss"), ("slot", "hit"), ("slot", "miss")
    before = {k: sample("tessera_engine_adapter_cache_total", tier=k[0], result=k[1]) for k in names}
    loads0 = sample("tessera_engine_adapter_loads_total", tier="cpu")
    hist0 = sample("tessera_engine_adapter_load_seconds_count", tier="cpu")
    one_adapter0 = sample("tessera_engine_step_adapters_bucket", le="1.0") - sample("tessera_engine_step_adapters_bucket", le="0.0")

    def run(rid, adapter):
        req = greedy(rid, "Hello", 3, ignore_eos=True)
        req.adapter = adapter
        eng.generate([req])

    run("r1", "aaa")   # miss: fetched and parsed into the CPU tier, then copied into a slot
    run("r2", "aaa")   # hit in the CPU tier and in its slot
    run("r3", "bbb")   # miss
    delta = {k: sample("tessera_engine_adapter_cache_total", tier=k[0], result=k[1]) - v for k, v in before.items()}
    assert delta[("cpu", "miss")] == 2 and delta[("cpu", "hit")] == 1
    assert delta[("slot", "miss")] == 2 and delta[("slot", "hit")] > 0
    assert sample("tessera_engine_adapter_loads_total", tier="cpu") - loads0 == 2
    assert sample("tessera_engine_adapter_load_seconds_count", tier="cpu") - hist0 == 2
    assert sample("tessera_engine_adapters_resident", tier="slot") >= 2
    one_adapter = sample("tessera_engine_step_adapters_bucket", le="1.0") - sample("tessera_engine_step_adapters_bucket", le="0.0")
    assert one_adapter - one_adapter0 >= 3  # every step of these requests ran exactly one adapter

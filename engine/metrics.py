"""Engine metrics for Prometheus (the engine imports prometheus_client, never the platform).

Cheap by construction: the step loop observes a few histograms once per step (`observe_step`);
everything that is state (queue lengths by priority class, KV cache use, adapters resident, the
LoRA manager's running counts) is read only when Prometheus scrapes, by `EngineCollector` from
the live engines of this process (LLMEngine registers itself with `track`).

  tessera_engine_step_seconds                      histogram, one observation per non-empty step
  tessera_engine_batch_tokens                      histogram, tokens computed per step
  tessera_engine_batch_sequences                   histogram, sequences per step
  tessera_engine_step_adapters                     histogram, distinct adapters per step
  tessera_engine_preemptions_total                 counter, sequences preempted (recomputed later)
  tessera_engine_request_faults_total{reason}      counter, requests failed by a fault in a step:
                                                   non_finite (logits) | exception (traced to it)
  tessera_engine_restarts_total                    counter, step loop restarts after it died
  tessera_engine_grammar_refusals_total            counter, requests ended because their grammar
                                                   (response_format, tools) could not go on: the
                                                   client's input, not a fault
  tessera_engine_running_sequences{priority}       gauge (scrape time)
  tessera_engine_waiting_sequences{priority}       gauge (scrape time)
  tessera_engine_kv_cache_usage_ratio              gauge, used / all KV blocks
  tessera_engine_kv_cache_blocks{state}            gauge, used | cached (free, holding a reusable
                                                   prefix) | free (empty)
  tessera_engine_prefix_cache_queries_total        counter, prompt tokens looked up in the prefix
                                                   cache (once per request, when first scheduled)
  tessera_engine_prefix_cache_hits_total           counter, of those, tokens whose KV was cached
  tessera_engine_adapters_resident{tier}           gauge, cpu | slot
  tessera_engine_adapter_cache_total{tier,result}  counter, cpu | slot x hit | miss
  tessera_engine_adapter_loads_total{tier}         counter, cpu (fetch + parse) | slot (copy in)
  tessera_engine_adapter_evictions_total{tier}     counter, cpu
  tessera_engine_adapter_load_seconds{tier="cpu"}  histogram, fetch + parse of one version
With several engines in one process (tests) the scrape-time values are summed over them.

The model-server protocol of the Kubernetes Gateway API Inference Extension (its endpoint picker,
EPP, and the routers built on it such as llm-d) is served under the vLLM names the EPP scrapes by
default (`--total-queued-requests-metric` etc. left unset), read at scrape time like the gauges
above (`model_server_protocol`):
  vllm:num_requests_waiting                        gauge, sequences waiting for a seat (TotalQueuedRequests)
  vllm:num_requests_running                        gauge, sequences holding a seat (TotalRunningRequests)
  vllm:kv_cache_usage_perc                         gauge, KV blocks in use / all, a fraction 0..1 as
                                                   vLLM's and the EPP's `kv-cache-usage-percentage-
                                                   metric` are (blocks free but holding a cached
                                                   prefix count as free, as in vLLM)
  vllm:lora_requests_info{max_lora,                gauge, the scrape's Unix time in seconds (the EPP
    running_lora_adapters,waiting_lora_adapters}   keeps the series with the largest value); one
                                                   series. max_lora: device adapter slots (how many
                                                   distinct adapters run at once); running / waiting:
                                                   the adapters of the running / waiting sequences,
                                                   sorted, joined by "," without spaces (the EPP
                                                   splits on "," and does not trim). Only with a
                                                   LoRA manager.
  vllm:cache_config_info{block_size,num_gpu_blocks}  gauge 1 (optional in the protocol: the EPP's
                                                   prefix-cache scorer reads the two labels)
Adapters are named by their version id (the sha256 the gateways resolve a tenant's `model` to and
the engine serves), never by the tenant's adapter name: names are scoped to a tenant (two tenants'
"support" are different adapters), and this endpoint is open and carries no tenant data. So an EPP
routes with LoRA affinity a request whose `model` is the version id; see docs/ARCHITECTURE.md
"Observability" for what that means for a deployment.
"""
from __future__ import annotations

import time
import weakref

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engine.durations import ADAPTER_LOAD_BUCKETS_S
from engine.sampling_params import PRIORITY_NAMES

STEP_SECONDS = Histogram("tessera_engine_step_seconds", "Wall time of one engine step.",
                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
BATCH_TOKENS = Histogram("tessera_engine_batch_tokens", "Tokens computed in one step (decodes + prefill chunks).",
                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
BATCH_SEQUENCES = Histogram("tessera_engine_batch_sequences", "Sequences in one step.",
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
STEP_ADAPTERS = Histogram("tessera_engine_step_adapters", "Distinct LoRA adapters in one step.",
                          buckets=(0, 1, 2, 4, 8, 16, 32, 64))
PREEMPTIONS = Counter("tessera_engine_preemptions_total", "Sequences preempted for KV blocks (recomputed later).")
REQUEST_FAULTS = Counter("tessera_engine_request_faults_total",
                         "Requests failed by a fault traced to them in a step (the engine kept serving).", ["reason"])
GRAMMAR_REFUSALS = Counter("tessera_engine_grammar_refusals_total",
                           "Requests ended because their response_format or tools grammar could not go on "
                           "(the client's input, not an engine fault).")
RESTARTS = Counter("tessera_engine_restarts_total", "Times the engine's step loop died and was reset and restarted.")

_engines: "weakref.WeakSet" = weakref.WeakSet()


def track(engine) -> None:
    """Report `engine`'s state at scrape time (until it is garbage collected)."""
    _engines.add(engine)


def observe_step(seconds: float, sched) -> None:
    """One non-empty step: its time, batch size in tokens and sequences, distinct adapters."""
    STEP_SECONDS.observe(seconds)
    BATCH_TOKENS.observe(sched.num_tokens)
    BATCH_SEQUENCES.observe(len(sched.decodes) + len(sched.prefills))
    adapters = {s.seq.adapter for s in sched.decodes} | {s.seq.adapter for s in sched.prefills}
    adapters.discard(None)
    STEP_ADAPTERS.observe(len(adapters))


def _cumulative_buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus's cumulative (le, count) pairs from per-bucket counts over ADAPTER_LOAD_BUCKETS_S."""
    out, acc = [], 0
    for bound, n in zip(ADAPTER_LOAD_BUCKETS_S + (float("inf"),), counts):
        acc += n
        out.append((floatToGoString(bound), acc))
    return out


class EngineCollector:
    """Scrape-time state of the tracked engines (see the module docstring)."""

    def describe(self):
        return []  # series appear only when an engine exists; no duplicate-name checks needed

    def collect(self):
        engines = list(_engines)
        if not engines:
            return
        running = GaugeMetricFamily("tessera_engine_running_sequences", "Sequences running, by priority class.",
                                    labels=["priority"])
        waiting = GaugeMetricFamily("tessera_engine_waiting_sequences", "Sequences waiting, by priority class.",
                                    labels=["priority"])
        run_n, wait_n = dict.fromkeys(PRIORITY_NAMES, 0), dict.fromkeys(PRIORITY_NAMES, 0)
        used = total = cached = 0
        prefix = {"query_tokens": 0, "hit_tokens": 0}
        cpu_resident = slot_resident = 0
        stats = {"cpu_hits": 0, "cpu_misses": 0, "slot_hits": 0, "slot_loads": 0, "evictions": 0}
        load_counts, load_sum_s = [0] * (len(ADAPTER_LOAD_BUCKETS_S) + 1), 0.0
        running_adapters, waiting_adapters, max_lora, block_size = set(), set(), None, 0
        for e in engines:
            # list() copies are atomic under the GIL: the step thread may change the queues meanwhile.
            for seq in list(e.scheduler.running):
                run_n[seq.priority.name] += 1
                if seq.adapter is not None:
                    running_adapters.add(seq.adapter)
            for seq in list(e.scheduler.waiting):
                wait_n[seq.priority.name] += 1
                if seq.adapter is not None:
                    waiting_adapters.add(seq.adapter)
            bm = e.block_manager
            block_size = bm.block_size
            total += bm.num_blocks
            used += bm.num_blocks - bm.num_free_blocks
            cached += bm.num_cached_free_blocks
            for k in prefix:
                prefix[k] += bm.stats[k]
            lm = e.lora_manager
            if lm is not None:
                max_lora = (max_lora or 0) + lm.slots.num_slots
                cpu_resident += len(lm._cpu)
                slot_resident += sum(1 for o in list(lm._slot_owner) if o is not None)
                for k in stats:
                    stats[k] += lm.stats[k]
                lt = lm.load_times
                load_counts = [a + b for a, b in zip(load_counts, list(lt.counts))]
                load_sum_s += lt.sum_s
        for p in PRIORITY_NAMES:
            running.add_metric([p], run_n[p])
            waiting.add_metric([p], wait_n[p])
        yield running
        yield waiting
        yield GaugeMetricFamily("tessera_engine_kv_cache_usage_ratio", "Share of KV cache blocks in use.",
                                value=used / total if total else 0.0)
        blocks = GaugeMetricFamily("tessera_engine_kv_cache_blocks", "KV cache blocks by state.", labels=["state"])
        blocks.add_metric(["used"], used)
        blocks.add_metric(["cached"], cached)
        blocks.add_metric(["free"], total - used - cached)
        yield blocks
        yield CounterMetricFamily("tessera_engine_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache when first scheduled.",
                                  value=prefix["query_tokens"])
        yield CounterMetricFamily("tessera_engine_prefix_cache_hits",
                                  "Prompt tokens whose KV the prefix cache already held.", value=prefix["hit_tokens"])
        resident = GaugeMetricFamily("tessera_engine_adapters_resident", "Adapter versions held, by tier.",
                                     labels=["tier"])
        resident.add_metric(["cpu"], cpu_resident)
        resident.add_metric(["slot"], slot_resident)
        yield resident
        cache = CounterMetricFamily("tessera_engine_adapter_cache", "Adapter lookups by tier and result.",
                                    labels=["tier", "result"])
        cache.add_metric(["cpu", "hit"], stats["cpu_hits"])
        cache.add_metric(["cpu", "miss"], stats["cpu_misses"])
        cache.add_metric(["slot", "hit"], stats["slot_hits"])
        cache.add_metric(["slot", "miss"], stats["slot_loads"])
        yield cache
        loads = CounterMetricFamily("tessera_engine_adapter_loads", "Adapter loads into a tier.", labels=["tier"])
        loads.add_metric(["cpu"], sum(load_counts))
        loads.add_metric(["slot"], stats["slot_loads"])
        yield loads
        evictions = CounterMetricFamily("tessera_engine_adapter_evictions", "Adapter versions evicted, by tier.",
                                        labels=["tier"])
        evictions.add_metric(["cpu"], stats["evictions"])
        yield evictions
        hist = HistogramMetricFamily("tessera_engine_adapter_load_seconds",
                                     "Time to fetch and parse one adapter version into the CPU tier.", labels=["tier"])
        hist.add_metric(["cpu"], _cumulative_buckets(load_counts), load_sum_s)
        yield hist
        yield from model_server_protocol(
            waiting=sum(wait_n.values()), running=sum(run_n.values()), used_blocks=used, total_blocks=total,
            block_size=block_size, max_lora=max_lora, running_adapters=running_adapters,
            waiting_adapters=waiting_adapters)


def model_server_protocol(*, waiting: int, running: int, used_blocks: int, total_blocks: int, block_size: int,
                          max_lora: int | None, running_adapters: set, waiting_adapters: set):
    """The inference extension's model-server metric families under vLLM's names (module
    docstring); `max_lora` None: no LoRA manager, so no LoRA info series."""
    yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for a seat (sequences in the "
                            "scheduler's waiting queue, preempted ones included).", value=waiting)
    yield GaugeMetricFamily("vllm:num_requests_running", "Requests holding a seat (sequences being prefilled "
                            "or decoded).", value=running)
    yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                            value=used_blocks / total_blocks if total_blocks else 0.0)
    if max_lora is not None:
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters (version ids); "
                                 "the value is when this was read (Unix seconds).",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(max_lora), ",".join(sorted(running_adapters)), ",".join(sorted(waiting_adapters))],
                        time.time())
        yield info
    cache = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (labels).",
                              labels=["block_size", "num_gpu_blocks"])
    cache.add_metric([str(block_size), str(total_blocks)], 1.0)
    yield cache


REGISTRY.register(EngineCollector())

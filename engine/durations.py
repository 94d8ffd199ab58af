"""Durations of one kind of engine event, kept in constant memory however long the engine runs.

`Durations.record(seconds)` updates histogram counts since start over fixed bucket bounds (what
engine.metrics exports, made cumulative over the bounds as Prometheus wants), the count and sum,
and an exponentially weighted mean of recent events (what an engine worker publishes for
routing: tessera.engine_client.routing estimates a request's start delay on each replica from it). Recording is a few additions; the
caller serialises `record` calls (the LoRA manager under its lock, the engine on its step thread),
and readers take the attributes as they are (each is replaced or updated in one operation).
"""
from __future__ import annotations

import bisect

#: Bucket bounds of adapter load times (fetch + parse into the CPU tier), in seconds.
ADAPTER_LOAD_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Durations:
    """Histogram counts, count and sum since start, and the recent mean, of durations in seconds.

    `counts[i]` counts events of at most `buckets[i]` seconds not counted in an earlier bucket;
    the last entry, those above every bound. `mean_s` is None until the first event; then each
    event moves it `alpha` of the way to its own duration (so it follows a change of workload
    within tens of events)."""

    def __init__(self, buckets: tuple[float, ...] = (), alpha: float = 0.1):
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.buckets = tuple(buckets)
        self.alpha = alpha
        self.counts = [0] * (len(self.buckets) + 1)
        self.count = 0
        self.sum_s = 0.0
        self.mean_s: float | None = None

    def record(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.count += 1
        self.sum_s += seconds
        self.mean_s = seconds if self.mean_s is None else self.mean_s + self.alpha * (seconds - self.mean_s)

"""The CPU backend's weight formats follow the CPU, not the load at start-up: an engine started
while both cores were busy and one started on an idle machine choose the same formats and give the
same greedy tokens, on the base model and on the demo adapters (engine.backends.cpu.formats)."""
from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from engine.lora.source import LocalDirectoryAdapterSource
from engine.sampling_params import GenerationRequest, SamplingParams

from .conftest import chat

DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"
ADAPTERS = ("json-answer", "pirate", "upper")


def _spin(ready, stop) -> None:
    ready.set()
    while not stop.is_set():
        pass


class _BusyCores:
    """One busy-looping process per core while the block runs."""

    def __enter__(self):
        ctx = multiprocessing.get_context("fork")
        self.stop = ctx.Event()
        ready = [ctx.Event() for _ in range(multiprocessing.cpu_count())]
        self.procs = [ctx.Process(target=_spin, args=(r, self.stop), daemon=True) for r in ready]
        for p in self.procs:
            p.start()
        assert all(r.wait(30) for r in ready)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _greedy(engine, tokenizer, prompts: list[str]) -> dict[tuple, list[int]]:
    """Greedy tokens of every prompt on the base (None) and on each demo adapter, in one batch
    (after each adapter is loaded, so both engines see the same batches)."""
    warm = [GenerationRequest(f"warm-{a}", prompt=chat(tokenizer, "hi"), adapter=a,
                              params=SamplingParams(max_tokens=1, temperature=0.0)) for a in ADAPTERS]
    engine.generate(warm)
    reqs = {(a, i): GenerationRequest(f"{a}-{i}", prompt=chat(tokenizer, p), adapter=a,
                                      params=SamplingParams(max_tokens=16, temperature=0.0))
            for a in (None, *ADAPTERS) for i, p in enumerate(prompts)}
    outs = engine.generate(list(reqs.values()))
    assert not any(o.error for o in outs.values())
    return {key: outs[r.request_id].token_ids for key, r in reqs.items()}


def test_engines_started_idle_and_under_load_give_the_same_greedy_tokens(make_engine, tokenizer):
    prompts = json.loads((DEMO / "behaviour.json").read_text())["eval"]["prompts"][:3]

    def start():
        return make_engine(LocalDirectoryAdapterSource(DEMO), weight_format="auto", max_loras=len(ADAPTERS),
                           max_lora_rank=64, kv_cache_bytes=32 << 20)

    with _BusyCores():
        loaded = start()
    idle = start()
    assert loaded.format_timings == idle.format_timings
    assert "CPU weight formats" in idle.format_timings["summary"]
    got_loaded, got_idle = _greedy(loaded, tokenizer, prompts), _greedy(idle, tokenizer, prompts)
    assert got_loaded == got_idle
    # The adapters took part: each changes some answer of the base's.
    for a in ADAPTERS:
        assert any(got_idle[(a, i)] != got_idle[(None, i)] for i in range(len(prompts))), a

"""The CPU backend's weight formats follow the CPU, not the load at start-up: an engine started
while both cores were busy and one started on an idle machine choose the same formats and give the
same greedy tokens, on the base model and on the demo adapters; and the rules' choice per kind of
CPU (engine.backends.cpu.formats)."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
from pathlib import Path

import torch

from engine.backends.cpu import formats
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


INTEL_CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\nflags\t\t: fpu avx2\n"
AMD_CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: fpu avx2\n"


def test_the_vendor_comes_from_cpuinfo_else_from_the_cpu_name():
    assert formats.vendor_of(INTEL_CPUINFO) == "intel"
    assert formats.vendor_of(AMD_CPUINFO, "Intel Xeon") == "amd"  # vendor_id wins
    assert formats.vendor_of("", "AMD EPYC 9R14") == "amd"
    assert formats.vendor_of("", "Intel Xeon") == "intel"
    assert formats.vendor_of("vendor_id\t: CentaurHauls\n", "") == ""
    assert formats.vendor_of("", "") == ""


def test_avx512_bf16_without_amx_takes_bf16_copies_on_amd_cores_and_fp32_on_intel_ones():
    """The dense copy past the int8 crossover: bf16 where oneDNN's bf16 GEMMs beat fp32's (AMX;
    avx512_bf16 on Zen 4), fp32 on an Intel core with avx512_bf16 but no AMX, where they were
    1.5x slower; the int8 crossover is measured against the copy each kind takes, and the log line
    says which kind the rule saw."""
    def choose(**kind):
        return formats.choose_formats(formats.CpuKind(avx2=True, avx512=True, **kind), int8_kernel=True,
                                      amx_kernel=False, q4_kernel=True)

    amd = choose(avx512_bf16=True, amx=False, vendor="amd")
    intel = choose(avx512_bf16=True, amx=False, vendor="intel")
    unknown = choose(avx512_bf16=True, amx=False)
    assert (amd.dense, amd.int8_max_rows, amd.head_int8_max_rows) == (torch.bfloat16, 8, 4)
    assert unknown == dataclasses.replace(amd, cpu=unknown.cpu)
    assert (intel.dense, intel.int8_max_rows, intel.head_int8_max_rows) == (torch.float32, 12, 8)
    assert "no AMX, Intel)" in intel.summary() and "dense fp32 beyond" in intel.summary()
    assert "Intel" not in amd.summary() and "dense bf16 beyond" in amd.summary()
    # AMX and AVX-512 without bf16 do not depend on the vendor.
    for vendor in ("intel", "amd"):
        assert choose(avx512_bf16=True, amx=True, vendor=vendor).dense == torch.bfloat16
        no_bf16 = choose(avx512_bf16=False, amx=False, vendor=vendor)
        assert (no_bf16.dense, no_bf16.int8_max_rows, no_bf16.head_int8_max_rows) == (torch.float32, 12, 8)
        assert "Intel" not in no_bf16.summary()

"""The start-up warm-up (engine.engine_builder.warm_up, EngineConfig.startup_warmup): when the
engine is built on the Triton backend every decode graph is captured and every kernel variant a
served step can launch has been launched once, so serving captures nothing and compiles nothing.

Runs the whole engine on the tiny synthetic Llama (the parity test's fixture, adapters of ranks 4,
8 and 16). Under the interpreter (the default run) the graph capture is the stand-in of
test_cuda_graphs.py (it runs the forward once at capture, as CudaGraphCapture's warm-up call
does, and replays by calling it again), and a variant is its key (engine.backends.triton.variants:
what Triton's JIT would compile a launch for); the engine is built with launches recorded and not
run (`LaunchRecorder(launch=False)`: the interpreter compiles nothing, so only the keys matter and
the warm-up costs its host code alone). On a GPU (`TRITON_INTERPRET=0`, bench/gpu.sh) the real
capture and warm-up run, and the JIT's compile hook must stay silent while serving."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from prometheus_client import REGISTRY

from engine.backends.triton import TritonBackend, norms
from engine.backends.triton.cuda_graphs import DecodeGraphs
from engine.backends.triton.variants import CompileRecorder, LaunchRecorder
from engine.model_runner import ModelRunner
from engine.sampling_params import GenerationRequest, SamplingParams
from punica_kernels.kernels._common import INTERPRETED

from .test_backend_parity import _engine, tiny  # noqa: F401 - the module fixture


class ForwardingCapture:
    """Stands in for CudaGraphCapture under the interpreter: runs the forward once at capture
    (CudaGraphCapture's warm-up call) and replays it by calling it again. Logs each capture's
    bucket and whether every row of its static inputs was padding over the sink block."""

    def __init__(self):
        self.graphs: DecodeGraphs | None = None
        self.captured: list[tuple[int, bool]] = []

    def __call__(self, forward):
        g = self.graphs
        b, sink, bs = g.capturing, g.sink_block, g.runner.block_size
        padding = (bool((g.block_tables[:b] == sink).all()) and bool((g.slot_mapping[:b] // bs == sink).all())
                   and bool((g.seq_lens[:b] == 1).all()) and bool((g.token_slots[:b] == -1).all()))
        self.captured.append((b, padding))
        forward()
        return forward


def _graphs_with(monkeypatch, capture: ForwardingCapture) -> None:
    """Under the interpreter the Triton backend builds no decode graphs (CUDA only): give it
    DecodeGraphs over `capture`, as it builds them on CUDA."""
    if not INTERPRETED:
        return

    def decode_graphs(self, runner, **kw):
        capture.graphs = DecodeGraphs(runner, capture=capture, **kw)
        return capture.graphs

    monkeypatch.setattr(TritonBackend, "decode_graphs", decode_graphs)


def _built(tiny, **overrides):  # noqa: F811
    """(engine, the launches its construction made): on the interpreter recorded, not run."""
    with LaunchRecorder(launch=not INTERPRETED) as rec:
        engine = _engine(tiny, "triton", **overrides)
    return engine, rec


def _workload(tokenizer) -> list[GenerationRequest]:
    """Prompts of 1, 15, 16, 17 and 60 tokens (longer than the 48-token chunk) and one of 5;
    2 to 7 new tokens each, so decode steps shrink through several batch sizes; base and adapter
    requests, greedy and sampled."""
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 12)
    lengths = [1, 15, 16, 17, 60, 5]
    assert len(words) >= max(lengths)
    adapters = [None, "r4-attn", None, "r8-all", "r16-mlp", None]
    out = []
    for i, (n, a) in enumerate(zip(lengths, adapters)):
        params = SamplingParams(max_tokens=2 + i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        out.append(GenerationRequest(request_id=f"w{i}", prompt_token_ids=words[:n], params=params, adapter=a))
    return out


def _serve(engine, requests) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
    return tokens


def _steps_observed() -> float:
    return REGISTRY.get_sample_value("tessera_engine_step_seconds_count") or 0.0


def test_every_decode_graph_is_captured_at_start_and_the_warm_up_leaves_no_state(tiny, monkeypatch):  # noqa: F811
    capture = ForwardingCapture()
    _graphs_with(monkeypatch, capture)
    tables: list[list[int]] = []  # the block table of every sequence a warm-up step ran
    execute = ModelRunner.execute

    def recording(runner, sched, lora=None, *pending):
        tables.extend(list(s.seq.block_table) for s in sched.decodes + sched.prefills)
        return execute(runner, sched, lora, *pending)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    steps = _steps_observed()
    engine, _ = _built(tiny, startup_warmup=True)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    fresh = _engine(tiny, "triton", startup_warmup=False)
    graphs = engine.runner.graphs
    assert graphs is not None and set(graphs.replays) == set(graphs.buckets)
    assert graphs.stats["captures"] == len(graphs.buckets)
    if INTERPRETED:  # each bucket captured once, over padding rows only
        assert sorted(capture.captured) == [(b, True) for b in graphs.buckets]
    # The warm-up's steps read and wrote only the sink block (the index past the block manager's).
    sink = engine.block_manager.num_blocks
    assert tables and all(t and set(t) == {sink} for t in tables)
    # Nothing of the warm-up is left: no block held, no request, no step counted, no adapter slot.
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == fresh.block_manager.num_blocks
    assert not engine.requests and not engine.has_unfinished()
    assert engine.stats == fresh.stats
    assert _steps_observed() == steps
    assert engine.lora_manager.stats == fresh.lora_manager.stats
    assert engine.lora_manager._slot_owner == fresh.lora_manager._slot_owner
    # Serving captures nothing more: every decode-only step replays a graph captured at start.
    captures = graphs.stats["captures"]
    _serve(engine, _workload(engine.tokenizer)[:4])
    assert graphs.stats["replays"] > 0
    assert graphs.stats["captures"] == captures


def test_serving_after_the_warm_up_launches_no_kernel_variant_it_did_not(tiny, monkeypatch):  # noqa: F811
    _graphs_with(monkeypatch, ForwardingCapture())
    engine, warm = _built(tiny, startup_warmup=True)
    assert warm.variants  # the warm-up launched kernels
    with LaunchRecorder() as served, CompileRecorder() as compiled:
        tokens = _serve(engine, _workload(engine.tokenizer))
    assert all(len(t) == 2 + i for i, t in enumerate(tokens.values()))
    new = served.variants - warm.variants
    assert not new, "variants first launched while serving:\n" + "\n".join(
        f"{k.kernel} {k.specialization} {k.options}" for k in sorted(new, key=repr))
    if compiled.available:  # compiled kernels: the JIT compiled (or loaded) nothing either
        assert compiled.compiles == []


def test_a_variant_key_changes_exactly_where_triton_specializes(triton_engine_device):
    """The key (engine.backends.triton.variants) tells apart what Triton compiles apart: a row
    count of 1, one divisible by 16 and one neither, and a pointer 16-byte aligned or not; the
    same shapes at other addresses give the same key."""
    dev = triton_engine_device
    weight = torch.ones(64, device=dev)

    def key(x: torch.Tensor):
        with LaunchRecorder(launch=False) as rec:
            norms.rms_norm(x, weight, 1e-6)
        (k,) = rec.keys
        return k

    rows = {t: key(torch.zeros(t, 64, device=dev)) for t in (1, 16, 17, 32, 33)}
    assert len({rows[1], rows[16], rows[17]}) == 3
    assert rows[16] == rows[32] and rows[17] == rows[33]
    base = torch.zeros(17 * 64 + 4, device=dev)  # views 8 and 16 bytes past a 16-byte aligned start
    assert base.data_ptr() % 16 == 0
    assert key(base[4:].view(17, 64)) == rows[17] != key(base[2:2 + 17 * 64].view(17, 64))


_COMPILE_PARTITION = r"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
sys.path.insert(0, "bench")
import sass
from engine.backends.triton import norms
from engine.backends.triton.variants import CompileRecorder, compile_launch, compiling_for, variant_key

with sass.recording() as rec:
    for t in (1, 2, 16, 17, 32):
        norms.rms_norm(torch.empty(t, 64), torch.empty(64), 1e-6)
        norms.silu_mul(torch.empty(t, 128))
keys = [variant_key(x.fn, x.args, x.kwargs) for x in rec.launches]
with CompileRecorder() as compiles, compiling_for(GPUTarget("cuda", 90, 32)):
    hashes = [compile_launch(x.fn, x.args, x.kwargs, x.grid).hash for x in rec.launches]
print(json.dumps({"keys": [repr(k) for k in keys], "hashes": hashes, "compiles": len(compiles.compiles),
                  "hook": compiles.available}))
"""


def test_variant_keys_split_launches_as_tritons_compiler_does(tmp_path):
    """Compiled for sm_90 without a GPU (bench/sass.py's way, in a process without the
    interpreter): two launches get one binary exactly when their keys are equal, and the JIT's
    compile hook reports one compile per binary."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _COMPILE_PARTITION], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    keys, hashes = got["keys"], got["hashes"]
    assert len(set(hashes)) > 2
    assert all((keys[i] == keys[j]) == (hashes[i] == hashes[j]) for i in range(len(keys)) for j in range(len(keys)))
    assert got["hook"] and got["compiles"] == len(set(hashes))

"""Kernel launches per decode layer and per step, and host time per step with the device work
taken out, counted through the engine's Triton backend. Needs no GPU; prints one JSON object
(figures, never pass/fail).

    python bench/step_model.py                            # llama3.1-tiny, batches 1,8,32
    python bench/step_model.py --family qwen3 --batches 1 --steps 3 --no-lora

What runs: the whole engine (LLMEngine, backend "triton", bf16 activations) on a tiny synthetic
model of a family's real layer structure (engine.loader.synthetic, "<family>-tiny", its GGUF with
4-bit layers), on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set here before
Triton is imported). For each batch size B, without and with LoRA (every request on one of four
rank-16 adapters over all seven projections): B requests of a 16-token prompt, one prefill step,
then `--steps` decode steps of B rows.

Counted, on one decode step and on the prefill step:
- Triton launches (every `kernel[grid](...)`, by kernel), split into those made inside the
  decoder layers (per layer: their count / the layer count), those inside the model outside the
  layers (embedding, final norm, lm_head) and elsewhere in the step;
- torch ops that launch a GPU kernel when the tensors are on CUDA (aten ops other than views and
  allocations, counted through a TorchDispatchMode, outside the Triton launches), inside the
  layers and inside the model's forward and logits. Ops elsewhere in the step (host-side inputs,
  sampling) run on CPU tensors here whether or not a GPU would run them, so they are listed
  apart, as `other_torch_ops`.
Per step at the family's real layer count: outside + layers x per-layer.

Host time: each step's wall time minus the time spent inside the interpreted Triton launches
(the device work; measured per launch and subtracted, which is a no-op launch's cost without
its garbage outputs, whose non-finite logits would end the requests as faults). What is left is
the engine's Python: scheduling, input packing, launchers' checks and argument building, torch
ops on the tiny tensors (microseconds at these sizes), sampling, detokenizing. It excludes
Triton's own launch path on a GPU (JITFunction.run's argument binding and the driver call, paid
once per launch counted above) and any CUDA graph: on CUDA, decode steps replay graphs, so their
per-launch host cost is not paid there; mixed (prefill) steps run eagerly. `host_outside_model_ms`
is the step's time outside the model's forward and logits (scheduling, building and uploading
the inputs, the LoRA batch, sampling, applying the tokens): what a graph replay does not remove
and what overlapped steps (EngineConfig.overlap_steps) run while the device computes. Per-layer host time is
the time inside DecoderLayer.forward minus its launches', so the real-depth figure is
outside + layers x per-layer, as for the counts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "1") != "1":
    raise SystemExit("bench/step_model.py runs the Triton backend under the interpreter: unset TRITON_INTERPRET "
                     "or set it to 1")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels build for the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that allocate without a kernel (views are recognised by their schema).
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_local_scalar_dense", "set_", "resize_", "_unsafe_view", "view", "as_strided",
              "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
              "is_same_size", "equal"}


class _Counter:
    """Where the engine is (layer, model, elsewhere) and what it launched and spent there."""

    def __init__(self):
        self.where = "step"  # "layer" | "model" | "step"
        self.in_kernel = False
        self.counting = False
        self.launches: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.torch_ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.kernel_s = collections.Counter()  # seconds inside launches, by where
        self.layer_s = 0.0  # wall seconds inside decoder layers
        self.model_s = 0.0  # wall seconds inside the model's forward and its logits

    def reset(self):
        self.launches.clear()
        self.torch_ops.clear()
        self.kernel_s.clear()
        self.layer_s = 0.0
        self.model_s = 0.0


class _OpCounter(TorchDispatchMode):
    def __init__(self, counter: _Counter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.c
        if c.counting and not c.in_kernel:
            name = func.overloadpacket.__name__
            if not func.is_view and name not in _NO_KERNEL:
                c.torch_ops[c.where][name] += 1
            elif name == "_local_scalar_dense":
                c.torch_ops[c.where]["_local_scalar_dense (a device read on CUDA)"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def instrumented(engine, counter: _Counter):
    """Count and time every Triton launch, and mark where the engine is, while inside."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if counter.counting:
            counter.launches[counter.where][self.__name__.lstrip("_")] += 1
        counter.in_kernel = True
        t0 = time.perf_counter()
        try:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter.kernel_s[counter.where] += time.perf_counter() - t0
            counter.in_kernel = False

    model = engine.model
    handles = []

    def enter(where):
        def hook(module, args, kwargs=None):
            module._bench_prev = counter.where
            module._bench_t0 = time.perf_counter()
            counter.where = where
        return hook

    def leave(module, args, output):
        if counter.where == "layer":
            counter.layer_s += time.perf_counter() - module._bench_t0
        elif module is model:
            counter.model_s += time.perf_counter() - module._bench_t0
        counter.where = module._bench_prev

    for layer in model.layers:
        handles.append(layer.register_forward_pre_hook(enter("layer")))
        handles.append(layer.register_forward_hook(leave))
    handles.append(model.register_forward_pre_hook(enter("model")))
    handles.append(model.register_forward_hook(leave))
    compute_logits = model.compute_logits

    def logits(*a, **k):
        prev, counter.where = counter.where, "model"
        t0 = time.perf_counter()
        try:
            return compute_logits(*a, **k)
        finally:
            counter.model_s += time.perf_counter() - t0
            counter.where = prev

    model.compute_logits = logits
    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original
        model.compute_logits = compute_logits
        for h in handles:
            h.remove()


def _counts(counter: _Counter, layers: int, real_layers: int) -> dict:
    """One counted step: per layer, outside the layers, and the step at the real depth."""
    lay = counter.launches["layer"]
    per_layer = {k: v / layers for k, v in sorted(lay.items())}
    ops_layer = {k: v / layers for k, v in sorted(counter.torch_ops["layer"].items())}
    model = dict(sorted(counter.launches["model"].items()))
    elsewhere = dict(sorted(counter.launches["step"].items()))
    ops_model = dict(sorted(counter.torch_ops["model"].items()))
    n_layer = sum(per_layer.values())
    n_ops_layer = sum(ops_layer.values())
    n_out = sum(model.values()) + sum(elsewhere.values())
    n_ops_out = sum(ops_model.values())
    return {
        "triton_per_layer": n_layer, "torch_per_layer": n_ops_layer, "kernels_per_layer": n_layer + n_ops_layer,
        "triton_per_layer_by_kernel": per_layer, "torch_per_layer_by_op": ops_layer,
        "triton_outside_layers": model, "triton_elsewhere": elsewhere, "torch_in_model_outside_layers": ops_model,
        "kernels_per_step_at_real_depth": round(real_layers * (n_layer + n_ops_layer) + n_out + n_ops_out, 1),
        "triton_per_step_at_real_depth": round(real_layers * n_layer + n_out, 1),
        "other_torch_ops": sum(counter.torch_ops["step"].values()),
    }


def _host(counter: _Counter, wall: float, layers: int, real_layers: int) -> dict:
    kernel = sum(counter.kernel_s.values())
    layer_host = (counter.layer_s - counter.kernel_s["layer"]) / layers
    outside = wall - kernel - layer_host * layers
    return {"host_ms": (wall - kernel) * 1e3, "host_per_layer_ms": layer_host * 1e3,
            "host_outside_layers_ms": outside * 1e3,
            "host_outside_model_ms": (wall - counter.model_s - counter.kernel_s["step"]) * 1e3,
            "host_at_real_depth_ms": (outside + real_layers * layer_host) * 1e3,
            "interpreted_kernels_ms": kernel * 1e3}


def run_case(engine, tokenizer, batch: int, adapters: list[str], steps: int, real_layers: int,
             counter: _Counter) -> dict:
    from engine.sampling_params import GenerationRequest, SamplingParams

    layers = len(engine.model.layers)
    prompt = tokenizer.encode("the quick brown fox jumps over the lazy dog and runs far away")[:16]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    tag = f"b{batch}-{'lora' if adapters else 'base'}-{time.monotonic_ns()}"
    for i in range(batch):
        engine.add_request(GenerationRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, params=params,
                                             adapter=adapters[i % len(adapters)] if adapters else None))
    mode = _OpCounter(counter)
    if adapters:  # loaded before the clock starts; their slots fill in the prefill step, as in serving
        for name in adapters:
            engine.lora_manager.request_adapter(name)
            engine.lora_manager.wait_loaded(name)
            engine.lora_manager.release(name)

    def one(count_launches: bool, count_ops: bool) -> float:
        counter.reset()
        counter.counting = count_launches
        t0 = time.perf_counter()
        with (mode if count_ops else contextlib.nullcontext()):
            outs = engine.step()
        wall = time.perf_counter() - t0
        counter.counting = False
        for o in outs:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
        produced.append(len(outs))
        return wall

    produced: list[int] = []

    # The prefill step (every prompt in one step): its launches counted (a dictionary increment
    # each) and its host time measured; torch ops are counted on decode steps only (the dispatch
    # mode's own cost would distort the timing, and a step cannot be run twice).
    wall = one(count_launches=True, count_ops=False)
    while produced[-1] < batch:  # nothing scheduled yet (an adapter still settling): not the prefill
        if len(produced) > 20:
            raise RuntimeError(f"the batch of {batch} did not start in 20 steps")
        wall = one(count_launches=True, count_ops=False)
    prefill = {"triton_launches": sum(sum(v.values()) for v in counter.launches.values()),
               "triton_launches_per_layer": sum(counter.launches["layer"].values()) / layers,
               **{k: round(v, 3) for k, v in _host(counter, wall, layers, real_layers).items()}}
    # Decode: the first decode step counted (not timed), the next `steps` timed.
    one(count_launches=True, count_ops=True)
    counts = _counts(counter, layers, real_layers)
    hosts = [_host(counter, one(count_launches=False, count_ops=False), layers, real_layers) for _ in range(steps)]
    while engine.has_unfinished():
        engine.step()
    med = {k: round(statistics.median(h[k] for h in hosts), 3) for k in hosts[0]}
    return {"batch": batch, "lora": bool(adapters), "decode_counts": counts, "decode_host": med,
            "prefill_step": prefill}


def real_shape_launches(family: str, batches: list[int], lora: bool) -> dict:
    """{(batch, lora): {kernel: launches}} of one decode layer at the real family's shapes, as
    the backend's launchers choose them on an H100 (split-K, decode attention's splits),
    recorded by bench/sass.py --count-only in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).with_name("sass.py")), "--families", family, "--batches",
           ",".join(map(str, batches)), "--prefill", "0", "--count-only"] + ([] if lora else ["--no-lora"])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    launches = json.loads(done.stdout)["launches"]
    out = {}
    for b in batches:
        for with_lora in ((False, True) if lora else (False,)):
            tag = f"{family} decode{'+lora' if with_lora else ''} T={b} "
            sel = [x for x in launches if x["site"].startswith(tag)]
            counts = collections.Counter()
            for x in sel:  # a launch made by a share of the layers (attention by window) counts that share
                counts[x["kernel"]] += x["share_of_layers"]
            out[(b, with_lora)] = {k: round(v, 2) for k, v in sorted(counts.items())}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama3.1", help="family whose <family>-tiny model runs (default llama3.1)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per case (median reported)")
    p.add_argument("--layers", type=int, default=None,
                   help="layer count to scale to (default: the family's real model's)")
    p.add_argument("--no-lora", action="store_true", help="only the cases without adapters")
    args = p.parse_args(argv)

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_checkpoint
    from engine.loader.synthetic import FAMILIES, family_model_config, write_family_gguf
    from engine.lora.source import LocalDirectoryAdapterSource
    from engine.lora.weights import base_shape_of
    from engine.tokenizer import TextTokenizer
    from tests.engine.lora_fixtures import write_random_adapter

    tiny = f"{args.family}-tiny"
    if tiny not in FAMILIES:
        fams = sorted(f[:-5] for f in FAMILIES if f.endswith("-tiny"))
        print(f"unknown family {args.family!r}; one of {', '.join(fams)}", file=sys.stderr)
        return 2
    real = next(f for f in FAMILIES if f.startswith(args.family) and not f.endswith("-tiny"))
    real_layers = args.layers or family_model_config(real).num_layers
    batches = [int(b) for b in args.batches.split(",") if b]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_family_gguf(Path(tmp) / f"{tiny}.gguf", tiny, seed=1)
        checkpoint = load_checkpoint(path)
        tokenizer = TextTokenizer.from_gguf_metadata(checkpoint[2])
        names = [f"a{i}" for i in range(4)]
        for i, name in enumerate(names):
            write_random_adapter(Path(tmp) / "adapters" / name, 16, base=base_shape_of(checkpoint[0]), seed=i)
        most = max(batches)
        cfg = EngineConfig(backend="triton", device="cpu", dtype=torch.bfloat16, weight_format="auto",
                           block_size=16, num_kv_blocks=most * 4 + 8, max_num_seqs=most,
                           max_num_batched_tokens=max(512, most * 16), max_loras=4, max_lora_rank=16)
        engine = LLMEngine(path, cfg, checkpoint=checkpoint, tokenizer=tokenizer,
                           adapter_source=LocalDirectoryAdapterSource(Path(tmp) / "adapters"))
        counter = _Counter()
        cases = []
        with instrumented(engine, counter):
            # Warm-up (not reported): first calls pay imports, the interpreter's rewrites, caches.
            run_case(engine, tokenizer, 1, [] if args.no_lora else names, 1, real_layers, counter)
            for b in batches:
                for lora in ((False,) if args.no_lora else (False, True)):
                    cases.append(run_case(engine, tokenizer, b, names if lora else [], args.steps, real_layers,
                                          counter))
    import triton

    real_counts = real_shape_launches(real, batches, not args.no_lora)
    for case in cases:
        c = case["decode_counts"]
        triton_real = real_counts[(case["batch"], case["lora"])]
        n = sum(triton_real.values())
        outside = (sum(c["triton_outside_layers"].values()) + sum(c["triton_elsewhere"].values())
                   + sum(c["torch_in_model_outside_layers"].values()))
        c["real_shape_triton_per_layer_by_kernel"] = triton_real
        c["real_shape_kernels_per_layer"] = n + c["torch_per_layer"]
        c["real_shape_kernels_per_step"] = round(real_layers * (n + c["torch_per_layer"]) + outside, 1)

    out = {"tool": "bench/step_model.py", "model": tiny, "tiny_layers": checkpoint[0].num_layers,
           "scaled_to_layers": real_layers, "scaled_from": real, "triton": triton.__version__,
           "torch": torch.__version__, "cases": cases, "seconds": round(time.perf_counter() - t_start, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

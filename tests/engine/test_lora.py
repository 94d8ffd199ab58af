"""Multi-LoRA serving: PEFT-exact logits, mixed batches, tiers, versions, and broken adapters."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.lora.source import LocalDirectoryAdapterSource
from engine.model.attention import AttentionMetadata, KVCache, PrefillChunk
from engine.sampling_params import GenerationRequest, SamplingParams
from tests.requirements import require_c_compiler

from .conftest import chat
from .helpers import PROMPTS
from .lora_fixtures import write_random_adapter

DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"
DEMO_NAMES = sorted(p.name for p in DEMO.iterdir() if (p / "adapter_config.json").is_file()) if DEMO.is_dir() else []


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for name in DEMO_NAMES:
        shutil.copytree(DEMO / name, root / name)
    for i, r in enumerate((1, 8, 16, 64)):
        write_random_adapter(root / f"rand-r{r}", r, seed=i)
    write_random_adapter(root / "attn-only-r4", 4, targets=("q_proj", "v_proj"), seed=7, std=0.05)
    write_random_adapter(root / "mlp-only-r32", 32, targets=("gate_proj", "up_proj", "down_proj"), seed=8)
    write_random_adapter(root / "rslora-r8", 8, seed=9, extra_config={"use_rslora": True})
    return root


@pytest.fixture(scope="module")
def lora_engine(make_engine, adapter_root):
    return make_engine(LocalDirectoryAdapterSource(adapter_root), max_loras=8, max_lora_rank=64)


def _engine_logits(engine, ids, version):
    """One prefill of `ids` through the engine's LoRA path (slot for `version`)."""
    from engine.scheduler import ScheduledSequence, SchedulerOutput

    seq = engine.add_request(GenerationRequest(f"logits-{version}", prompt_token_ids=ids, adapter=version,
                                               params=SamplingParams(max_tokens=1, temperature=0)))
    engine.lora_manager.wait_loaded(version)
    assert engine.lora_manager.load_error(version) is None
    engine.scheduler.waiting.remove(seq)
    try:
        cfg = engine.model_config
        T = len(ids)
        kv = KVCache(cfg.num_layers, -(-T // 16), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        meta = AttentionMetadata(torch.arange(T), 0, None, None, [PrefillChunk(0, T, T, None, None)])
        sched = SchedulerOutput(prefills=[ScheduledSequence(seq, T)])
        lora = engine.lora_manager.batch_for(sched)
        return engine.model.compute_logits(engine.model(torch.tensor(ids), torch.arange(T), kv, meta, lora))
    finally:
        engine.abort(seq.request_id)


@pytest.mark.parametrize("version", DEMO_NAMES + ["rand-r1", "rand-r8", "rand-r16", "rand-r64", "attn-only-r4", "rslora-r8"])
def test_logits_match_peft(lora_engine, hf_model, tokenizer, adapter_root, version):
    peft = pytest.importorskip("peft")
    ids = tokenizer.encode(chat(tokenizer, "What is the capital of France?"))
    ours = _engine_logits(lora_engine, ids, version)
    model = peft.PeftModel.from_pretrained(hf_model, str(adapter_root / version))
    try:
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float()
            with model.disable_adapter():
                plain = model(torch.tensor([ids])).logits[0].float()
    finally:
        model.unload()  # restore the shared HF model
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-3, f"{version}: relative error {rel:.2e}"
    assert (ref - plain).abs().max() > 10 * (ours - ref).abs().max(), "the adapter must change the logits"


def _greedy(rid, prompt, adapter, n=12):
    return GenerationRequest(rid, prompt=prompt, adapter=adapter,
                             params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def test_mixed_batch_of_24_over_8_adapters_equals_alone(lora_engine, adapter_root):
    versions = (DEMO_NAMES + ["rand-r1", "rand-r8", "rand-r16", "rand-r64", "attn-only-r4", "mlp-only-r32", "rslora-r8"])[:8]
    reqs = []
    for i in range(24):
        adapter = None if i % 9 == 8 else versions[i % len(versions)]
        reqs.append(_greedy(f"m{i}", PROMPTS[i % len(PROMPTS)], adapter))
    alone = {r.request_id: lora_engine.generate([_greedy("solo", r.prompt, r.adapter)])["solo"].token_ids for r in reqs}
    together = lora_engine.generate(reqs)
    for r in reqs:
        assert together[r.request_id].token_ids == alone[r.request_id], (r.request_id, r.adapter)
    assert lora_engine.block_manager.num_free_blocks == lora_engine.block_manager.num_blocks


def test_adapters_change_behaviour_and_base_is_untouched(lora_engine, tokenizer):
    if "json-answer" not in DEMO_NAMES:
        pytest.skip("demo adapters not trained")
    prompt = chat(tokenizer, "What is the capital of France?")
    outs = lora_engine.generate([GenerationRequest("j", prompt=prompt, adapter="json-answer", params=SamplingParams(max_tokens=32, temperature=0)),
                                 GenerationRequest("b", prompt=prompt, params=SamplingParams(max_tokens=32, temperature=0))])
    assert json.loads(outs["j"].text)["answer"]
    assert "Paris" in outs["b"].text and not outs["b"].text.startswith("{")


def test_evicted_and_reloaded_adapter_gives_identical_output(make_engine, adapter_root):
    # Two slots and a CPU tier that holds about one rank-16 adapter: everything gets evicted.
    e = make_engine(LocalDirectoryAdapterSource(adapter_root), max_loras=2, max_lora_rank=64,
                    lora_cpu_cache_bytes=8 << 20)
    first = e.generate([_greedy("a1", PROMPTS[0], "rand-r16")])["a1"].token_ids
    for v in ("rand-r8", "rand-r64", "rslora-r8", "mlp-only-r32"):
        e.generate([_greedy(f"x-{v}", PROMPTS[1], v)])
    assert e.lora_manager.stats["evictions"] > 0
    again = e.generate([_greedy("a2", PROMPTS[0], "rand-r16")])["a2"].token_ids
    assert again == first
    assert e.lora_manager.stats["cpu_misses"] >= 6  # rand-r16 was fetched twice


def test_new_version_serves_new_weights(lora_engine, adapter_root):
    write_random_adapter(adapter_root / "tenant-x-v1", 8, seed=100, std=0.05)
    out1 = lora_engine.generate([_greedy("v1", PROMPTS[2], "tenant-x-v1")])["v1"].token_ids
    write_random_adapter(adapter_root / "tenant-x-v2", 8, seed=200, std=0.05)
    out2 = lora_engine.generate([_greedy("v2", PROMPTS[2], "tenant-x-v2")])["v2"].token_ids
    again1 = lora_engine.generate([_greedy("v1b", PROMPTS[2], "tenant-x-v1")])["v1b"].token_ids
    assert out1 != out2
    assert again1 == out1


def test_broken_adapters_fail_only_their_requests(lora_engine, adapter_root):
    bad = adapter_root / "corrupt"
    bad.mkdir(exist_ok=True)
    shutil.copy(adapter_root / "rand-r8" / "adapter_config.json", bad / "adapter_config.json")
    (bad / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 100)
    write_random_adapter(adapter_root / "dora", 4, seed=3, extra_config={"use_dora": True})
    reqs = [_greedy("ok", PROMPTS[0], "rand-r8"), _greedy("base", PROMPTS[1], None),
            _greedy("c", PROMPTS[2], "corrupt"), _greedy("d", PROMPTS[3], "dora"),
            _greedy("missing", PROMPTS[4], "no-such-version")]
    outs = lora_engine.generate(reqs)
    assert outs["ok"].finish_reason == "length" and outs["base"].finish_reason == "length"
    assert outs["c"].finish_reason == "error" and "corrupt" in outs["c"].error
    assert outs["d"].finish_reason == "error" and "DoRA" in outs["d"].error
    assert outs["missing"].finish_reason == "error" and "not found" in outs["missing"].error
    assert lora_engine.block_manager.num_free_blocks == lora_engine.block_manager.num_blocks


def test_decode_tokens_run_in_adapter_slot_order(lora_engine, monkeypatch):
    """Each step's decodes are ordered by slot (no adapter first), so each adapter's tokens are
    one contiguous run for the LoRA path; outputs do not depend on the order (tested above)."""
    manager = lora_engine.lora_manager
    seen: list[list[int]] = []
    original = manager.batch_for

    def recording(sched):
        batch = original(sched)
        if batch is not None and sched.decodes:
            seen.append(batch.meta.token_slots[:len(sched.decodes)].tolist())
        return batch

    monkeypatch.setattr(manager, "batch_for", recording)
    adapters = [None, "rand-r8", "rand-r1", "rand-r8", None, "rand-r1"]
    lora_engine.generate([_greedy(f"ord{i}", PROMPTS[i], a, n=4) for i, a in enumerate(adapters)])
    assert seen, "no decode step had adapters"
    assert any(len(set(s)) > 2 for s in seen)
    for slots in seen:
        assert slots == sorted(slots)


@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_compact_adapter_storage_keeps_the_adapters_effect(make_engine, tokenizer, lora_engine, adapter_root,
                                                           lora_dtype):
    """The measured ("auto") format stores adapters as int8 rows with fp32 scales where the C LoRA
    kernel reads them (a quarter of fp32's bytes, which a many-adapter decode step is bound by);
    the exact format keeps fp32. On the exact base, bf16 and int8 adapters stay within 1e-3 and
    3e-3 (relative to the largest logit) of fp32 ones, far below the adapter's own effect."""
    from punica_kernels import cpu_native

    assert lora_engine.lora_manager.slots.a[(0, "q")].dtype == torch.float32
    require_c_compiler()
    assert cpu_native.library() is not None, "the C LoRA kernel did not build although a C compiler is here"
    auto = make_engine(LocalDirectoryAdapterSource(adapter_root), weight_format="auto", max_lora_rank=64)
    assert auto.lora_manager.slots.a[(0, "q")].dtype == torch.int8
    compact = make_engine(LocalDirectoryAdapterSource(adapter_root), max_lora_rank=64, lora_dtype=lora_dtype)
    ids = tokenizer.encode(chat(tokenizer, "What is the capital of France?"))
    bound = {torch.bfloat16: 1e-3, torch.int8: 3e-3}[lora_dtype]
    for version in ("rand-r16", "mlp-only-r32"):
        ours, ref = _engine_logits(compact, ids, version), _engine_logits(lora_engine, ids, version)
        base = lora_engine.model.compute_logits(lora_engine.model(
            torch.tensor(ids), torch.arange(len(ids)),
            KVCache(lora_engine.model_config.num_layers, -(-len(ids) // 16), 16, lora_engine.model_config.num_kv_heads,
                    lora_engine.model_config.head_dim, torch.float32),
            AttentionMetadata(torch.arange(len(ids)), 0, None, None, [PrefillChunk(0, len(ids), len(ids), None, None)])))
        err = (ours - ref).abs().max()
        assert err < bound * ref.abs().max(), version
        assert (ref - base).abs().max() > 10 * err, version


def test_int8_adapters_batched_equal_alone_through_slot_reuse(make_engine, adapter_root):
    """int8 adapter storage (the measured format's default): a mixed batch over adapters of
    ranks 1 to 64 gives each request the tokens it gets alone, through two slots that every
    adapter passes through in turn (each slot rewritten at another rank: B rows packed at the
    new rank), with adapters evicted from the CPU tier and loaded again along the way."""
    e = make_engine(LocalDirectoryAdapterSource(adapter_root), max_loras=2, max_lora_rank=64,
                    lora_dtype=torch.int8, lora_cpu_cache_bytes=8 << 20)
    assert e.lora_manager.slots.b[(0, "q")].dtype == torch.int8
    versions = ["rand-r64", "rand-r1", "mlp-only-r32", "rand-r16", "attn-only-r4", None]
    reqs = [_greedy(f"q{i}", PROMPTS[i % len(PROMPTS)], versions[i % len(versions)], n=6) for i in range(9)]
    alone = {r.request_id: e.generate([_greedy("solo", r.prompt, r.adapter, n=6)])["solo"].token_ids for r in reqs}
    together = e.generate(reqs)
    for r in reqs:
        assert together[r.request_id].token_ids == alone[r.request_id], (r.request_id, r.adapter)
    assert e.lora_manager.stats["evictions"] > 0 and e.lora_manager.stats["slot_loads"] > len(versions)
    assert len({tuple(t) for t in alone.values()}) > 3  # the adapters do change the outputs

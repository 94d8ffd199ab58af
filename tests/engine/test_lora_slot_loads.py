"""Slot loads from prepared images (engine.lora.layers.SlotImage): a staged write fills a slot
exactly as copying the adapter tensor by tensor does, a rewritten slot computes only its new
adapter, off the host a load is one host-to-device transfer, and mismatched images are refused
before anything is written."""
import pytest
import torch

import punica_kernels
from engine.config import ModelConfig
from engine.lora.layers import LoRASlots
from engine.lora.manager import LoRAManager
from engine.lora.source import LocalDirectoryAdapterSource
from engine.lora.weights import GROUPS, base_shape_of, load_lora_weights

from .lora_fixtures import write_random_adapter

DTYPES = [torch.float32, torch.bfloat16, torch.int8]
MAX_RANK = 16


def _cfg(fused: bool = False) -> ModelConfig:
    """A small decoder (odd widths on purpose), with Phi-3's fused projections when `fused`."""
    return ModelConfig(name="tiny-phi3" if fused else "tiny-llama", architecture="phi3" if fused else "llama",
                       num_layers=3, hidden_size=72, intermediate_size=88, num_heads=6, num_kv_heads=2, head_dim=12,
                       vocab_size=64, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       fused_projections=fused)


#: name -> (rank, targets, rank_pattern): mixed ranks, partial targets (k and every MLP module left
#: out), per-layer ranks, and a rank-pattern module above the adapter's default rank.
ADAPTERS = {
    "all-r16": (16, None, None),
    "qv-r4": (4, ("q_proj", "v_proj"), None),
    "pattern": (8, ("q_proj", "k_proj", "o_proj", "down_proj"),
                {"q_proj": 2, r"model\.layers\.1\.mlp\.down_proj": 16, r"model\.layers\.0\.self_attn\.o_proj": 3}),
}
FUSED_ADAPTERS = {
    "fused-r8": (8, None, None),
    "fused-pattern": (4, ("qkv_proj", "down_proj"), {r"model\.layers\.2\.self_attn\.qkv_proj": 12}),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(root, {name: ModelConfig}) of the adapters above, for the plain and the fused decoder."""
    root = tmp_path_factory.mktemp("slot_loads")
    cfgs = {}
    for fused, table in ((False, ADAPTERS), (True, FUSED_ADAPTERS)):
        cfg = _cfg(fused)
        for seed, (name, (rank, targets, pattern)) in enumerate(table.items()):
            write_random_adapter(root / name, rank, targets=targets, rank_pattern=pattern, seed=seed,
                                 base=base_shape_of(cfg), alpha_pattern={"q_proj": 3} if name == "pattern" else None)
            cfgs[name] = cfg
    return root, cfgs


def _load(adapters, name, dtype):
    root, cfgs = adapters
    return load_lora_weights(root / name, name, cfgs[name], max_rank=MAX_RANK, dtype=dtype)


def _write_per_tensor(slots: LoRASlots, slot: int, w) -> None:
    """The reference: each (layer, module)'s A, B (and int8 row scales) copied on its own, its
    padding up to its group's rank zeroed, a module the adapter does not target zeroed whole."""
    for (layer, group), row in slots.row_of.items():
        rg = w.group_rank.get((layer, group), 0)
        slots.ranks[row, slot] = rg
        slots.scales[row, slot] = w.group_scale.get((layer, group), 0.0)
        for m in GROUPS[group]:
            key = (layer, m)
            a, b = slots.a[key], slots.b[key]
            if key not in w.a:
                a[slot].zero_()
                b[slot].zero_()
                if slots.quantized:
                    slots.a_rs[key][slot].zero_()
                    slots.b_rs[key][slot].zero_()
                continue
            rm = w.a[key].shape[0]
            a[slot, :rm].copy_(w.a[key])
            a[slot, rm:rg].zero_()
            if slots.quantized:
                padded = torch.zeros(b.shape[1], rg, dtype=torch.int8)
                padded[:, :rm] = w.b[key]
                punica_kernels.int8_b_write(b, slot, padded)
                slots.a_rs[key][slot, :rm].copy_(w.a_scale[key])
                slots.a_rs[key][slot, rm:rg].zero_()
                slots.b_rs[key][slot].copy_(w.b_scale[key])
            else:
                b[slot, :, :rm].copy_(w.b[key])
                b[slot, :, rm:rg].zero_()


def _assert_same_slots(got: LoRASlots, want: LoRASlots) -> None:
    assert torch.equal(got.ranks.cpu(), want.ranks) and torch.equal(got.scales.cpu(), want.scales)
    for name in ("a", "b", "a_rs", "b_rs"):
        wanted = getattr(want, name)
        assert getattr(got, name).keys() == wanted.keys()
        for key, t in wanted.items():
            assert torch.equal(getattr(got, name)[key].cpu(), t), (name, key)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_staged_write_fills_the_slots_as_the_per_tensor_write(adapters, dtype, fused):
    names = list(FUSED_ADAPTERS if fused else ADAPTERS)
    cfg = _cfg(fused)
    staged, reference = LoRASlots(cfg, 4, MAX_RANK, dtype), LoRASlots(cfg, 4, MAX_RANK, dtype)
    for slot, name in enumerate(names + names[:1]):  # the last slot: the first adapter again
        w = _load(adapters, name, dtype)
        assert staged.write(slot, staged.prepare(w)) == 0  # on the host: no transfer
        _write_per_tensor(reference, slot, w)
    assert staged.rank_in(0, 0, "gate_up") == (8 if fused else 16) and staged.rank_in(1, 0, "gate_up") == 0
    _assert_same_slots(staged, reference)


@pytest.mark.parametrize("name", ["all-r16", "qv-r4", "fused-r8"])
def test_an_image_is_the_size_of_the_adapter_not_of_the_slot(adapters, name):
    """An adapter of one rank takes its own bytes in the CPU tier (plus ranks, scales and
    alignment), not max_rank's, nor a copy per slice of Phi-3's one qkv_proj A."""
    cfg = adapters[1][name]
    slots = LoRASlots(cfg, 2, 4 * MAX_RANK, torch.bfloat16)
    w = _load(adapters, name, torch.bfloat16)
    image = slots.prepare(w)
    assert w.nbytes <= image.nbytes < w.nbytes + 16 * 1024
    if cfg.fused_projections:
        assert len({s.offset for s in image.sections if s.kind == "a" and s.module in GROUPS["qkv"]}) == 1


def _lora_outputs(slots: LoRASlots, slot: int, impl: str | None = None, layers=None) -> dict:
    """add_lora's output for every (layer, group) of a batch of one base token and three of `slot`."""
    g = torch.Generator().manual_seed(0)
    x_dtype = torch.bfloat16 if slots.dtype == torch.bfloat16 and impl == "triton" else torch.float32
    meta = punica_kernels.build_lora_metadata([-1, slot, slot, slot], num_slots=slots.num_slots, device=slots.device)
    out = {}
    for (layer, group), stack in slots.stacks.items():
        if layers is not None and layer not in layers:
            continue
        width = stack.min_out_width
        x = torch.randn(4, stack.in_features, generator=g).to(slots.device, x_dtype)
        y = torch.randn(4, width, generator=g).to(slots.device, x_dtype)
        out[(layer, group)] = punica_kernels.add_lora(y, x, stack, meta=meta, impl=impl)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rewritten_slot_computes_only_its_new_adapter(adapters, dtype):
    """Slot 0 first holds the rank-16 all-module adapter, then adapters of smaller and per-layer
    ranks that leave modules out: each time the slot's LoRA outputs equal a fresh slot's holding
    only the new adapter, and the rows its kernels read past a module's own rank are zero."""
    cfg = _cfg()
    rewritten = LoRASlots(cfg, 2, MAX_RANK, dtype)
    rewritten.write(0, _load(adapters, "all-r16", dtype))
    for name in ("pattern", "qv-r4"):
        w = _load(adapters, name, dtype)
        rewritten.write(0, rewritten.prepare(w))
        fresh = LoRASlots(cfg, 2, MAX_RANK, dtype)
        fresh.write(0, w)
        got, want = _lora_outputs(rewritten, 0), _lora_outputs(fresh, 0)
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)
        for (layer, group), row in rewritten.row_of.items():
            rg = int(rewritten.ranks[row, 0])
            for m in GROUPS[group]:
                rm = w.a[(layer, m)].shape[0] if (layer, m) in w.a else 0
                assert not rewritten.a[(layer, m)][0, rm:rg].any(), (name, layer, m)
                b = (punica_kernels.int8_b_read(rewritten.b[(layer, m)], 0, rg) if dtype == torch.int8
                     else rewritten.b[(layer, m)][0, :, :rg])
                assert not b[:, rm:].any(), (name, layer, m)
    assert rewritten.rank_in(0, 0, "o") == 0 and rewritten.rank_in(0, 0, "qkv") == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_kernels_read_a_rewritten_slot_as_a_fresh_one(adapters, dtype, device):
    """The same through the Triton kernels (the CUDA path's; here the interpreter on CPU)."""
    cfg = _cfg()
    rewritten, fresh = LoRASlots(cfg, 2, MAX_RANK, dtype, device), LoRASlots(cfg, 2, MAX_RANK, dtype, device)
    rewritten.write(1, _load(adapters, "all-r16", dtype))
    w = _load(adapters, "pattern", dtype)
    rewritten.write(1, rewritten.prepare(w))
    fresh.write(1, w)
    got = _lora_outputs(rewritten, 1, impl="triton", layers={0, 1})
    want = _lora_outputs(fresh, 1, impl="triton", layers={0, 1})
    for key in want:
        assert torch.equal(got[key].cpu(), want[key].cpu()), key


def test_an_image_for_other_slots_or_of_the_wrong_dtype_is_refused_before_any_write(adapters):
    cfg = _cfg()
    slots = LoRASlots(cfg, 2, MAX_RANK, torch.float32)
    slots.write(1, _load(adapters, "qv-r4", torch.float32))
    before = {k: t.clone() for k, t in slots.a.items()}, slots.ranks.clone()
    other = LoRASlots(cfg, 2, 2 * MAX_RANK, torch.float32)
    with pytest.raises(ValueError, match="prepared for slots of another"):
        slots.write(1, other.prepare(_load(adapters, "all-r16", torch.float32)))
    with pytest.raises(ValueError, match="is int8 but the slots are not"):
        slots.write(1, _load(adapters, "all-r16", torch.int8))
    small = LoRASlots(cfg, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="rank 16, above the slots' 8"):
        small.prepare(_load(adapters, "all-r16", torch.float32))
    assert all(torch.equal(slots.a[k], t) for k, t in before[0].items()) and torch.equal(slots.ranks, before[1])


class _Backend:
    """The part of a backend the manager uses, on `device`; the step's batch is the slot map."""

    def __init__(self, device):
        self.device = torch.device(device)

    def lora_dtype(self):
        return torch.bfloat16

    def lora_batch(self, slots, sched, slot_of):
        return slot_of


class _Seq:
    def __init__(self, adapter):
        self.adapter = adapter


class _Scheduled:
    def __init__(self, *adapters):
        self.decodes = []
        self.prefills = [type("Chunk", (), {"seq": _Seq(a)})() for a in adapters]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_slot_load_is_one_host_to_device_transfer(adapters, device):
    """Off the host (the meta device stands in for CUDA here) each slot load copies its image with
    one transfer; on the host it copies from the image in place, with none."""
    root, _ = adapters
    manager = LoRAManager(LocalDirectoryAdapterSource(root), _cfg(), num_slots=2, max_rank=MAX_RANK,
                          cpu_budget_bytes=1 << 30, backend=_Backend(device))
    try:
        names = ["all-r16", "qv-r4", "pattern"]
        for name in names:
            manager.request_adapter(name)
            manager.wait_loaded(name)
            assert manager.is_ready(name)
        # Three adapters through two slots: the third load and the first one's reload evict.
        for step in (["all-r16", "qv-r4"], ["pattern"], ["all-r16"], ["all-r16", "pattern"]):
            assert set(manager.batch_for(_Scheduled(*step))) == set(step)
        loads = manager.stats["slot_loads"]
        assert loads == 4 and manager.stats["slot_hits"] == 2
        assert manager.stats["slot_load_transfers"] == (0 if device == "cpu" else loads)
    finally:
        manager.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_cuda_slot_load_copies_a_pinned_image_asynchronously(adapters, dtype):
    cfg = _cfg()
    on_gpu, on_host = LoRASlots(cfg, 3, MAX_RANK, dtype, "cuda"), LoRASlots(cfg, 3, MAX_RANK, dtype)
    for slot, name in enumerate(["all-r16", "pattern", "qv-r4"]):
        w = _load(adapters, name, dtype)
        image = on_gpu.prepare(w)
        assert image.buffer.is_pinned()
        n = image.nbytes  # what the CPU tier counts: the pinned allocator's power-of-two block
        assert n >= image.buffer.numel() and n & (n - 1) == 0
        assert on_gpu.write(slot, image) == 1
        del image  # the pinned block stays reserved until its copy is done
        on_host.write(slot, w)
    on_gpu.write(0, _load(adapters, "qv-r4", dtype))  # a rewrite, staged behind the first loads
    on_host.write(0, _load(adapters, "qv-r4", dtype))
    _assert_same_slots(on_gpu, on_host)


def test_the_loader_threads_run_torch_ops_on_themselves(adapters):
    """The adapter loaders are serial threads (engine.omp_threads): a load's torch ops open no
    OpenMP pool beside the step thread's."""
    from engine import omp_threads
    if omp_threads._libgomp() is None:
        pytest.skip("torch's OpenMP runtime is not libgomp")
    root, _ = adapters
    manager = LoRAManager(LocalDirectoryAdapterSource(root), _cfg(), num_slots=2, max_rank=MAX_RANK,
                          cpu_budget_bytes=1 << 30, backend=_Backend("cpu"))
    try:
        manager.request_adapter("all-r16")
        manager.wait_loaded("all-r16")
        assert manager._pool.submit(omp_threads.max_threads).result() == 1
    finally:
        manager.shutdown()

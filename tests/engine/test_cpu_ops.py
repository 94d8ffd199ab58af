"""The C decode-step ops (engine.backends.cpu.decode_ops) against float64 references and against the torch
path they replace: RMSNorm, residual + RMSNorm, SwiGLU gate, and decode attention over a paged
cache (RoPE, cache write, GQA attention reading only each sequence's own slots)."""
import pytest
import torch

from engine.backends.cpu import decode_ops as cpu_ops
from engine.backends.cpu import CpuBackend
from engine.config import EngineConfig
from engine.model.attention import AttentionMetadata, AttentionSpec
from engine.model.layers import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("needs_c_compiler")  # missing: skip, or fail under CI=true


def _rms_ref(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("m,h", [(1, 576), (3, 577), (9, 64), (33, 1000)])
def test_norms_and_gate_match_float64(m, h):
    g = torch.Generator().manual_seed(m * h)
    x, a, w = torch.randn(m, h, generator=g), torch.randn(m, h, generator=g), torch.randn(h, generator=g)
    got = cpu_ops.rms_norm(x, w, 1e-5)
    assert torch.allclose(got.double(), _rms_ref(x, w, 1e-5), rtol=1e-5, atol=1e-6)

    resid = x.clone()
    h_out = cpu_ops.add_rms_norm(resid, a, w, 1e-5)
    assert torch.allclose(resid.double(), x.double() + a.double(), rtol=1e-6, atol=1e-6)  # x += a, in place
    assert torch.allclose(h_out.double(), _rms_ref(x + a, w, 1e-5), rtol=1e-5, atol=1e-6)

    gu = torch.randn(m, 2 * h, generator=g) * 4
    gate, up = gu.double().split(h, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert torch.allclose(cpu_ops.silu_mul(gu).double(), want, rtol=1e-5, atol=1e-5)


def test_ops_decline_what_they_cannot_take():
    assert cpu_ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), 1e-5) is None
    assert cpu_ops.silu_mul(torch.randn(4, 8).t()) is None  # not contiguous


def _paged_case(lens, hq=9, hkv=3, d=64, block=16, seed=0):
    """A cache with each sequence's blocks scattered over the pool; unused rows are NaN, so a
    read outside a sequence's own slots shows up in the output."""
    g = torch.Generator().manual_seed(seed)
    nd = len(lens)
    blocks_needed = [-(-n // block) for n in lens]
    pool = torch.randperm(sum(blocks_needed) + 5, generator=g)
    tables, i = [], 0
    for n in blocks_needed:
        tables.append(pool[i:i + n])
        i += n
    slots_total = (sum(blocks_needed) + 5) * block
    k_cache = torch.full((slots_total, hkv, d), float("nan"))
    v_cache = torch.full((slots_total, hkv, d), float("nan"))
    lmax = max(lens)
    slots = torch.zeros(nd, lmax, dtype=torch.int64)
    for t, (tb, n) in enumerate(zip(tables, lens)):
        pos = torch.arange(n)
        slots[t, :n] = tb[pos // block] * block + pos % block
        # cached history (positions < n - 1); the new token's row is written by the op
        k_cache[slots[t, :n - 1]] = torch.randn(n - 1, hkv, d, generator=g)
        v_cache[slots[t, :n - 1]] = torch.randn(n - 1, hkv, d, generator=g)
    qkv = torch.randn(nd, (hq + 2 * hkv) * d, generator=g)
    rope = RotaryEmbedding(d, 4096, 10000.0, torch.float32)
    positions = torch.tensor(lens) - 1
    cos_sin = rope.cos_sin(positions)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=slots.gather(1, positions[:, None]).squeeze(1), num_decode=nd,
                             decode_slots=slots, decode_mask=(torch.arange(lmax)[None, :] < lens_t[:, None])[:, None, None, :],
                             decode_lens=lens_t)
    return qkv, cos_sin, k_cache, v_cache, meta


def _reference(qkv, cos_sin, k_cache, v_cache, meta, hq, hkv, d, scale):
    """float64 math: rotate, then softmax(q k^T) v over each sequence's own slots."""
    nd = qkv.shape[0]
    q, k, v = qkv.double().split([hq * d, hkv * d, hkv * d], dim=-1)
    cos, sin = (c.double() for c in cos_sin)
    q = RotaryEmbedding.apply((cos, sin), q.view(nd, hq, d))
    k = RotaryEmbedding.apply((cos, sin), k.view(nd, hkv, d))
    v = v.view(nd, hkv, d)
    outs = []
    for t in range(nd):
        n = int(meta.decode_lens[t])
        ks = k_cache[meta.decode_slots[t, :n - 1]].double()
        vs = v_cache[meta.decode_slots[t, :n - 1]].double()
        ks, vs = torch.cat([ks, k[t:t + 1]]), torch.cat([vs, v[t:t + 1]])
        ks, vs = ks.repeat_interleave(hq // hkv, dim=1), vs.repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[t], ks) * scale, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, vs).reshape(-1))
    return torch.stack(outs), k, v


@pytest.mark.parametrize("lens", [[1], [17], [5, 40, 16, 33], list(range(1, 40, 3))])
def test_decode_attention_matches_float64_and_writes_the_cache(lens):
    hq, hkv, d, scale = 9, 3, 64, 64 ** -0.5
    qkv, cos_sin, k_cache, v_cache, meta = _paged_case(lens)
    want, k_rot, v_new = _reference(qkv, cos_sin, k_cache, v_cache, meta, hq, hkv, d, scale)
    out = torch.empty(len(lens), hq * d)
    assert cpu_ops.decode_attention(qkv, len(lens), hq, hkv, d, cos_sin[0], cos_sin[1], k_cache, v_cache,
                                    meta.decode_slots, meta.decode_lens, scale, out)
    assert torch.isfinite(out).all(), "read a slot outside a sequence's own context"
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(k_cache[meta.slot_mapping].double(), k_rot, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache[meta.slot_mapping], v_new.float())


def test_attention_with_and_without_the_kernel_agree():
    """The layer entry point gives the same output and cache through the C kernel and through
    torch's RoPE + gathers + SDPA (the fallback when the kernel is unavailable)."""
    hq, hkv, d, scale = 9, 3, 64, 64 ** -0.5
    lens = [3, 30, 18]
    qkv, cos_sin, k_cache, v_cache, meta = _paged_case(lens, seed=3)
    nan_free = torch.nan_to_num  # SDPA's masked gathers still read (and multiply by 0) the NaN padding
    k2, v2 = nan_free(k_cache.clone()), nan_free(v_cache.clone())
    spec = AttentionSpec(hq, hkv, d, scale)
    fast = CpuBackend(EngineConfig()).attention(qkv, None, cos_sin, k_cache, v_cache, meta, spec)
    slow = CpuBackend(EngineConfig(cpu_decode_ops=False)).attention(qkv, None, cos_sin, k2, v2, meta, spec)
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-5)
    assert torch.allclose(k_cache[meta.slot_mapping], k2[meta.slot_mapping], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32], ids=str)
def test_the_steps_lora_call_matches_add_lora(dtype, smollm_checkpoint):
    """The backend's per-step LoRA batch calls the C kernel directly (cpu_native.StepCall) and
    gives add_lora's own result, for every group of a layer, on a batch mixing the demo adapters
    and base tokens, and on a prompt longer than the kernel's fp32 runs (which add_lora's torch
    path serves)."""
    from pathlib import Path

    import punica_kernels
    from engine.backends.cpu import CpuLoRABatch
    from engine.lora.layers import LoRASlots
    from engine.lora.weights import GROUPS, load_lora_weights
    from engine.scheduler import SchedulerOutput

    demo = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"
    cfg = smollm_checkpoint[0]
    slots = LoRASlots(cfg, 3, 64, dtype)
    for i, name in enumerate(("json-answer", "pirate", "upper")):
        slots.write(i, load_lora_weights(demo / name, name, cfg, max_rank=64, dtype=dtype))
    g = torch.Generator().manual_seed(0)
    widths = {"qkv": (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), "o": (cfg.q_size, cfg.hidden_size),
              "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size), "down": (cfg.intermediate_size, cfg.hidden_size)}
    for token_slots in ([-1, 0, 0, 1, 2, 2, 2, -1, 1], [1] * 70 + [-1, 0]):
        batch = CpuLoRABatch(slots, token_slots, SchedulerOutput())  # the layout: unused here
        assert batch.native is not None
        for group in GROUPS:
            k, n = widths[group]
            x, y = torch.randn(len(token_slots), k, generator=g), torch.randn(len(token_slots), n, generator=g)
            want = punica_kernels.add_lora(y.clone(), x, slots.stacks[(3, group)], meta=batch.meta)
            got = y.clone()
            batch.apply(3, group, x, got)
            assert torch.equal(got, want) and not torch.equal(got, y), group

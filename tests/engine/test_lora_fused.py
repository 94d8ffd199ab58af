"""A LoRA adapter for a base with fused projections (Phi-3: qkv_proj, gate_up_proj), made by PEFT,
loads into the engine's canonical slots exactly: every slice gets the module's A and its own rows
of B, so the slices' outputs together are PEFT's scale * B @ (A @ x)."""
import pytest
import torch

from engine.loader.architectures import model_config_from_hf
from engine.lora.weights import GROUPS, AdapterLoadError, base_shape_of, load_lora_weights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FUSED_TARGETS = ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def phi3():
    """A tiny random Phi-3 (6 heads, 2 KV heads: q 96, k and v 32 each) and the engine's ModelConfig of it."""
    config = transformers.Phi3Config(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                                     num_key_value_heads=2, vocab_size=128, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config), model_config_from_hf(config.to_dict(), "tiny-phi3")


def _peft_adapter(model, path, **lora):
    """PEFT's LoRA on `model` with random A and B (not B = 0: the product must be non-trivial),
    saved to `path`; returns the PEFT model."""
    torch.manual_seed(1)
    lora_model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora))
    lora_model.save_pretrained(path)
    return lora_model


def _peft_delta(lora_model, layer: int, parent: str, module: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's own LoRA term of `parent`.`module` in `layer`: scaling * B @ (A @ x)."""
    block = lora_model.base_model.model.model.layers[layer]
    lin = getattr(getattr(block, parent), module)
    a, b = lin.lora_A["default"].weight, lin.lora_B["default"].weight
    return lin.scaling["default"] * (b @ (a @ x))


def _engine_delta(w, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
    """What the engine's slots add for (layer, group): group_scale * B_slice @ (A_slice @ x) per
    slice, the slices' rows in order (the fused layer's output layout)."""
    scale = w.group_scale[(layer, group)]
    return torch.cat([scale * (w.b[(layer, s)] @ (w.a[(layer, s)] @ x)) for s in GROUPS[group]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_fused_phi3_adapter_loads_exactly_into_the_canonical_slices(phi3, tmp_path, dtype):
    model, cfg = phi3
    lora_model = _peft_adapter(model, tmp_path, r=8, lora_alpha=16, target_modules=FUSED_TARGETS,
                               rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 64})
    w = load_lora_weights(tmp_path, "phi3-fused", cfg, max_rank=16, dtype=dtype)
    assert w.config.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    base = base_shape_of(cfg)
    for module in ("qkv_proj", "gate_up_proj"):  # every slice reads the module's whole A
        slices = [c for c, _ in base.module(module).slices]
        assert all(w.a[(0, c)] is w.a[(0, slices[0])] for c in slices)
    assert {s: tuple(w.b[(1, s)].shape) for s in ("q", "k", "v", "gate", "up")} == {
        "q": (96, 8), "k": (32, 8), "v": (32, 8), "gate": (128, 8), "up": (128, 8)}
    if dtype == torch.float32:  # the CPU tier's budget counts a shared A once: the file's own size
        from safetensors.torch import load_file
        assert w.nbytes == sum(t.numel() * 4 for t in load_file(str(tmp_path / "adapter_model.safetensors")).values())
    if dtype == torch.int8:  # rows quantized: dequantize before comparing
        w.a = {k: v.float() * w.a_scale[k][:, None] for k, v in w.a.items()}
        w.b = {k: v.float() * w.b_scale[k][:, None] for k, v in w.b.items()}
    g = torch.Generator().manual_seed(2)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # int8: rows at 1/127 of their largest entry
    with torch.no_grad():
        for layer in range(cfg.num_layers):
            for group, parent, module, fan_in in (("qkv", "self_attn", "qkv_proj", 96), ("o", "self_attn", "o_proj", 96),
                                                  ("gate_up", "mlp", "gate_up_proj", 96),
                                                  ("down", "mlp", "down_proj", 128)):
                x = torch.randn(fan_in, generator=g)
                want = _peft_delta(lora_model, layer, parent, module, x)
                got = _engine_delta(w, layer, group, x)
                assert got.shape == want.shape
                err = (got - want).abs().max() / want.abs().max()
                assert err < tolerance, (layer, module, float(err))


def test_q_proj_on_a_phi3_base_is_refused_naming_its_modules(phi3, tmp_path):
    """Targets of a Llama-layout adapter name modules a Phi-3 checkpoint does not have."""
    _, cfg = phi3
    (tmp_path / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterLoadError, match=r"target module 'q_proj' is not supported: tiny-phi3 \(phi3\) has no "
                                               r"such module \(q_proj is part of its fused qkv_proj\); its LoRA-able "
                                               r"modules are qkv_proj, o_proj, gate_up_proj, down_proj"):
        load_lora_weights(tmp_path, "wrong-layout", cfg, max_rank=16)

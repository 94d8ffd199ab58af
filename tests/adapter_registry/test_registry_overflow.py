"""Adapters whose tensors are finite but whose effect could overflow the engine's arithmetic are
rejected at upload, naming the module and the bound; real adapters pass with a wide margin."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from registry_helpers import write_adapter

from adapter_registry import services
from adapter_registry.errors import NotFound

DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"


@pytest.fixture
def reg(make_ctx):
    return make_ctx("sqlite")


def upload(ctx, path, *, name="bot", **kw):
    with ctx.session_factory() as s:
        try:
            tenant = services.get_tenant(session=s, name="acme")
        except NotFound:
            tenant = services.create_tenant(session=s, name="acme")
        return services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant,
                                       name=name, source=path, **kw)


@pytest.mark.parametrize("name", ["pirate", "upper", "json-answer"])
def test_demo_adapters_pass_even_with_a_ten_times_tighter_bound(make_ctx, name, tmp_path):
    """Their largest gain is ~18 against a limit of ~1024: still ready with activations planned
    up to 640 (a limit of ~102)."""
    if not (DEMO / name).is_dir():
        pytest.skip(f"demo adapter {name!r} is not there")
    ctx = make_ctx("sqlite", validation_activation_bound=640.0)
    v = upload(ctx, shutil.copytree(DEMO / name, tmp_path / name), name=name)
    assert v.status == "ready", v.rejection_reason


def test_a_peft_initialized_adapter_passes(reg, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.engine.lora_fixtures import SMOLLM2 as base

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=base.hidden_size, intermediate_size=base.intermediate_size, num_hidden_layers=base.num_layers,
        num_attention_heads=base.num_heads, num_key_value_heads=base.num_kv_heads, head_dim=base.head_dim,
        vocab_size=64))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "peft")
    v = upload(reg, tmp_path / "peft", base_model=base.name)
    assert v.status == "ready", v.rejection_reason


def test_a_huge_alpha_is_rejected_naming_the_module_and_the_bound(reg, tmp_path):
    d = write_adapter(tmp_path / "a", config_overrides={"lora_alpha": 1e30})
    v = upload(reg, d)
    assert v.status == "rejected"
    assert "LoRA module base_model.model.model.layers." in v.rejection_reason
    assert "could overflow" in v.rejection_reason and "exceeds the bound 1024" in v.rejection_reason
    assert "activations up to 64" in v.rejection_reason, v.rejection_reason


def test_rslora_scale_counts_too(reg, tmp_path):
    # r=4: alpha/sqrt(r) = 5e3, far beyond what alpha/r alone would flag at this alpha.
    d = write_adapter(tmp_path / "a", config_overrides={"lora_alpha": 1e4, "use_rslora": True})
    v = upload(reg, d)
    assert v.status == "rejected" and "= 5e+03 x" in v.rejection_reason, v.rejection_reason


def test_fp32_weights_beyond_fp16_range_are_rejected(reg, tmp_path):
    def huge(tensors):
        tensors["base_model.model.model.layers.7.self_attn.v_proj.lora_B.weight"][0, 0] = 1e30

    d = write_adapter(tmp_path / "a", dtype=torch.float32, tensors_hook=huge)
    v = upload(reg, d)
    assert v.status == "rejected"
    assert "layers.7.self_attn.v_proj.lora_B.weight" in v.rejection_reason
    assert "beyond the fp16 range" in v.rejection_reason, v.rejection_reason


def test_a_huge_scale_with_zero_b_is_still_refused(reg, tmp_path):
    """B = 0 makes every gain 0, but a scale beyond fp16 cannot be applied in fp16 arithmetic."""
    def zero_b(tensors):
        for k, t in tensors.items():
            if "lora_B" in k:
                t.zero_()

    d = write_adapter(tmp_path / "a", config_overrides={"lora_alpha": 1e30}, tensors_hook=zero_b)
    v = upload(reg, d)
    assert v.status == "rejected" and "scale (lora_alpha/r = 2.5e+29) is beyond the fp16 range" in v.rejection_reason


def test_bf16_weights_are_scanned(reg, tmp_path):
    def big(tensors):
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].fill_(4.0)
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].fill_(4.0)

    v = upload(reg, write_adapter(tmp_path / "a", dtype=torch.bfloat16, tensors_hook=big))
    assert v.status == "rejected" and "layers.0.self_attn.q_proj could overflow" in v.rejection_reason

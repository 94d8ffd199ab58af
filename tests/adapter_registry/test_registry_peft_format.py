"""engine.lora.peft_format: config parsing, tensor names and shapes, checked against real PEFT."""
from __future__ import annotations

import math

import pytest

from engine.lora.peft_format import (
    SMOLLM2_135M_INSTRUCT,
    BaseModelShape,
    UnsupportedAdapterError,
    check_not_pickle,
    expected_tensor_shapes,
    parse_adapter_config,
    parse_tensor_name,
    tensor_name,
)


def cfg(**kw):
    return {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none", **kw}


def test_rank_and_alpha_patterns_follow_peft_matching():
    """PEFT's rule: the first pattern whose `(.*\.)?(key)$` matches the module's full name."""
    c = parse_adapter_config(cfg(target_modules=["q_proj", "v_proj", "down_proj"],
                                 rank_pattern={"q_proj": 4, r"layers\.[0-3]\.mlp\.down_proj": 16},
                                 alpha_pattern={"v_proj": 40}), num_layers=30)
    assert c.module_rank(0, "q") == 4 and c.module_rank(2, "down") == 16 and c.module_rank(13, "down") == 8
    assert c.module_rank(0, "v") == 8 and c.module_alpha(0, "v") == 40 and c.module_alpha(0, "q") == 16
    assert c.module_scale(0, "v") == 5.0 and c.module_scale(0, "q") == 4.0
    assert c.largest_rank(30) == (16, 0, "down")


def test_parse_maps_hf_names_and_scale():
    c = parse_adapter_config(cfg(target_modules=["v_proj", "q_proj", "down_proj"]))
    assert c.target_modules == ("q", "v", "down") and c.scale == 2.0 and c.rank == 8
    assert parse_adapter_config(cfg(use_rslora=True)).scale == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize("targets, expected", [
    ("all-linear", ("q", "k", "v", "o", "gate", "up", "down")),
    (r".*\.(q_proj|k_proj)", ("q", "k")),
    (["self_attn.o_proj", "mlp.gate_proj", "up_proj"], ("o", "gate", "up")),
])
def test_target_module_forms(targets, expected):
    assert parse_adapter_config(cfg(target_modules=targets), num_layers=30).target_modules == expected


@pytest.mark.parametrize("override, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["score"]}, "modules_to_save"),
    ({"target_modules": ["embed_tokens"]}, "embedding/lm_head"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"layers_to_transform": [1]}, "selected layers"),
    ({"target_modules": r"model\.layers\.1\..*q_proj"}, "only some layers"),
    ({"peft_type": "IA3"}, "PEFT type 'IA3'"),
    ({"r": 0}, "positive integer"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
])
def test_unsupported_variants_name_what_is_unsupported(override, message):
    with pytest.raises(UnsupportedAdapterError, match=message):
        parse_adapter_config(cfg(**override), num_layers=30)


def test_pickle_files_are_refused_by_name():
    with pytest.raises(UnsupportedAdapterError, match="arbitrary code"):
        check_not_pickle("adapter_model.bin")
    check_not_pickle("adapter_model.safetensors")


def test_smollm2_shapes():
    shapes = expected_tensor_shapes(SMOLLM2_135M_INSTRUCT, parse_adapter_config(cfg(r=16, target_modules="all-linear")))
    assert len(shapes) == 30 * 7 * 2
    assert shapes[tensor_name(0, "q", "A")] == (16, 576)
    assert shapes[tensor_name(29, "k", "B")] == (192, 16)
    assert shapes[tensor_name(3, "down", "A")] == (16, 1536)
    assert shapes[tensor_name(3, "gate", "B")] == (1536, 16)
    assert parse_tensor_name(tensor_name(12, "up", "B")) == (12, "up", "B")
    with pytest.raises(UnsupportedAdapterError, match="unexpected tensor"):
        parse_tensor_name("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector")


def test_names_and_shapes_match_what_peft_saves(tmp_path):
    """A real PEFT LoRA on a tiny Llama: the keys and shapes PEFT saves are exactly ours."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors import safe_open

    base = BaseModelShape("tiny", hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    lora.save_pretrained(tmp_path)
    import json
    config = parse_adapter_config(json.loads((tmp_path / "adapter_config.json").read_text()), num_layers=2)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert saved == expected_tensor_shapes(base, config)

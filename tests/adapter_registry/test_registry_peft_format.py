"""engine.lora.peft_format: the served model's description, config parsing against it, tensor names
and shapes, checked against real PEFT on tiny transformers models of each layout."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from registry_helpers import GEMMA, PHI3, QWEN2

from engine.lora.peft_format import (
    BaseModelShape,
    ModuleNotInBase,
    UnsupportedAdapterError,
    check_not_pickle,
    expected_tensor_shapes,
    parse_adapter_config,
    parse_tensor_name,
    tensor_name,
)
from tests.engine.lora_fixtures import SMOLLM2, decoder_shape


def cfg(**kw):
    return {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none", **kw}


def test_rank_and_alpha_patterns_follow_peft_matching():
    r"""PEFT's rule: the first pattern whose `(.*\.)?(key)$` matches the module's full name."""
    c = parse_adapter_config(cfg(target_modules=["q_proj", "v_proj", "down_proj"],
                                 rank_pattern={"q_proj": 4, r"layers\.[0-3]\.mlp\.down_proj": 16},
                                 alpha_pattern={"v_proj": 40}), SMOLLM2)
    assert c.module_rank(0, "q_proj") == 4 and c.module_rank(2, "down_proj") == 16 and c.module_rank(13, "down_proj") == 8
    assert c.module_rank(0, "v_proj") == 8 and c.module_alpha(0, "v_proj") == 40 and c.module_alpha(0, "q_proj") == 16
    assert c.module_scale(0, "v_proj") == 5.0 and c.module_scale(0, "q_proj") == 4.0
    assert c.largest_rank(30) == (16, 0, "down_proj")


def test_rank_pattern_keys_name_the_fused_modules_of_a_phi3_base():
    c = parse_adapter_config(cfg(target_modules="all-linear", rank_pattern={"qkv_proj": 16, r"layers\.1\.mlp\.gate_up_proj": 4},
                                 alpha_pattern={"o_proj": 64}), PHI3)
    assert c.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert [c.module_rank(0, m) for m in c.target_modules] == [16, 8, 8, 8]
    assert c.module_rank(1, "gate_up_proj") == 4 and c.module_scale(0, "o_proj") == 8.0
    shapes = expected_tensor_shapes(PHI3, c)
    assert shapes[tensor_name(0, "self_attn", "qkv_proj", "B")] == (96 + 2 * 32, 16)  # q 96 + k 32 + v 32
    assert shapes[tensor_name(1, "mlp", "gate_up_proj", "B")] == (2 * 128, 4)


def test_parse_maps_checkpoint_names_and_scale():
    c = parse_adapter_config(cfg(target_modules=["v_proj", "q_proj", "down_proj"]), SMOLLM2)
    assert c.target_modules == ("q_proj", "v_proj", "down_proj") and c.scale == 2.0 and c.rank == 8
    assert parse_adapter_config(cfg(use_rslora=True), SMOLLM2).scale == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize("targets, expected", [
    ("all-linear", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (r".*\.(q_proj|k_proj)", ("q_proj", "k_proj")),
    (["self_attn.o_proj", "mlp.gate_proj", "up_proj"], ("o_proj", "gate_proj", "up_proj")),
])
def test_target_module_forms(targets, expected):
    assert parse_adapter_config(cfg(target_modules=targets), SMOLLM2).target_modules == expected


@pytest.mark.parametrize("targets, expected", [
    ("all-linear", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    (["qkv_proj", "gate_up_proj"], ("qkv_proj", "gate_up_proj")),
    (r".*\.(qkv|o)_proj", ("qkv_proj", "o_proj")),
])
def test_target_module_forms_on_a_fused_phi3_base(targets, expected):
    assert parse_adapter_config(cfg(target_modules=targets), PHI3).target_modules == expected


def test_a_module_the_base_does_not_have_is_refused_naming_the_base_modules():
    with pytest.raises(ModuleNotInBase) as e:
        parse_adapter_config(cfg(target_modules=["q_proj", "v_proj"]), PHI3)
    assert str(e.value) == ("target module 'q_proj' is not supported: microsoft/Phi-3-tiny-instruct (phi3) has no such "
                            "module (q_proj is part of its fused qkv_proj); its LoRA-able modules are qkv_proj, o_proj, "
                            "gate_up_proj, down_proj")
    with pytest.raises(ModuleNotInBase, match="target module 'qkv_proj' is not supported: SmolLM2-135M-Instruct"):
        parse_adapter_config(cfg(target_modules=["qkv_proj"]), SMOLLM2)


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
        parse_adapter_config(cfg(**override), SMOLLM2)


def test_pickle_files_are_refused_by_name():
    with pytest.raises(UnsupportedAdapterError, match="arbitrary code"):
        check_not_pickle("adapter_model.bin")
    check_not_pickle("adapter_model.safetensors")


def test_smollm2_shapes():
    shapes = expected_tensor_shapes(SMOLLM2, parse_adapter_config(cfg(r=16, target_modules="all-linear"), SMOLLM2))
    assert len(shapes) == 30 * 7 * 2
    assert shapes[tensor_name(0, "self_attn", "q_proj", "A")] == (16, 576)
    assert shapes[tensor_name(29, "self_attn", "k_proj", "B")] == (192, 16)
    assert shapes[tensor_name(3, "mlp", "down_proj", "A")] == (16, 1536)
    assert shapes[tensor_name(3, "mlp", "gate_proj", "B")] == (1536, 16)
    assert parse_tensor_name(tensor_name(12, "mlp", "up_proj", "B"), SMOLLM2) == (12, "up_proj", "B")
    with pytest.raises(UnsupportedAdapterError, match="unexpected tensor"):
        parse_tensor_name("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", SMOLLM2)
    with pytest.raises(ModuleNotInBase, match="is for module qkv_proj, which SmolLM2-135M-Instruct"):
        parse_tensor_name(tensor_name(0, "self_attn", "qkv_proj", "A"), SMOLLM2)


def test_widths_come_from_heads_and_head_dim():
    """Qwen2's k/v are narrower than q (grouped-query attention); Gemma's head_dim is not hidden /
    heads, so q is wider than hidden and o maps it back."""
    assert QWEN2.module_dims("q_proj") == (128, 128) and QWEN2.module_dims("k_proj") == (128, 32)
    assert QWEN2.module_text("k_proj") == "k_proj maps 128 -> 32 (2 KV heads x head dim 16)"
    assert GEMMA.module_dims("q_proj") == (64, 128) and GEMMA.module_dims("o_proj") == (128, 64)
    assert GEMMA.module_dims("v_proj") == (64, 64)
    assert PHI3.module("qkv_proj").slices == (("q", 96), ("k", 32), ("v", 32))
    assert PHI3.slice_dims("k") == (96, 32) and PHI3.slice_dims("up") == (96, 128)


@pytest.mark.parametrize("base", [SMOLLM2, QWEN2, GEMMA, PHI3], ids=lambda b: b.architecture)
def test_the_description_survives_a_json_round_trip(base):
    assert BaseModelShape.from_dict(json.loads(json.dumps(base.to_dict()))) == base


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("modules"), "has no 'modules'"),
    (lambda d: d.update(num_layers=0), "num_layers must be an integer"),
    (lambda d: d.update(num_layers=True), "num_layers must be an integer"),
    (lambda d: d["modules"][0].update(parent="attn"), "parent 'attn'"),
    (lambda d: d["modules"][0].update(name="q.proj"), "not a unique identifier"),
    (lambda d: d["modules"][1].update(name="qkv_proj"), "not a unique identifier"),
    (lambda d: d["modules"][0].update(out_features=97), "do not add up to its 97 output rows"),
    (lambda d: d["modules"][0].update(slices=[["z", 96], ["k", 32], ["v", 32]]), "names slice 'z'"),
    (lambda d: d["modules"][1].update(slices=[["q", 96]]), "covered twice"),
    (lambda d: d["modules"][0].update(slices="q"), "list of slices"),
])
def test_a_malformed_description_is_refused_naming_the_field(edit, message):
    data = PHI3.to_dict()
    edit(data)
    with pytest.raises(ValueError, match=message):
        BaseModelShape.from_dict(data)


def test_the_format_module_imports_without_torch():
    """The registry's validation child (1 GiB address space) imports it with numpy only."""
    code = ("import sys; import engine.lora.peft_format, adapter_registry.validation; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _saved_by_peft(model, target_modules, tmp_path, **lora) -> tuple[dict, dict]:
    peft = pytest.importorskip("peft")
    from safetensors import safe_open

    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, **lora)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return config, saved


def test_names_and_shapes_match_what_peft_saves(tmp_path):
    """A real PEFT LoRA on a tiny Llama: the keys and shapes PEFT saves are exactly ours."""
    transformers = pytest.importorskip("transformers")
    base = decoder_shape("tiny", layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128))
    config, saved = _saved_by_peft(model, "all-linear", tmp_path)
    assert saved == expected_tensor_shapes(base, parse_adapter_config(config, base))


def test_names_and_shapes_match_what_peft_saves_for_a_phi3_base(tmp_path):
    """The same on a tiny Phi-3 (fused qkv_proj and gate_up_proj), with a rank pattern on the fused
    attention projection."""
    transformers = pytest.importorskip("transformers")
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=128, pad_token_id=0))
    config, saved = _saved_by_peft(model, ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], tmp_path,
                                   rank_pattern={"qkv_proj": 8})
    parsed = parse_adapter_config(config, PHI3)
    assert parsed.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert saved == expected_tensor_shapes(PHI3, parsed)
    assert saved[tensor_name(0, "self_attn", "qkv_proj", "B")] == (160, 8)

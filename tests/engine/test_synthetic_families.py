"""Synthetic checkpoints of every family (engine/loader/synthetic.py FAMILIES): the tiny ones are
real Hugging Face directories (transformers loads model and tokenizer; the loader's tensors are
transformers' own) and real GGUF files (the same model and tokenizer through the GGUF loader);
the full-size ones parse at the real model's shape and hold its parameter count."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from engine.config import RopeConfig
from engine.loader import load_checkpoint
from engine.loader.architectures import model_config_from_hf
from engine.loader.gguf_writer import tokenizer_metadata_from_hf
from engine.loader.synthetic import (FAMILIES, family_config_json, family_gguf_config,
                                     family_plan_bytes, hf_plan, main, random_blocks, random_half, write_family)
from engine.model.rope import inv_freq
from engine.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

TINY = sorted(n for n in FAMILIES if n.endswith("-tiny"))
FULL = sorted(n for n in FAMILIES if not n.endswith("-tiny"))
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM"}


class Written:
    """One tiny family written both ways, and what transformers and the loader make of them."""

    def __init__(self, root, name):
        self.name = name
        self.dir = write_family(root / "hf", name, fmt="safetensors", seed=0)
        self.gguf = write_family(root / f"{name}.gguf", name, fmt="gguf", seed=0, quant="q4_0")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.bfloat16)
        self.hf_tokenizer = transformers.AutoTokenizer.from_pretrained(self.dir)
        self.hf = load_checkpoint(self.dir)
        self.gg = load_checkpoint(self.gguf)


@pytest.fixture(scope="module")
def written_by_name(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Written(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get


@pytest.fixture(params=TINY)
def written(request, written_by_name):
    return written_by_name(request.param)


def test_directory_is_a_transformers_checkpoint(written):
    cfg = written.hf[0]
    assert type(written.model).__name__ == MODEL_CLASSES[cfg.architecture]
    config = json.loads((written.dir / "config.json").read_text())
    assert config["_name_or_path"] == f"tessera-synthetic/{written.name}"
    assert len(written.hf_tokenizer) == cfg.vocab_size
    with torch.no_grad():
        logits = written.model(torch.tensor([written.hf_tokenizer("Paris is").input_ids])).logits
    assert logits.shape[-1] == cfg.vocab_size and torch.isfinite(logits).all()
    generation = json.loads((written.dir / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert set(eos if isinstance(eos, list) else [eos]) >= set(cfg.eos_token_ids)


def test_loader_tensors_are_transformers_state_dict(written):
    """load_checkpoint's tensors are transformers' weights after the contract's renaming: fused
    projections split, Gemma's stored w as the applied 1 + w."""
    cfg, tensors, _ = written.hf
    state = written.model.state_dict()
    seen = set()
    for name, t in state.items():
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name.endswith("qkv_proj.weight"):
            parts = zip("qkv", t.split([cfg.q_size, cfg.kv_size, cfg.kv_size]))
            pairs = [(name.replace("qkv_proj", f"{x}_proj"), p) for x, p in parts]
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            pairs = [(name.replace("gate_up_proj", "gate_proj"), gate), (name.replace("gate_up_proj", "up_proj"), up)]
        elif name.endswith("norm.weight") and cfg.architecture.startswith("gemma"):
            pairs = [(name, t.float() + 1)]
        else:
            pairs = [(name, t)]
        for key, want in pairs:
            assert torch.equal(tensors[key].to(want.dtype), want), key
            seen.add(key)
    assert seen == set(tensors)


def test_weights_have_the_planned_scale(written):
    """Layer weights std ~ 1/sqrt(fan_in), embeddings ~ 3/sqrt(hidden), zero mean; norms ones as
    applied: the activations of a random model stay O(1) through every layer."""
    cfg, tensors, _ = written.hf
    for name, t in tensors.items():
        t = t.float()
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith(".bias"):
            assert 0.015 < float(t.std()) < 0.025, name
        else:
            want = 3 / cfg.hidden_size ** 0.5 if "embed" in name or "lm_head" in name else t.shape[1] ** -0.5
            assert abs(float(t.std()) / want - 1) < 0.08 and abs(float(t.mean())) < 0.1 * want, name


def test_gguf_form_is_the_same_model(written):
    """The GGUF is the directory's model as llama.cpp would hold it: the same ModelConfig (its
    eos ids also generation_config's; llama3 scaling as frequency divisors)."""
    hf_cfg, gg_cfg = written.hf[0], written.gg[0]
    assert set(gg_cfg.eos_token_ids) >= set(hf_cfg.eos_token_ids)
    a = dataclasses.replace(hf_cfg, name="", eos_token_ids=())
    b = dataclasses.replace(gg_cfg, name="", eos_token_ids=())
    if hf_cfg.rope.rope_type == "llama3":
        want, _ = inv_freq(hf_cfg.rope, hf_cfg.head_dim, hf_cfg.max_position_embeddings)
        got, _ = inv_freq(gg_cfg.rope, gg_cfg.head_dim, gg_cfg.max_position_embeddings)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        a, b = dataclasses.replace(a, rope=RopeConfig()), dataclasses.replace(b, rope=RopeConfig())
    assert b == a
    assert set(gg_cfg.eos_token_ids) == set(family_gguf_config(written.name).eos_token_ids)


def test_gguf_blocks_are_the_seeded_ones(written):
    """Each quantized GGUF tensor is what random_blocks draws for (seed, its index in the plan)."""
    reader = GGUFReader(str(written.gguf))
    for index, t in enumerate(reader.tensors):
        if t.tensor_type.name not in ("Q4_0", "Q8_0"):
            continue
        rows, cols = (int(x) for x in reversed(t.shape.tolist()))
        data = np.asarray(t.data)
        std = 3 / written.hf[0].hidden_size ** 0.5 if t.name in ("token_embd.weight", "output.weight") else cols ** -0.5
        assert np.array_equal(data, random_blocks(t.tensor_type, rows, cols, std, 0, index)), t.name
    _, tensors, _ = written.gg
    w = tensors["model.layers.1.mlp.down_proj.weight"].dequantize()
    assert 0.8 < float(w.std()) * w.shape[1] ** 0.5 < 1.2


def test_tokenizer_forms_agree(written):
    """transformers' tokenizer of the directory, the GGUF's tokenizer and the one built from the
    directory's GGUF keys encode alike, render the same chat, and keep control tokens whole."""
    hf = written.hf_tokenizer
    from_gguf = TextTokenizer.from_gguf_metadata(written.gg[2])
    from_dir = TextTokenizer.from_gguf_metadata(tokenizer_metadata_from_hf(written.dir))
    text = "The capital of France is Paris. 42 ünïcödé, 日本語!\n  end"
    ids = hf(text).input_ids
    assert from_gguf.encode(text) == from_dir.encode(text) == ids
    assert from_gguf.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert text in from_gguf.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": "42"}, {"role": "user", "content": "Thanks"}]
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert from_gguf.apply_chat_template(msgs) == rendered
    chat_ids = from_gguf.encode_chat(msgs)
    assert chat_ids == hf(rendered, add_special_tokens=False).input_ids
    end = written.gg[2]["tokenizer.ggml.eos_token_id"]
    assert len(chat_ids) < len(rendered.encode()) and end in written.gg[0].eos_token_ids


def test_same_seed_same_files_other_seed_differs(tmp_path, written_by_name):
    first = written_by_name("qwen2.5-tiny")
    again = write_family(tmp_path / "again.gguf", "qwen2.5-tiny", quant="q4_0")
    other = write_family(tmp_path / "other.gguf", "qwen2.5-tiny", quant="q4_0", seed=1)
    assert again.read_bytes() == first.gguf.read_bytes() != other.read_bytes()
    hf_again = write_family(tmp_path / "hf", "qwen2.5-tiny", fmt="safetensors")
    assert (hf_again / "model.safetensors").read_bytes() == (first.dir / "model.safetensors").read_bytes()


def test_large_checkpoints_are_sharded(tmp_path, monkeypatch):
    """Above the shard size the weights split over files named by model.safetensors.index.json,
    which transformers and the loader both follow."""
    import engine.loader.synthetic as synthetic

    monkeypatch.setattr(synthetic, "SHARD_BYTES", 200_000)
    out = write_family(tmp_path / "hf", "gemma2-tiny", fmt="safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert all((out / f).stat().st_size <= 200_000 + 4096 for f in files[1:-1])
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    _, tensors, _ = load_checkpoint(out)
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"],
                       model.state_dict()["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_random_half_has_the_target_scale(fmt):
    bits = random_half(256, 4096, 0.0123, 7, 3, fmt)
    if fmt == "f16":
        w = bits.view(np.float16).astype(np.float64)
    else:
        w = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).double().numpy()
    assert abs(w.std() / 0.0123 - 1) < 0.03 and abs(w.mean()) < 1e-4
    assert np.array_equal(bits, random_half(256, 4096, 0.0123, 7, 3, fmt))


# ----------------------------------------------------------------------------- full size


#: The published models' token ids (config.json's bos, eos and pad).
PUBLISHED_IDS = {
    "llama3.1-8b": (128000, [128001, 128008, 128009], None),
    "qwen2.5-7b": (151643, 151645, None),
    "qwen3-8b": (151643, 151645, None),
    "mistral-7b": (1, 2, None),
    "gemma2-9b": (2, [1, 107], 0),
    "gemma3-1b": (2, [1, 106], 0),
    "phi3.5-mini": (1, 32000, 32000),
}


@pytest.mark.parametrize("name", FULL)
def test_full_size_families_have_the_real_shape(name):
    """Not written here (gigabytes): the config parses, the ids are the published ones, and the
    tensor plan holds the real model's parameter count (2 bytes each in bf16) within 2%."""
    config = family_config_json(name)
    cfg = model_config_from_hf(config, name)
    assert (config["bos_token_id"], config["eos_token_id"], config.get("pad_token_id")) == PUBLISHED_IDS[name]
    params = FAMILIES[name].params
    assert abs(family_plan_bytes(name, "safetensors") / (2 * params) - 1) < 0.02
    assert abs(family_plan_bytes(name, "gguf", "f16") / (2 * params) - 1) < 0.02
    q4 = family_plan_bytes(name, "gguf", "q4_0")
    assert 0.55 * params < q4 < 0.75 * params  # 4.5 bits a layer weight, Q8_0 embeddings
    assert sum(np.prod(t.shape) for t in hf_plan(cfg)) == params


def test_full_size_families_state_their_distinguishing_fields():
    cfg = {n: model_config_from_hf(family_config_json(n), n) for n in FULL}
    assert cfg["llama3.1-8b"].rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                                                 original_max_position=8192)
    assert cfg["qwen2.5-7b"].attention_bias and cfg["qwen2.5-7b"].layer_windows == ()
    assert cfg["qwen3-8b"].qk_norm and cfg["qwen3-8b"].head_dim == 128
    assert cfg["mistral-7b"].vocab_size == 32768 and cfg["mistral-7b"].layer_windows == ()
    g2 = cfg["gemma2-9b"]
    assert (g2.head_dim, g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (256, 50, 30, 256)
    assert g2.layer_windows[:2] == (4096, None) and g2.vocab_size == 256000 and g2.tie_word_embeddings
    g3 = cfg["gemma3-1b"]
    assert g3.layer_windows[:6] == (512,) * 5 + (None,) and g3.local_rope.theta == 10000 and g3.qk_norm
    phi = cfg["phi3.5-mini"]
    assert phi.fused_projections and phi.rope.rope_type == "longrope" and len(phi.rope.long_factor) == 48
    assert (phi.vocab_size, phi.rope.original_max_position, phi.rope.factor) == (32064, 4096, 32.0)


# ----------------------------------------------------------------------------- CLI


def test_cli_writes_both_forms(tmp_path, capsys):
    assert main(["--family", "mistral-tiny", "--format", "safetensors", "--out", str(tmp_path / "m")]) == 0
    assert main(["--family", "mistral-tiny", "--quant", "q8_0", "--out", str(tmp_path / "m.gguf")]) == 0
    assert "family mistral-tiny" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "m")[0].architecture == "mistral"
    assert load_checkpoint(tmp_path / "m.gguf")[0].architecture == "mistral"


@pytest.mark.parametrize("argv, message", [
    (["--family", "qwen3-tiny", "--out", "x.bin"], "--out must name a .gguf file"),
    (["--shape", "tiny", "--format", "safetensors", "--out", "d"], "--format safetensors needs --family"),
    (["--shape", "tiny", "--quant", "q8_0", "--out", "t.gguf"], "--shape takes --quant q4_0 or q4_1"),
])
def test_cli_refuses_bad_arguments_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1

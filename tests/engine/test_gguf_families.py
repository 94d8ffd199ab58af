"""GGUF files of every served family (engine/loader/gguf_writer.py, gguf_loader.py): a small
random transformers model of each family, with every field that sets the family apart, written
as llama.cpp converts it and read back, is the same model: the same ModelConfig and the same
tensors (f32 exactly, q8_0/q4_0 within the type's rounding), Q/K un-permuted, fused projections
split, Gemma's norms as applied. The files follow llama.cpp's conventions (names, permutation,
fusing, metadata keys), checked against llama.cpp's formulas and transformers' own tensors."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeConfig
from engine.loader import load_checkpoint
from engine.loader.architectures import UnsupportedModelError
from engine.loader.gguf_loader import model_config_from_metadata
from engine.loader.quantized import QuantizedWeight, dense
from engine.loader.gguf_writer import tokenizer_metadata_from_hf, write_gguf
from engine.loader.synthetic import write_family_tokenizer
from engine.model.rope import inv_freq
from engine.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 300
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5)


def _llama(ids):
    return transformers.LlamaConfig(
        **_SHAPE, max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
        bos_token_id=ids("<|begin_of_text|>"), eos_token_id=[ids(t) for t in ("<|end_of_text|>", "<|eom_id|>",
                                                                             "<|eot_id|>")])


def _mistral(ids):
    return transformers.MistralConfig(**_SHAPE, sliding_window=64, rope_theta=1e6, tie_word_embeddings=False,
                                      bos_token_id=ids("<s>"), eos_token_id=ids("</s>"))


def _qwen2(ids):
    return transformers.Qwen2Config(
        **_SHAPE, max_position_embeddings=2048, rope_theta=1e6, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))


def _qwen3(ids):
    return transformers.Qwen3Config(**_SHAPE, head_dim=48, rope_theta=1e6, tie_word_embeddings=True,
                                    bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))


def _gemma2(ids):
    return transformers.Gemma2Config(
        **_SHAPE, head_dim=32, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, bos_token_id=ids("<bos>"), eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
        pad_token_id=ids("<pad>"))


def _gemma3(ids):
    return transformers.Gemma3TextConfig(
        **_SHAPE, head_dim=32, query_pre_attn_scalar=24, sliding_window=16, sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, bos_token_id=ids("<bos>"),
        eos_token_id=[ids("<eos>"), ids("<end_of_turn>")], pad_token_id=ids("<pad>"))


def _phi3(ids):
    return transformers.Phi3Config(
        **{**_SHAPE, "num_key_value_heads": 4}, max_position_embeddings=4096, original_max_position_embeddings=1024,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                      "long_factor": [1.0 + 2.5 * i for i in range(8)]},
        sliding_window=2047, bos_token_id=ids("<s>"), eos_token_id=ids("<|endoftext|>"),
        pad_token_id=ids("<|endoftext|>"))


# family -> (transformers config, model class, the synthetic tokenizer it uses, llama.cpp arch)
FAMILIES = {
    "llama": (_llama, "LlamaForCausalLM", "llama3.1-tiny", "llama"),
    "mistral": (_mistral, "MistralForCausalLM", "mistral-tiny", "llama"),
    "qwen2": (_qwen2, "Qwen2ForCausalLM", "qwen2.5-tiny", "qwen2"),
    "qwen3": (_qwen3, "Qwen3ForCausalLM", "qwen3-tiny", "qwen3"),
    "gemma2": (_gemma2, "Gemma2ForCausalLM", "gemma2-tiny", "gemma2"),
    "gemma3_text": (_gemma3, "Gemma3ForCausalLM", "gemma3-tiny", "gemma3"),
    "phi3": (_phi3, "Phi3ForCausalLM", "phi3.5-tiny", "phi3"),
}


class Converted:
    """One family's HF directory, its transformers state dict, the loader's view of it, and the
    GGUF files written from that view."""

    def __init__(self, root, family):
        make_config, model_class, tokenizer, self.gguf_arch = FAMILIES[family]
        hf = root / "hf"
        vocab = write_family_tokenizer(hf, tokenizer, vocab_size=VOCAB)
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(make_config(vocab.id))
        if getattr(model.config, "sliding_window", None) is not None:
            assert model.config.sliding_window > 0
        # Gemma's norm weights start at zero (HF applies 1 + w): random ones tell 1 + w from w.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.1)
        model.save_pretrained(hf)
        self.hf_dir = hf
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.cfg, self.tensors, _ = load_checkpoint(hf)
        self.tokenizer_meta = tokenizer_metadata_from_hf(hf)
        self.files, self.loaded = {}, {}
        for quant in ("f32", "q8_0", "q4_0"):
            path = write_gguf(root / f"{family}-{quant}.gguf", self.cfg, self.tensors, self.tokenizer_meta, quant=quant)
            self.files[quant] = path
            self.loaded[quant] = load_checkpoint(path)

    def raw(self, quant: str, name: str) -> np.ndarray:
        """A tensor of the GGUF file as stored (dequantized, rows in the file's order)."""
        t = next(t for t in GGUFReader(str(self.files[quant])).tensors if t.name == name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        return dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(shape)


@pytest.fixture(scope="module")
def convert(tmp_path_factory):
    """family -> its Converted, built once per module."""
    cache = {}

    def get(family: str) -> Converted:
        if family not in cache:
            cache[family] = Converted(tmp_path_factory.mktemp(family), family)
        return cache[family]

    return get


@pytest.fixture(params=list(FAMILIES))
def converted(request, convert):
    return convert(request.param)


def _same_model(a: ModelConfig, b: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    """The two configs with what GGUF does not carry as such set alike: the name (the file's
    stem), the order of the eos ids (the engine takes them as a set), and llama3 RoPE, which the
    converter writes as per-frequency divisors (checked apart: test_llama3_rope_...)."""
    a = dataclasses.replace(a, name="", eos_token_ids=tuple(sorted(a.eos_token_ids)))
    b = dataclasses.replace(b, name="", eos_token_ids=tuple(sorted(b.eos_token_ids)))
    if a.rope.rope_type == "llama3":
        a, b = dataclasses.replace(a, rope=RopeConfig()), dataclasses.replace(b, rope=RopeConfig())
    return a, b


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_0"])
def test_config_survives_the_file(converted, quant):
    cfg, _, meta = converted.loaded[quant]
    assert meta["general.architecture"] == converted.gguf_arch
    original, read_back = _same_model(converted.cfg, cfg)
    assert read_back == original


def test_f32_tensors_come_back_exactly(converted):
    _, tensors, _ = converted.loaded["f32"]
    assert set(tensors) == set(converted.tensors)
    for name, t in converted.tensors.items():
        assert torch.equal(tensors[name], t.float()), name


# Largest rounding error of one weight, as a share of its 32-weight block's largest |weight|:
# Q8_0 rounds to 1/127 steps (half a step, plus the fp16 scale's rounding), Q4_0 to 1/8 steps
# with the block's extreme weight at the clamped end (up to a whole step).
_ERROR_SHARE = {"q8_0": 0.5 / 127 + 1e-3, "q4_0": 1 / 8 + 1e-3}


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_tensors_within_the_types_rounding(converted, quant):
    _, tensors, _ = converted.loaded[quant]
    for name, t in converted.tensors.items():
        original, got = t.float(), dense(tensors[name])
        if original.dim() == 1:  # norms and biases stay F32
            assert torch.equal(got, original), name
            continue
        blocks = original.reshape(-1, 32)
        bound = blocks.abs().amax(dim=1, keepdim=True) * _ERROR_SHARE[quant] + 1e-6
        err = (got.reshape(-1, 32) - blocks).abs()
        assert bool((err <= bound).all()), f"{name}: error {float((err / bound).max()):.2f} x the bound"
        if name.startswith("model.layers."):
            # Layer matrices stay quantized: the file's codes and scales (rows in the weight's
            # order, split alike for fused tensors).
            assert isinstance(tensors[name], QuantizedWeight) and tensors[name].source == f"gguf {quant}", name


def test_weights_are_transformers_own(converted):
    """The loader's view of the directory is transformers' state dict, renamed, split and with
    Gemma's 1 + w; the GGUF gives the same back."""
    _, tensors, _ = converted.loaded["f32"]
    state, cfg = converted.state, converted.cfg
    for name, t in state.items():
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name.endswith("qkv_proj.weight"):
            parts = dict(zip("qkv", t.split([cfg.q_size, cfg.kv_size, cfg.kv_size])))
            for x, part in parts.items():
                assert torch.equal(tensors[name.replace("qkv_proj", f"{x}_proj")], part)
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            assert torch.equal(tensors[name.replace("gate_up_proj", "gate_proj")], gate)
            assert torch.equal(tensors[name.replace("gate_up_proj", "up_proj")], up)
        elif name.endswith("norm.weight") and cfg.architecture.startswith("gemma"):
            assert torch.equal(tensors[name], t + 1), name
        else:
            assert torch.equal(tensors[name], t), name


def test_file_follows_llama_cpp_conventions(converted):
    """Names, permutation, fusing and norms as convert_hf_to_gguf.py writes them, against the
    transformers tensors with llama.cpp's formulas."""
    state, cfg = converted.state, converted.cfg
    names = {t.name for t in GGUFReader(str(converted.files["f32"])).tensors}
    p = "model.layers.0."

    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    if converted.gguf_arch == "llama":
        q, k = state[p + "self_attn.q_proj.weight"].numpy(), state[p + "self_attn.k_proj.weight"].numpy()
        assert np.array_equal(converted.raw("f32", "blk.0.attn_q.weight"), llama_cpp_permute(q, cfg.num_heads))
        assert np.array_equal(converted.raw("f32", "blk.0.attn_k.weight"), llama_cpp_permute(k, cfg.num_kv_heads))
    elif converted.gguf_arch == "phi3":
        assert np.array_equal(converted.raw("f32", "blk.0.attn_qkv.weight"), state[p + "self_attn.qkv_proj.weight"])
        assert np.array_equal(converted.raw("f32", "blk.0.ffn_up.weight"), state[p + "mlp.gate_up_proj.weight"])
        assert not {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"} & names
    else:  # not permuted
        assert np.array_equal(converted.raw("f32", "blk.0.attn_q.weight"), state[p + "self_attn.q_proj.weight"])
    if converted.gguf_arch.startswith("gemma"):
        for gguf, hf in (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                         ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm")):
            assert np.array_equal(converted.raw("f32", f"blk.0.{gguf}.weight"), state[p + hf + ".weight"] + 1)
        assert "output.weight" not in names  # tied
    expected = {"qwen2": {"blk.0.attn_q.bias"}, "qwen3": {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"},
                "gemma3": {"blk.0.attn_q_norm.weight"}, "llama": set(), "phi3": set(), "gemma2": set()}
    assert expected[converted.gguf_arch] <= names


def test_family_metadata_keys(converted):
    _, _, meta = converted.loaded["f32"]
    arch = converted.gguf_arch
    names = {t.name for t in GGUFReader(str(converted.files["f32"])).tensors}
    assert meta[f"{arch}.attention.key_length"] == converted.cfg.head_dim
    family = converted.cfg.architecture
    if family == "llama":
        assert "rope_freqs.weight" in names and f"{arch}.rope.scaling.type" not in meta
    if family == "mistral":
        assert meta[f"{arch}.attention.sliding_window"] == 64
    if family == "qwen2":
        assert (meta["qwen2.rope.scaling.type"], meta["qwen2.rope.scaling.factor"],
                meta["qwen2.rope.scaling.original_context_length"]) == ("yarn", 4.0, 512)
    if family == "gemma2":
        assert (meta["gemma2.attn_logit_softcapping"], meta["gemma2.final_logit_softcapping"],
                meta["gemma2.attention.sliding_window"]) == (50.0, 30.0, 16)
        assert meta["gemma2.attention.scale"] == pytest.approx(24 ** -0.5)
    if family == "gemma3_text":
        assert meta["gemma3.attention.sliding_window_pattern"] == 2  # not llama.cpp's 6
        assert (meta["gemma3.rope.scaling.type"], meta["gemma3.rope.freq_base_swa"]) == ("linear", 10000.0)
    if family == "phi3":
        assert {"rope_factors_short.weight", "rope_factors_long.weight"} <= names
        assert meta["phi3.rope.scaling.original_context_length"] == 1024
        assert meta["phi3.rope.scaling.attn_factor"] == pytest.approx((1 + np.log(4) / np.log(1024)) ** 0.5)


def test_sliding_layers_llama_cpp_cannot_derive_are_stated(tmp_path, convert):
    """Gemma 3's layers follow every-sixth-global unless the file says otherwise: a pattern
    number where one fits, else one flag per layer; both read back."""
    converted = convert("gemma3_text")
    for windows, stated in (((16, None), 2), ((None, 16), [False, True]), ((16, 16), None)):
        cfg = dataclasses.replace(converted.cfg, layer_windows=windows)
        path = write_gguf(tmp_path / "w.gguf", cfg, converted.tensors, {})
        read, _, meta = load_checkpoint(path)
        assert read.layer_windows == windows
        assert meta.get("gemma3.attention.sliding_window_pattern") == stated


def test_llama3_rope_as_frequency_divisors(convert):
    """Llama 3.1's llama3 scaling becomes llama.cpp's rope_freqs tensor; the frequencies the
    model rotates by are the same."""
    converted = convert("llama")
    assert converted.cfg.rope.rope_type == "llama3"
    cfg, _, _ = converted.loaded["f32"]
    assert cfg.rope.rope_type == "default" and len(cfg.rope.freq_factors) == cfg.head_dim // 2
    want, _ = inv_freq(converted.cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    got, _ = inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert 1.0 < max(cfg.rope.freq_factors) == 8.0 and min(cfg.rope.freq_factors) == 1.0


def test_tokenizer_survives_the_file(converted):
    """The GGUF's tokenizer encodes like the directory's, by transformers, and renders its chat."""
    _, _, meta = converted.loaded["q4_0"]
    hf = transformers.AutoTokenizer.from_pretrained(converted.hf_dir)
    tok = TextTokenizer.from_gguf_metadata(meta)
    text = "The capital of France is Paris. 42 ünïcödé!\n"
    assert tok.encode(text) == hf(text).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert set(converted.cfg.eos_token_ids) == {
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in meta}


# ----------------------------------------------------------------------------- metadata alone


def _meta(arch: str, **extra) -> dict:
    meta = {"general.architecture": arch, f"{arch}.embedding_length": 4608, f"{arch}.attention.head_count": 32,
            f"{arch}.attention.head_count_kv": 16, f"{arch}.block_count": 46, f"{arch}.feed_forward_length": 36864,
            f"{arch}.context_length": 8192, f"{arch}.attention.key_length": 128, f"{arch}.vocab_size": 256000}
    meta.update({k.replace("ARCH", arch): v for k, v in extra.items()})
    return meta


def test_gemma_defaults_are_llama_cpps():
    """What a Gemma file leaves out is what llama.cpp assumes: the 27B shape's
    query_pre_attn_scalar is hidden / heads (others: head_dim), Gemma 2's even layers and Gemma
    3's five of six slide, Gemma 3's local theta is 10000; stated keys win."""
    big = model_config_from_metadata(_meta("gemma2", **{"ARCH.attention.sliding_window": 4096}), "g")
    assert big.query_pre_attn_scalar == 4608 / 32
    assert big.layer_windows[:3] == (4096, None, 4096)
    small = model_config_from_metadata(_meta("gemma2", **{"ARCH.block_count": 42}), "g")
    assert small.query_pre_attn_scalar == 128 and small.layer_windows == ()
    scale = float(np.float32(144 ** -0.5))
    stated = model_config_from_metadata(_meta("gemma2", **{"ARCH.attention.scale": scale}), "g")
    assert stated.query_pre_attn_scalar == 144
    g3 = model_config_from_metadata(_meta("gemma3", **{"ARCH.block_count": 12, "ARCH.attention.sliding_window": 512,
                                                       "ARCH.rope.freq_base": 1e6}), "g")
    assert g3.layer_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert g3.local_rope == RopeConfig(theta=10000.0) and g3.rope.theta == 1e6
    assert g3.embedding_multiplier == 4608 ** 0.5 and g3.hidden_act == "gelu_tanh"


def test_unknown_architecture_or_rope_is_refused_in_one_line():
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'falcon'") as e:
        model_config_from_metadata(_meta("falcon"), "f")
    assert "\n" not in str(e.value)
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'ntk-magic'"):
        model_config_from_metadata(_meta("llama", **{"ARCH.rope.scaling.type": "ntk-magic"}), "l")
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count 64"):
        model_config_from_metadata(_meta("llama", **{"ARCH.rope.dimension_count": 64}), "l")


def test_writer_refuses_what_gguf_cannot_say(tmp_path, convert):
    converted = convert("qwen2")
    dynamic = dataclasses.replace(converted.cfg, rope=RopeConfig(theta=1e6, rope_type="dynamic", factor=2.0))
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        write_gguf(tmp_path / "d.gguf", dynamic, converted.tensors, {})
    two_windows = dataclasses.replace(converted.cfg, layer_windows=(16, 32))
    with pytest.raises(UnsupportedModelError, match="2 sizes"):
        write_gguf(tmp_path / "w.gguf", two_windows, converted.tensors, {})
    with pytest.raises(ValueError, match="quant must be one of"):
        write_gguf(tmp_path / "q.gguf", converted.cfg, converted.tensors, {}, quant="q3_k")
    missing = {k: v for k, v in converted.tensors.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="no tensor model.layers.1.mlp.up_proj.weight"):
        write_gguf(tmp_path / "m.gguf", converted.cfg, missing, {})


def test_loader_refuses_a_tensor_it_does_not_serve(tmp_path, convert):
    """An extra tensor the family does not have (a mixture-of-experts router, say) is refused,
    not dropped."""
    converted = convert("mistral")
    from gguf import GGUFWriter

    reader = GGUFReader(str(converted.files["f32"]))
    w = GGUFWriter(str(tmp_path / "moe.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_key_value(key, value, field.types[0])
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'blk.0.ffn_gate_inp.weight' is not served"):
        load_checkpoint(tmp_path / "moe.gguf")


def test_tokenizer_keys_from_a_transformers_saved_directory(tmp_path, convert):
    """A tokenizer transformers saved itself (chat template in chat_template.jinja, add_bos only
    in the post-processor) gives the same GGUF keys as the directory it came from."""
    converted = convert("llama")
    transformers.AutoTokenizer.from_pretrained(converted.hf_dir).save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert tokenizer_metadata_from_hf(tmp_path, vocab_size=VOCAB) == converted.tokenizer_meta
    assert converted.tokenizer_meta["tokenizer.ggml.add_bos_token"] is True
    assert converted.tokenizer_meta["tokenizer.ggml.pre"] == "llama-bpe"


def test_sentencepiece_tokenizer_is_refused_in_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "byte_fallback": True, "vocab": {"<unk>": 0}, "merges": []},
        "decoder": {"type": "Sequence", "decoders": []}, "pre_tokenizer": None}))
    with pytest.raises(UnsupportedModelError, match="not a byte-level BPE tokenizer") as e:
        tokenizer_metadata_from_hf(tmp_path)
    assert "\n" not in str(e.value)

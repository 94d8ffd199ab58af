"""Synthetic GGUF checkpoints (engine/loader/synthetic.py): the file loads at its named shape,
its blocks are the seeded bytes, its tokenizer works, and the engine serves it on CPU."""
import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.gguf_loader import _unpermute_rope
from engine.loader.gguf_quants import q4_1_blocks
from engine.loader.quantized import dense
from engine.loader.synthetic import (BOS_ID, EOS_ID, SHAPES, dequantize_blocks, random_blocks, tensor_plan,
                                     write_synthetic_gguf)
from engine.sampling_params import GenerationRequest, SamplingParams
from engine.tokenizer import TextTokenizer

HF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("synthetic") / "tiny.gguf", "tiny", seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_checkpoint(tiny_path)


def test_tiny_loads_at_its_named_shape(tiny):
    cfg, tensors, _ = tiny
    s = SHAPES["tiny"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == \
        (s.num_layers, s.hidden_size, s.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (s.num_heads, s.num_kv_heads, s.head_dim)
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rope_theta) == \
        (s.vocab_size, s.context_length, s.rope_theta)
    assert cfg.tie_word_embeddings is False and "lm_head.weight" in tensors
    assert cfg.bos_token_id == BOS_ID and cfg.eos_token_ids == (EOS_ID,)
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (s.hidden_size, s.intermediate_size)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (s.num_kv_heads * s.head_dim, s.hidden_size)


def test_blocks_dequantize_to_the_seeded_bytes(tiny):
    """Every tensor the loader returns is what random_blocks drew for (seed, index), read by
    ggml's formulas independently of gguf's dequantizer; Q4_1 layers also keep those bytes."""
    cfg, tensors, _ = tiny
    for index, (name, (rows, cols), qtype, std) in enumerate(tensor_plan(SHAPES["tiny"])):
        data = random_blocks(qtype, rows, cols, std, 0, index)
        expected = dequantize_blocks(qtype, data, cols)
        if name.startswith("blk."):
            _, layer, kind, _ = name.split(".")
            if kind not in HF_LAYER:
                continue  # the norms: ones
            hf = f"model.layers.{layer}.{HF_LAYER[kind]}.weight"
            heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(kind)
            if heads:  # the loader un-permutes llama.cpp's Q/K rows, bytes and weights alike
                expected, data = _unpermute_rope(expected, heads), _unpermute_rope(data, heads)
            assert np.array_equal(q4_1_blocks(tensors[hf]), data), name
            # The scale keeps each layer's output at about its input's size.
            assert 0.8 < float(dense(tensors[hf]).std()) * cols ** 0.5 < 1.2, name
        else:
            hf = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                  "output_norm.weight": "model.norm.weight"}[name]
        got = dense(tensors[hf])
        np.testing.assert_array_equal(got.numpy(), expected.reshape(got.shape), err_msg=name)


def test_same_seed_same_bytes_other_seed_or_quant_differs(tmp_path, tiny_path):
    again = write_synthetic_gguf(tmp_path / "again.gguf", "tiny", seed=0)
    other = write_synthetic_gguf(tmp_path / "other.gguf", "tiny", seed=1)
    q4_0 = write_synthetic_gguf(tmp_path / "q4_0.gguf", "tiny", seed=0, quant="q4_0")
    assert again.read_bytes() == tiny_path.read_bytes()
    assert other.stat().st_size == tiny_path.stat().st_size and other.read_bytes() != tiny_path.read_bytes()
    cfg, tensors, _ = load_checkpoint(q4_0)
    assert cfg.hidden_size == SHAPES["tiny"].hidden_size
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    assert w.source == "gguf q4_0" and w.mins is not None  # Q4_0: the min is -8 d
    w = w.dequantize()
    assert torch.isfinite(w).all() and 0.8 < float(w.std()) * w.shape[1] ** 0.5 < 1.2


def test_tokenizer_round_trips_and_renders_chat(tiny):
    tok = TextTokenizer.from_gguf_metadata(tiny[2])
    assert tok.vocab_size == SHAPES["tiny"].vocab_size
    text = "The capital of France is Paris. 42 ünïcödé, 日本語!\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # the learned merges shorten English text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 1  # control tokens as single ids
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS_ID


def test_engine_generates_greedy_tokens_deterministically(tiny_path, tiny):
    def run():
        eng = LLMEngine(tiny_path, EngineConfig(weight_format="fp32", kv_cache_bytes=4 << 20))
        prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        reqs = [GenerationRequest(f"r{i}", prompt=prompt if i == 0 else "Once upon a time",
                                  params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i in range(2)]
        return {k: o.token_ids for k, o in eng.generate(reqs).items()}

    first, second = run(), run()
    assert first == second
    vocab = tiny[0].vocab_size
    assert all(len(ids) == 12 and all(0 <= t < vocab for t in ids) for ids in first.values())
    assert first["r0"] != first["r1"]  # the prompt matters


def test_a_gguf_header_is_parsed_once_for_the_memory_check_and_the_load(tmp_path, monkeypatch):
    """read_model_config (the memory check before loading) keeps its parsed reader for the
    load_checkpoint that follows on the same file, and releases it to it; a file changed since
    is parsed again."""
    from engine.loader import gguf_loader, read_model_config

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", seed=1)
    opened = []
    real = gguf_loader.GGUFReader
    monkeypatch.setattr(gguf_loader, "GGUFReader", lambda p: opened.append(p) or real(p))
    cfg, _ = read_model_config(path)
    assert load_checkpoint(path)[0] == cfg and len(opened) == 1
    assert not gguf_loader._kept_reader  # the load took it: nothing keeps the file mapped
    read_model_config(path)
    write_synthetic_gguf(path, "tiny", seed=2)  # replaced: its size or modification time differs
    load_checkpoint(path)
    assert len(opened) == 3

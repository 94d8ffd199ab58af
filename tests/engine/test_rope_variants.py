"""RoPE tables of every variant against transformers' own frequency functions, and the config
forms they are read from (rope_scaling + rope_theta, transformers 5's rope_parameters)."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import RopeConfig
from engine.loader.architectures import UnsupportedModelError, model_config_from_hf, rope_from_hf
from engine.model.rope import inv_freq, rope_tables

HEAD_DIM, MAX_POS = 64, 4096

CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]},
}


def _hf(params: dict, seq_len: int | None = None):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                      rope_parameters={"rope_theta": 500000.0, **params})
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", seq_len=seq_len) \
        if params["rope_type"] != "default" else (None, 1.0)


@pytest.mark.parametrize("case", [c for c in CASES if c != "default"])
def test_inverse_frequencies_match_transformers(case):
    params = CASES[case]
    rope = rope_from_hf(params, theta=500000.0, max_position=MAX_POS)
    want, want_attention = _hf(params)
    got, got_attention = inv_freq(rope, HEAD_DIM, MAX_POS)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0)
    assert math.isclose(got_attention, want_attention, rel_tol=1e-6)
    # The variant changes the result (the tests comparing models would see it).
    assert not torch.allclose(got, inv_freq(RopeConfig(theta=500000.0), HEAD_DIM, MAX_POS)[0])


def test_longrope_takes_the_long_factors_from_the_original_context_on():
    params = CASES["longrope"]
    rope = rope_from_hf(params, theta=500000.0, max_position=MAX_POS)
    cos, sin = rope_tables(rope, HEAD_DIM, MAX_POS)
    short, attention = _hf(params, seq_len=10)
    long, _ = _hf(params, seq_len=MAX_POS)
    for pos, inv in ((5, short), (1023, short), (1024, long), (4000, long)):
        emb = torch.cat([pos * inv, pos * inv]).float()
        assert torch.allclose(cos[pos], emb.cos() * attention, atol=1e-5)
        assert torch.allclose(sin[pos], emb.sin() * attention, atol=1e-5)


def test_dynamic_ntk_is_transformers_theta_at_the_full_scaled_length():
    params = {"rope_type": "dynamic", "factor": 2.0}
    rope = rope_from_hf(params, theta=500000.0, max_position=MAX_POS)
    want, _ = _hf(params, seq_len=MAX_POS * 2)
    got, _ = inv_freq(rope, HEAD_DIM, MAX_POS)
    assert torch.allclose(got, want.float(), rtol=1e-6)


def test_both_config_forms_give_the_same_rope():
    base = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=100, max_position_embeddings=131072)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = model_config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": scaling}, "m")
    new = model_config_from_hf({**base, "rope_parameters": {"rope_theta": 500000.0, **scaling}}, "m")
    assert old.rope == new.rope and old.rope.rope_type == "llama3" and old.rope.theta == 500000.0
    # Phi-3's older spelling: {"type": "su"} is LongRoPE; the factor comes from the context ratio.
    phi = model_config_from_hf({**base, "model_type": "phi3", "max_position_embeddings": 131072,
                                "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
                                "rope_scaling": {"type": "su", "short_factor": [1.0] * 32,
                                                 "long_factor": [2.0] * 32}}, "m")
    assert phi.rope.rope_type == "longrope" and phi.rope.factor == 32.0


@pytest.mark.parametrize("params, message", [
    ({"rope_type": "mrope", "factor": 2.0}, "unsupported rope_type 'mrope'"),
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "unsupported rope_type 'ntk-by-parts'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs original_max_position_embeddings"),
])
def test_an_unknown_or_incomplete_rope_is_refused_by_name(params, message):
    with pytest.raises(UnsupportedModelError, match=message):
        rope_from_hf(params, theta=10000.0, max_position=MAX_POS)


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'mamba'"):
        model_config_from_hf({"model_type": "mamba", "hidden_size": 8, "num_attention_heads": 1,
                              "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 8}, "m")

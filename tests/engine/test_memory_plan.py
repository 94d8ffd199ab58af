"""A model too big for the machine is refused before any weight is read, with the numbers."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import read_model_config
from engine.memory_plan import GiB, InsufficientMemoryError, check_fits, parameter_counts

# Llama-3-70B's shape (config only: no weights are written, none are needed to refuse it).
LLAMA3_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
              "_name_or_path": "meta-llama/Meta-Llama-3-70B"}


def test_a_model_that_cannot_fit_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))  # no safetensors at all
    with pytest.raises(InsufficientMemoryError) as e:
        LLMEngine(tmp_path, EngineConfig())
    msg = str(e.value)
    assert "meta-llama/Meta-Llama-3-70B" in msg and "70.55B weights" in msg
    assert "GiB of host memory" in msg and "GiB is available" in msg and "\n" not in msg


def test_parameter_count_and_device_check():
    cfg, per_weight = read_model_config_from(LLAMA3_70B)
    layers, embed = parameter_counts(cfg)
    assert round((layers + embed) / 1e9, 2) == 70.55 and per_weight == 2.0
    # On a GPU with 48 GiB free, 4-bit layers (~36 GiB), bf16 embeddings and one 8k sequence's KV
    # fit; bf16 layers do not.
    bf16 = dict(backend="triton", device="cuda", dtype=torch.bfloat16)
    check_fits(cfg, EngineConfig(**bf16, weight_format="auto"), source_bytes_per_weight=2.0,
               host_available=1 << 50, device_free=48 * GiB)
    with pytest.raises(InsufficientMemoryError, match=r"needs about 13\d\.\d GiB of cuda memory .* 48\.0 GiB is free"):
        check_fits(cfg, EngineConfig(**bf16, weight_format="bf16"), source_bytes_per_weight=2.0,
                   host_available=1 << 50, device_free=48 * GiB)


def read_model_config_from(config: dict):
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(config))
    return read_model_config(d)

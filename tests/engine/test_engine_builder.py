"""Engine construction (engine.engine_builder): the KV cache's size bounds the context an engine
serves, a paged backend's cache keeps one sink block beyond the block manager's (the CPU
backend's none), and a wider token budget reserves more device memory beside the cache. A tiny
synthetic Llama (2 layers, 2 KV heads of 32: 1 KiB of fp32 K/V per token), so each build takes
well under a second; the Triton backend runs under the interpreter (tests/conftest.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_builder import activation_reserve_bytes, build_engine_parts, kv_cache_blocks
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.synthetic import write_synthetic_gguf
from engine.request_checks import ContextLengthExceeded
from engine.sampling_params import GenerationRequest, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("builder") / "tiny.gguf", "tiny", seed=5)


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_path):
    return load_checkpoint(tiny_path)


def _config(**overrides) -> EngineConfig:
    return EngineConfig(**{"dtype": torch.float32, "weight_format": "fp32", "block_size": BLOCK,
                           "max_num_batched_tokens": 32, "max_num_seqs": 4, **overrides})


def test_a_byte_budget_gives_whole_blocks_and_bounds_the_context(tiny_path):
    """From a file (memory check, load, tokenizer): 5.5 blocks' worth of bytes is 5 blocks, so the
    longest sequence is 80 tokens although the model's context is 1024."""
    block_bytes = 1024 * BLOCK  # fp32 K+V of 2 layers x 2 heads x 32 dims per token
    parts = build_engine_parts(_config(kv_cache_bytes=5 * block_bytes + block_bytes // 2), model_path=tiny_path)
    assert parts.model_config.max_position_embeddings == 1024
    assert parts.num_kv_blocks == 5
    assert parts.max_model_len == 5 * BLOCK
    assert parts.kv.k[0].shape[0] == 5 * BLOCK  # the CPU backend keeps no sink block
    assert parts.tokenizer.encode("hello")  # built from the file's metadata
    # Less than one block's bytes still gives one block; the config's own bound wins when shorter.
    assert build_engine_parts(_config(kv_cache_bytes=100), model_path=tiny_path).num_kv_blocks == 1
    assert build_engine_parts(_config(num_kv_blocks=8, max_model_len=50), model_path=tiny_path).max_model_len == 50
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.max_model_len = 1024  # type: ignore[misc]


def test_an_engine_refuses_a_prompt_its_small_cache_could_never_hold(tiny_checkpoint):
    engine = LLMEngine(config=_config(num_kv_blocks=3), checkpoint=tiny_checkpoint)
    assert engine.max_model_len == 3 * BLOCK
    assert engine.block_manager.num_blocks == 3
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(ContextLengthExceeded, match="context is 48 tokens"):
        engine.add_request(GenerationRequest("long", prompt_token_ids=[7] * 48, params=params))
    out = engine.generate([GenerationRequest("fits", prompt_token_ids=[7] * 40, params=params)])["fits"]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_a_paged_backend_keeps_one_sink_block_beyond_the_block_managers(tiny_checkpoint, triton_engine_device):
    cpu = build_engine_parts(_config(num_kv_blocks=6), checkpoint=tiny_checkpoint)
    paged = build_engine_parts(_config(backend="triton", device=triton_engine_device, num_kv_blocks=6),
                               checkpoint=tiny_checkpoint)
    assert (cpu.backend.kv_sink_blocks, paged.backend.kv_sink_blocks) == (0, 1)
    assert cpu.num_kv_blocks == paged.num_kv_blocks == 6
    assert cpu.kv.k[0].shape[0] == 6 * BLOCK
    assert paged.kv.k[0].shape[0] == paged.kv.v[-1].shape[0] == 7 * BLOCK
    assert cpu.max_model_len == paged.max_model_len == 6 * BLOCK  # the sink is no sequence's
    assert cpu.runner.graphs is None  # the CPU backend runs every step eagerly


class _FreeMemoryBackend:
    """A device with 1 GiB free: the cache gets what the activation reserve leaves."""

    kv_sink_blocks = 0

    def kv_cache_bytes(self, reserved_bytes: int = 0) -> int:
        return (1 << 30) - reserved_bytes


def test_a_wider_token_budget_reserves_more_memory_beside_the_cache(tiny_checkpoint):
    model_cfg = tiny_checkpoint[0]
    narrow, wide = _config(max_num_batched_tokens=256), _config(max_num_batched_tokens=8192)
    assert activation_reserve_bytes(model_cfg, narrow) >= 256 << 20  # the kernels' workspaces
    assert activation_reserve_bytes(model_cfg, wide) > activation_reserve_bytes(model_cfg, narrow)
    backend = _FreeMemoryBackend()
    few, many = kv_cache_blocks(backend, model_cfg, wide), kv_cache_blocks(backend, model_cfg, narrow)
    assert 1 <= few < many
    assert many == ((1 << 30) - activation_reserve_bytes(model_cfg, narrow)) // (1024 * BLOCK)
    # A set block count is taken as it is.
    assert kv_cache_blocks(backend, model_cfg, _config(num_kv_blocks=9)) == 9


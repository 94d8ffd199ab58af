"""An operator sizes the engine through settings (TESSERA_ENGINE_MAX_LORAS, _MAX_NUM_SEQS,
_LORA_CPU_CACHE_MIB, TESSERA_MAX_RANK): the engine the platform builds has those sizes, and every
adapter rank the registry accepts is one the engine serves."""
from __future__ import annotations

import pytest

from adapter_registry.migrate import upgrade
from tessera.app import create_app
from tessera.engine_config import engine_config_from_settings
from tessera.settings import PlatformSettings
from tests.adapter_registry.registry_helpers import write_adapter

from .conftest import ADMIN_TOKEN, Platform, ServerThread
from .test_gateway_isolation import upload


def sized_settings(root, **sizes) -> PlatformSettings:
    return PlatformSettings(_env_file=None, database_url=f"sqlite:///{root}/tessera.db", object_store_root=root / "objects",
                            adapter_cache_dir=root / "adapter-cache", usage_outbox_dir=root / "usage-outbox",
                            admin_token=ADMIN_TOKEN, engine_kv_cache_mib=32, **sizes)


def test_unset_sizes_keep_the_engines_defaults(tmp_path):
    from engine.config import EngineConfig

    config, default = engine_config_from_settings(sized_settings(tmp_path)), EngineConfig()
    assert (config.max_loras, config.max_num_seqs, config.lora_cpu_cache_bytes, config.max_lora_rank) == \
        (default.max_loras, default.max_num_seqs, default.lora_cpu_cache_bytes, 64)


def test_cuda_engines_run_as_many_adapters_at_once_as_seats_unless_told_otherwise(tmp_path):
    # Only the configuration: building it needs no GPU.
    def slots_and_seats(**sizes):
        config = engine_config_from_settings(sized_settings(tmp_path, engine_device="cuda", **sizes))
        return config.max_loras, config.max_num_seqs

    assert slots_and_seats() == (64, 64)
    assert slots_and_seats(engine_max_num_seqs=32) == (32, 32)
    assert slots_and_seats(engine_max_loras=8) == (8, 64)


def test_a_rank_128_adapter_is_served_when_the_registry_accepts_rank_128(tmp_path):
    settings = sized_settings(tmp_path, max_rank=128, engine_max_loras=2, engine_max_num_seqs=8,
                              engine_lora_cpu_cache_mib=64)
    upgrade(settings)
    app = create_app(settings)  # builds its engine from the settings, as `tessera serve` does
    with ServerThread(app) as server:
        platform = Platform(server.url, settings, app)
        engine = platform.gateway.engine.aengine.engine
        assert (engine.config.max_loras, engine.config.max_num_seqs, engine.config.lora_cpu_cache_bytes,
                engine.lora_manager.max_rank) == (2, 8, 64 << 20, 128)
        tenant = platform.tenant()
        upload(platform, tenant.name, "wide", write_adapter(tmp_path / "wide", rank=128, seed=3))
        out = platform.openai(tenant).chat.completions.create(
            model="wide", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("field, value", [("engine_max_loras", 0), ("engine_max_num_seqs", 0),
                                          ("engine_lora_cpu_cache_mib", 8)])
def test_sizes_out_of_range_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        sized_settings(tmp_path, **{field: value})

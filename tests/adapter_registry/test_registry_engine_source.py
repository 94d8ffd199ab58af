"""The engine's fetch protocol over the registry: upload to the loopback S3 server, fetch as an
engine would, verify sha256; caching, coalescing, checksum failures, tenant scoping."""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
from registry_helpers import write_adapter

from adapter_registry import services
from adapter_registry.content import blob_key
from adapter_registry.engine_source import RegistryAdapterSource
from engine.lora.peft_format import parse_adapter_config
from tests.engine.lora_fixtures import SMOLLM2
from engine.lora.source import AdapterFetchError, AdapterSource

DEMO_ROOT = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"


def _demo_adapters() -> list[Path]:
    if not DEMO_ROOT.is_dir():
        return []
    return sorted(p for p in DEMO_ROOT.iterdir()
                  if (p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file())


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def s3(make_ctx):
    return make_ctx("postgres")


def _source(ctx, tmp_path, **kw) -> RegistryAdapterSource:
    return RegistryAdapterSource(session_factory=ctx.session_factory, store=ctx.store, cache_dir=tmp_path / "cache", **kw)


def _upload(ctx, tenant, name, path):
    with ctx.session_factory() as s:
        return services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant, name=name, source=path)


def _tenant(ctx, name="acme"):
    with ctx.session_factory() as s:
        return services.create_tenant(session=s, name=name)


DEMOS = _demo_adapters()


@pytest.mark.parametrize("adapter", DEMOS or ["generated-rank16-all-targets"], ids=lambda p: getattr(p, "name", p))
def test_round_trip_through_s3_verifies_sha256(s3, tmp_path, adapter):
    if isinstance(adapter, str):  # no demo adapters trained yet: a random SmolLM2-shaped one
        adapter = write_adapter(tmp_path / "gen", rank=16, modules=("q", "k", "v", "o", "gate", "up", "down"))
    tenant = _tenant(s3)
    v = _upload(s3, tenant, "demo", adapter)
    assert v.status == "ready", v.rejection_reason
    source = _source(s3, tmp_path)
    assert isinstance(source, AdapterSource)
    local = source.fetch(v.sha256)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert _sha(local / name) == _sha(adapter / name)
    assert parse_adapter_config(json.loads((local / "adapter_config.json").read_text()), SMOLLM2).rank == v.rank


def test_second_fetch_is_served_from_the_disk_cache(s3, tmp_path, adapter_dir):
    v = _upload(s3, _tenant(s3), "bot", adapter_dir)
    source = _source(s3, tmp_path)
    assert source.fetch(v.sha256) == source.fetch(v.sha256)
    assert source.downloads == 1


def test_concurrent_fetches_of_one_version_download_once(s3, tmp_path, adapter_dir):
    v = _upload(s3, _tenant(s3), "bot", adapter_dir)
    source = _source(s3, tmp_path)
    results, errors = [], []
    barrier = threading.Barrier(8)

    def fetch():
        barrier.wait()
        try:
            results.append(source.fetch(v.sha256))
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1
    assert source.downloads == 1


def test_corrupted_object_fails_its_checksum_and_is_not_cached(s3, tmp_path, adapter_dir):
    v = _upload(s3, _tenant(s3), "bot", adapter_dir)
    bad = tmp_path / "bad.safetensors"
    data = bytearray((adapter_dir / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    s3.store.put_file(blob_key(v.weights_sha256), bad)  # bit rot in the bucket
    source = _source(s3, tmp_path)
    with pytest.raises(AdapterFetchError, match="adapter_model.safetensors failed its checksum"):
        source.fetch(v.sha256)
    assert not (tmp_path / "cache" / v.sha256).exists()


def test_unknown_rejected_and_malformed_ids_are_refused(s3, tmp_path):
    tenant = _tenant(s3)
    rejected = _upload(s3, tenant, "bot", write_adapter(tmp_path / "a", config_overrides={"use_dora": True}))
    source = _source(s3, tmp_path)
    with pytest.raises(AdapterFetchError, match="not found or not ready"):
        source.fetch(rejected.sha256)
    with pytest.raises(AdapterFetchError, match="not found or not ready"):
        source.fetch("0" * 64)
    with pytest.raises(AdapterFetchError, match="invalid adapter version id"):
        source.fetch("../../etc/passwd")


def test_a_tenant_bound_source_never_fetches_another_tenants_version(s3, tmp_path, adapter_dir):
    alpha, beta = _tenant(s3, "alpha"), _tenant(s3, "beta")
    v = _upload(s3, alpha, "secret", adapter_dir)
    with pytest.raises(AdapterFetchError, match="not found"):
        _source(s3, tmp_path, tenant_id=beta.id).fetch(v.sha256)
    assert _source(s3, tmp_path, tenant_id=alpha.id).fetch(v.sha256).is_dir()


def test_deleted_version_is_no_longer_served(s3, tmp_path, adapter_dir):
    tenant = _tenant(s3)
    v = _upload(s3, tenant, "bot", adapter_dir)
    with s3.session_factory() as s:
        services.delete_adapter(session=s, tenant=tenant, ref="bot")
    with pytest.raises(AdapterFetchError, match="not found or not ready"):
        _source(s3, tmp_path).fetch(v.sha256)

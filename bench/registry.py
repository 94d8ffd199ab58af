"""Adapter registry benchmark: upload + validate, and fetch-to-disk from S3 on loopback.

Prints one JSON object. Cases: a rank-16 all-targets SmolLM2-135M adapter (~9.8 MB fp16) and a
Llama-7B-shaped rank-8 all-targets random adapter (~40 MB fp16). Upload + validate is the whole
`upload_adapter` call (stage, sha256, store put, DB rows, validation reading the files back from
the store: config, shapes, NaN/Inf scan); `validate_only` is validation of local files alone.
Store: moto's S3 server on 127.0.0.1 (and the local-directory store for comparison); DB: SQLite.

    .venv/bin/python bench/registry.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform as _platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "adapter_registry"))

from registry_helpers import write_adapter  # noqa: E402

from adapter_registry import services  # noqa: E402
from adapter_registry.engine_source import RegistryAdapterSource  # noqa: E402
from adapter_registry.migrate import upgrade  # noqa: E402
from adapter_registry.settings import RegistrySettings  # noqa: E402
from adapter_registry.validation import validate_adapter_files  # noqa: E402
from tessera_core.context import build_context  # noqa: E402
from tests.engine.lora_fixtures import SMOLLM2, decoder_shape  # noqa: E402

# The served models' descriptions, as their engines would publish them.
LLAMA2_7B = decoder_shape("meta-llama/Llama-2-7b-hf", layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32)
ALL = ("q", "k", "v", "o", "gate", "up", "down")
CASES = {
    "smollm2_r16_all": dict(base=SMOLLM2, rank=16, modules=ALL),
    "llama7b_r8_all": dict(base=LLAMA2_7B, rank=8, modules=ALL),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ctx(work: Path, store: str, endpoint: str | None):
    kw = dict(database_url=f"sqlite:///{work / f'{store}.db'}", served_base_models=[SMOLLM2, LLAMA2_7B],
              object_store=store, object_store_root=work / "objects", default_max_adapter_bytes=1 << 30)
    if store == "s3":
        kw.update(s3_endpoint_url=endpoint, s3_bucket="bench", s3_access_key_id="bench", s3_secret_access_key="bench")
    settings = RegistrySettings(**kw)
    upgrade(settings)
    ctx = build_context(settings)
    if store == "s3":
        ctx.store.ensure_bucket()
    return ctx


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    results: dict = {"bench": "adapter_registry", "repeats": args.repeats, "cpu_count": os.cpu_count(),
                     "machine": _platform.machine(), "db": "sqlite", "cases": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            ctxs = {store: _ctx(work / store, store, f"http://127.0.0.1:{port}") for store in ("local", "s3")}
            tenants = {}
            for store, ctx in ctxs.items():
                with ctx.session_factory() as s:
                    tenants[store] = services.create_tenant(session=s, name="bench")
            for case, spec in CASES.items():
                row: dict = {"rank": spec["rank"], "modules": list(spec["modules"]), "base": spec["base"].name}
                adapters = [write_adapter(work / f"{case}-{i}", seed=i, **spec) for i in range(args.repeats)]
                row["weights_mb"] = round((adapters[0] / "adapter_model.safetensors").stat().st_size / 1e6, 1)
                t = []
                for a in adapters:
                    t0 = time.perf_counter()
                    validate_adapter_files(config_path=a / "adapter_config.json", weights_path=a / "adapter_model.safetensors",
                                           settings=ctxs["local"].settings, base=spec["base"])
                    t.append(time.perf_counter() - t0)
                row["validate_only_ms"] = _median_ms(t)
                versions = {}
                for store, ctx in ctxs.items():
                    t = []
                    for i, a in enumerate(adapters):
                        with ctx.session_factory() as s:
                            t0 = time.perf_counter()
                            v = services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings,
                                                        tenant=tenants[store], name=case, source=a)
                            t.append(time.perf_counter() - t0)
                            assert v.status == "ready", v.rejection_reason
                            versions.setdefault(store, []).append(v.sha256)
                    row[f"upload_validate_{store}_ms"] = _median_ms(t)
                ctx = ctxs["s3"]
                t = []
                for i, sha in enumerate(versions["s3"]):
                    source = RegistryAdapterSource(session_factory=ctx.session_factory, store=ctx.store,
                                                   cache_dir=work / f"cache-{case}-{i}")
                    t0 = time.perf_counter()
                    source.fetch(sha)
                    t.append(time.perf_counter() - t0)
                row["fetch_to_disk_s3_ms"] = _median_ms(t)
                row["fetch_to_disk_s3_mb_per_s"] = round(row["weights_mb"] / (row["fetch_to_disk_s3_ms"] / 1000), 1)
                t = []
                source = RegistryAdapterSource(session_factory=ctx.session_factory, store=ctx.store,
                                               cache_dir=work / f"cache-{case}-0")
                for _ in range(args.repeats):  # version 0 is on disk already: a cache hit
                    t0 = time.perf_counter()
                    source.fetch(versions["s3"][0])
                    t.append(time.perf_counter() - t0)
                row["fetch_cached_ms"] = _median_ms(t)
                results["cases"][case] = row
            for ctx in ctxs.values():
                ctx.engine.dispose()
    finally:
        server.stop()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""A hostile tenant's adapter uploads, through the admin API, never reach another tenant: a regex
that would backtrack forever, a validation past its deadline, an adapter whose scale overflows
fp16, a version a dead validator left 'validating', a version the engine found faulty, an archive
whose tar header declares a gigabyte-long name. Each is answered with its reason while another
tenant's greedy stream runs unchanged and /health answers.
"""
from __future__ import annotations

import json
import shutil
import threading
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest

from adapter_registry import services as registry
from tessera_core.db import utcnow

BASE = "SmolLM2-135M-Instruct"
PIRATE = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters" / "pirate"
# Exponential for a backtracking regex engine against module names such as
# "model.layers.29.post_attention_layernorm" (Python's re would not finish).
CATASTROPHIC = r"(.|.)*X"
MSGS = [{"role": "user", "content": "Tell me about the sea in three sentences."}]


@pytest.fixture(scope="module", autouse=True)
def _pirate():
    if not PIRATE.is_dir():
        pytest.skip("demo adapter 'pirate' is not there")


def pirate_with(tmp_path: Path, **config) -> Path:
    """The pirate demo adapter (real weights) with `config` merged into its adapter_config.json."""
    d = shutil.copytree(PIRATE, tmp_path / f"pirate-{len(list(tmp_path.iterdir()))}")
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return d


def upload(platform, tenant: str, name: str, folder: Path) -> dict:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    r = platform.admin.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=files)
    assert r.status_code == 201, r.text
    return r.json()


class Stream:
    """Tenant `tenant`'s greedy chat stream in a thread; `.started` is set at its first token."""

    def __init__(self, platform, tenant):
        self.client = platform.openai(tenant)
        self.started = threading.Event()
        self.text: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            parts = []
            for chunk in self.client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=48, temperature=0,
                                                             stream=True):
                parts.append((chunk.choices[0].delta.content or "") if chunk.choices else "")
                self.started.set()
            self.text = "".join(parts)
        except BaseException as e:  # reported by result()
            self.error = e
        finally:
            self.started.set()

    def __enter__(self) -> "Stream":
        self.thread.start()
        assert self.started.wait(120), "the stream never started"
        return self

    def __exit__(self, *exc):
        self.thread.join(120)

    def result(self) -> str:
        self.thread.join(120)
        if self.error is not None:
            raise self.error
        assert self.text is not None, "the stream did not finish"
        return self.text


def alone(platform, tenant) -> str:
    r = platform.openai(tenant).chat.completions.create(model=BASE, messages=MSGS, max_tokens=48, temperature=0)
    return r.choices[0].message.content


def health_ok(platform) -> bool:
    return httpx.get(f"{platform.url}/health", timeout=10).status_code == 200


def test_catastrophic_regex_upload_while_another_tenant_streams(platform, tmp_path):
    a, b = platform.tenant(), platform.tenant()
    expected = alone(platform, a)
    with Stream(platform, a) as stream:
        v = upload(platform, b.name, "evil", pirate_with(tmp_path, target_modules=CATASTROPHIC))
        assert health_ok(platform)
    assert v["status"] == "rejected" and "(.|.)*X" in v["rejection_reason"], v
    assert stream.result() == expected
    assert health_ok(platform)


def test_validation_past_its_deadline_is_a_rejection_while_another_tenant_streams(platform, tmp_path):
    """A deadline no validation can meet (test-only setting): the upload is answered at once with
    the deadline as its reason, the version is not left validating, the stream is unchanged; the
    same bytes validate again under the normal deadline."""
    a, b = platform.tenant(), platform.tenant()
    expected = alone(platform, a)
    folder = pirate_with(tmp_path)
    saved = platform.settings.validation_timeout_s
    platform.settings.validation_timeout_s = 0.01
    try:
        with Stream(platform, a) as stream:
            v = upload(platform, b.name, "slow", folder)
            assert health_ok(platform)
    finally:
        platform.settings.validation_timeout_s = saved
    assert (v["status"], v["rejection_reason"]) == ("rejected", "validation exceeded its 0.01 s deadline")
    assert stream.result() == expected
    again = upload(platform, b.name, "slow", folder)
    assert (again["version"], again["status"], again["current"]) == (v["version"], "ready", True)


def test_overflowing_adapter_is_rejected_at_upload_and_never_served(platform, tmp_path):
    a, b = platform.tenant(), platform.tenant()
    expected = alone(platform, a)
    with Stream(platform, a) as stream:
        v = upload(platform, b.name, "huge", pirate_with(tmp_path, lora_alpha=1e30))
    assert v["status"] == "rejected"
    assert "LoRA module base_model.model.model.layers." in v["rejection_reason"]
    assert "exceeds the bound" in v["rejection_reason"] and "fp16" in v["rejection_reason"], v
    assert stream.result() == expected
    with pytest.raises(openai.APIStatusError) as e:
        platform.openai(b).chat.completions.create(model="huge@1", messages=MSGS, max_tokens=4, temperature=0)
    assert e.value.status_code == 409 and "rejected" in e.value.body["message"]
    assert alone(platform, a) == expected


def _leave_validating(platform, tenant: str, name: str) -> None:
    """What a validator that died mid-way leaves behind: 'validating' since an hour ago."""
    with platform.gateway.session_factory() as s:
        t = registry.get_tenant(session=s, name=tenant)
        v = registry.resolve_version(session=s, tenant=t, ref=f"{name}@1", require_ready=False)
        v.status, v.validation_started_at = "validating", utcnow() - timedelta(hours=1)
        s.commit()


def _status(platform, tenant: str, name: str) -> str:
    return platform.admin.get(f"/admin/v1/tenants/{tenant}/adapters/{name}").json()["versions"][-1]["status"]


def test_a_version_left_validating_is_recovered(platform, tmp_path):
    b = platform.tenant()
    folder = pirate_with(tmp_path)
    assert upload(platform, b.name, "stuck", folder)["status"] == "ready"

    _leave_validating(platform, b.name, "stuck")
    assert _status(platform, b.name, "stuck") == "validating"
    again = upload(platform, b.name, "stuck", folder)  # the same bytes: validated again, not returned stuck
    assert (again["version"], again["status"]) == (1, "ready")

    _leave_validating(platform, b.name, "stuck")
    gw = platform.gateway
    with gw.session_factory() as s:  # what the gateway and the worker run at start
        assert registry.recover_stuck_versions(session=s, store=gw.store, settings=gw.settings) >= 1
    assert _status(platform, b.name, "stuck") == "ready"
    r = platform.openai(b).chat.completions.create(model="stuck@1", messages=MSGS, max_tokens=4, temperature=0)
    assert r.choices[0].message.content


def test_a_version_the_engine_reports_faulty_is_quarantined(platform, aengine, tmp_path):
    b = platform.tenant()
    # Bytes of its own: a quarantine covers every version with the same digest.
    v = upload(platform, b.name, "faulty", pirate_with(tmp_path, revision="quarantine-test"))
    assert v["status"] == "ready"
    source = aengine.engine.lora_manager.source
    source.report_fault(v["sha256"], "non-finite logits in a request using this adapter")
    got = platform.admin.get(f"/admin/v1/tenants/{b.name}/adapters/faulty").json()
    assert (got["current_version"], got["versions"][0]["status"]) == (None, "quarantined")
    assert got["versions"][0]["rejection_reason"] == "non-finite logits in a request using this adapter"
    with pytest.raises(openai.APIStatusError) as e:
        platform.openai(b).chat.completions.create(model="faulty@1", messages=MSGS, max_tokens=4, temperature=0)
    assert e.value.status_code == 409 and "quarantined: non-finite logits" in e.value.body["message"]


def test_an_archive_declaring_a_gigabyte_long_name_is_refused_while_another_tenant_streams(platform, tmp_path):
    """A .tar.gz whose first header declares a 4 GiB GNU long name (tarfile alone reads the whole
    declared record into memory): a 4xx naming the header, before anything is stored."""
    import gzip
    import tarfile

    header = tarfile.TarInfo("././@LongLink")
    header.size, header.type = 4 << 30, tarfile.GNUTYPE_LONGNAME
    archive = tmp_path / "adapter.tar.gz"
    with gzip.open(archive, "wb") as gz:
        gz.write(header.tobuf(format=tarfile.GNU_FORMAT))
        gz.write(b"a" * (1 << 20))
    a, b = platform.tenant(), platform.tenant()
    expected = alone(platform, a)
    with Stream(platform, a) as stream:
        r = platform.admin.post(f"/admin/v1/tenants/{b.name}/adapters/bomb/versions",
                                files=[("files", (archive.name, archive.read_bytes()))])
        assert health_ok(platform)
    assert 400 <= r.status_code < 500 and "long name or pax header" in r.json()["error"]["message"], r.text
    assert platform.admin.get(f"/admin/v1/tenants/{b.name}/adapters/bomb").status_code == 404
    assert stream.result() == expected

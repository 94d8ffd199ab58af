"""The embedded mode (one SQLite file) under concurrent writers: an admin change made while
another connection writes waits its turn and lands; it is never a 503 "database is unavailable"."""
from __future__ import annotations

import sqlite3
import threading
import time
import uuid

from sqlalchemy.engine import make_url

from .conftest import Tenant

BASE = "SmolLM2-135M-Instruct"


def test_admin_changes_wait_for_another_writer_instead_of_failing(platform):
    path = make_url(platform.settings.database_url).database
    taken, release = threading.Event(), threading.Event()

    def writer():  # e.g. the billing rollup's transaction, or a worker's usage insert
        c = sqlite3.connect(path, isolation_level=None)
        c.execute("BEGIN IMMEDIATE")
        taken.set()
        release.wait(30)
        time.sleep(0.3)  # still holding it while the admin requests below have started
        c.execute("COMMIT")
        c.close()

    t = threading.Thread(target=writer)
    t.start()
    assert taken.wait(10)
    name = "t-" + uuid.uuid4().hex[:10]
    release.set()
    try:
        r = platform.admin.put(f"/admin/v1/plans/{name}", json={})
        assert r.status_code == 200, r.text
        r = platform.admin.post("/admin/v1/tenants", json={"name": name, "plan": name})
        assert r.status_code == 201, r.text
    finally:
        t.join()

    # The tenant is whole: its key works for a completion.
    r = platform.admin.post(f"/admin/v1/tenants/{name}/keys", json={"name": "k"})
    assert r.status_code == 201, r.text
    client = platform.openai(Tenant(name, r.json()["key"], r.json()["id"]))
    out = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_an_upload_never_holds_the_write_lock_while_it_stages_stores_or_validates(platform, monkeypatch, tmp_path):
    """An adapter upload through the admin API unpacks and hashes the archive, puts its files in
    the object store and (embedded) validates them in a child process: seconds for a large one.
    Through each of those phases another connection can take SQLite's write lock at once (usage
    events, other admins and the billing rollup are not held up), and the upload ends ready."""
    import io
    import zipfile

    from adapter_registry import services
    from tests.engine.lora_fixtures import write_random_adapter

    path = make_url(platform.settings.database_url).database
    seen: dict[str, bool] = {}

    def others_can_write(phase: str) -> None:
        c = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            c.execute("BEGIN IMMEDIATE")
            c.execute("ROLLBACK")
            seen.setdefault(phase, True)
        except sqlite3.OperationalError:  # "database is locked"
            seen[phase] = False
        finally:
            c.close()

    def probed(phase, fn):
        def run(*a, **kw):
            others_can_write(phase)
            out = fn(*a, **kw)
            others_can_write(phase)
            return out
        return run

    store = platform.gateway.store
    monkeypatch.setattr(services, "stage_upload", probed("staging", services.stage_upload))
    monkeypatch.setattr(store, "put_file", probed("storing", store.put_file))
    monkeypatch.setattr(services, "validate_in_sandbox", probed("validating", services.validate_in_sandbox))

    t = platform.tenant()
    write_random_adapter(tmp_path / "a", 4, seed=3)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            z.write(tmp_path / "a" / f, f)
    r = platform.admin.post(f"/admin/v1/tenants/{t.name}/adapters/locks/versions",
                            files={"files": ("locks.zip", buf.getvalue(), "application/zip")}, timeout=300)
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text
    assert seen == {"staging": True, "storing": True, "validating": True}

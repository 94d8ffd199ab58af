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

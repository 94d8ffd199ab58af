"""The README's main job as a newcomer does it: `make run` (= `tessera demo`) in a fresh folder,
then what it prints, pasted into a shell. Nothing is reconstructed: the API key, the admin token,
the URL and the commands are read from the demo's own output.

One demo process for the whole file (it loads the engine and uploads the demo adapters).
"""
from __future__ import annotations

import io
import json
import re
import uuid
import zipfile

import httpx
import openai
import pytest

from .demo_process import ADAPTERS, Demo, printed_commands, sh


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("newcomer")
    d = Demo(cwd)
    d.wait_ready()
    yield d, cwd
    d.stop()


def test_the_printed_commands_work_as_pasted_and_ctrl_c_stops_the_demo(demo):
    d, cwd = demo
    out = d.output
    url = re.search(r"Tessera is running at (\S+)", out).group(1)
    commands = printed_commands(out)
    chat_curl = next(c for c in commands if "/v1/chat/completions" in c)
    openai_example = next(c for c in commands if "<<'EOF'" in c)
    admin_call = next(c for c in commands if "/admin/v1/" in c and "/versions" not in c)
    upload_curl = next(c for c in commands if "/versions" in c)
    key = re.search(r'Authorization: Bearer (\S+)"', chat_curl).group(1)
    admin_token = re.search(r'Authorization: Bearer (\S+)"', admin_call).group(1)
    model = re.search(r'"model": "([^"]+)"', chat_curl).group(1)
    assert re.search(r"Admin web UI: (\S+)/admin ", out).group(1) == url
    # The admin API's line in the form it has always had (scripts read the token from it).
    assert f"Admin API: {url}/admin/v1 with header 'Authorization: Bearer {admin_token}'." in out

    # The streamed curl: SSE chunks with text, then [DONE].
    sse = [line for line in sh(chat_curl, cwd).splitlines() if line]
    assert sse[-1] == "data: [DONE]", sse[-3:]
    assert any('"content":"' in line and '"content":""' not in line for line in sse)

    # The openai example prints the streamed answer.
    assert sh(openai_example, cwd).strip()

    # The admin API call lists the demo tenant's adapters.
    listed = json.loads(sh(admin_call, cwd))
    assert {"json-answer", "pirate", "upper", "weather-tools"} <= {a["name"] for a in listed["data"]}

    # The printed upload, as pasted: a new adapter version, validated and ready.
    uploaded = json.loads(sh(upload_curl, cwd))
    assert uploaded["status"] == "ready", uploaded

    # Sign in to the web UI with the printed admin token; pages and the admin API on the cookie.
    with httpx.Client(base_url=url, timeout=60) as ui:
        r = ui.post("/admin/session", json={"password": admin_token})
        assert r.status_code == 204, r.text
        page = ui.get("/admin", follow_redirects=True)
        assert page.status_code == 200 and page.url.path == "/admin/tenants"
        tenants = ui.get("/admin/v1/tenants")
        assert tenants.status_code == 200 and "demo" in {t["name"] for t in tenants.json()["data"]}

        # Upload a demo adapter folder, zipped, under a new name, as the web UI does (session
        # cookie + CSRF header), through the admin API's multipart route.
        name = "newcomer-" + uuid.uuid4().hex[:6]
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                z.write(ADAPTERS / "upper" / f, f)
        r = ui.post(f"/admin/v1/tenants/demo/adapters/{name}/versions",
                    files={"files": (f"{name}.zip", buf.getvalue(), "application/zip")},
                    headers={"x-csrf-token": ui.cookies["tessera_csrf"]}, timeout=300)
        assert r.status_code == 201 and r.json()["status"] == "ready", r.text

    # The tenant chats with the new adapter through the openai client, with the printed key.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    assert name in {m.id for m in client.models.list()}
    text = client.chat.completions.create(model=name, max_tokens=16, temperature=0,
                                          messages=[{"role": "user", "content": "Which color is a plum?"}]
                                          ).choices[0].message.content
    assert text.strip()
    assert model in {m.id for m in client.models.list()}

    # Ctrl+C: the demo stops cleanly.
    assert d.stop() == 0
    assert "Traceback" not in d.stderr_text(), d.stderr_text()

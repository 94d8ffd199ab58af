"""An adapter saved from a local base checkout (PEFT writes the local path into
base_model_name_or_path), uploaded as a new user would: through the admin API's multipart upload
and through the admin UI's upload form. A path the platform can tell is accepted; one it cannot is
refused with a 422 that says how to name the base model, and accepted once it is named."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .ui_browser import (  # noqa: F401 (chromium_browser: the browser fixture)
    PIRATE, browser_context, chromium_browser, evidence, sign_in_on_the_way, watched_page)

SMOL = "SmolLM2-135M-Instruct"  # the engine's name for the served model (adapters may name its hub id)


@pytest.fixture(autouse=True)
def _pirate():
    if not (PIRATE / "adapter_model.safetensors").is_file():
        pytest.skip("demo adapter 'pirate' is not there")


def saved_from(tmp_path: Path, base_path: str) -> Path:
    """The pirate demo adapter (real weights) as PEFT saves it when its base was loaded from base_path."""
    d = tmp_path / "adapter"
    shutil.copytree(PIRATE, d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": base_path}))
    return d


def post(platform, tenant: str, name: str, folder: Path, **form):
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    return platform.admin.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=files, data=form)


def test_a_local_checkout_path_the_platform_can_tell_is_accepted(platform, tmp_path):
    t = platform.tenant()
    r = post(platform, t.name, "local", saved_from(tmp_path, "/home/me/models/SmolLM2-135M-Instruct"))
    assert r.status_code == 201, r.text
    assert (r.json()["status"], r.json()["base_model"]) == ("ready", SMOL)


def test_an_unknown_local_path_is_a_422_naming_the_field_then_accepted_with_it(platform, tmp_path):
    t = platform.tenant()
    folder = saved_from(tmp_path, "/home/me/checkpoints/base")
    r = post(platform, t.name, "bot", folder)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("base_model", "base_model_not_served")
    assert err["message"].startswith("base model '/home/me/checkpoints/base' (adapter_config.json's "
                                     "base_model_name_or_path) is not served by this platform; ")
    assert "the upload form's 'Base model' field (API: multipart field base_model)" in err["message"]
    assert "`tessera adapters upload --base-model NAME`" in err["message"]
    assert f"served: {SMOL}" in err["message"] and "TESSERA_BASE_MODEL_ALIASES" in err["message"]
    got = platform.admin.get(f"/admin/v1/tenants/{t.name}/adapters").json()
    assert got["data"] == [] and got["served_base_models"] == [SMOL]  # nothing stored; what to name
    assert got["served_base_model_details"] == [{"name": SMOL, "architecture": "llama", "num_layers": 30, "modules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}]  # what the engine describes

    r = post(platform, t.name, "bot", folder, base_model="smollm2-135m-instruct")
    assert r.status_code == 201, r.text
    assert (r.json()["status"], r.json()["base_model"], r.json()["version"]) == ("ready", SMOL, 1)


@pytest.mark.usefixtures("needs_chromium")
def test_the_upload_form_names_the_base_model_when_the_config_cannot(browser, platform, tmp_path):
    t = platform.tenant()
    folder = saved_from(tmp_path, "/home/me/checkpoints/base")
    files = [str(folder / "adapter_config.json"), str(folder / "adapter_model.safetensors")]
    with browser_context(browser, platform) as ctx:
        page, script_errors = watched_page(ctx)
        with evidence(page, "adapters-base-model"):
            sign_in_on_the_way(page, f"/admin/adapters?tenant={t.name}")
            page.get_by_role("heading", name=f"Upload an adapter for {t.name}").wait_for()
            page.get_by_label("Adapter name").fill("local")
            page.set_input_files("#adapter-files", files)
            page.get_by_role("button", name="Upload").click()
            alert = page.get_by_role("alert")
            alert.wait_for()
            assert "The upload was refused: base model '/home/me/checkpoints/base'" in alert.inner_text()
            assert "'Base model' field" in alert.inner_text()

            base = page.get_by_label("Base model (optional)")
            assert base.evaluate("el => [...el.list.options].map(o => o.value)") == [SMOL]  # offered
            # ... with what the engine says about it: the modules an adapter's target_modules name.
            assert page.locator(".served-model").inner_text() == (
                f"Served base model: {SMOL} (llama, 30 layers). An adapter's target_modules name its modules: "
                "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.")
            base.fill(SMOL)
            page.set_input_files("#adapter-files", files)
            page.get_by_role("button", name="Upload").click()
            page.locator(".upload-status").get_by_text("local@1 is ready").wait_for()
    assert script_errors == []
    versions = platform.admin.get(f"/admin/v1/tenants/{t.name}/adapters/local").json()["versions"]
    assert [(v["status"], v["base_model"]) for v in versions] == [("ready", SMOL)]


def test_a_version_for_another_base_than_the_one_served_is_refused_at_request_time(platform, tmp_path):
    """The deployment changed models since the version was uploaded (its base is recorded): a
    request naming it is a 409 saying so, not an engine failure; versions recorded under the
    embedded model's hub id (before the engine's name was recorded) still serve."""
    import openai
    from sqlalchemy import update

    from adapter_registry.models import AdapterVersion

    t = platform.tenant()
    for name, path in (("old", "/models/SmolLM2-135M-Instruct"), ("legacy", "HuggingFaceTB/SmolLM2-135M-Instruct")):
        r = post(platform, t.name, name, saved_from(tmp_path / name, path))  # different bytes: two versions
        assert r.status_code == 201 and r.json()["status"] == "ready", r.text
    # The versions' ids first: the gateway's reads wait while this test's transaction holds the write lock.
    sha = {name: platform.admin.get(f"/admin/v1/tenants/{t.name}/adapters/{name}").json()["versions"][0]["sha256"]
           for name in ("old", "legacy")}
    with platform.gateway.session_factory() as s:
        for name, base in (("old", "Qwen/Qwen2.5-7B-Instruct"), ("legacy", "HuggingFaceTB/SmolLM2-135M-Instruct")):
            s.execute(update(AdapterVersion).where(AdapterVersion.sha256 == sha[name]).values(base_model=base))
        s.commit()
    client = platform.openai(t)
    with pytest.raises(openai.ConflictError) as e:
        client.chat.completions.create(model="old", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.body["code"] == "adapter_base_not_served" and e.value.body["param"] == "model"
    assert e.value.body["message"] == (f"adapter version old@1 was trained for base model Qwen/Qwen2.5-7B-Instruct, and "
                                       f"this platform now serves {SMOL}; upload a version trained for {SMOL}")
    assert client.chat.completions.create(model="legacy", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1).choices

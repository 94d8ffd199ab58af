"""The admin web UI end to end in a real browser: Debian's Chromium, headless, driven by
Playwright against the real app on loopback. An admin signs in with the keyboard, creates a plan
and a tenant, uploads a trained PEFT adapter and watches it become ready, sees a pickle upload
refused with its reason, issues a key, calls /v1/chat/completions with it through the openai
client, finds the request in the usage chart, and suspends the tenant.

Screenshots of every page at 1280 and 390 px wide go to test-artifacts/ui-screenshots/.
"""
from __future__ import annotations

import re
import uuid
from pathlib import Path

import openai
import pytest
import torch

from .conftest import ADMIN_TOKEN
from .ui_browser import (  # noqa: F401 (chromium_browser: the browser fixture)
    PIRATE, ROOT, browser_context, chromium_browser, evidence, keep_texts, seen_texts, shot,
    sign_in_on_the_way, watched_page)

UPPER = ROOT / "platform" / "tessera" / "demo_adapters" / "upper"

pytestmark = pytest.mark.usefixtures("needs_chromium")  # missing: skip, or fail under CI=true


@pytest.fixture()
def context(browser, platform):
    with browser_context(browser, platform) as ctx:
        ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=platform.url)
        yield ctx


def sign_in(page) -> None:
    sign_in_on_the_way(page, "/admin/tenants")
    # The login page's own URL ends in "next=/admin/tenants": wait for the path, not the suffix.
    page.wait_for_url(re.compile(r"^[^?]*/admin/tenants$"))


def pickle_adapter(dest: Path) -> Path:
    """A PEFT adapter saved the old way: adapter_model.bin, a pickle."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_text((PIRATE / "adapter_config.json").read_text())
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 576)},
               dest / "adapter_model.bin")
    return dest


def budget_text(remaining) -> str:
    """What the SLO page writes for an error budget remaining (slo.js budgetBar)."""
    if remaining is None:
        return "no traffic yet"
    return f"overspent by {-remaining * 100:.0f}%" if remaining < 0 else f"{remaining * 100:.0f}% left"


def burn_text(rate) -> str:
    """What the SLO page writes for a burn rate (slo.js burn)."""
    if rate is None:
        return "—"
    return f"{rate:.0f}×" if rate >= 10 else f"{rate:.2f}×"


def check_usage_chart(page, tenant: str, used_tokens: int) -> None:
    page.locator("#usage-tokens").wait_for()
    datasets = page.evaluate("""() => Chart.getChart(document.getElementById('usage-tokens')).data.datasets
        .map(d => ({label: d.label, total: d.data.reduce((a, b) => a + b, 0)}))""")
    assert {"label": "pirate", "total": used_tokens} in datasets, datasets
    row = page.locator("#usage-table tr[data-series='pirate']")
    assert row.locator("td").first.inner_text() == "1"  # one request
    page.get_by_label("Break down by").select_option("priority")
    page.locator("#usage-table tr[data-series='standard']").wait_for()
    page.get_by_label("Break down by").select_option("tenant")
    page.locator(f"#usage-table tr[data-series='{tenant}']").wait_for()
    page.get_by_label("Break down by").select_option("adapter")
    page.locator("#usage-tokens").wait_for()


def test_pages_without_a_session_show_sign_in(context):
    page = context.new_page()
    for path in ("/admin/keys", "/admin/usage", "/admin/adapters?tenant=x"):
        page.goto(path)
        page.wait_for_url("**/admin/login?next=**")
        assert page.get_by_label("Admin password").is_visible()
        assert page.locator("#main").inner_text().count("Tenants") == 0  # no page content leaks
    page.get_by_label("Admin password").fill("wrong password")
    page.get_by_role("button", name="Sign in").click()
    assert "not right" in page.get_by_role("alert").inner_text()
    shot(page, "sign-in-error")
    # The right password takes the admin to the page first asked for, query included.
    page.get_by_label("Admin password").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r"/admin/adapters\?tenant=x$"))


def test_admin_runs_a_tenant_end_to_end(context, platform, tmp_path):
    if not (PIRATE.is_dir() and UPPER.is_dir()):
        pytest.skip("the demo adapters 'pirate' and 'upper' are not there")
    page, script_errors = watched_page(context)
    with evidence(page, "end-to-end"):
        page.goto("/admin/login")
        shot(page, "sign-in")
        sign_in(page)

        # A plan, then a tenant on it.
        plan, tenant = f"ui-plan-{uuid.uuid4().hex[:6]}", f"ui-{uuid.uuid4().hex[:8]}"
        page.get_by_label("Plan name").fill(plan)
        page.get_by_label("Requests per minute").last.fill("120")
        page.get_by_label("realtime").last.check()
        page.get_by_role("button", name="Save plan").click()
        page.get_by_role("cell", name=plan, exact=True).wait_for()
        create = page.get_by_role("region", name="Create a tenant")
        create.get_by_label("Name").fill(tenant)
        create.get_by_label("Plan").select_option(plan)
        create.get_by_role("button", name="Create tenant").click()
        page.wait_for_url(f"**/admin/tenants/{tenant}")
        assert page.get_by_role("heading", level=1).inner_text().startswith(tenant)

        # Quotas: override tokens per minute for this tenant only.
        page.get_by_label("Tokens per minute").fill("50000")
        page.get_by_role("button", name="Save quotas").click()
        page.get_by_text(f"Quotas of {tenant} saved").wait_for()
        policy = platform.admin.get(f"/admin/v1/tenants/{tenant}").json()["policy"]
        assert (policy["plan"], policy["requests_per_minute"], policy["tokens_per_minute"]) == (plan, 120, 50000)
        # SLO objectives: a stricter availability target for this tenant only.
        page.get_by_label("Availability target").fill("0.999")
        page.get_by_role("button", name="Save objectives").click()
        page.get_by_text(f"SLO objectives of {tenant} saved").wait_for()
        slo = platform.admin.get(f"/admin/v1/tenants/{tenant}/slo").json()
        assert slo["objectives"]["availability"]["target"] == 0.999
        assert slo["overrides"]["availability_target"] == 0.999 and slo["overrides"]["ttft_target"] is None
        shot(page, "tenant")

        # Upload the trained PEFT adapter through the page; the status goes validating -> ready.
        page.get_by_role("link", name="Adapters", exact=True).click()  # opens on the tenant just edited
        page.get_by_role("heading", name=f"Upload an adapter for {tenant}").wait_for()
        keep_texts(page, ".upload-status")
        page.get_by_label("Adapter name").fill("pirate")
        page.set_input_files("#adapter-files", [str(PIRATE / "adapter_config.json"), str(PIRATE / "adapter_model.safetensors")])
        page.get_by_role("button", name="Upload").click()
        status = page.locator(".upload-status")
        status.get_by_text("is ready").wait_for()
        assert "pirate@1 is ready" in status.inner_text()
        seen = seen_texts(page)
        assert any("validating" in s for s in seen), seen
        assert page.locator("progress").get_attribute("value") == "100"
        card = page.get_by_role("region", name="Adapter pirate")
        assert "current: version 1" in card.inner_text()

        # A pickle checkpoint is refused, and the page says why in words.
        bad = pickle_adapter(tmp_path / "pickled")
        page.get_by_label("Adapter name").fill("pickled")
        page.set_input_files("#adapter-files", [str(bad / "adapter_config.json"), str(bad / "adapter_model.bin")])
        page.get_by_role("button", name="Upload").click()
        alert = page.get_by_role("alert")
        alert.wait_for()
        assert "adapter_model.bin is a pickle file, which is refused" in alert.inner_text()
        assert page.get_by_role("region", name="Adapter pickled").count() == 0

        # A second version becomes current; the admin points back at version 1 and deletes 2.
        page.get_by_label("Adapter name").fill("pirate")
        page.set_input_files("#adapter-files", [str(UPPER / "adapter_config.json"), str(UPPER / "adapter_model.safetensors")])
        page.get_by_role("button", name="Upload").click()
        status.get_by_text("pirate@2 is ready").wait_for()
        card.get_by_text("current: version 2").wait_for()
        card.get_by_role("button", name="Make current pirate@1").click()
        card.get_by_text("current: version 1").wait_for()
        card.get_by_role("button", name="Delete version pirate@2").click()
        page.get_by_role("dialog").get_by_role("button", name="Delete version").click()
        card.locator("tr", has_text="pirate@2").wait_for(state="detached")
        versions = platform.admin.get(f"/admin/v1/tenants/{tenant}/adapters/pirate").json()["versions"]
        assert [(v["version"], v["current"]) for v in versions] == [(1, True)]
        shot(page, "adapters")

        # Issue a key: the secret is shown once, with a copy button.
        page.get_by_role("link", name="Keys", exact=True).first.click()
        page.get_by_role("heading", name=f"Issue a key for {tenant}").wait_for()
        page.get_by_label("Key name (optional)").fill("from-the-ui")
        page.get_by_role("button", name="Issue key").click()
        secret = page.get_by_label("New API key")
        key = secret.input_value()
        assert key.startswith("tsk-")
        page.get_by_role("button", name="Copy key").click()
        page.get_by_text("Copied to the clipboard").wait_for()
        assert page.evaluate("navigator.clipboard.readText()") == key
        row = page.locator("tr", has_text="from-the-ui")
        assert key[:16] in row.inner_text() and key not in page.locator("table").inner_text()
        shot(page, "keys")

        # The tenant calls the API with that key and adapter, through the official client.
        client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="pirate", max_tokens=12,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
        used = answer.usage.prompt_tokens + answer.usage.completion_tokens

        # ... and the request shows in the usage chart, per adapter, priority class and tenant.
        page.goto(f"/admin/usage?tenant={tenant}&by=adapter&period=24h")
        check_usage_chart(page, tenant, used)
        shot(page, "usage")

        # Billing: the month's row shows the request and its tokens, as the API reports them
        # after a rollup (the amount depends on the session's shared price book; not asserted).
        assert platform.admin.post("/admin/v1/billing/rollup").status_code == 200
        month = platform.admin.get(f"/admin/v1/tenants/{tenant}/billing/periods").json()["data"][0]
        assert month["status"] == "open" and int(month["pending"]["requests"]) == 1
        assert int(month["pending"]["input_tokens"]) + int(month["pending"]["output_tokens"]) == used
        page.goto(f"/admin/billing?tenant={tenant}")
        row = page.locator(f"#periods tr[data-period='{month['period']}']")
        row.wait_for()
        assert row.locator("td[data-label='Requests']").inner_text().strip() == "1"
        assert row.locator("td[data-label='Tokens']").inner_text().strip().replace(",", "") == str(used)
        assert "open" in row.locator("td[data-label='Status']").inner_text()
        shot(page, "billing")

        # SLOs: the tenant's card shows its own objective (set above), and the budget, burn rates
        # and firing alerts the API computes from its usage (the TTFT ones depend on this
        # machine's speed, so they are read from the API, not assumed).
        slo_doc = next(t for t in platform.admin.get("/admin/v1/slo").json()["tenants"] if t["tenant"] == tenant)
        assert slo_doc["status"]["availability"]["target"] == 0.999
        assert slo_doc["status"]["availability"]["error_budget_remaining"] == 1.0  # its one request succeeded
        page.goto(f"/admin/slo?tenant={tenant}")
        card = page.get_by_role("region", name=f"SLOs of {tenant}")
        card.wait_for()
        assert card.locator("tr", has_text="Availability").locator(
            "td[data-label='Objective']").inner_text() == "99.90% of requests succeed"
        for label, name in (("Availability", "availability"), ("Time to first token", "ttft"),
                            ("Time per output token", "tpot")):
            s_ = slo_doc["status"][name]
            r = card.locator("tr", has_text=label)
            assert r.locator("td[data-label='Error budget (30 days)']").inner_text().strip() == budget_text(
                s_["error_budget_remaining"]), label
            for w in ("5m", "1h", "6h", "1d", "3d"):
                assert r.locator(f"td[data-label='Burn {w}']").inner_text().strip() == burn_text(
                    s_["burn_rates"][w]), (label, w)
        firing = [a for a in slo_doc["alerts"] if a["state"] == "firing"]
        badge = f"{len(firing)} firing" if firing else "healthy"
        assert card.locator(".title-row .badge").inner_text() == badge
        assert page.locator(".alerts li").count() == len(firing)
        shot(page, "slo")

        # Suspend from the tenant's page: the key is refused with 403 at once.
        page.goto(f"/admin/tenants/{tenant}")
        page.get_by_role("button", name="Suspend tenant").click()
        page.get_by_role("dialog").get_by_role("button", name="Suspend").click()
        page.get_by_role("button", name="Reactivate tenant").wait_for()
        with pytest.raises(openai.PermissionDeniedError):
            client.models.list()
        page.goto("/admin/tenants")
        assert "suspended" in page.locator("tr", has_text=tenant).inner_text()
        shot(page, "tenants")

        # Revoke the key from the Keys page: it is refused from the next request on.
        page.goto(f"/admin/keys?tenant={tenant}")
        page.get_by_role("button", name=f"Revoke key {key[:16]}").click()
        page.get_by_role("dialog").get_by_role("button", name="Revoke key").click()
        page.locator("tr", has_text="from-the-ui").get_by_text("revoked").wait_for()
        platform.admin.patch(f"/admin/v1/tenants/{tenant}", json={"status": "active"})
        with pytest.raises(openai.AuthenticationError):
            client.models.list()

        # Signing out ends the session: the pages send the browser back to sign in.
        page.get_by_role("button", name="Sign out").click()
        page.wait_for_url(re.compile(r"/admin/login$"))
        page.goto("/admin/tenants")
        page.wait_for_url("**/admin/login?next=**")
        assert not script_errors, script_errors

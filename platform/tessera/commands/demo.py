"""`tessera demo`: the whole platform on one machine with the embedded defaults (SQLite under
./var, local object store, eager validation, in-memory quotas, the engine in this process on
CPU). It creates the demo tenant with a fresh key, uploads the demo adapters, starts the server
and prints a curl and an openai-client example that work when pasted.

`--self-test` runs both examples against the server itself and exits (0 when they worked).
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
import time
from pathlib import Path

DEMO_TENANT = "demo"
DEMO_PLAN = "demo"
ADAPTERS_DIR = Path(__file__).resolve().parent.parent / "demo_adapters"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole platform embedded, with a demo tenant, key and adapters")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000, or TESSERA_PORT)")
    p.add_argument("--self-test", action="store_true", help="run the printed examples against the server, then exit")
    p.set_defaults(func=run)


def _setup(settings) -> tuple[str, list[str]]:
    """Migrate, ensure the demo plan/tenant, issue a key, upload the adapters; (key, adapter names)."""
    from adapter_registry import services as registry
    from adapter_registry.context import build_context
    from adapter_registry.errors import NotFound, RegistryError
    from adapter_registry.migrate import upgrade
    from tessera import services

    if settings.database_url.startswith("sqlite"):
        upgrade(settings)
    ctx = build_context(settings)
    names = []
    with ctx.session_factory() as s:
        services.upsert_plan(session=s, name="default", requests_per_minute=60, tokens_per_minute=100_000,
                             max_concurrent_requests=8)
        services.upsert_plan(session=s, name=DEMO_PLAN, requests_per_minute=600, tokens_per_minute=1_000_000,
                             max_concurrent_requests=32, monthly_token_budget=50_000_000,
                             allowed_priorities=["realtime", "standard", "batch"], default_priority="standard")
        try:
            tenant = registry.get_tenant(session=s, name=DEMO_TENANT)
        except NotFound:
            tenant = services.create_tenant(session=s, name=DEMO_TENANT, plan=DEMO_PLAN)
        _, key = services.issue_key(session=s, tenant=tenant, name="demo")
        _seed_prices(s)
        folders = sorted(p for p in ADAPTERS_DIR.iterdir() if p.is_dir()) if ADAPTERS_DIR.is_dir() else []
        for folder in folders:
            if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
                print(f"tessera demo: skipping adapter {folder.name!r}: its files are not there (yet)", file=sys.stderr)
                continue
            try:
                v = registry.upload_adapter(session=s, store=ctx.store, settings=settings, tenant=tenant,
                                            name=folder.name, source=folder)
            except RegistryError as e:
                print(f"tessera demo: skipping adapter {folder.name!r}: {e}", file=sys.stderr)
                continue
            if v.status == "ready":
                names.append(folder.name)
            else:
                print(f"tessera demo: adapter {folder.name!r} is {v.status}: {v.rejection_reason}", file=sys.stderr)
    ctx.engine.dispose()
    return key, names


# Demo price book (micro-USD per million tokens) for the embedded model, set only when the book
# has no price for it yet: realtime costs twice standard, batch half.
DEMO_PRICES = {"realtime": (200_000, 800_000), "standard": (100_000, 400_000), "batch": (50_000, 200_000)}


def _seed_prices(session) -> None:
    from datetime import date

    from sqlalchemy import select

    from engine.loader.gguf_loader import DEFAULT_MODEL_NAME
    from tessera.billing.models import Price
    from tessera.billing.prices import set_price

    if session.scalar(select(Price.id).where(Price.base_model == DEFAULT_MODEL_NAME).limit(1)) is not None:
        return
    for priority, (inp, out) in DEMO_PRICES.items():
        for kind, micros in (("input", inp), ("output", out)):
            set_price(session=session, base_model=DEFAULT_MODEL_NAME, priority=priority, token_kind=kind,
                      micros_per_mtok=micros, effective_from=date(2026, 1, 1))


def examples(url: str, key: str, model: str) -> str:
    """The copy-paste examples: curl (streamed SSE) and the openai client (this interpreter)."""
    py = sys.executable
    return f"""
Tessera is running at {url}  (tenant {DEMO_TENANT!r}; models: GET /v1/models)

curl, streamed:
  curl -N {url}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Which color is a plum?"}}], "max_tokens": 48, "stream": true}}'

openai client:
{py} - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{key}")
stream = client.chat.completions.create(model="{model}", max_tokens=48, stream=True,
    messages=[{{"role": "user", "content": "Which color is a plum?"}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF
"""


def _self_test(url: str, key: str, model: str) -> bool:
    import httpx
    from openai import OpenAI

    body = {"model": model, "messages": [{"role": "user", "content": "Which color is a plum?"}],
            "max_tokens": 16, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"}) as r:
        lines = [line for line in r.iter_lines() if line]
    ok_curl = r.status_code == 200 and lines[-1] == "data: [DONE]"
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    text = "".join((c.choices[0].delta.content or "") for c in client.chat.completions.create(
        model=model, max_tokens=16, stream=True, messages=[{"role": "user", "content": "Which color is a plum?"}]))
    print(f"self-test: curl-style stream {'ok' if ok_curl else 'FAILED'}; openai client answered {text!r}", flush=True)
    return ok_curl and bool(text)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tessera.app import create_app
    from tessera.commands.serve import check_port_free, load_settings

    admin = os.environ.get("TESSERA_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    settings = load_settings(host=args.host, port=args.port, admin_token=admin,
                             engine_mode="inprocess", redis_url=None, celery_eager=True,
                             # usage shows up priced in the web UI within a minute
                             billing_rollup_interval_s=None if "TESSERA_BILLING_ROLLUP_INTERVAL_S" in os.environ else 60.0)
    check_port_free(settings.host, settings.port)
    key, adapters = _setup(settings)
    model = "pirate" if "pirate" in adapters else (adapters[0] if adapters else "SmolLM2-135M-Instruct")
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                                           log_level="warning"))
    url = f"http://{settings.host}:{settings.port}"
    result = {"ok": True}

    def announce():
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.1)
        print(examples(url, key, model), flush=True)
        print(f"Admin API: {url}/admin/v1 with header 'Authorization: Bearer {admin}'. "
              f"Demo adapters: {', '.join(adapters) or 'none'}.", flush=True)
        print(f"Admin web UI: {url}/admin (password: the admin token above, unless TESSERA_ADMIN_PASSWORD is set).",
              flush=True)
        if args.self_test:
            try:
                result["ok"] = _self_test(url, key, model)
            except Exception as e:  # noqa: BLE001 - any failure is a failed self-test
                print(f"self-test failed: {type(e).__name__}: {e}", flush=True)
                result["ok"] = False
            server.should_exit = True
        else:
            print("Press Ctrl+C to stop.", flush=True)

    print("tessera demo: loading the engine (SmolLM2-135M on CPU)...", flush=True)
    threading.Thread(target=announce, daemon=True).start()
    server.run()
    return 0 if result["ok"] else 1

"""`tessera demo`: the whole platform on one machine with the embedded defaults (SQLite under
./var, local object store, eager validation, in-memory quotas, the engine in this process on
CPU). It creates the demo tenant with a fresh key, uploads the demo adapters, starts the server
and prints what works when pasted: a curl and an openai-client example, a tool-call round trip
with the `weather-tools` adapter (openai client: the request with `tools`, the call it returns,
the tool's result sent back, the answer), an admin API call and an adapter upload (curl), and
where the admin web UI signs in.

`--model PATH` (or TESSERA_MODEL_PATH; served as TESSERA_MODEL_NAME when set) serves another base
model: a .gguf file or a Hugging Face checkpoint directory. The demo adapters were trained on the
embedded SmolLM2; for any other model they are not uploaded (one printed line says why), and the
printed commands talk to that model and show how to upload an adapter trained for it.

`--self-test` does the same against the server itself and exits (0 when all of it worked): the
streamed chat as curl sends it, the openai client, the tool round trip (when weather-tools is
uploaded), the admin API call, signing in to the web UI with the admin password (then a page and
an admin API call on the session cookie), an upload of a demo adapter under a new name through
the admin API, and a chat with that adapter.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path

DEMO_TENANT = "demo"
DEMO_PLAN = "demo"
ADAPTERS_DIR = Path(__file__).resolve().parent.parent / "demo_adapters"
#: The demo adapter trained to call tools (scripts/train_demo_adapters.py), and the tool it was
#: trained with, as the printed example sends it.
TOOLS_ADAPTER = "weather-tools"
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole platform embedded, with a demo tenant, key and adapters")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000, or TESSERA_PORT)")
    p.add_argument("--self-test", action="store_true", help="run the printed examples against the server, then exit")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="the base model to serve: a .gguf file or a Hugging Face checkpoint directory "
                        "(default: TESSERA_MODEL_PATH, else the embedded SmolLM2)")
    p.set_defaults(func=run)


def demo_adapters_for(settings) -> tuple[list[Path], str | None]:
    """(the demo adapter folders whose files are there and whose base is the served model, a
    line saying why the others are not uploaded or None). `settings` serve the model."""
    from adapter_registry.validation import AdapterRejected, read_adapter_config, resolve_base_model

    folders = sorted(p for p in ADAPTERS_DIR.iterdir() if p.is_dir()) if ADAPTERS_DIR.is_dir() else []
    fitting, other_bases = [], {}
    for folder in folders:
        if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
            print(f"tessera demo: skipping adapter {folder.name!r}: its files are not there (yet)", file=sys.stderr)
            continue
        try:
            trained_for = read_adapter_config(folder / "adapter_config.json").get("base_model_name_or_path")
            resolve_base_model(trained_for, settings.served_names, settings.aliases)
        except AdapterRejected:
            other_bases.setdefault(str(trained_for), []).append(folder.name)
            continue
        fitting.append(folder)
    if not other_bases:
        return fitting, None
    served = settings.served_base_models[0]
    names = ", ".join(n for group in other_bases.values() for n in group)
    return fitting, (f"tessera demo: not uploading the demo adapters ({names}): they were trained for "
                     f"{' and '.join(other_bases)}, and this demo serves {served.label}")


def _setup(settings) -> tuple[str, list[str]]:
    """Migrate, ensure the demo plan/tenant, issue a key, upload the demo adapters trained for the
    served model (`settings` serve it); (key, adapter names)."""
    from adapter_registry import services as registry
    from adapter_registry.errors import NotFound
    from adapter_registry.migrate import upgrade
    from engine.sampling_params import PRIORITY_NAMES, Priority
    from tessera import services
    from tessera_core.context import build_context
    from tessera_core.errors import TesseraError

    if settings.database_url.startswith("sqlite"):
        upgrade(settings)
    ctx = build_context(settings)
    names = []
    with ctx.session_factory() as s:
        services.upsert_plan(session=s, name="default", requests_per_minute=60, tokens_per_minute=100_000,
                             max_concurrent_requests=8)
        services.upsert_plan(session=s, name=DEMO_PLAN, requests_per_minute=600, tokens_per_minute=1_000_000,
                             max_concurrent_requests=32, monthly_token_budget=50_000_000,
                             allowed_priorities=list(PRIORITY_NAMES), default_priority=Priority.standard.name)
        try:
            tenant = registry.get_tenant(session=s, name=DEMO_TENANT)
        except NotFound:
            tenant = services.create_tenant(session=s, name=DEMO_TENANT, plan=DEMO_PLAN)
        _, key = services.issue_key(session=s, tenant=tenant, name="demo")
        _seed_prices(s, settings.served_names[0])
        folders, skipped = demo_adapters_for(settings)
        if skipped:
            print(skipped, flush=True)
        for folder in folders:
            try:
                v = registry.upload_adapter(session=s, store=ctx.store, settings=settings, tenant=tenant,
                                            name=folder.name, source=folder)
            except TesseraError as e:  # the registry's, the object store's
                print(f"tessera demo: skipping adapter {folder.name!r}: {e}", file=sys.stderr)
                continue
            if v.status == "ready":
                names.append(folder.name)
            else:
                print(f"tessera demo: adapter {folder.name!r} is {v.status}: {v.rejection_reason}", file=sys.stderr)
    ctx.engine.dispose()
    return key, names


def _seed_prices(session, model: str) -> None:
    """Set a demo price book for the served `model`, only when the book has no price for it yet."""
    from datetime import date

    from sqlalchemy import select

    from engine.sampling_params import Priority
    from tessera.billing.models import Price
    from tessera.billing.prices import set_price

    # Micro-USD per million (input, output) tokens: realtime costs twice standard, batch half.
    demo_prices = {Priority.realtime: (200_000, 800_000), Priority.standard: (100_000, 400_000),
                   Priority.batch: (50_000, 200_000)}
    if session.scalar(select(Price.id).where(Price.base_model == model).limit(1)) is not None:
        return
    for priority, (inp, out) in demo_prices.items():
        for kind, micros in (("input", inp), ("output", out)):
            set_price(session=session, base_model=model, priority=priority.name, token_kind=kind,
                      micros_per_mtok=micros, effective_from=date(2026, 1, 1))


def examples(url: str, key: str, model: str, tools_model: str | None = None) -> str:
    """The copy-paste examples: curl (streamed SSE) and the openai client (this interpreter); with
    `tools_model` (the weather-tools adapter, when uploaded), a tool-call round trip through it."""
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
""" + (tools_example(url, key, tools_model) if tools_model else "")


def tools_example(url: str, key: str, model: str) -> str:
    """The tool round trip (openai client): a request with `tools`, the model's call, the tool's
    result sent back in a `tool` message, the model's answer from it."""
    return f"""
tools, a round trip with the {model} adapter (it calls get_weather, then answers from the result):
{sys.executable} - <<'EOF'
import json
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{key}")
tools = {json.dumps([GET_WEATHER])}
messages = [{{"role": "user", "content": "What's the weather like in Edinburgh?"}}]
reply = client.chat.completions.create(model="{model}", messages=messages, tools=tools, temperature=0, max_tokens=64)
call = reply.choices[0].message.tool_calls[0]  # finish_reason: "tool_calls"
print("call:", call.function.name, call.function.arguments)
city = json.loads(call.function.arguments)["city"]
result = {{"city": city, "temperature_c": 14, "condition": "rainy"}}  # your get_weather runs here
messages += [reply.choices[0].message, {{"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}}]
answer = client.chat.completions.create(model="{model}", messages=messages, tools=tools, temperature=0, max_tokens=64)
print("answer:", answer.choices[0].message.content)
EOF
"""


def admin_examples(url: str, admin: str, adapters: list[str], base=None) -> str:
    """The admin side: an admin API call, an adapter upload (curl) and the web UI's address. With
    no demo adapter for the served model (`base`, a BaseModelShape), the upload names a folder of
    the user's own, trained for that model."""
    if adapters or base is None:
        folder, trained = ADAPTERS_DIR / (adapters[0] if adapters else "pirate"), ""
    else:
        folder = Path("/path/to/your-adapter")
        trained = (f"\n(a PEFT LoRA adapter trained on {base.name}; its LoRA-able modules: "
                   f"{', '.join(base.module_names)})")
    return f"""
Admin API: {url}/admin/v1 with header 'Authorization: Bearer {admin}'. Demo adapters: {', '.join(adapters) or 'none'}.
  curl {url}/admin/v1/tenants/{DEMO_TENANT}/adapters -H "Authorization: Bearer {admin}"

upload an adapter for tenant {DEMO_TENANT!r} (adapter_config.json + adapter_model.safetensors, or one .zip of them):{trained}
  curl {url}/admin/v1/tenants/{DEMO_TENANT}/adapters/my-adapter/versions -H "Authorization: Bearer {admin}" \\
    -F "files=@{folder}/adapter_config.json" -F "files=@{folder}/adapter_model.safetensors"

Admin web UI: {url}/admin (password: the admin token above, unless TESSERA_ADMIN_PASSWORD is set).
"""


def _served_base(settings):
    """The served model's description, from its files (the engine loads once the server starts);
    CLIError with one line when they cannot be read."""
    from tessera.cli import CLIError
    from tessera.served_model import describe_model_files

    try:
        return describe_model_files(settings.model_path, settings.model_name)[1]
    except (FileNotFoundError, ValueError) as e:
        where = f"--model {settings.model_path}" if settings.model_path else "the embedded model"
        raise CLIError(f"{where} cannot be served: {e}") from None


def _serving(settings, base):
    """`settings` serving `base`; CLIError with one line when an alias names another model."""
    from tessera.cli import CLIError

    try:
        return settings.serving([base])
    except ValueError as e:
        raise CLIError(f"settings: {e}") from None


class _SelfTest:
    """What the demo prints, run as a user would (`--self-test`): one method per printed example,
    each answering (worked, a note for its line of output)."""

    QUESTION = [{"role": "user", "content": "Which color is a plum?"}]

    def __init__(self, url: str, key: str, model: str, *, admin: str, password: str | None, adapters: list[str]):
        from openai import OpenAI

        self.url, self.key, self.model = url, key, model
        self.admin_headers = {"authorization": f"Bearer {admin}"}
        self.password, self.adapters = password, adapters
        self.client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        self.uploaded: str | None = None

    def run(self) -> bool:
        """Every step in the order the demo prints them; one line each; True when all worked.
        Without a demo adapter for the served model, the upload steps are skipped (said so)."""
        steps = [("curl-style stream", self.curl_stream), ("openai client", lambda: self.chat(self.model))]
        if TOOLS_ADAPTER in self.adapters:
            steps.append(("tool round trip", self.tool_round_trip))
        steps += [("admin API call", self.admin_call), ("admin web UI sign-in", self.sign_in)]
        if self.adapters:
            steps += [("adapter upload", self.upload), ("chat with the uploaded adapter", self.chat_uploaded)]
        ok = all([self._step(name, fn) for name, fn in steps])
        if not self.adapters:
            print("self-test: adapter upload skipped; no demo adapter was trained for the served model", flush=True)
        return ok

    @staticmethod
    def _step(name: str, fn) -> bool:
        try:
            ok, note = fn()
        except Exception as e:  # noqa: BLE001 - any failure is a failed step
            ok, note = False, f"{type(e).__name__}: {e}"
        print(f"self-test: {name} {'ok' if ok else 'FAILED'}{'; ' + note if note else ''}", flush=True)
        return ok

    def curl_stream(self) -> tuple[bool, str]:
        import httpx

        body = {"model": self.model, "messages": self.QUESTION, "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {self.key}"}) as r:
            lines = [line for line in r.iter_lines() if line]
        return r.status_code == 200 and lines[-1] == "data: [DONE]", ""

    def chat(self, model: str) -> tuple[bool, str]:
        """The printed openai example (sampled, as printed): a streamed reply that ends with a
        finish_reason. Its text may be empty only where the model ended its turn at once
        (finish_reason "stop"): a sampled first token can be the end of turn, most often on a
        random-weight checkpoint, and that reply is still the API working."""
        text, finish = "", None
        for chunk in self.client.chat.completions.create(model=model, max_tokens=16, stream=True,
                                                         messages=self.QUESTION):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        ok = finish in ("stop", "length") and (bool(text) or finish == "stop")
        return ok, f"{model} answered {text!r}" + ("" if ok and text else f" (finish_reason {finish!r})")

    def tool_round_trip(self) -> tuple[bool, str]:
        """The printed tool example: a get_weather call, its result sent back, an answer from it."""
        messages = [{"role": "user", "content": "What's the weather like in Edinburgh?"}]
        reply = self.client.chat.completions.create(model=TOOLS_ADAPTER, messages=messages, tools=[GET_WEATHER],
                                                    temperature=0, max_tokens=64)
        choice = reply.choices[0]
        if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
            return False, f"no call: finish_reason {choice.finish_reason!r}, content {choice.message.content!r}"
        call = choice.message.tool_calls[0]
        city = json.loads(call.function.arguments).get("city")
        result = {"city": city, "temperature_c": 14, "condition": "rainy"}
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
        answer = self.client.chat.completions.create(model=TOOLS_ADAPTER, messages=messages, tools=[GET_WEATHER],
                                                     temperature=0, max_tokens=64).choices[0].message.content or ""
        return (call.function.name == "get_weather" and "14" in answer,
                f"{call.function.name}({call.function.arguments}), then {answer!r}")

    def chat_uploaded(self) -> tuple[bool, str]:
        return self.chat(self.uploaded) if self.uploaded else (False, "nothing was uploaded")

    def admin_call(self) -> tuple[bool, str]:
        import httpx

        r = httpx.get(f"{self.url}/admin/v1/tenants/{DEMO_TENANT}/adapters", headers=self.admin_headers, timeout=30)
        listed = {a["name"] for a in r.json().get("data", [])} if r.status_code == 200 else set()
        return r.status_code == 200 and set(self.adapters) <= listed, f"HTTP {r.status_code}"

    def sign_in(self) -> tuple[bool, str]:
        import httpx

        with httpx.Client(base_url=self.url, timeout=30) as c:
            r = c.post("/admin/session", json={"password": self.password or ""})
            if r.status_code != 204:
                return False, f"sign-in answered HTTP {r.status_code}"
            # Signed in, /admin leads to the tenants page (without a session: to the sign-in page).
            page, api = c.get("/admin", follow_redirects=True), c.get("/admin/v1/tenants")
            return (page.status_code == 200 and page.url.path == "/admin/tenants" and api.status_code == 200,
                    f"/admin showed {page.url.path} (HTTP {page.status_code}), admin API on the session "
                    f"HTTP {api.status_code}")

    def upload(self) -> tuple[bool, str]:
        import io
        import zipfile

        import httpx

        source = ADAPTERS_DIR / (self.adapters[0] if self.adapters else "pirate")
        name = f"self-test-{secrets.token_hex(3)}"
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                z.write(source / f, f)
        r = httpx.post(f"{self.url}/admin/v1/tenants/{DEMO_TENANT}/adapters/{name}/versions",
                       headers=self.admin_headers, timeout=300,
                       files={"files": (f"{name}.zip", buf.getvalue(), "application/zip")})
        status = r.json().get("status") if r.status_code == 201 else None
        if status == "ready":
            self.uploaded = name
        return status == "ready", f"{name} (a zip of {source.name}): HTTP {r.status_code}, {status or r.text[:200]}"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tessera.admin_session import admin_password
    from tessera.app import create_app
    from tessera.commands.serve import check_port_free, load_settings
    from tessera.http_server import server_options

    admin = os.environ.get("TESSERA_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    settings = load_settings(host=args.host, port=args.port, admin_token=admin, model_path=args.model,
                             engine_mode="inprocess", redis_url=None, celery_eager=True,
                             # usage shows up priced in the web UI within a minute
                             billing_rollup_interval_s=None if "TESSERA_BILLING_ROLLUP_INTERVAL_S" in os.environ else 60.0)
    check_port_free(settings.host, settings.port)
    if settings.metrics_port is not None:
        check_port_free(settings.host, settings.metrics_port)
    base = _served_base(settings)
    key, adapters = _setup(_serving(settings, base))
    model = "pirate" if "pirate" in adapters else (adapters[0] if adapters else base.name)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                                           log_level="warning", **server_options(settings)))
    url = f"http://{settings.host}:{settings.port}"
    result = {"ok": True}

    def announce():
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.1)
        print(examples(url, key, model, TOOLS_ADAPTER if TOOLS_ADAPTER in adapters else None), flush=True)
        print(admin_examples(url, admin, adapters, base), flush=True)
        if args.self_test:
            try:
                result["ok"] = _SelfTest(url, key, model, admin=admin, password=admin_password(settings),
                                         adapters=adapters).run()
            except Exception as e:  # noqa: BLE001 - any failure is a failed self-test
                print(f"self-test failed: {type(e).__name__}: {e}", flush=True)
                result["ok"] = False
            server.should_exit = True
        else:
            print("Press Ctrl+C to stop.", flush=True)

    if settings.metrics_port is not None:
        from tessera.observability.exposure import start_listener

        start_listener(settings)
    print(f"tessera demo: loading the engine ({base.name}, {base.architecture}, on CPU)...", flush=True)
    from engine.backends import show_choices_on_stderr

    show_choices_on_stderr()  # what the backend chose at start (the CPU weight formats), one line
    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn shuts down on Ctrl+C, then re-raises it: stopping is how a demo ends.
        print("tessera demo: stopped.", flush=True)
    return 0 if result["ok"] else 1

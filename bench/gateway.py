"""Added latency of the gateway (auth + quota + metering + SSE over HTTP) over the engine itself.

The real app runs under uvicorn in this process with the in-process engine (embedded settings:
SQLite, in-memory quotas). A load generator in a separate process streams chat completions
(max_tokens small, greedy) at concurrency 1 and 32 and reports each request's end-to-end time.
The engine client is wrapped to time, per request, the span from handing the request to the
engine to its last delta; a request's added latency is its end-to-end time minus that span
(so it includes the HTTP round trip itself; http_roundtrip_ms_p50_c1 is a bare GET /health on the
same server and client, for scale).
The headline figures use a minimal HTTP/1.1 client (pre-encoded request, chunked body read to its
end), so they hold what the server and the wire add; `httpx_*` repeats the loads through httpx,
the client library under the openai package, whose own parsing adds to each stream.
The same loads then run against the same gateway in front of an instant engine (answers at
once, no compute): `gateway_only_added_ms_*` is the gateway's own cost, without the real engine
competing with it for this machine's 2 cores.
Prints one JSON object.

`--tracing` measures instead what OpenTelemetry tracing (tessera.observability.tracing) adds to the
gateway's own time: two gateways in front of the instant engine, one built with tracing off (no
middleware; every helper a no-op) and one with it on, sampling every request and exporting to the
SDK's in-memory exporter through the batch processor; c1 rounds alternate between them (peers:
the same load, machine state and process), and each side's added latency is pooled over its rounds.
It also times the helpers the request path calls while tracing is off.

    .venv/bin/python bench/gateway.py [--requests-c1 200] [--requests-c32 128] [--max-tokens 4] [--engine-threads N]
    .venv/bin/python bench/gateway.py --tracing [--rounds 6] [--requests-c1 200]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as pyplatform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT))

LOAD = r"""
import asyncio, json, sys, time
from urllib.parse import urlsplit
url, key, conc, total, max_tokens, client = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                             int(sys.argv[5]), sys.argv[6])
body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True}

async def run_httpx(out):
    import httpx
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, headers={"authorization": "Bearer " + key}, timeout=300, limits=limits) as c:
        todo = list(range(total))
        async def worker():
            while todo:
                todo.pop()
                t0 = time.perf_counter()
                if max_tokens == 0:  # baseline: a bare HTTP round trip to the same server
                    await c.get("/health")
                    out.append(("", (time.perf_counter() - t0) * 1000.0))
                    continue
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200, r.status_code
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            break
                out.append((r.headers["x-request-id"], (time.perf_counter() - t0) * 1000.0))
        await asyncio.gather(*(worker() for _ in range(conc)))

async def run_raw(out):
    # A minimal HTTP/1.1 keep-alive client (pre-encoded request; reads the status, the headers and
    # the whole chunked or sized body, and checks the stream ends with [DONE]): it measures what the
    # server and the wire add, without a client library's own parsing in the figure.
    u = urlsplit(url)
    payload = json.dumps(body).encode()
    chat = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {u.netloc}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n").encode() + payload
    health = f"GET /health HTTP/1.1\r\nhost: {u.netloc}\r\n\r\n".encode()
    todo = list(range(total))
    async def worker():
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        while todo:
            todo.pop()
            t0 = time.perf_counter()
            writer.write(health if max_tokens == 0 else chat)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            assert lines[0].split(" ")[1] == "200", lines[0]
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            data = b""
            if headers.get("transfer-encoding") == "chunked":
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    chunk = await reader.readexactly(size + 2)
                    if size == 0:
                        break
                    data += chunk[:-2]
            else:
                data = await reader.readexactly(int(headers["content-length"]))
            elapsed = (time.perf_counter() - t0) * 1000.0
            assert max_tokens == 0 or data.endswith(b"data: [DONE]\n\n"), data[-200:]
            out.append((headers.get("x-request-id", ""), elapsed))
        writer.close()
    await asyncio.gather(*(worker() for _ in range(conc)))

out = []
asyncio.run(run_raw(out) if client == "raw" else run_httpx(out))
print(json.dumps(out))
"""


class TimingEngineClient:
    """Passes everything to the real client; records engine-side time per request id."""

    def __init__(self, inner):
        self.inner = inner
        self.tokenizer, self.model_name, self.max_model_len = inner.tokenizer, inner.model_name, inner.max_model_len
        self.engine_ms: dict[str, float] = {}

    async def generate(self, request):
        t0 = time.perf_counter()
        async for out in self.inner.generate(request):
            if out.finished:
                self.engine_ms[request.request_id] = (time.perf_counter() - t0) * 1000.0
            yield out

    async def start(self):
        await self.inner.start()

    async def close(self):
        await self.inner.close()


class InstantEngineClient:
    """An engine that answers at once (max_tokens deltas, no compute): with it, the added latency
    is the gateway's own work, without the real engine competing for the same 2 cores."""

    def __init__(self, real):
        self.tokenizer, self.model_name, self.max_model_len = real.tokenizer, real.model_name, real.max_model_len

    async def generate(self, request):
        from engine.sampling_params import RequestOutput

        n = request.params.max_tokens
        for _ in range(n):
            yield RequestOutput(request.request_id, " hi", [42])
        yield RequestOutput(request.request_id, "", [], finished=True, finish_reason="length",
                            prompt_tokens=len(request.prompt_token_ids or []), completion_tokens=n)

    async def start(self):
        return None

    async def close(self):
        return None


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests-c1", type=int, default=200)
    ap.add_argument("--requests-c32", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="torch threads of the engine (default: torch's); 1 leaves a core to the gateway")
    ap.add_argument("--tracing", action="store_true", help="tracing on vs off instead (module docstring)")
    ap.add_argument("--rounds", type=int, default=6, help="--tracing: rounds per side")
    args = ap.parse_args()

    import uvicorn

    from adapter_registry.migrate import upgrade
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import GenerationRequest, SamplingParams
    from tessera import services
    from tessera.app import create_app
    from tessera.engine_client.inprocess import InProcessEngineClient
    from tessera.settings import PlatformSettings
    from tessera_core.context import build_context

    work = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    settings = PlatformSettings(_env_file=None, database_url=f"sqlite:///{work}/t.db", object_store_root=work / "obj",
                                adapter_cache_dir=work / "cache", admin_token="bench-admin")
    upgrade(settings)
    ctx = build_context(settings)
    with ctx.session_factory() as s:
        services.upsert_plan(session=s, name="bench", requests_per_minute=1_000_000, tokens_per_minute=10**12,
                             max_concurrent_requests=1000, monthly_token_budget=10**12)
        tenant = services.create_tenant(session=s, name="bench", plan="bench")
        _, key = services.issue_key(session=s, tenant=tenant)

    aengine = AsyncLLMEngine(LLMEngine(config=EngineConfig(kv_cache_bytes=128 << 20, num_threads=args.engine_threads)))

    def serve(client, app_settings=None):
        app = create_app(app_settings or settings, engine_client=client)
        with __import__("socket").socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        return server, f"http://127.0.0.1:{port}"

    timing = TimingEngineClient(InProcessEngineClient(aengine))
    if args.tracing:
        print(json.dumps(tracing_overhead(args, settings, key, timing, serve)))
        aengine.shutdown()
        return
    server, url = serve(timing)

    # The engine alone, for reference: the same request without the gateway.
    async def direct(n: int) -> list[float]:
        tok = aengine.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hello."}]))
        res = []
        for i in range(n):
            t0 = time.perf_counter()
            async for _ in aengine.generate(GenerationRequest(f"direct-{i}", prompt_token_ids=ids,
                                                              params=SamplingParams(max_tokens=args.max_tokens, temperature=0))):
                pass
            res.append((time.perf_counter() - t0) * 1000.0)
        return res

    direct_ms = asyncio.run(direct(max(10, args.requests_c1 // 2)))

    def run_load(url: str, conc: int, n: int, client: str, max_tokens: int) -> list:
        return json.loads(subprocess.run(
            [sys.executable, "-c", LOAD, url, key, str(conc), str(n), str(max_tokens), client],
            check=True, capture_output=True, text=True).stdout)

    def load(url: str, timing, conc: int, total: int, prefix: str, result: dict, client: str = "raw") -> None:
        run_load(url, conc, min(total, 2 * conc), client, args.max_tokens)  # warm-up: connections, caches
        samples = run_load(url, conc, total, client, args.max_tokens)
        added = [e2e - timing.engine_ms[rid] for rid, e2e in samples]
        e2e = [e for _, e in samples]
        result[f"{prefix}added_ms_p50_c{conc}"] = round(pct(added, 50), 3)
        result[f"{prefix}added_ms_p99_c{conc}"] = round(pct(added, 99), 3)
        result[f"{prefix}e2e_ms_p50_c{conc}"] = round(pct(e2e, 50), 1)
        result[f"{prefix}requests_c{conc}"] = total

    result: dict = {}
    for conc, total in ((1, args.requests_c1), (32, args.requests_c32)):
        load(url, timing, conc, total, "", result)
    # The same loads through httpx (what Python clients, the openai package included, use): the
    # client library's own parsing is on the client's side of the wire, but users see it.
    for conc, total in ((1, args.requests_c1), (32, args.requests_c32)):
        load(url, timing, conc, total, "httpx_", result, client="httpx")
    # The same gateway in front of an instant engine: its own cost, without CPU contention.
    instant = TimingEngineClient(InstantEngineClient(timing))
    instant_server, instant_url = serve(instant)
    for conc, total in ((1, args.requests_c1 * 4), (32, args.requests_c32 * 4)):
        load(instant_url, instant, conc, total, "gateway_only_", result)
    instant_server.should_exit = True
    for client, name in (("raw", "http_roundtrip_ms_p50_c1"), ("httpx", "httpx_http_roundtrip_ms_p50_c1")):
        base = run_load(url, 1, 200, client, 0)
        result[name] = round(pct([e for _, e in base], 50), 3)
    result["direct_engine_e2e_ms_p50_c1"] = round(statistics.median(direct_ms), 1)
    result["max_tokens"] = args.max_tokens
    result["engine_threads"] = args.engine_threads or __import__("torch").get_num_threads()
    import importlib.util

    impl = ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio") + " + " + (
        "httptools" if importlib.util.find_spec("httptools") else "h11")
    result["setup"] = f"embedded: SQLite usage + key lookup, in-memory quotas, in-process engine, uvicorn ({impl}), SSE"
    result["machine"] = f"{os.cpu_count()} CPUs {pyplatform.processor() or pyplatform.machine()}, no GPU"
    server.should_exit = True
    aengine.shutdown()
    print(json.dumps(result))


def tracing_overhead(args, settings, key: str, real, serve) -> dict:
    """The --tracing comparison (module docstring): added latency p50/p99 at c1 with tracing off
    and on (every request sampled, in-memory exporter), and the off helpers' cost per request."""
    import timeit

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    from engine.sampling_params import GenerationRequest, SamplingParams
    from tessera.observability import tracing

    exporter = InMemorySpanExporter()
    tracing.setup("bench", exporter=exporter, sampler=ALWAYS_ON)
    engines = {"off": TimingEngineClient(InstantEngineClient(real)), "on": TimingEngineClient(InstantEngineClient(real))}
    tracing.set_enabled(False)
    servers = {"off": serve(engines["off"], settings)}
    tracing.set_enabled(True)
    servers["on"] = serve(engines["on"], settings.model_copy(update={"tracing": True}))

    def run(side: str, n: int) -> list:
        return json.loads(subprocess.run(
            [sys.executable, "-c", LOAD, servers[side][1], key, "1", str(n), str(args.max_tokens), "raw"],
            check=True, capture_output=True, text=True).stdout)

    added: dict[str, list[float]] = {"off": [], "on": []}
    per_round: dict[str, list[float]] = {"off": [], "on": []}
    spans = 0
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        for side in (("off", "on") if r % 2 else ("on", "off")):
            tracing.set_enabled(side == "on")
            samples = run(side, 40 if r == 0 else args.requests_c1)
            if r == 0:
                continue
            got = [e2e - engines[side].engine_ms[rid] for rid, e2e in samples]
            added[side] += got
            per_round[side].append(round(pct(got, 50), 3))
        tracing.flush()
        spans += len(exporter.get_finished_spans())
        exporter.clear()
    for server, _ in servers.values():
        server.should_exit = True
    # Off, what the request path calls (per request: 5 spans, 4 annotations, the engine call's
    # wrapper, one inject), timed in this process.
    tracing.set_enabled(False)
    req = GenerationRequest("r", prompt_token_ids=[1], params=SamplingParams(max_tokens=1))

    def off_path():
        for _ in range(5):
            with tracing.span("x") as s:
                s.set_attribute("tessera.x", 1)
        for _ in range(4):
            tracing.annotate(request_id="r", tenant="t")
        tracing.engine_call(None, req)
        tracing.inject({})

    reps = 20000
    off_us = min(timeit.repeat(off_path, number=reps, repeat=5)) / reps * 1e6
    result = {f"tracing_{side}_added_ms_{q}_c1": round(pct(added[side], p), 3)
              for side in ("off", "on") for q, p in (("p50", 50), ("p99", 99))}
    result["tracing_added_p50_ms"] = round(result["tracing_on_added_ms_p50_c1"] - result["tracing_off_added_ms_p50_c1"], 3)
    result |= {f"tracing_{side}_round_p50s_ms": per_round[side] for side in ("off", "on")}
    result["tracing_requests_per_side"] = len(added["on"])
    result["tracing_spans_exported"] = spans
    result["tracing_off_helpers_us_per_request"] = round(off_us, 3)
    result["setup"] = "embedded gateway (SQLite usage + key lookup, in-memory quotas) over the instant engine, raw HTTP client, SSE"
    result["machine"] = f"{os.cpu_count()} CPUs {pyplatform.processor() or pyplatform.machine()}, no GPU"
    return result


if __name__ == "__main__":
    main()

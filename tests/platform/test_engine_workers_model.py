"""Every engine worker of a deployment serves the deployment's model: a worker that reports another
model (or the same name with another shape) is refused, never routed to, and the gateway's /ready
names both models. The served model's description comes from the workers and is what uploads are
checked against. Real engines: the run's SmolLM2 and a tiny synthetic Qwen2.5 checkpoint."""
from __future__ import annotations

import asyncio
import logging
import uuid

import httpx
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.loader.synthetic import write_family
from engine.sampling_params import GenerationRequest, SamplingParams
from tessera.engine_client.http import HttpEngineClient
from tessera.engine_client.worker import create_worker_app
from tessera.served_model import load_engine

from .conftest import ServerThread
from .test_gateway_http_engine import SECRET, gateway_for

SMOL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_family(tmp_path_factory.mktemp("qwen") / "qwen2.5-tiny", "qwen2.5-tiny", fmt="safetensors")


def _worker(path, name=None):
    engine = load_engine(path, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=4), model_name=name)
    aengine = AsyncLLMEngine(engine)
    return aengine, ServerThread(create_worker_app(aengine, secret=SECRET))


@pytest.fixture(scope="module")
def smol_worker(aengine):
    with ServerThread(create_worker_app(aengine, secret=SECRET)) as server:
        yield server


@pytest.fixture(scope="module")
def qwen_worker(qwen_dir):
    aengine, thread = _worker(qwen_dir)
    with thread as server:
        yield server
    aengine.shutdown()


@pytest.fixture(scope="module")
def qwen_named_smol_worker(qwen_dir):
    """The Qwen checkpoint served under the SmolLM2's name (TESSERA_MODEL_NAME set wrong)."""
    aengine, thread = _worker(qwen_dir, name=SMOL)
    with thread as server:
        yield server
    aengine.shutdown()


def test_a_worker_serving_another_model_is_refused_naming_both(platform, smol_worker, qwen_worker, caplog):
    app, _ = gateway_for(platform, [qwen_worker.url, smol_worker.url])
    with caplog.at_level(logging.ERROR, logger="tessera.engine_client.http"), ServerThread(app) as server:
        r = httpx.get(f"{server.url}/ready", timeout=30)
        assert r.status_code == 200, r.text  # the SmolLM2 worker serves
        engine = r.json()["engine"]
        assert engine["engines"] == {"worker-0": "wrong_model", "worker-1": "ready"}
        assert engine["reason"] == (f"worker-0 serves 'tessera-synthetic/qwen2.5-tiny', not this deployment's "
                                    f"'{SMOL}'; refused")
        assert "127.0.0.1" not in r.text
        # Never routed to: every request goes to the worker that serves the deployment's model.
        client = app.state.gateway.engine
        assert [r.name for r in client._order(_request())] == ["worker-1"]
        assert client.base_model.name == SMOL and client.base_model.architecture == "llama"
    assert any("serves 'tessera-synthetic/qwen2.5-tiny', not this deployment's" in m for m in caplog.messages)


def test_only_workers_of_another_model_leave_the_gateway_not_ready(platform, qwen_worker):
    app, _ = gateway_for(platform, [qwen_worker.url])
    with ServerThread(app) as server:
        r = httpx.get(f"{server.url}/ready", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "not_ready"
        assert r.json()["reason"] == ("no engine worker is ready (worker-0: wrong_model); worker-0 serves "
                                      f"'tessera-synthetic/qwen2.5-tiny', not this deployment's '{SMOL}'; refused")
        # Nothing described the deployment's model: uploads wait for a worker that serves it.
        t = platform.tenant()
        up = httpx.post(f"{server.url}/admin/v1/tenants/{t.name}/adapters/bot/versions", timeout=30,
                        headers={"authorization": platform.admin.headers["authorization"]},
                        files=[("files", ("adapter_config.json", b"{}"))])
        assert up.status_code == 503 and "no engine has described the base model" in up.json()["error"]["message"]


def test_the_same_name_with_another_shape_is_refused_too(platform, smol_worker, qwen_named_smol_worker):
    """A Qwen checkpoint served under the SmolLM2's name: the name matches, the description does
    not (the deployment's files describe the SmolLM2): refused, with both models' shapes."""
    app, _ = gateway_for(platform, [qwen_named_smol_worker.url, smol_worker.url])
    with ServerThread(app) as server:
        engine = httpx.get(f"{server.url}/ready", timeout=30).json()["engine"]
        assert engine["engines"] == {"worker-0": "wrong_model", "worker-1": "ready"}
        assert engine["reason"].startswith(f"worker-0 serves {SMOL} (qwen2) (hidden 128, ")
        assert (f"not this deployment's {SMOL} (llama) (hidden 576, intermediate 1536, 9 heads, 3 KV heads, "
                "head dim 64, 30 layers); refused") in engine["reason"]
        assert app.state.gateway.engine.base_model.architecture == "llama"


def test_the_http_client_learns_the_model_from_a_worker_of_the_deployment(qwen_dir, qwen_worker, smol_worker):
    """A gateway configured for the Qwen model (TESSERA_MODEL_PATH) takes the Qwen worker's
    description and context, and refuses the SmolLM2 worker."""
    async def scenario():
        client = HttpEngineClient([smol_worker.url, qwen_worker.url], secret=SECRET, model_path=qwen_dir, poll_s=3600)
        await client.start()
        try:
            ready = await client.ready()
            assert ready.engines == {"worker-0": "wrong_model", "worker-1": "ready"}
            assert client.model_name == "tessera-synthetic/qwen2.5-tiny"
            assert (client.base_model.architecture, client.base_model.module_dims("k_proj")) == ("qwen2", (128, 64))
            out = [o async for o in client.generate(_request())]
            assert out[-1].finished and out[-1].completion_tokens == 2
        finally:
            await client.close()

    asyncio.run(scenario())


def _request() -> GenerationRequest:
    return GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1, 2, 3],
                             params=SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))


def test_engine_worker_serves_the_model_path_under_the_model_name(qwen_dir, tmp_path):
    """`tessera engine-worker` with TESSERA_MODEL_PATH (a Hugging Face directory) and
    TESSERA_MODEL_NAME publishes that name and the model's description."""
    import os

    from .conftest import free_port
    from .test_gateway_scaleout import TESSERA, start, wait_http

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_ENGINE_SECRET": SECRET, "TESSERA_ENGINE_THREADS": "1", "TESSERA_ENGINE_KV_CACHE_MIB": "16",
        "TESSERA_MODEL_PATH": str(qwen_dir), "TESSERA_MODEL_NAME": "acme/qwen-tiny-chat",
        "TESSERA_DATABASE_URL": f"sqlite:///{tmp_path}/registry.db", "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "o"),
        "TESSERA_ADAPTER_CACHE_DIR": str(tmp_path / "cache")}
    proc = start([TESSERA, "engine-worker", "--port", str(port)], tmp_path / "worker.log", cwd=tmp_path, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/internal/info", proc, headers={"authorization": f"Bearer {SECRET}"})
        info = httpx.get(f"{url}/internal/info", headers={"authorization": f"Bearer {SECRET}"}, timeout=10).json()
        assert (info["model"], info["architecture"]) == ("acme/qwen-tiny-chat", "qwen2")
        assert info["base_model"]["name"] == "acme/qwen-tiny-chat"
        assert [m["name"] for m in info["base_model"]["modules"]] == [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        state = httpx.get(f"{url}/internal/state", headers={"authorization": f"Bearer {SECRET}"}, timeout=10).json()
        assert state["model"] == "acme/qwen-tiny-chat"
    finally:
        proc.kill()
        proc.wait(timeout=30)

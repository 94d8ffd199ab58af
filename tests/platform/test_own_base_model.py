"""A team brings its own base model and its adapters, as a user does it, through the public API
only: `tessera demo --model DIR` on a Qwen2.5-shaped checkpoint directory (a tiny synthetic one,
written by `python -m engine.loader.synthetic`), then an adapter made with PEFT for that base
uploaded through the admin API and served through the OpenAI client; an adapter made for another
base (the SmolLM2 demo adapter) is refused with a 422 naming both; /v1/models names the model.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from .demo_process import ADAPTERS, Demo
from .peft_adapters import peft_adapter

QWEN = "tessera-synthetic/qwen2.5-tiny"


@pytest.fixture(scope="module")
def qwen_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("own-model")
    model = root / "qwen2.5-tiny"
    subprocess.run([sys.executable, "-m", "engine.loader.synthetic", "--family", "qwen2.5-tiny", "--format",
                    "safetensors", "--out", str(model)], check=True, capture_output=True, timeout=300)
    demo = Demo(root, args=["--model", str(model)])
    out = demo.wait_ready()
    yield root, model, demo, out
    demo.stop()


def _upload(url: str, token: str, name: str, adapter_dir: Path) -> httpx.Response:
    files = [("files", (f.name, f.read_bytes(), "application/octet-stream"))
             for f in (adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors")]
    return httpx.post(f"{url}/admin/v1/tenants/demo/adapters/{name}/versions", files=files,
                      headers={"Authorization": f"Bearer {token}"}, timeout=300)


def test_own_base_model_serves_its_adapters_and_refuses_others(qwen_demo):
    root, model, demo, out = qwen_demo
    url = re.search(r"Admin web UI: (\S+)/admin ", out).group(1)
    token = re.search(r"Admin API: \S+ with header 'Authorization: Bearer (\S+)'", out).group(1)
    key = re.search(r'"Authorization: Bearer (\S+)"', out).group(1)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)

    # /v1/models names the served model (the checkpoint's own name), and no SmolLM2.
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == QWEN and not any("SmolLM2" in i for i in ids)

    # An adapter made with PEFT for this base uploads, validates and is served by name.
    adapter = peft_adapter(model, root / "my-qwen-lora")
    r = _upload(url, token, "qwen-lora", adapter)
    assert r.status_code in (200, 201) and r.json()["status"] == "ready", r.text
    messages = [{"role": "user", "content": "Tell me about the water cycle."}]
    tuned = client.chat.completions.create(model="qwen-lora", messages=messages, max_tokens=12, temperature=0)
    base = client.chat.completions.create(model=QWEN, messages=messages, max_tokens=12, temperature=0)
    assert tuned.usage.completion_tokens == 12 and base.usage.prompt_tokens == tuned.usage.prompt_tokens
    assert tuned.choices[0].message.content != base.choices[0].message.content  # the adapter is applied

    # An adapter made for another base is refused with a 422 that names the mismatch.
    r = _upload(url, token, "wrong-base", ADAPTERS / "pirate")
    assert r.status_code == 422, r.text
    detail = r.text
    assert "SmolLM2-135M-Instruct" in detail and QWEN in detail
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="wrong-base", messages=messages, max_tokens=4)

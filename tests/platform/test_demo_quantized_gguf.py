"""The quantized GGUF files people download, served as a user serves them: `tessera demo --model
X.Q4_K_M.gguf` on llama.cpp's Q4_K_M mix (Q4_K layer matrices, Q6_K attn_v / ffn_down on its
"more bits" layers) of two families (Llama 3.1 and Qwen2.5 shapes, random weights, written by
`python -m engine.loader.synthetic --quant q4_k_m`), then a PEFT adapter made for that base
uploaded through the admin API and served through the OpenAI client beside the base model.
"""
from __future__ import annotations

import re
import subprocess
import sys

import httpx
import openai
import pytest
from gguf import GGUFReader

from .demo_process import Demo
from .peft_adapters import peft_adapter


@pytest.mark.parametrize("family", ["llama3.1-wide-tiny", "qwen2.5-wide-tiny"])
def test_a_q4_k_m_gguf_is_served_with_its_adapter(tmp_path, family):
    synthetic = [sys.executable, "-m", "engine.loader.synthetic", "--family", family]
    gguf = tmp_path / "gguf" / f"{family}.gguf"
    gguf.parent.mkdir()
    subprocess.run([*synthetic, "--quant", "q4_k_m", "--out", str(gguf)], check=True, capture_output=True, timeout=300)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(gguf)).tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K", types
    # The same base as a HF directory of the same name: what a team trains its adapter on.
    hf_dir = tmp_path / family
    subprocess.run([*synthetic, "--format", "safetensors", "--out", str(hf_dir)], check=True, capture_output=True,
                   timeout=300)
    adapter = peft_adapter(hf_dir, tmp_path / "my-lora")

    demo = Demo(tmp_path, args=["--model", str(gguf)])
    try:
        out = demo.wait_ready()
        url = re.search(r"Admin web UI: (\S+)/admin ", out).group(1)
        token = re.search(r"Admin API: \S+ with header 'Authorization: Bearer (\S+)'", out).group(1)
        key = re.search(r'"Authorization: Bearer (\S+)"', out).group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data][0] == family

        files = [("files", (f.name, f.read_bytes(), "application/octet-stream"))
                 for f in (adapter / "adapter_config.json", adapter / "adapter_model.safetensors")]
        r = httpx.post(f"{url}/admin/v1/tenants/demo/adapters/my-lora/versions", files=files,
                       headers={"Authorization": f"Bearer {token}"}, timeout=300)
        assert r.status_code in (200, 201) and r.json()["status"] == "ready", r.text

        messages = [{"role": "user", "content": "Tell me about the water cycle."}]
        # Random weights may say their end of turn at any point: ignore_eos keeps every answer 12 tokens.
        ask = dict(messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        base = client.chat.completions.create(model=family, **ask)
        tuned = client.chat.completions.create(model="my-lora", **ask)
        assert base.usage.completion_tokens == tuned.usage.completion_tokens == 12
        assert tuned.choices[0].message.content != base.choices[0].message.content  # the adapter is applied
        again = client.chat.completions.create(model=family, **ask)
        assert again.choices[0].message.content == base.choices[0].message.content  # greedy: the same answer
    finally:
        demo.stop()

"""`tessera demo --model PATH` serves another base model (here a tiny synthetic Qwen2.5 checkpoint
directory): the demo adapters, trained on SmolLM2, are not uploaded onto it (one line says why),
and what the demo prints talks to the served model and shows how to upload an adapter for it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.loader.synthetic import write_family

from .conftest import free_port

TESSERA = Path(sys.executable).parent / "tessera"
QWEN = "tessera-synthetic/qwen2.5-tiny"


def test_demo_on_another_model_skips_the_smollm2_adapters_and_prints_its_commands(tmp_path):
    model = write_family(tmp_path / "qwen2.5-tiny", "qwen2.5-tiny", fmt="safetensors")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {"TESSERA_PORT": str(free_port())}
    r = subprocess.run([str(TESSERA), "demo", "--model", str(model), "--self-test"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out[0] == ("tessera demo: not uploading the demo adapters (json-answer, pirate, upper, weather-tools): they were trained "
                      f"for HuggingFaceTB/SmolLM2-135M-Instruct, and this demo serves {QWEN} (qwen2)")
    assert sum("not uploading the demo adapters" in line for line in out) == 1
    assert f'"model": "{QWEN}"' in r.stdout and f'model="{QWEN}"' in r.stdout  # curl and openai examples
    assert "Demo adapters: none." in r.stdout
    assert (f"(a PEFT LoRA adapter trained on {QWEN}; its LoRA-able modules: q_proj, k_proj, v_proj, o_proj, "
            "gate_proj, up_proj, down_proj)") in r.stdout
    assert '-F "files=@/path/to/your-adapter/adapter_config.json"' in r.stdout
    assert "self-test: openai client ok" in r.stdout and "FAILED" not in r.stdout
    assert "self-test: adapter upload skipped; no demo adapter was trained for the served model" in r.stdout
    assert "Traceback" not in r.stderr


def test_demo_with_a_model_that_cannot_be_read_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {"TESSERA_PORT": str(free_port())}
    r = subprocess.run([str(TESSERA), "demo", "--model", str(tmp_path / "nothing-here")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"tessera: error: --model {tmp_path / 'nothing-here'} cannot be served: ")
    assert r.stderr.count("\n") == 1

"""`tessera demo` (what `make run` runs): everything embedded in a fresh folder, the demo tenant,
key and adapters, and the printed examples working (its --self-test runs them)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .conftest import free_port


def test_demo_command_serves_the_printed_examples(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {"TESSERA_PORT": str(port)}
    tessera = Path(sys.executable).parent / "tessera"
    r = subprocess.run([str(tessera), "demo", "--self-test"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"curl -N http://127.0.0.1:{port}/v1/chat/completions" in r.stdout
    assert "from openai import OpenAI" in r.stdout
    # Every printed example ran and worked: the tenant's three (the last a tool round trip with
    # weather-tools), the admin API call, the web UI sign-in, an upload through the admin API and
    # a chat with the adapter it made.
    for step in ("curl-style stream", "openai client", "tool round trip", "admin API call", "admin web UI sign-in",
                 "adapter upload", "chat with the uploaded adapter"):
        assert f"self-test: {step} ok" in r.stdout, r.stdout
    assert (tmp_path / "var" / "tessera.db").is_file()


def test_demo_refuses_a_busy_port_with_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {"TESSERA_PORT": str(port)}
        r = subprocess.run([str(Path(sys.executable).parent / "tessera"), "demo"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in r.stderr

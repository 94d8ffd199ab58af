"""`tessera demo` run as a subprocess, as `make run` starts it (bench/demo_process.py), for the
tests: a demo that does not start fails the test with its output. The newcomer test drives one
of its own (it ends it with Ctrl+C); the modules that only talk to a demo share the session's one
(`shared_demo` in conftest.py), which saves a model load and the adapters' upload each.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.demo_process import TESSERA, DemoProcess, printed_commands  # noqa: F401 - re-exported for the tests

ADAPTERS = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"


class Demo(DemoProcess):
    def wait_ready(self, timeout: float = 300) -> str:
        try:
            return super().wait_ready(timeout)
        except RuntimeError as e:
            pytest.fail(str(e))


def sh(command: str, cwd: Path, timeout: float = 180) -> str:
    r = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{command}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout

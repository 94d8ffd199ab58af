"""`tessera demo` run as a subprocess, as `make run` starts it, and what it printed: the newcomer
test drives one of its own (it ends it with Ctrl+C); the modules that only talk to a demo share the
session's one (`shared_demo` in conftest.py), which saves a model load and the adapters' upload each.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from .conftest import free_port

TESSERA = Path(sys.executable).parent / "tessera"
ADAPTERS = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"


class Demo:
    """`tessera demo` as `make run` starts it, and what it printed."""

    def __init__(self, cwd: Path, args: list[str] = ()):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {"TESSERA_PORT": str(port)}
        self.cwd = cwd  # the demo's folder: its var/ holds the database (var/tessera.db)
        self.stderr = open(cwd / "demo.stderr", "w+")
        self.proc = subprocess.Popen([str(TESSERA), "demo", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("Press Ctrl+C"):
                self.ready.set()
        self.ready.set()  # it exited

    def wait_ready(self, timeout: float = 300) -> str:
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            pytest.fail("tessera demo did not start:\n" + self.output + self.stderr_text())
        return self.output

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def url(self) -> str:
        """The base URL the demo printed ("Tessera is running at ...")."""
        return re.search(r"Tessera is running at (\S+)", self.output).group(1)

    @property
    def key(self) -> str:
        """The demo tenant's API key, read off the printed chat curl."""
        chat_curl = next(c for c in printed_commands(self.output) if "/v1/chat/completions" in c)
        return re.search(r'Authorization: Bearer (\S+)"', chat_curl).group(1)

    @property
    def admin_token(self) -> str:
        return re.search(r"Admin API: \S+ with header 'Authorization: Bearer (\S+)'", self.output).group(1)

    def stderr_text(self) -> str:
        self.stderr.flush()
        return Path(self.stderr.name).read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl+C, as the demo says
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def printed_commands(output: str) -> list[str]:
    """Every shell command the demo printed, as pasted: `curl ...` lines with their `\\`
    continuations, and the python heredoc through its closing EOF."""
    lines, commands, i = output.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("curl "):
            block = [line]
            while block[-1].endswith("\\"):
                i += 1
                block.append(lines[i])
            commands.append("\n".join(block))
        elif line.endswith("<<'EOF'"):
            end = lines.index("EOF", i)
            commands.append("\n".join(lines[i:end + 1]))
            i = end
        i += 1
    return commands


def sh(command: str, cwd: Path, timeout: float = 180) -> str:
    r = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{command}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout

"""`tessera demo` run as a subprocess the way a user starts it (`make run`), and what it printed:
the benchmarks of the live path (bench/guidellm.py, bench/demo_mix.py) and the tests that drive
the demo (tests/platform/demo_process.py) start it through `DemoProcess`. The URL, the demo
tenant's key and the admin token are read from its own output, never reconstructed."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

TESSERA = Path(sys.executable).parent / "tessera"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class DemoProcess:
    """`tessera demo [args]` in `cwd` (its var/ holds the database, var/tessera.db) on a free
    loopback port, its environment's TESSERA_* settings left out."""

    def __init__(self, cwd: Path, args: list[str] = ()):
        self.cwd = Path(cwd)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {"TESSERA_PORT": str(free_port())}
        self.stderr = open(self.cwd / "demo.stderr", "w+")
        self.proc = subprocess.Popen([str(TESSERA), "demo", *args], cwd=self.cwd, env=env, stdout=subprocess.PIPE,
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
        """What it printed, once it has printed its examples; RuntimeError (with its output) if it
        exits or takes longer than `timeout` seconds."""
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("tessera demo did not start:\n" + self.output + "\n" + self.stderr_text())
        return self.output

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def url(self) -> str:
        """The base URL it printed ("Tessera is running at ...")."""
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
        """Ctrl+C, as the demo says; killed if it has not stopped within a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

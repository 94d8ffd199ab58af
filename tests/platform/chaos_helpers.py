"""Real processes for the chaos tests: a private PostgreSQL cluster that a test may stop and start,
and tessera commands (gateway, engine worker) as subprocesses with only the TESSERA_* settings the
test gives them."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, select

from adapter_registry.models import Tenant
from tessera.models import UsageEvent

from tests.requirements import HOW, require

#: The virtualenv's `tessera` command (next to the interpreter running the tests).
TESSERA = str(Path(sys.executable).parent / "tessera")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivatePostgres:
    """A throwaway PostgreSQL cluster on a free loopback port (trust auth, user postgres), in a
    temporary directory. PostgreSQL refuses to run as root: as root the cluster belongs to the
    `postgres` system user and its commands run through runuser."""

    def __init__(self):
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        require("PostgreSQL server binaries under /usr/lib/postgresql/*/bin", bool(bins), HOW["postgres"])
        self.bin = Path(bins[-1]).parent
        self.root = Path(tempfile.mkdtemp(prefix="tessera-chaos-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                owner = None
            require("a 'postgres' system user (this runs as root; PostgreSQL refuses root)", owner is not None,
                    HOW["postgres"])
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as_owner = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        proc = subprocess.run([*self._as_owner, str(self.bin / tool), *args], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")

    def start(self) -> None:
        """Start the cluster and wait until it accepts connections."""
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                   "-c fsync=off -c max_connections=40")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"), "-w",
                  "start")

    def stop(self) -> None:
        """Fast shutdown (open connections are terminated) and wait until it is down."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except RuntimeError:
            pass  # already down
        shutil.rmtree(self.root, ignore_errors=True)


class Service:
    """A tessera command run as a subprocess in `cwd` (no .env there), with the environment of
    the tests minus every TESSERA_* variable, plus `settings` (TESSERA_<KEY>=value); output in
    cwd/<name>.log."""

    def __init__(self, name: str, args: list[str], *, cwd: Path, settings: dict[str, object]):
        self.name = name
        self.args = args
        self.cwd = cwd
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("TESSERA_") and k != "PROMETHEUS_MULTIPROC_DIR"}
        self.env |= {f"TESSERA_{k.upper()}": str(v) for k, v in settings.items()}
        self.log_path = cwd / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        return self

    def wait_until_answers(self, url: str, *, headers: dict | None = None, timeout: float = 300.0) -> None:
        """Poll `url` until it answers 200 (fails with the log's tail if the process exits)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(url, headers=headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not answer {url} in {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL, and wait until the process is gone."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def metric_samples(text: str, name: str) -> list[tuple[dict, float]]:
    """(labels, value) of every sample of `name` in a Prometheus exposition."""
    return [(s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


def usage_events(database_url: str, tenant: str) -> list:
    """The usage_events rows of `tenant` (by name) in the database at `database_url`, read
    directly (the platform under test runs in other processes)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as c:
            tid = c.scalar(select(Tenant.id).where(Tenant.name == tenant))
            return list(c.execute(select(UsageEvent).where(UsageEvent.tenant_id == tid)))
    finally:
        engine.dispose()

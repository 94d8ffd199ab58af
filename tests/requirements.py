"""What a test needs from the machine, and one rule for when it is missing.

A test that needs a service (Postgres, Redis) or a tool (Chromium, promtool, prometheus, amtool,
a C compiler, guidellm) calls `require(...)` (or one of the `require_*` shortcuts, or names the
matching fixture in tests/conftest.py). Where it is missing the test skips with the reason and how
to get it, except under `CI=true`, where it fails: a green CI run means every such test ran.

Probes are cached for the run; a service probe is one TCP connect with a short timeout.
"""
from __future__ import annotations

import functools
import os
import shutil
import socket
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
#: guidellm in its own virtualenv (the Makefile's `guidellm` target, which `make test` runs).
GUIDELLM = Path(__file__).resolve().parent.parent / ".venv-guidellm" / "bin" / "guidellm"

HOW = {
    "postgres": "PostgreSQL on 127.0.0.1:5432, trust auth for user postgres (apt-get install postgresql)",
    "redis": "Redis on 127.0.0.1:6379 (apt-get install redis-server)",
    "chromium": "Debian's chromium at /usr/bin/chromium and the playwright package (make setup installs both)",
    "promtool": "Debian's prometheus package (make setup installs it)",
    "prometheus": "Debian's prometheus package (make setup installs it)",
    "amtool": "Debian's prometheus-alertmanager package (make setup installs it)",
    "cc": "a C compiler on PATH as cc or gcc (apt-get install gcc)",
    "guidellm": "guidellm 0.8.1 in its own virtualenv at .venv-guidellm (`make guidellm`; `make test` runs it)",
}


def in_ci() -> bool:
    """Whether this run is CI's (the CI environment variable is exactly "true")."""
    return os.environ.get("CI") == "true"


def require(what: str, available: bool, how_to_get_it: str) -> None:
    """Return if `available`; otherwise skip the test naming `what` and `how_to_get_it`, or,
    under CI=true, fail it with the same words."""
    if available:
        return
    message = f"{what} is not available; needs {how_to_get_it}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a test whose requirement is missing fails instead of skipping)",
                    pytrace=False)
    pytest.skip(message)


@functools.cache
def tcp_up(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port (2 s timeout)."""
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def has_c_compiler() -> bool:
    return shutil.which("cc") is not None or shutil.which("gcc") is not None


def has_chromium() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return CHROMIUM.exists()


def require_postgres() -> None:
    require("PostgreSQL at 127.0.0.1:5432", tcp_up("127.0.0.1", 5432), HOW["postgres"])


def require_redis() -> None:
    require("Redis at 127.0.0.1:6379", tcp_up("127.0.0.1", 6379), HOW["redis"])


def require_tool(name: str) -> None:
    """A command-line tool on PATH: promtool, prometheus or amtool."""
    require(name, shutil.which(name) is not None, HOW[name])


def require_c_compiler() -> None:
    require("a C compiler", has_c_compiler(), HOW["cc"])


def require_chromium() -> None:
    require("Chromium for the browser tests", has_chromium(), HOW["chromium"])


def require_guidellm() -> None:
    require(f"guidellm at {GUIDELLM}", GUIDELLM.exists(), HOW["guidellm"])

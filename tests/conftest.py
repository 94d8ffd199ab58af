"""Fixtures and helpers every test folder shares: the Triton interpreter switch, the S3-protocol
server (moto's, on loopback), and one fixture per service or tool a test may
need (`pytestmark = pytest.mark.usefixtures("needs_redis")`): missing, the test skips, or fails
under CI=true (tests/requirements.py)."""
import os
import socket

import pytest

from tests import requirements

# Triton kernels run on this CPU-only machine through the interpreter; set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")



@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3 server on a free loopback port, for the whole run."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _requirement(check, *args):
    """A session fixture that runs check(*args) (tests/requirements.py) once for the run."""

    @pytest.fixture(scope="session")
    def fixture():
        """What its tests need: missing, they skip, or fail under CI=true."""
        check(*args)

    return fixture


needs_postgres = _requirement(requirements.require_postgres)
needs_redis = _requirement(requirements.require_redis)
needs_chromium = _requirement(requirements.require_chromium)
needs_promtool = _requirement(requirements.require_tool, "promtool")
needs_prometheus = _requirement(requirements.require_tool, "prometheus")
needs_amtool = _requirement(requirements.require_tool, "amtool")
needs_c_compiler = _requirement(requirements.require_c_compiler)

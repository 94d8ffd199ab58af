"""Fixtures and helpers every test folder shares: the Triton interpreter switch, the S3-protocol
server (moto's, on loopback) and the Redis probe."""
import os
import socket

import pytest

# Triton kernels run on this CPU-only machine through the interpreter; set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")


def redis_up(host: str = "127.0.0.1", port: int = 6379) -> bool:
    """Whether the machine's Redis answers (tests that need it skip, with the reason, if not)."""
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


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

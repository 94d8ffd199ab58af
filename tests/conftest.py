"""Fixtures and helpers every test folder shares: the Triton interpreter switch, the S3-protocol
server (moto's, on loopback), and one fixture per service or tool a test may
need (`pytestmark = pytest.mark.usefixtures("needs_redis")`): missing, the test skips, or fails
under CI=true (tests/requirements.py)."""
import os
import socket

import pytest
import torch

from tests import requirements

# Triton kernels run on this CPU-only machine through the interpreter; set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

#: Where the Triton kernel tests run: CPU tensors (through the interpreter) always, CUDA where present.
TRITON_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=TRITON_DEVICES)
def device(request) -> torch.device:
    """Where a Triton kernel test (tests/punica_kernels, tests/engine's kernel tests) puts its
    tensors: every such test runs on CPU tensors through the interpreter, and again on CUDA
    tensors (compiled kernels) where a GPU is present.

    Triton builds a kernel for the interpreter or for the GPU when its module is imported, by
    TRITON_INTERPRET (set to 1 above unless the environment already says otherwise), so one
    process runs one of the two: on a GPU machine `TRITON_INTERPRET=0 pytest ...` runs the "cuda"
    cases compiled and skips the "cpu" ones, the default run the other way round. Where no GPU is
    present there is no "cuda" case at all, so nothing is skipped."""
    from punica_kernels.kernels._common import INTERPRETED

    if request.param == "cpu" and not INTERPRETED:
        pytest.skip("Triton on CPU tensors needs the interpreter; this process compiled the kernels "
                    "for the GPU (TRITON_INTERPRET unset or 0)")
    if request.param == "cuda" and INTERPRETED:
        pytest.skip("this process built the kernels for the interpreter (TRITON_INTERPRET=1); "
                    "run with TRITON_INTERPRET=0 for the compiled CUDA kernels")
    return torch.device(request.param)



@pytest.fixture(scope="session")
def triton_engine_device() -> str:
    """Where a test's whole engine on the Triton backend runs: CPU tensors under the interpreter
    (the default run), or the GPU when this process compiled the kernels (`TRITON_INTERPRET=0` on
    a GPU machine, as bench/gpu.sh runs them)."""
    from punica_kernels.kernels._common import INTERPRETED

    if INTERPRETED:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels for a GPU, and none is present")
    return "cuda"


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

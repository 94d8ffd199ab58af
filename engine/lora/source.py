"""How the engine gets adapter files: a small protocol, so the engine never knows the registry.

An adapter version is immutable and named by an opaque `version_id` (the registry uses the
content hash). `AdapterSource.fetch(version_id)` returns a local directory holding the PEFT files
(adapter_config.json + adapter_model.safetensors) of exactly that version. Implementations:
`LocalDirectoryAdapterSource` here (embedded mode, tests); the registry's S3-backed source in
adapter_registry (cached on disk by sha256, checksum-verified, concurrent fetches coalesced).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol, runtime_checkable

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_VERSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class AdapterFetchError(Exception):
    """The version cannot be fetched (unknown, unreadable, or failed its checksum)."""


@runtime_checkable
class AdapterSource(Protocol):
    def fetch(self, version_id: str) -> Path:
        """Return a local directory with the PEFT files of `version_id`.

        Blocking (may download); the engine calls it off the step loop. Raises
        AdapterFetchError with a message a user can read when the version cannot be had.
        """
        ...


def check_version_id(version_id: str) -> str:
    """Return `version_id` if it is a safe opaque id (no path separators), else raise."""
    if not isinstance(version_id, str) or not _VERSION_ID.match(version_id):
        raise AdapterFetchError(f"invalid adapter version id {version_id!r}")
    return version_id


class LocalDirectoryAdapterSource:
    """Adapters laid out as `<root>/<version_id>/{adapter_config.json, adapter_model.safetensors}`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def fetch(self, version_id: str) -> Path:
        path = self.root / check_version_id(version_id)
        if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
            raise AdapterFetchError(
                f"adapter version {version_id!r} not found (expected {ADAPTER_CONFIG} and "
                f"{ADAPTER_WEIGHTS} under {path})"
            )
        return path

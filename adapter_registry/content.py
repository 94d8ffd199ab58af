"""Content addressing: sha256 of files, the digest that names an adapter version, object keys."""
from __future__ import annotations

import hashlib
from pathlib import Path

from engine.lora.source import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CHUNK_BYTES = 1024 * 1024


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex sha256, size in bytes) of the file at `path`, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def version_digest(config_sha256: str, weights_sha256: str) -> str:
    """The sha256 that names an adapter version (its `version_id` for engines): a hash over the
    hashes of its two files, so a change to either (alpha in the config, any weight) is a new
    version and the same pair of files is always the same version.

    Semantics: sha256(f"{ADAPTER_CONFIG}\\0{config_sha256}\\n{ADAPTER_WEIGHTS}\\0{weights_sha256}\\n")
    """
    manifest = f"{ADAPTER_CONFIG}\0{config_sha256}\n{ADAPTER_WEIGHTS}\0{weights_sha256}\n"
    return hashlib.sha256(manifest.encode()).hexdigest()


def blob_key(sha256: str) -> str:
    """Object key of the blob with this content hash (fanned out by the first two hex digits)."""
    return f"blobs/sha256/{sha256[:2]}/{sha256}"


BLOB_PREFIX = "blobs/"

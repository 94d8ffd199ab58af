"""Object storage (adapter files, billing exports): one interface, a local directory and S3 (boto3).

Transfers stream between a local file and the store in chunks (S3 uploads above a threshold go
multipart), so an adapter is never held whole in memory. Keys are '/'-separated relative paths
without '..'. Failures of the store surface as ObjectStoreError (a 503 for callers) with the
operation and key in the message; a missing key is ObjectNotFound.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Protocol

from tessera_core.errors import ObjectNotFound, ObjectStoreError
from tessera_core.settings import CoreSettings

CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size_bytes: int
    last_modified: datetime  # timezone-aware


class ObjectStore(Protocol):
    """A flat key -> bytes store. Every method raises ObjectStoreError when the store fails."""

    def put_file(self, key: str, path: Path) -> None:
        """Store the file at `path` under `key`, streaming it; replaces an existing object atomically."""
        ...

    def get_file(self, key: str, path: Path) -> None:
        """Write the object `key` to `path`, streaming it. Raises ObjectNotFound if absent."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, or None if there is no such object."""
        ...

    def delete(self, key: str) -> None:
        """Remove `key`; removing a missing key is not an error."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`."""
        ...


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative key, else raise ValueError (a programming error)."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key


class LocalDirectoryStore:
    """Objects as files under `root` (the embedded default). Writes go to a temp file in the same
    directory and are renamed into place, so readers never see a partial object."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".upload-")
            try:
                with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                    shutil.copyfileobj(src, out, CHUNK_BYTES)
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise ObjectStoreError(f"object store: cannot write {key!r} under {self.root}: {e.strerror or e}") from e

    def get_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        try:
            with open(src, "rb") as f, open(path, "wb") as out:
                shutil.copyfileobj(f, out, CHUNK_BYTES)
        except FileNotFoundError:
            raise ObjectNotFound(f"object {key!r} not found") from None
        except OSError as e:
            raise ObjectStoreError(f"object store: cannot read {key!r}: {e.strerror or e}") from e

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, timezone.utc))

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise ObjectStoreError(f"object store: cannot delete {key!r}: {e.strerror or e}") from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return
        for p in sorted(self.root.rglob("*")):
            if not p.is_file() or p.name.startswith(".upload-"):
                continue
            key = p.relative_to(self.root).as_posix()
            if key.startswith(prefix):
                st = p.stat()
                yield ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, timezone.utc))


class S3Store:
    """Objects in an S3 bucket (AWS, MinIO, or any S3-compatible endpoint) under `prefix`.

    Uploads use boto3's managed transfer: files of at least `multipart_threshold` bytes go up in
    `multipart_chunk` parts read from disk one at a time, and a failed multipart upload is
    aborted, so no partial object becomes visible.
    """

    def __init__(self, *, bucket: str, endpoint_url: str | None = None, region: str = "us-east-1",
                 access_key_id: str | None = None, secret_access_key: str | None = None, prefix: str = "",
                 multipart_threshold: int = 8 * 1024 * 1024, multipart_chunk: int = 8 * 1024 * 1024):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            # Fail fast when the endpoint is down: the caller gets a 503, not a minute-long hang.
            config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"}),
        )
        # Threads off: the upload is already off the request path, and one part in memory at a
        # time keeps memory flat however big the adapter is.
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunk,
                                        use_threads=False)

    def _where(self) -> str:
        return f"s3://{self.bucket}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")

    def _wrap(self, op: str, key: str, e: Exception) -> ObjectStoreError:
        return ObjectStoreError(f"object store unavailable: {op} {key!r} in {self._where()} failed: {e}")

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (deployments usually provision it instead)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError:
            try:
                self._client.create_bucket(Bucket=self.bucket)
            except (BotoCoreError, ClientError) as e:
                raise self._wrap("create bucket", self.bucket, e) from e
        except BotoCoreError as e:
            raise self._wrap("head bucket", self.bucket, e) from e

    def put_file(self, key: str, path: Path) -> None:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.upload_file(str(path), self.bucket, self.prefix + check_key(key), Config=self._transfer)
        except (BotoCoreError, ClientError, S3UploadFailedError) as e:
            raise self._wrap("upload", key, e) from e

    def get_file(self, key: str, path: Path) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.download_file(self.bucket, self.prefix + check_key(key), str(path), Config=self._transfer)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise ObjectNotFound(f"object {key!r} not found in {self._where()}") from None
            raise self._wrap("download", key, e) from e
        except BotoCoreError as e:
            raise self._wrap("download", key, e) from e

    def head(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self._client.head_object(Bucket=self.bucket, Key=self.prefix + check_key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._wrap("head", key, e) from e
        except BotoCoreError as e:
            raise self._wrap("head", key, e) from e
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"])

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.prefix + check_key(key))
        except (BotoCoreError, ClientError) as e:
            raise self._wrap("delete", key, e) from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][len(self.prefix):], int(obj["Size"]), obj["LastModified"])
        except (BotoCoreError, ClientError) as e:
            raise self._wrap("list", prefix, e) from e


def make_object_store(settings: CoreSettings) -> ObjectStore:
    """The store the settings name: a LocalDirectoryStore or an S3Store."""
    if settings.object_store == "local":
        return LocalDirectoryStore(settings.object_store_root)
    return S3Store(
        bucket=settings.s3_bucket,
        endpoint_url=settings.s3_endpoint_url,
        region=settings.s3_region,
        access_key_id=settings.s3_access_key_id.get_secret_value() if settings.s3_access_key_id else None,
        secret_access_key=settings.s3_secret_access_key.get_secret_value() if settings.s3_secret_access_key else None,
        prefix=settings.s3_prefix,
        multipart_threshold=settings.s3_multipart_threshold_bytes,
        multipart_chunk=settings.s3_multipart_chunk_bytes,
    )

"""Both object stores behave alike; S3 goes multipart for large files; failures are clear."""
from __future__ import annotations

import os

import pytest

from tessera_core.errors import ObjectNotFound, ObjectStoreError
from tessera_core.objectstore import LocalDirectoryStore, S3Store


@pytest.fixture(params=["local", "s3"])
def store(request, make_ctx):
    ctx = make_ctx("postgres", object_store=request.param)
    return ctx.store


def test_put_get_head_list_delete(store, tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"hello adapter")
    store.put_file("blobs/sha256/ab/abc", src)
    assert store.head("blobs/sha256/ab/abc").size_bytes == 13
    assert [o.key for o in store.list("blobs/")] == ["blobs/sha256/ab/abc"]
    store.get_file("blobs/sha256/ab/abc", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"hello adapter"
    store.delete("blobs/sha256/ab/abc")
    store.delete("blobs/sha256/ab/abc")  # deleting twice is fine
    assert store.head("blobs/sha256/ab/abc") is None
    with pytest.raises(ObjectNotFound, match="not found"):
        store.get_file("blobs/sha256/ab/abc", tmp_path / "out2")


def test_keys_cannot_escape_the_store(store, tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    for key in ("../x", "/abs", "a//b", "a/./b"):
        with pytest.raises(ValueError, match="invalid object key"):
            store.put_file(key, tmp_path / "f")


def test_large_s3_upload_goes_multipart(make_ctx, tmp_path):
    ctx = make_ctx("postgres")
    big = tmp_path / "big"
    big.write_bytes(os.urandom(12 * 1024 * 1024))  # threshold and part size are 5 MiB in tests
    ctx.store.put_file("big", big)
    etag = ctx.store._client.head_object(Bucket=ctx.store.bucket, Key="big")["ETag"]
    assert etag.strip('"').endswith("-3")  # S3 marks a 3-part multipart upload this way
    ctx.store.get_file("big", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == big.read_bytes()


def test_unreachable_s3_is_a_clear_store_error(tmp_path):
    store = S3Store(bucket="b", endpoint_url="http://127.0.0.1:9", access_key_id="x", secret_access_key="y")
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ObjectStoreError, match=r"object store unavailable: upload 'k' in s3://b at http://127.0.0.1:9"):
        store.put_file("k", tmp_path / "f")


def test_local_store_leaves_no_partial_file_when_the_source_vanishes(tmp_path):
    store = LocalDirectoryStore(tmp_path / "root")
    with pytest.raises(ObjectStoreError):
        store.put_file("a/b", tmp_path / "missing")
    assert list(store.list()) == []

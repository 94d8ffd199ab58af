"""Tar meta-headers (GNU long names, pax records) are bounded before tarfile reads them into memory,
and every decompressed byte of the stream, headers included, counts against the archive budget."""
from __future__ import annotations

import gzip
import io
import tarfile

import pytest
from registry_helpers import write_adapter

from adapter_registry import services
from adapter_registry.content import BLOB_PREFIX
from adapter_registry.errors import UploadRejected
from adapter_registry.models import AdapterVersion

MiB = 1 << 20


@pytest.fixture
def reg(make_ctx):
    return make_ctx("sqlite", archive_max_uncompressed_bytes=1 * MiB, archive_max_files=8)


def upload(reg, path):
    with reg.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        return services.upload_adapter(session=s, store=reg.store, settings=reg.settings, tenant=tenant,
                                       name="bot", source=path)


def assert_refused(reg, path, message):
    with pytest.raises(UploadRejected, match=message):
        upload(reg, path)
    assert list(reg.store.list(BLOB_PREFIX)) == []
    with reg.session_factory() as s:
        assert s.query(AdapterVersion).count() == 0


def _header(name: str, size: int, type_: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, type_
    return info.tobuf(format=tarfile.GNU_FORMAT)  # a plain header block: size as declared


def test_gnu_long_name_declaring_gigabytes_is_refused_before_it_is_read(reg, tmp_path):
    """The header claims 4 GiB of long name and 1 MiB of it follows: refused at the header, with
    nothing read into memory (tarfile alone would read the whole claimed record)."""
    path = tmp_path / "longname.tar.gz"
    with gzip.open(path, "wb") as gz:
        gz.write(_header("././@LongLink", 4 << 30, tarfile.GNUTYPE_LONGNAME))
        gz.write(b"a" * MiB)
    assert_refused(reg, path, r"tar header record of 4294967296 bytes \(long name or pax header\); at most 65536")


def test_pax_header_declaring_gigabytes_is_refused(reg, tmp_path):
    path = tmp_path / "pax.tar.gz"
    with gzip.open(path, "wb") as gz:
        gz.write(_header("././@PaxHeader", 2 << 30, tarfile.XHDTYPE))
        gz.write(b"0" * 4096)
    assert_refused(reg, path, "tar header record of 2147483648 bytes")


def test_a_chain_of_long_names_is_refused(reg, tmp_path):
    path = tmp_path / "chain.tar.gz"
    record = b"x" * 100 + b"\0" * 412
    with gzip.open(path, "wb") as gz:
        for _ in range(200):
            gz.write(_header("././@LongLink", 512, tarfile.GNUTYPE_LONGNAME) + record)
    assert_refused(reg, path, "more than 36 tar header records")


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return f"{n}{body}".encode()


def test_header_bytes_count_against_the_budget(reg, tmp_path):
    """Twenty pax records of 60 KB each (1.2 MB of headers, each under the record cap) in front of
    a small adapter, under a 1 MiB budget: refused although every member is small."""
    d = write_adapter(tmp_path / "a", rank=1, modules=("q",))
    assert sum(f.stat().st_size for f in d.iterdir()) < 200_000
    path = tmp_path / "padded.tar.gz"
    pad = _pax_record("TESSERA.pad", "p" * 60_000)
    with gzip.open(path, "wb") as gz:
        for _ in range(20):
            gz.write(_header("././@PaxHeader", len(pad), tarfile.XHDTYPE))
            gz.write(pad + b"\0" * (-len(pad) % 512))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
            for f in sorted(d.iterdir()):
                tf.add(str(f), arcname=f.name)
        gz.write(buf.getvalue())
    assert_refused(reg, path, "archive expands to more than 1048576 bytes")


def test_a_sparse_member_is_refused(reg, tmp_path):
    path = tmp_path / "sparse.tar"
    info = tarfile.TarInfo("adapter_model.safetensors")
    info.type = tarfile.GNUTYPE_SPARSE
    path.write_bytes(info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 1024)
    assert_refused(reg, path, "sparse file")


def test_a_normal_tar_gz_still_uploads(reg, tmp_path):
    d = write_adapter(tmp_path / "a", rank=1, modules=("q",))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for f in sorted(d.iterdir()):
            tf.add(str(f), arcname=f"bot/{f.name}")
    (tmp_path / "ok.tgz").write_bytes(buf.getvalue())
    assert upload(reg, tmp_path / "ok.tgz").status == "ready"

"""Turn an upload into the two PEFT files on local disk, refusing anything unsafe.

An upload is a directory holding adapter_config.json + adapter_model.safetensors, or one .zip /
.tar.gz (.tgz) holding them (at its root or inside one top-level folder). Archives are read
member by member with explicit checks instead of extractall: no absolute paths or '..', no
symbolic/hard links or device files, at most `max_files` entries, at most
`max_uncompressed_bytes` in total (counted while decompressing, not trusted from headers), no
encrypted members. Pickle weights (adapter_model.bin, *.pt, ...) are refused wherever they are.

Tar archives are decompressed by our own reader, which counts every byte tarfile reads (headers,
padding and skipped members included) against `max_uncompressed_bytes`; tarfile's meta-headers
(GNU long names/links, pax records), which it would read whole into memory before any member
check, are refused above MAX_TAR_META_BYTES each and beyond a few per entry, before tarfile
reads them. GNU sparse members are refused.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from adapter_registry.errors import UploadRejected
from engine.lora.peft_format import UnsupportedAdapterError, check_not_pickle
from engine.lora.source import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CHUNK_BYTES = 1024 * 1024
_WANTED = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
# A GNU long name or pax header record larger than this is refused: real ones hold a path and a
# few attributes (PATH_MAX is 4 KiB), and tarfile reads each whole into memory.
MAX_TAR_META_BYTES = 64 * 1024
_TAR_META_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                   tarfile.SOLARIS_XHDTYPE)
# Meta-headers allowed per archive entry (a long name + a long link + a pax record + a global one).
_TAR_META_PER_ENTRY = 4


@dataclass(frozen=True)
class ArchiveLimits:
    max_uncompressed_bytes: int
    max_files: int


@dataclass(frozen=True)
class StagedAdapter:
    """The two files of an upload on local disk."""

    config_path: Path
    weights_path: Path


def _refuse_pickle(name: str) -> None:
    try:
        check_not_pickle(PurePosixPath(name).name)
    except UnsupportedAdapterError as e:
        raise UploadRejected(str(e)) from None


def _safe_name(name: str) -> PurePosixPath:
    """The member's path if it stays inside the extraction root, else UploadRejected."""
    p = PurePosixPath(name)
    if (not name or name.startswith("/") or "\\" in name or ":" in (p.parts[0] if p.parts else "")
            or any(part == ".." for part in p.parts)):
        raise UploadRejected(f"archive entry {name!r} has an unsafe path (absolute or with '..'); refused")
    return p


def _pick(found: dict[str, list[PurePosixPath]], what: str) -> PurePosixPath:
    paths = found.get(what, [])
    if not paths:
        raise UploadRejected(f"the upload holds no {what}; a PEFT adapter needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    if len(paths) > 1:
        raise UploadRejected(f"the upload holds more than one {what} ({', '.join(map(str, paths))}); upload one adapter at a time")
    if len(paths[0].parts) > 2:
        raise UploadRejected(f"{paths[0]} is nested too deep; put the files at the archive root or in one folder")
    return paths[0]


class _Budget:
    """Counts decompressed bytes across an archive and refuses past the limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise UploadRejected(
                f"archive expands to more than {self.limit} bytes; refused as a possible zip bomb"
            )


def _copy_bounded(src: IO[bytes], dest: Path, budget: _Budget | None) -> None:
    with open(dest, "wb") as out:
        while chunk := src.read(CHUNK_BYTES):
            if budget is not None:
                budget.take(len(chunk))
            out.write(chunk)


def _stage_zip(path: Path, workdir: Path, limits: ArchiveLimits) -> StagedAdapter:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise UploadRejected(f"{path.name} is not a readable zip archive: {e}") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_files:
            raise UploadRejected(f"archive holds {len(infos)} entries; at most {limits.max_files} are allowed")
        declared = 0
        found: dict[str, list[PurePosixPath]] = {}
        members: dict[PurePosixPath, zipfile.ZipInfo] = {}
        for info in infos:
            p = _safe_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise UploadRejected(f"archive entry {info.filename!r} is a symbolic link; links are refused")
            if info.flag_bits & 0x1:
                raise UploadRejected(f"archive entry {info.filename!r} is encrypted; refused")
            if info.is_dir():
                continue
            _refuse_pickle(info.filename)
            declared += info.file_size
            if declared > limits.max_uncompressed_bytes:
                raise UploadRejected(
                    f"archive expands to more than {limits.max_uncompressed_bytes} bytes; refused as a possible zip bomb"
                )
            if p.name in _WANTED:
                found.setdefault(p.name, []).append(p)
                members[p] = info
        config, weights = _pick(found, ADAPTER_CONFIG), _pick(found, ADAPTER_WEIGHTS)
        budget = _Budget(limits.max_uncompressed_bytes)
        try:
            for p in (config, weights):
                with zf.open(members[p]) as src:
                    _copy_bounded(src, workdir / p.name, budget)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise UploadRejected(f"{path.name} is corrupt: {e}") from None
    return StagedAdapter(workdir / ADAPTER_CONFIG, workdir / ADAPTER_WEIGHTS)


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses oversized or too many meta-headers and sparse members before
    tarfile processes them (tarfile.open(..., tarinfo=_BoundedTarInfo))."""

    max_meta_headers = 0  # set per archive by _stage_tar (a subclass per call)

    def _proc_member(self, tarfile_):
        if self.type in _TAR_META_TYPES:
            if self.size > MAX_TAR_META_BYTES:
                raise UploadRejected(
                    f"archive holds a tar header record of {self.size} bytes (long name or pax header); at most "
                    f"{MAX_TAR_META_BYTES} are allowed"
                )
            seen = getattr(tarfile_, "_tessera_meta_headers", 0) + 1
            tarfile_._tessera_meta_headers = seen
            if seen > self.max_meta_headers:
                raise UploadRejected(f"archive holds more than {self.max_meta_headers} tar header records; refused")
        elif self.type == tarfile.GNUTYPE_SPARSE:
            raise UploadRejected(f"archive entry {self.name!r} is a sparse file; refused")
        return super()._proc_member(tarfile_)


class _CountingReader:
    """A read-only stream over the decompressed tar bytes that charges each read to `budget`."""

    def __init__(self, raw: IO[bytes], budget: _Budget):
        self.raw = raw
        self.budget = budget

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n if n is not None and n >= 0 else CHUNK_BYTES)
        self.budget.take(len(data))
        return data


def _open_decompressed(path: Path) -> IO[bytes]:
    """`path` opened through the decompressor its magic bytes name (gzip, bz2, xz), or raw."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    if magic.startswith(b"BZh"):
        return bz2.open(path, "rb")
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.open(path, "rb")
    return open(path, "rb")


def _stage_tar(path: Path, workdir: Path, limits: ArchiveLimits) -> StagedAdapter:
    found: dict[str, list[PurePosixPath]] = {}
    budget = _Budget(limits.max_uncompressed_bytes)
    tarinfo = type("_ArchiveTarInfo", (_BoundedTarInfo,),
                   {"max_meta_headers": _TAR_META_PER_ENTRY * (limits.max_files + 1)})
    count = 0
    try:
        # Stream mode: one pass over the decompressed stream, members handled as they come; every
        # byte tarfile reads goes through the budget.
        with _open_decompressed(path) as raw, tarfile.open(fileobj=_CountingReader(raw, budget), mode="r|",
                                                          tarinfo=tarinfo) as tf:
            for m in tf:
                count += 1
                if count > limits.max_files:
                    raise UploadRejected(f"archive holds more than {limits.max_files} entries; refused")
                p = _safe_name(m.name)
                if m.issym() or m.islnk():
                    raise UploadRejected(f"archive entry {m.name!r} is a link; links are refused")
                if m.isdir():
                    continue
                if not m.isfile() or m.sparse is not None:
                    raise UploadRejected(f"archive entry {m.name!r} is not a regular file; refused")
                _refuse_pickle(m.name)
                if budget.used + m.size > budget.limit:
                    budget.take(m.size)  # raises with the bomb message before decompressing it
                if p.name in _WANTED:
                    found.setdefault(p.name, []).append(p)
                    if len(found[p.name]) == 1:
                        src = tf.extractfile(m)
                        assert src is not None  # a regular file always has a stream
                        _copy_bounded(src, workdir / p.name, None)  # its bytes are charged as read
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        raise UploadRejected(f"{path.name} is not a readable tar archive: {e}") from None
    _pick(found, ADAPTER_CONFIG), _pick(found, ADAPTER_WEIGHTS)
    return StagedAdapter(workdir / ADAPTER_CONFIG, workdir / ADAPTER_WEIGHTS)


def _stage_directory(path: Path) -> StagedAdapter:
    for child in path.iterdir():
        _refuse_pickle(child.name)
    config, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for f in (config, weights):
        if not f.is_file():
            raise UploadRejected(f"{path} holds no {f.name}; a PEFT adapter needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    return StagedAdapter(config, weights)


def stage_upload(source: Path, workdir: Path, limits: ArchiveLimits) -> StagedAdapter:
    """The PEFT files of `source` (a directory, .zip, .tar.gz or .tgz) as local files.

    Archive members are extracted into `workdir` (which the caller owns and removes); a
    directory's files are used in place. Raises UploadRejected with the reason for anything
    unsafe or incomplete.
    """
    source = Path(source)
    name = source.name.lower()
    if source.is_dir():
        return _stage_directory(source)
    if not source.is_file():
        raise UploadRejected(f"{source} does not exist")
    _refuse_pickle(name)
    if name.endswith(".zip"):
        return _stage_zip(source, workdir, limits)
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return _stage_tar(source, workdir, limits)
    raise UploadRejected(
        f"{source.name}: upload a folder with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, or a .zip or .tar.gz holding them"
    )


"""Turn an upload into the two PEFT files on local disk, refusing anything unsafe.

An upload is a directory holding adapter_config.json + adapter_model.safetensors, or one .zip /
.tar.gz (.tgz) holding them (at its root or inside one top-level folder). Archives are read
member by member with explicit checks instead of extractall: no absolute paths or '..', no
symbolic/hard links or device files, at most `max_files` entries, at most
`max_uncompressed_bytes` in total (counted while decompressing, not trusted from headers), no
encrypted members. Pickle weights (adapter_model.bin, *.pt, ...) are refused wherever they are.
"""
from __future__ import annotations

import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from adapter_registry.errors import UploadRejected
from engine.lora.peft_format import UnsupportedAdapterError, check_not_pickle
from engine.lora.source import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CHUNK_BYTES = 1024 * 1024
_WANTED = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


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


def _copy_bounded(src: IO[bytes], dest: Path, budget: _Budget) -> None:
    with open(dest, "wb") as out:
        while chunk := src.read(CHUNK_BYTES):
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


def _stage_tar(path: Path, workdir: Path, limits: ArchiveLimits) -> StagedAdapter:
    found: dict[str, list[PurePosixPath]] = {}
    budget = _Budget(limits.max_uncompressed_bytes)
    count = 0
    try:
        # Stream mode: one pass over the gzip stream, members handled as they come.
        with tarfile.open(path, mode="r|*") as tf:
            for m in tf:
                count += 1
                if count > limits.max_files:
                    raise UploadRejected(f"archive holds more than {limits.max_files} entries; refused")
                p = _safe_name(m.name)
                if m.issym() or m.islnk():
                    raise UploadRejected(f"archive entry {m.name!r} is a link; links are refused")
                if m.isdir():
                    continue
                if not m.isfile():
                    raise UploadRejected(f"archive entry {m.name!r} is not a regular file; refused")
                _refuse_pickle(m.name)
                if budget.used + m.size > budget.limit:
                    budget.take(m.size)  # raises with the bomb message
                if p.name in _WANTED:
                    found.setdefault(p.name, []).append(p)
                    if len(found[p.name]) == 1:
                        src = tf.extractfile(m)
                        assert src is not None  # a regular file always has a stream
                        _copy_bounded(src, workdir / p.name, budget)
                    continue
                budget.take(m.size)  # skipped members still cost decompression
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UploadRejected(f"{path.name} is not a readable tar.gz archive: {e}") from None
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


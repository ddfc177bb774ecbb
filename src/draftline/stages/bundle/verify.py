"""Verification: recompute every hash of a bundle folder or archive against its manifest.
Archives are read, never extracted; unsafe members (absolute paths, ``..``, links) are refused."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import sys
import tarfile
import zlib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from tqdm import tqdm

from draftline.core.atomic import sha256_file
from draftline.stages.bundle.archive import (
    BUNDLE_FORMAT,
    CHUNK,
    MANIFEST,
    VerifyError,
    sort_key,
)


def _check_member_path(name: str, what: str) -> PurePosixPath:
    """Refuse absolute paths, drive letters, backslashes and ``..`` components."""
    path = PurePosixPath(name)
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or path.is_absolute():
        raise VerifyError(f"{what} {name!r}: absolute path refused")
    if ".." in path.parts or "\\" in name:
        raise VerifyError(f"{what} {name!r}: path escapes the bundle ('..' or '\\') refused")
    return path


def _parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The manifest, its file list checked entry by entry: whatever the bytes hold, a problem
    is a VerifyError naming it, never a lookup or type error further on."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise VerifyError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise VerifyError(f"{where}: not a {BUNDLE_FORMAT} manifest")
    if "files" not in manifest:
        raise VerifyError(f"{where}: no 'files' list")
    files = manifest["files"]
    if not isinstance(files, list):
        raise VerifyError(f"{where}: 'files' must be a list of file entries, "
                          f"got {type(files).__name__}")
    seen = set()
    for i, entry in enumerate(files):
        _check_file_entry(entry, f"{where}: files[{i}]")
        if entry["path"] in seen or entry["path"] == MANIFEST:
            raise VerifyError(f"{where}: {entry['path']} listed twice")
        seen.add(entry["path"])
    return manifest


def _check_file_entry(entry: Any, what: str) -> None:
    if not isinstance(entry, dict):
        raise VerifyError(f"{what} must be an object with path, sha256 and size, "
                          f"got {type(entry).__name__}")
    if not {"path", "sha256", "size"} <= set(entry):
        raise VerifyError(f"{what} lacks path, sha256 or size")
    for key in ("path", "sha256"):
        if not isinstance(entry[key], str):
            raise VerifyError(f"{what} {key!r} must be a string, got {entry[key]!r}")
    size = entry["size"]
    # bool is an int subclass, but True is not a size anyone wrote.
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise VerifyError(f"{what} 'size' must be a non-negative integer, got {size!r}")
    _check_member_path(entry["path"], what)


def _compare(manifest: dict, found: Mapping[str, tuple[str, int]]) -> None:
    """Compare measured (sha256, size) per path with the manifest, in manifest order."""
    for entry in manifest["files"]:
        path = entry["path"]
        if path not in found:
            raise VerifyError(f"{path}: listed in the manifest but missing")
        sha, size = found[path]
        if size != entry["size"]:
            raise VerifyError(f"{path}: size {size} != {entry['size']} in the manifest")
        if sha != entry["sha256"]:
            raise VerifyError(f"{path}: sha256 {sha} != {entry['sha256']} in the manifest")
    listed = {e["path"] for e in manifest["files"]} | {MANIFEST}
    extra = sorted(set(found) - listed, key=sort_key)
    if extra:
        raise VerifyError(f"{extra[0]}: not listed in the manifest")


def verify_bundle(path: str | Path) -> dict[str, Any]:
    """Recompute every hash of a bundle folder or archive; return its manifest or raise
    VerifyError naming the first problem. Archives are read, never extracted."""
    path = Path(path)
    if path.is_dir():
        return _verify_dir(path)
    if path.is_file():
        return _verify_tar(path)
    raise FileNotFoundError(f"{path}: no such bundle folder or archive")


def _verify_dir(root: Path) -> dict[str, Any]:
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise VerifyError(f"{MANIFEST}: not found in {root}")
    manifest = _parse_manifest(manifest_path.read_bytes(), MANIFEST)
    found: dict[str, tuple[str, int]] = {}
    entries = sorted(root.rglob("*"), key=lambda p: sort_key(p.relative_to(root).as_posix()))
    total = sum(p.stat().st_size for p in entries if p.is_file() and not p.is_symlink())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", mininterval=1) as bar:
        for p in entries:
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise VerifyError(f"{rel}: symbolic link (to {os.readlink(p)}) refused")
            if p.is_file() and rel != MANIFEST:
                found[rel] = (sha256_file(p, bar), p.stat().st_size)
    _compare(manifest, found)
    return manifest


def _hash_stream(fh: BinaryIO, bar: tqdm) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := fh.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
        bar.update(len(chunk))
    return digest.hexdigest(), size


# What a damaged or truncated archive raises while it is read: tarfile's own errors, and the
# decompressors' (gzip, bz2 and xz streams end early or hold garbage).
_ARCHIVE_READ_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)


def _verify_tar(tar_path: Path) -> dict[str, Any]:
    try:
        members, manifest_bytes = _read_tar(tar_path)
    except _ARCHIVE_READ_ERRORS as exc:
        raise VerifyError(f"{tar_path}: cannot read the archive ({exc})") from exc
    prefix = _archive_prefix(list(manifest_bytes), tar_path)
    for name in members:
        if not name.startswith(prefix):
            raise VerifyError(f"archive member {name!r}: outside the bundle folder {prefix!r}")
    manifest = _parse_manifest(manifest_bytes[prefix + MANIFEST], f"{prefix}{MANIFEST}")
    _compare(manifest, {n[len(prefix):]: v for n, v in members.items()
                        if n[len(prefix):] != MANIFEST})
    return manifest


def _read_tar(tar_path: Path) -> tuple[dict[str, tuple[str, int]], dict[str, bytes]]:
    """(sha256, size) of every file member, and the bytes of each candidate manifest; unsafe
    members are refused before anything is read from them."""
    members: dict[str, tuple[str, int]] = {}
    manifest_bytes: dict[str, bytes] = {}
    with tarfile.open(tar_path, "r:*") as tar, \
            tqdm(unit="B", unit_scale=True, desc="verify", mininterval=1) as bar:
        for member in tar:
            name = member.name.rstrip("/")
            path = _check_member_path(member.name, "archive member")
            _check_member_kind(member, path, name)
            if name in members or name in manifest_bytes:
                raise VerifyError(f"archive member {name!r}: appears twice")
            if member.isfile():
                fh = tar.extractfile(member)
                if path.name == MANIFEST and len(path.parts) <= 2:
                    manifest_bytes[name] = fh.read()
                    members[name] = (hashlib.sha256(manifest_bytes[name]).hexdigest(),
                                     len(manifest_bytes[name]))
                else:
                    members[name] = _hash_stream(fh, bar)
    return members, manifest_bytes


def _check_member_kind(member: tarfile.TarInfo, path: PurePosixPath, name: str) -> None:
    """Only regular files and folders: links could point anywhere once extracted."""
    if member.issym() or member.islnk():
        kind = "symbolic link" if member.issym() else "hard link"
        target = PurePosixPath(member.linkname)
        outside = (target.is_absolute() or ".." in
                   (path.parent / target if member.issym() else target).parts)
        raise VerifyError(f"archive member {name!r}: {kind} to {member.linkname!r}"
                          f"{' (outside the bundle)' if outside else ''} refused")
    if not (member.isfile() or member.isdir()):
        raise VerifyError(f"archive member {name!r}: not a regular file or folder")


def _archive_prefix(manifest_names: list[str], tar_path: Path) -> str:
    if not manifest_names:
        raise VerifyError(f"{MANIFEST}: not found in {tar_path}")
    if len(manifest_names) > 1:
        raise VerifyError(f"{tar_path}: more than one {MANIFEST} ({', '.join(manifest_names)})")
    return manifest_names[0][: -len(MANIFEST)]


def main_verify(path: str) -> int:
    """``draftline verify``: 0 when every hash matches, 1 naming the first mismatch, 2 when
    there is nothing to verify."""
    manifest = checked(verify_bundle, path)
    if isinstance(manifest, int):
        return manifest
    print(f"OK: {path}: {len(manifest['files'])} files match manifest.json")
    return 0


def checked(check, *args):
    """``check(*args)``, or the verify commands' exit code when it refuses: 2 when there is
    nothing to check, 1 on a mismatch (each said on stderr)."""
    try:
        return check(*args)
    except FileNotFoundError as exc:
        print(f"draftline verify: {exc}", file=sys.stderr)
        return 2
    except VerifyError as exc:
        print(f"draftline verify: FAILED: {exc}", file=sys.stderr)
        return 1


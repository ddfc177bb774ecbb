"""The bundle's on-disk format: file names, errors, JSON style and the deterministic archive.

``results/bundle.tar`` holds the bundle folder's files with sorted entries, fixed mtime, owner
and modes: the same files give the same bytes.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

from draftline.core.atomic import atomic_open, sha256_file

BUNDLE_FORMAT = "draftline-bundle/1"
MANIFEST = "manifest.json"
README = "README.md"
TAR_ROOT = "bundle"  # the archive's single top-level folder
FIXED_MTIME = 0
CHUNK = 1 << 20


class BundleError(ValueError):
    """The bundle cannot be built from these inputs; the message names the file."""


class VerifyError(ValueError):
    """A bundle failed verification; the message names the first offending file."""


def json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def sort_key(path: str) -> list[str]:
    """Component-wise order, so a folder's entry comes right before its contents."""
    return path.split("/")


def walk_files(root: Path) -> list[str]:
    files = []
    for path in root.rglob("*"):
        if path.is_symlink():
            raise BundleError(f"{path}: symbolic links are not allowed in a bundle")
        if path.is_file():
            files.append(path.relative_to(root).as_posix())
    return files


def write_deterministic_tar(src_dir: str | Path, tar_path: str | Path,
                            root: str = TAR_ROOT) -> str:
    """Archive ``src_dir`` under ``root/``: sorted entries, mtime 0, owner 0:0 without names,
    modes 0755/0644, no compression. Returns the archive's SHA-256."""
    src_dir, tar_path = Path(src_dir), Path(tar_path)
    names = set()
    for rel in walk_files(src_dir):
        parts = rel.split("/")
        names.update("/".join(parts[:i]) for i in range(1, len(parts)))
        names.add(rel)
    with atomic_open(tar_path, "wb") as raw, \
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_tarinfo(root, is_dir=True))
        for rel in sorted(names, key=sort_key):
            path = src_dir / rel
            if path.is_dir():
                tar.addfile(_tarinfo(f"{root}/{rel}", is_dir=True))
            else:
                info = _tarinfo(f"{root}/{rel}", is_dir=False, size=path.stat().st_size)
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
    return sha256_file(tar_path)


def _tarinfo(name: str, is_dir: bool, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = 0o755 if is_dir else 0o644
    info.size = 0 if is_dir else size
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


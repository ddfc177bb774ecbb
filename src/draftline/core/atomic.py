"""Atomic outputs: a file appears under its final name only once complete and synced.

Every stage writes through these helpers, so an interrupted or failed write (a kill, a full
disk) never leaves a file that a rerun or Snakemake could take as complete: the data goes to a
temp name in the same folder, is fsynced, and is renamed into place; on any error the temp file
is removed and an earlier complete file under the final name is left untouched.

A full disk (ENOSPC, EDQUOT, EFBIG) is reported as :class:`DiskFullError`, which names the file
being written; a stage whose planned output cannot fit raises the same error before writing.
``sha256_file`` is the digest that indexes and manifests record of what was written.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# the system's text for them, all that some libraries keep (EFBIG's "File too large" is
# left out: libraries use those words for limits of their own)
NO_SPACE_MESSAGES = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; done once, before any thread starts
    os.umask(mask)
    return mask


UMASK = _read_umask()


class DiskFullError(OSError):
    """Not enough disk for ``path``: a write ran out of space (nothing incomplete was left under
    its name), or a stage's planned output does not fit (raised before anything is written)."""

    def __init__(self, path: str | Path, message: str):
        super().__init__(errno.ENOSPC, message)
        self.path = Path(path)

    @classmethod
    def while_writing(cls, path: str | Path, cause: OSError) -> DiskFullError:
        return cls(path, f"no space left on the device while writing {path} "
                   f"({cause.strerror or cause}); nothing incomplete is kept as complete and "
                   "earlier results stay: free space and rerun to continue")


@contextlib.contextmanager
def disk_full_names(path: Path) -> Iterator[None]:
    """Turn a no-space error raised inside the block into a DiskFullError naming ``path``.

    Libraries report a full disk in their own ways: safetensors in its own error type that
    keeps only the system's message, torch.save (to a Python file) in an error raised while
    handling the OSError. Any other failure passes through as it is, however little space is
    left: a bug in the writer is not a full disk.
    """
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if is_disk_full(exc):
            cause = exc if isinstance(exc, OSError) else OSError(errno.ENOSPC, str(exc))
            raise DiskFullError.while_writing(path, cause) from exc
        raise


def is_disk_full(exc: BaseException) -> bool:
    """True when ``exc`` or an exception it was raised from is a no-space OSError, or a
    library's error that carries the system's no-space message in place of the errno."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        if any(message in str(exc) for message in NO_SPACE_MESSAGES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def temp_name(path: Path) -> Path:
    """A hidden sibling of ``path``, unique per process and call."""
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"


def remove_temps(directory: str | Path) -> int:
    """Delete the temp files and folders that killed writers left in ``directory`` (and settle
    the folder swaps they left half done)."""
    recover_interrupted_swaps(directory)
    count = 0
    for tmp in Path(directory).glob(".*.tmp-*"):
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        count += 1
    return count


def fsync_dir(directory: Path) -> None:
    """Make a rename durable (the directory entry), where the platform allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, durable: bool = True) -> Iterator[Path]:
    """Yield a temp path to write (by any library); on success it becomes ``path``.

    ``durable=False`` keeps the rename's all-or-nothing but skips the fsyncs: for files that
    are read back at once and whose folder is wiped at start (a spool), a crash may lose them
    but never shows one half written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with disk_full_names(path):
            yield tmp
            if durable:
                _fsync_file(tmp)
            os.chmod(tmp, 0o666 & ~UMASK)  # an ordinary output file, not a private temp
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """``open(path, mode)`` that publishes the file only when the block completes."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp:
        kwargs = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
        with open(tmp, mode, **kwargs) as fh:
            yield fh


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path) as fh:
        fh.write(text)


def write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    with atomic_open(path) as fh:
        json.dump(obj, fh, indent=indent)
        fh.write("\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """One JSON object per line (UTF-8 kept as is)."""
    with atomic_open(path) as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def copy_file(src: str | Path, dst: str | Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temp folder to fill; on success it replaces ``path`` (removed on failure).

    A folder cannot be renamed over another, so an earlier ``path`` is first moved aside to
    ``.old-<name>-<token>``; a kill between the two renames leaves it there, and the next
    call for ``path`` (or :func:`recover_interrupted_swaps` on its folder) puts it back.
    """
    path = Path(path)
    recover_interrupted_swap(path)
    tmp = temp_name(path)
    tmp.mkdir(parents=True)
    try:
        with disk_full_names(path):
            yield tmp
            for file in tmp.rglob("*"):
                if file.is_file():
                    _fsync_file(file)
        old = path.with_name(f"{OLD_PREFIX}{path.name}-{secrets.token_hex(3)}")
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # else the next call for path does it
            recover_interrupted_swap(path)
        raise
    fsync_dir(path.parent)


OLD_PREFIX = ".old-"
_SWAPPED_ASIDE = re.compile(rf"{re.escape(OLD_PREFIX)}(?P<name>.+)-[0-9a-f]{{6}}")


def swapped_aside(path: Path) -> list[Path]:
    """The earlier versions of ``path`` that swaps moved aside and did not remove."""
    return [old for old in path.parent.glob(f"{glob.escape(OLD_PREFIX + path.name)}-*")
            if (match := _SWAPPED_ASIDE.fullmatch(old.name)) and match["name"] == path.name]


def recover_interrupted_swap(path: str | Path) -> None:
    """Settle a swap of ``path`` that was killed part way: with ``path`` missing, the version
    moved aside is the last complete one and goes back; with ``path`` present, the new version
    made it in and what was moved aside is only waiting to be removed."""
    path = Path(path)
    leftovers = sorted(swapped_aside(path), key=lambda old: old.stat().st_mtime_ns)
    if leftovers and not path.exists():
        os.rename(leftovers.pop(), path)
        fsync_dir(path.parent)
    for old in leftovers:
        shutil.rmtree(old, ignore_errors=True)


def recover_interrupted_swaps(directory: str | Path) -> None:
    """:func:`recover_interrupted_swap` for every folder of ``directory`` a swap moved aside."""
    names = {match["name"] for old in Path(directory).glob(f"{OLD_PREFIX}*")
             if (match := _SWAPPED_ASIDE.fullmatch(old.name))}
    for name in sorted(names):
        recover_interrupted_swap(Path(directory) / name)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


HASH_CHUNK = 8 << 20


def sha256_file(path: str | Path, progress: Any = None) -> str:
    """The SHA-256 hex digest of a file's bytes; ``progress`` (a tqdm bar), when given,
    advances by the bytes read."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()

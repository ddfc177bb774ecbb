"""On-disk format of the hidden-state stage: part files, their sidecars, the index, checks.

Layout under ``out_dir`` (docs/formats.md, "Hidden states"):

* ``{split}/part-{k:05d}.safetensors`` - whole samples concatenated along tokens: ``aux [N, 3H]``,
  ``final [N, H]``, ``input_ids [N]`` int64, ``loss_mask [N]`` uint8, ``offsets [n + 1]`` int64,
  metadata ``sample_ids`` (JSON list) plus ``layer_ids``, ``final_layer_id``.
* ``{split}/part-{k:05d}.json`` - the part's index entry, its rejected samples and a fingerprint
  of everything that determines its content; it makes resuming cheap (no re-hashing).
* ``index.json`` - written last: target facts and one entry per part file.

``HiddenStates`` (at the end) is the reader training uses: it opens the index and reads one
sample's slices at a time.

Part files are written by our own small safetensors writer: the Rust writer stores metadata in a
hash map whose order changes from process to process, so the same tensors would not give the
same bytes (and checksums) twice. Ours is deterministic and hashes while it writes.

Only torch is needed here (imported inside functions).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline.core.atomic import DiskFullError, atomic_open, sha256_file
from draftline.core.layout import HIDDEN_INDEX
from draftline.core.target import DTYPE_SIZES, NUM_AUX_LAYERS

FORMAT_VERSION = 1
# Bytes per token besides the states: input_ids (int64) and loss_mask (uint8).
TOKEN_SIDE_BYTES = 8 + 1

_SAFETENSORS_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
    "int8": "I8",
    "bool": "BOOL",
}


# ----------------------------------------------------------------------------- sizes


def state_bytes_per_token(hidden_size: int, dtype: str = "bfloat16",
                          num_aux: int = NUM_AUX_LAYERS) -> int:
    """Bytes of stored states per token: ``num_aux`` aux layers plus the final layer."""
    return (num_aux + 1) * hidden_size * DTYPE_SIZES[dtype]


def stored_bytes_per_token(hidden_size: int, dtype: str = "bfloat16",
                           num_aux: int = NUM_AUX_LAYERS) -> int:
    """State bytes plus the token ids and loss mask stored next to them."""
    return state_bytes_per_token(hidden_size, dtype, num_aux) + TOKEN_SIDE_BYTES


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_capacity(need_bytes: int, out_dir: Path, free_bytes: int | None, margin: float) -> dict:
    """Fail early when ``need_bytes * margin`` exceeds the free disk; return the figures."""
    measured = free_bytes is None
    free = free_disk_bytes(out_dir) if measured else int(free_bytes)
    required = int(need_bytes * margin)
    figures = {"need_bytes": int(need_bytes), "required_bytes": required, "free_bytes": free,
               "margin": margin, "free_source": "measured" if measured else "hidden.free_bytes"}
    if required > free:
        where = f"free on the disk of {out_dir}" if measured else "free (config hidden.free_bytes)"
        raise DiskFullError(
            out_dir,
            f"hidden states need {human_bytes(need_bytes)} ({need_bytes:,} bytes), "
            f"{human_bytes(required)} with the margin hidden.disk_margin={margin}, but only "
            f"{human_bytes(free)} ({free:,} bytes) are {where}. Free disk space, point "
            "'results' at a larger disk, or reduce prompts.max_samples / dataset.max_length."
        )
    return figures


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class PartSpec:
    """One part file: which rows of which split it holds (fixed by the dataset and config)."""

    split: str
    index: int
    rows: tuple[int, ...]

    @property
    def stem(self) -> str:
        return f"{self.split}/part-{self.index:05d}"

    @property
    def path(self) -> str:
        return f"{self.stem}.safetensors"

    @property
    def sidecar(self) -> str:
        return f"{self.stem}.json"


def plan_parts(lengths: dict[str, Sequence[int]], samples_per_file: int,
               max_file_tokens: int) -> list[PartSpec]:
    """Cut each split, in dataset order, into parts of at most ``samples_per_file`` samples and
    ``max_file_tokens`` tokens (a longer sample gets a part of its own).

    The cut depends only on the dataset and config, so a resumed run recomputes exactly the
    parts that are missing, with the same content.
    """
    parts: list[PartSpec] = []
    for split, split_lengths in lengths.items():
        rows: list[int] = []
        tokens = 0
        k = 0
        for row, n in enumerate(split_lengths):
            if rows and (len(rows) >= samples_per_file or tokens + n > max_file_tokens):
                parts.append(PartSpec(split, k, tuple(rows)))
                k, rows, tokens = k + 1, [], 0
            rows.append(row)
            tokens += n
        if rows:
            parts.append(PartSpec(split, k, tuple(rows)))
    return parts


def part_fingerprint(settings: dict, samples: Sequence[tuple]) -> str:
    """Hash of everything a part holds and training reads from it.

    ``settings`` fix the states (target, layers, dtype, backend); ``samples`` are the part's
    ``(id, input_ids, loss_mask)`` rows: the ids and tokens fix the states, and the mask is
    copied into the part for training, so a dataset rebuilt with the same tokens but another
    mask makes the part stale.
    """
    import numpy as np

    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(json.dumps([str(sample[0]) for sample in samples]).encode())
    for _, input_ids, loss_mask in samples:
        for array in (np.asarray(input_ids, dtype=np.int64),
                      np.asarray(loss_mask, dtype=np.uint8)):
            digest.update(len(array).to_bytes(8, "little"))
            digest.update(array.tobytes())
    return digest.hexdigest()


def load_complete_part(out_dir: Path, part: PartSpec, fingerprint: str) -> dict | None:
    """The sidecar of a finished part whose content is still valid, else None.

    A part counts as finished when its sidecar (written after the atomic rename of the part
    file) matches the fingerprint and the part file has the recorded size.
    """
    sidecar = out_dir / part.sidecar
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    if record.get("fingerprint") != fingerprint:
        return None
    part_file = out_dir / part.path
    if not part_file.is_file() or part_file.stat().st_size != record["entry"]["bytes"]:
        return None
    return record


def remove_stale_temp_files(out_dir: Path) -> int:
    """Delete temp files left by a killed run; return how many."""
    count = 0
    for tmp in Path(out_dir).rglob(".*.tmp-*"):
        tmp.unlink(missing_ok=True)
        count += 1
    return count


# ----------------------------------------------------------------------------- writing


def _dtype_name(tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {tensor.dtype} cannot be stored in a part file")
    return _SAFETENSORS_DTYPES[name]


def _header_bytes(tensors: dict, metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {k: metadata[k] for k in sorted(metadata)}}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _dtype_name(tensor), "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    # The data section must start 8-byte aligned; safetensors pads the header with spaces.
    return blob + b" " * (-len(blob) % 8)


def _tensor_bytes(tensor) -> memoryview:
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file atomically and deterministically; return (bytes, sha256).

    Same tensors and metadata give the same bytes. The file appears under its final name only
    once complete and synced (temp name in the same folder, then rename).
    """
    header = _header_bytes(tensors, metadata)
    digest = hashlib.sha256()
    size = 0
    with atomic_open(path, "wb") as fh:
        for chunk in (len(header).to_bytes(8, "little"), header):
            fh.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        for name in sorted(tensors):
            data = _tensor_bytes(tensors[name])
            fh.write(data)
            digest.update(data)
            size += data.nbytes
    return size, digest.hexdigest()


# ----------------------------------------------------------------------------- reading, checks


def load_part(path: Path) -> tuple[dict, list[str]]:
    """Tensors of a part file and its sample ids (in file order)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        sample_ids = json.loads(fh.metadata()["sample_ids"])
    return tensors, sample_ids


def read_index(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / HIDDEN_INDEX).read_text())


def _check_structure(path: Path, entry: dict, hidden_size: int, num_aux: int) -> list[str]:
    """Shapes and metadata of a part file against its index entry (header only, cheap)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            shapes = {name: list(fh.get_slice(name).get_shape()) for name in fh.keys()}
            sample_ids = json.loads((fh.metadata() or {}).get("sample_ids", "null"))
            offsets = fh.get_tensor("offsets") if "offsets" in shapes else None
    except (SafetensorError, OSError, ValueError) as exc:
        return [f"{entry['path']}: not a readable safetensors file ({exc})"]
    n, n_samples = entry["num_tokens"], len(entry["sample_ids"])
    expected = {"aux": [n, num_aux * hidden_size], "final": [n, hidden_size], "input_ids": [n],
                "loss_mask": [n], "offsets": [n_samples + 1]}
    problems = [f"{entry['path']}: tensor {name} has shape {shapes.get(name)}, expected {shape}"
                for name, shape in expected.items() if shapes.get(name) != shape]
    if sample_ids != entry["sample_ids"]:
        problems.append(f"{entry['path']}: sample_ids in the file differ from the index")
    if offsets is not None and not problems and (int(offsets[0]) != 0 or int(offsets[-1]) != n):
        problems.append(f"{entry['path']}: offsets do not span the {n} tokens")
    return problems


def verify_index(out_dir: Path) -> list[str]:
    """Check every part file listed in ``index.json``: present, size, sha256, shapes, ids.

    Returns the problems found (empty list: all good). Reads every byte (checksums).
    """
    out_dir = Path(out_dir)
    try:
        index = read_index(out_dir)
    except (OSError, ValueError) as exc:
        return [f"{out_dir / HIDDEN_INDEX}: cannot read the index ({exc})"]
    problems: list[str] = []
    num_aux = len(index.get("layer_ids", [])) or NUM_AUX_LAYERS
    seen: set[str] = set()
    for entry in index.get("files", []):
        path = out_dir / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']}: missing")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{entry['path']}: {size} bytes on disk, index says {entry['bytes']}")
            continue
        if sha256_file(path) != entry["sha256"]:
            problems.append(f"{entry['path']}: sha256 mismatch (file corrupted or replaced)")
            continue
        problems += _check_structure(path, entry, index["hidden_size"], num_aux)
        duplicates = seen.intersection(entry["sample_ids"])
        if duplicates:
            problems.append(f"{entry['path']}: sample ids stored twice: {sorted(duplicates)[:5]}")
        seen.update(entry["sample_ids"])
    return problems


# ----------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class SampleRef:
    """Where one sample's tokens lie in a part file: rows ``start:end``."""

    file: Path
    start: int
    end: int
    sample_id: str

    @property
    def length(self) -> int:
        return self.end - self.start


class HiddenStates:
    """The store of docs/formats.md, read lazily one sample slice at a time (training)."""

    MAX_OPEN = 8

    def __init__(self, hidden_dir: Path):
        from safetensors import safe_open

        self.root = Path(hidden_dir)
        index_path = self.root / HIDDEN_INDEX
        if not index_path.exists():
            raise FileNotFoundError(f"hidden-state index not found: {index_path}")
        self.index = json.loads(index_path.read_text())
        for key in ("hidden_size", "layer_ids", "files"):
            if key not in self.index:
                raise ValueError(f"{index_path}: missing key '{key}'")
        self.hidden_size = int(self.index["hidden_size"])
        self.layer_ids = [int(i) for i in self.index["layer_ids"]]
        self.samples: dict[str, list[SampleRef]] = {}
        for entry in self.index["files"]:
            path = self.root / entry["path"]
            if not path.exists():
                raise FileNotFoundError(f"hidden-state part listed in {index_path} is missing: "
                                        f"{path}")
            with safe_open(str(path), framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()  # [n_samples + 1]
            ids = entry.get("sample_ids") or [str(i) for i in range(len(offsets) - 1)]
            if len(ids) != len(offsets) - 1:
                raise ValueError(f"{path}: {len(offsets) - 1} samples in offsets, "
                                 f"{len(ids)} sample_ids in the index")
            split = self.samples.setdefault(entry["split"], [])
            split += [SampleRef(path, a, b, sid)
                      for a, b, sid in zip(offsets[:-1], offsets[1:], ids, strict=True)]
        self._open: dict[Path, Any] = {}

    @property
    def origin(self) -> Path:
        """What error messages name for these states."""
        return self.root / HIDDEN_INDEX

    def identity(self) -> bytes:
        """What fixes the states: a training checkpoint resumes only with the same."""
        return (self.root / HIDDEN_INDEX).read_bytes()

    def report(self) -> dict:
        return {"mode": "offline"}

    def close(self) -> None:
        self._open.clear()

    def __getstate__(self):  # data-loader workers open their own handles
        return {**self.__dict__, "_open": {}}

    def _handle(self, path: Path):
        from safetensors import safe_open

        if path not in self._open:
            if len(self._open) >= self.MAX_OPEN:
                self._open.pop(next(iter(self._open)))
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def read(self, ref: SampleRef) -> dict:
        """aux ``[n, 3Ht]``, final ``[n, Ht]``, input_ids ``[n]``, loss_mask ``[n]`` of a sample."""
        f = self._handle(ref.file)
        out = {name: f.get_slice(name)[ref.start:ref.end]
               for name in ("aux", "final", "input_ids", "loss_mask")}
        if out["aux"].shape[-1] != NUM_AUX_LAYERS * self.hidden_size or out["final"].shape[-1] != (
                self.hidden_size):
            raise ValueError(f"{ref.file}: sample {ref.sample_id}: aux/final widths "
                             f"{out['aux'].shape[-1]}/{out['final'].shape[-1]} do not match "
                             f"hidden_size {self.hidden_size} x {NUM_AUX_LAYERS} aux layers")
        return out

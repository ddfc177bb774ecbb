"""Hidden-state extraction: run the target over the tokenized dataset and store its states.

``extract_hidden_states`` reads the tokenized dataset, runs the target (backend ``hf``:
transformers with forward pre-hooks; backend ``vllm``: vLLM's ``extract_hidden_states`` method
with our KV connector) and writes part files plus ``index.json`` (formats: ``store.py`` and
docs/formats.md). It checks the disk first, resumes at part-file granularity, and rejects
samples whose states are not finite.

Layer ids follow vLLM (docs/formats.md): id k < L is the residual stream entering decoder layer k,
id L the pre-norm output of the last layer. Heavy packages are imported only when extracting.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from draftline.core.atomic import write_json
from draftline.core.layout import HIDDEN_INDEX, HIDDEN_STATS
from draftline.core.machine import engine_machine, torch_gpus
from draftline.core.target import DTYPE_SIZES, check_teacher_head, text_config
from draftline.serving.server import release_other_servers
from draftline.stages.hidden.layers import capture_ids, resolve_layer_ids
from draftline.stages.hidden.store import (
    FORMAT_VERSION,
    PartSpec,
    check_capacity,
    human_bytes,
    load_complete_part,
    part_fingerprint,
    plan_parts,
    remove_stale_temp_files,
    stored_bytes_per_token,
    write_safetensors,
)

log = logging.getLogger(__name__)

# Defaults of the schema's `hidden` section, for callers that pass a partial dict.
DEFAULTS = {
    "backend": "hf",
    "mode": "offline",
    "hf_batching": "bucketed",
    "layer_ids": None,
    "batch_tokens": 8192,
    "samples_per_file": 256,
    "max_file_bytes": 2 << 30,
    "free_bytes": None,
    "disk_margin": 1.1,
    "trust_remote_code": False,
}
SPLIT_ORDER = ("train", "eval")
# Safetensors header and offsets: a generous allowance per file and per sample.
FILE_OVERHEAD_BYTES, SAMPLE_OVERHEAD_BYTES = 4096, 64


class HiddenStateError(ValueError):
    """Bad input for extraction (dataset record, layer ids, target config)."""


# ----------------------------------------------------------------------------- target


def target_info(target_dir: Path) -> dict:
    """Layers, width, vocab, dtype and a cheap fingerprint of an HF model directory."""
    target_dir = Path(target_dir)
    config_path = target_dir / "config.json"
    try:
        raw = config_path.read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise HiddenStateError(f"{config_path}: cannot read the target config ({exc})") from exc
    check_teacher_head(config, config_path)  # states for a teacher training cannot build
    text = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise HiddenStateError(f"{config_path}: missing {missing}")
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if dtype not in DTYPE_SIZES:
        raise HiddenStateError(f"{config_path}: unsupported dtype {dtype!r}")
    # Weights are identified by name and size (hashing a 1T-parameter checkpoint is too slow).
    digest = hashlib.sha256(raw)
    for weights in sorted(target_dir.glob("*.safetensors")) + sorted(target_dir.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return {
        "num_layers": int(text["num_hidden_layers"]),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "dtype": dtype,
        "fingerprint": digest.hexdigest(),
        "config": config,
    }


# ----------------------------------------------------------------------------- dataset


class SplitData:
    """One dataset split, read part by part (the token columns are never all in memory)."""

    def __init__(self, name: str, dataset, vocab_size: int):
        import pyarrow.compute as pc

        missing = {"id", "input_ids", "loss_mask"} - set(dataset.column_names)
        if missing:
            raise HiddenStateError(f"dataset split {name!r}: missing columns {sorted(missing)}")
        self.name = name
        if getattr(dataset, "_indices", None) is not None:
            dataset = dataset.flatten_indices()  # the lengths below read the Arrow table
        self.dataset = dataset.with_format("numpy", columns=["input_ids", "loss_mask"])
        self.ids = [str(i) for i in dataset["id"]]
        table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
        self.lengths = pc.list_value_length(table.column("input_ids")).to_pylist()
        self.vocab_size = vocab_size

    def rows(self, rows: Sequence[int]) -> list[tuple[str, object, object]]:
        """(id, input_ids int64 [T], loss_mask uint8 [T]) of the given rows, validated."""
        import numpy as np

        batch = self.dataset[list(rows)]
        out = []
        for row, input_ids, loss_mask in zip(rows, batch["input_ids"], batch["loss_mask"],
                                              strict=True):
            sample_id = self.ids[row]
            input_ids = np.asarray(input_ids, dtype=np.int64)
            loss_mask = np.asarray(loss_mask).astype(np.uint8)
            where = f"dataset split {self.name!r}, sample {sample_id!r}"
            if len(input_ids) == 0:
                raise HiddenStateError(f"{where}: empty input_ids")
            if len(loss_mask) != len(input_ids):
                raise HiddenStateError(f"{where}: loss_mask has {len(loss_mask)} entries, "
                                       f"input_ids {len(input_ids)}")
            if input_ids.min() < 0 or input_ids.max() >= self.vocab_size:
                raise HiddenStateError(f"{where}: token id outside the target vocab "
                                       f"0..{self.vocab_size - 1}")
            out.append((sample_id, input_ids, loss_mask))
        return out


def load_splits(dataset_dir: Path, vocab_size: int) -> dict[str, SplitData]:
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(dataset_dir))
    except (FileNotFoundError, ValueError) as exc:
        raise HiddenStateError(f"{dataset_dir}: not a saved HF dataset ({exc})") from exc
    if not isinstance(data, DatasetDict):
        raise HiddenStateError(f"{dataset_dir}: expected a DatasetDict with splits train/eval")
    names = [s for s in SPLIT_ORDER if s in data] + sorted(set(data) - set(SPLIT_ORDER))
    splits = {name: SplitData(name, data[name], vocab_size) for name in names}
    seen: dict[str, str] = {}
    for name, split in splits.items():
        for sample_id in split.ids:
            if sample_id in seen:
                raise HiddenStateError(f"sample id {sample_id!r} appears twice (splits "
                                       f"{seen[sample_id]!r} and {name!r})")
            seen[sample_id] = name
    return splits


# ----------------------------------------------------------------------------- parts


def _split_states(states, layer_ids: Sequence[int], captured: Sequence[int], num_layers: int):
    """``[T, n_captured, H]`` -> aux ``[T, 3H]`` (layer_ids order) and final ``[T, H]``."""
    import torch

    aux = torch.cat([states[:, captured.index(k)] for k in layer_ids], dim=-1)
    final = states[:, captured.index(num_layers)]
    return aux, final


def _nonfinite_layers(aux, final, layer_ids: Sequence[int], num_layers: int) -> list[int]:
    import torch

    hidden = final.shape[-1]
    bad = [k for j, k in enumerate(layer_ids)
           if not torch.isfinite(aux[:, j * hidden:(j + 1) * hidden]).all()]
    if not torch.isfinite(final).all():
        bad.append(num_layers)
    return bad


def write_part(out_dir: Path, part: PartSpec, samples: list, states: list, ctx: dict) -> dict:
    """Write one part file and its sidecar; samples with non-finite states are left out."""
    import numpy as np
    import torch

    dtype = getattr(torch, ctx["dtype"])
    kept, rejected, aux_parts, final_parts = [], [], [], []
    for (sample_id, input_ids, loss_mask), sample_states in zip(samples, states, strict=True):
        aux, final = _split_states(sample_states.to(dtype), ctx["layer_ids"], ctx["captured"],
                                   ctx["num_layers"])
        bad = _nonfinite_layers(aux, final, ctx["layer_ids"], ctx["num_layers"])
        if bad:
            rejected.append({"id": sample_id, "split": part.split,
                             "reason": f"non-finite hidden states at layer ids {bad}"})
            log.warning("sample %r rejected: non-finite hidden states at layer ids %s",
                        sample_id, bad)
            continue
        kept.append((sample_id, input_ids, loss_mask))
        aux_parts.append(aux)
        final_parts.append(final)
    hidden = ctx["hidden_size"]
    lengths = [len(s[1]) for s in kept]
    offsets = np.zeros(len(kept) + 1, dtype=np.int64)  # [n + 1]
    np.cumsum(lengths, out=offsets[1:])
    tensors = {
        "aux": torch.cat(aux_parts) if aux_parts else torch.zeros(0, 3 * hidden, dtype=dtype),
        "final": torch.cat(final_parts) if final_parts else torch.zeros(0, hidden, dtype=dtype),
        "input_ids": torch.from_numpy(np.concatenate([s[1] for s in kept] or [np.zeros(0)])
                                      .astype(np.int64)),
        "loss_mask": torch.from_numpy(np.concatenate([s[2] for s in kept] or [np.zeros(0)])
                                      .astype(np.uint8)),
        "offsets": torch.from_numpy(offsets),
    }
    sample_ids = [s[0] for s in kept]
    metadata = {"sample_ids": json.dumps(sample_ids), "layer_ids": json.dumps(ctx["layer_ids"]),
                "final_layer_id": str(ctx["num_layers"])}
    size, sha = write_safetensors(out_dir / part.path, tensors, metadata)
    entry = {"path": part.path, "split": part.split, "sample_ids": sample_ids,
             "num_tokens": int(offsets[-1]), "bytes": size, "sha256": sha}
    record = {"fingerprint": ctx["fingerprint"], "entry": entry, "rejected": rejected}
    write_json(out_dir / part.sidecar, record)
    return record


# ----------------------------------------------------------------------------- extract


def _make_backend(backend: str, target_dir: Path, captured: list[int], info: dict,
                  cfg: dict, server_cfg: dict | None, out_dir: Path, max_len: int):
    if backend == "hf":
        from draftline.stages.hidden.hf_backend import HFBackend

        return HFBackend(target_dir, captured, info["num_layers"], info["dtype"],
                         cfg["batch_tokens"], cfg["trust_remote_code"], cfg["hf_batching"])
    if backend == "vllm":
        from draftline.stages.hidden.vllm_backend import VLLMBackend

        # the spool sits on the output disk: files are renamed in place, never copied
        return VLLMBackend(target_dir, captured, max_len, out_dir / ".spool", cfg, server_cfg)
    raise HiddenStateError(f"hidden.backend must be 'hf' or 'vllm', got {backend!r}")


def _disk_need(parts: list[PartSpec], splits: dict[str, SplitData], per_token: int,
               backend: str) -> int:
    tokens = sum(splits[p.split].lengths[r] for p in parts for r in p.rows)
    need = tokens * per_token + len(parts) * FILE_OVERHEAD_BYTES
    need += sum(len(p.rows) for p in parts) * SAMPLE_OVERHEAD_BYTES
    if backend == "vllm" and parts:  # spool files of the largest part, before conversion
        need += max(sum(splits[p.split].lengths[r] for r in p.rows) for p in parts) * per_token
    return need


def extract_hidden_states(dataset_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
            hidden_cfg: dict, server_cfg: dict | None = None,
            server_state_dir: str | Path | None = None,
            sampling: dict | None = None) -> dict:
    """Extract hidden states for every sample of the dataset; return the index.

    ``hidden_cfg`` is the config's ``hidden`` section (missing keys take the schema defaults;
    ``trust_remote_code`` may be added from ``target.trust_remote_code``); ``server_cfg`` the
    ``server`` section, used by the vllm backend, which first stops the run's idle shared
    servers recorded in ``server_state_dir`` (they would hold the accelerators' memory).
    Parts already complete from an earlier, interrupted run with the same target, layers,
    dtype, backend, tokens and loss masks are kept.
    Raises DiskFullError before writing anything when the disk is too small. With
    ``sampling`` (the ``temperature`` and ``top_p`` the dataset's answers were generated at),
    the hidden-state gate (``draftline.stages.hidden.gate``) checks the stored final states
    before the index is written; a refused capture leaves the parts, and no index.
    """
    from tqdm import tqdm

    cfg = {**DEFAULTS, **hidden_cfg}
    dataset_dir, target_dir, out_dir = Path(dataset_dir), Path(target_dir), Path(out_dir)
    info = target_info(target_dir)
    num_layers, hidden = info["num_layers"], info["hidden_size"]
    layer_ids = resolve_layer_ids(cfg["layer_ids"], num_layers, info["config"])
    captured = capture_ids(layer_ids, num_layers)
    splits = load_splits(dataset_dir, info["vocab_size"])
    per_token = stored_bytes_per_token(hidden, info["dtype"], len(layer_ids))
    max_file_tokens = max(1, int(cfg["max_file_bytes"]) // per_token)
    parts = plan_parts({n: s.lengths for n, s in splits.items()}, cfg["samples_per_file"],
                       max_file_tokens)
    settings = {"format_version": FORMAT_VERSION, "target": info["fingerprint"],
                "layer_ids": layer_ids, "final_layer_id": num_layers, "dtype": info["dtype"],
                "hidden_size": hidden, "backend": cfg["backend"]}
    if cfg["backend"] == "hf":  # bucketed and packed batching round differently
        settings["hf_batching"] = cfg["hf_batching"]

    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out_dir)
    records: dict[str, dict] = {}
    todo: list[tuple[PartSpec, str]] = []
    for part in parts:
        samples = splits[part.split].rows(part.rows)
        fingerprint = part_fingerprint(settings, samples)
        record = load_complete_part(out_dir, part, fingerprint)
        if record is None:
            todo.append((part, fingerprint))
        else:
            records[part.path] = record
    capacity = check_capacity(_disk_need([p for p, _ in todo], splits, per_token, cfg["backend"]),
                              out_dir, cfg["free_bytes"], cfg["disk_margin"])
    log.info("hidden states: %d parts (%d done earlier), %s to write, %s free", len(parts),
             len(records), human_bytes(capacity["need_bytes"]), human_bytes(capacity["free_bytes"]))

    todo_tokens = sum(splits[p.split].lengths[r] for p, _ in todo for r in p.rows)
    started = time.monotonic()
    capture = None  # how the vllm backend took the states: direct or connector
    if todo:
        max_len = max(max(s.lengths, default=1) for s in splits.values())
        if cfg["backend"] == "vllm" and server_state_dir:
            release_other_servers(Path(server_state_dir), log=log.info)
        backend = _make_backend(cfg["backend"], target_dir, captured, info, cfg, server_cfg,
                                out_dir, max_len)
        capture = getattr(backend, "capture", None)
        ctx = {"dtype": info["dtype"], "layer_ids": layer_ids, "captured": captured,
               "num_layers": num_layers, "hidden_size": hidden}
        try:
            with tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="hidden states",
                      dynamic_ncols=True) as bar:
                for part, fingerprint in todo:
                    samples = splits[part.split].rows(part.rows)
                    states = backend.states([s[1] for s in samples], on_batch=bar.update)
                    records[part.path] = write_part(out_dir, part, samples, states,
                                                    {**ctx, "fingerprint": fingerprint})
        finally:
            backend.close()
    elapsed = time.monotonic() - started

    gate = None
    if sampling is not None:
        gate = gate_stored_states(out_dir, [p.path for p in parts if p.split == "train"]
                                  or [p.path for p in parts], target_dir, sampling, layer_ids)
    index = _build_index(target_dir, info, layer_ids, cfg["backend"],
                         [records[p.path] for p in parts], _machine(cfg["backend"], server_cfg))
    write_json(out_dir / HIDDEN_INDEX, index)
    write_json(out_dir / HIDDEN_STATS, {
        "computed_tokens": todo_tokens, "computed_files": len(todo),
        "reused_files": len(parts) - len(todo), "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(todo_tokens / elapsed, 1) if todo and elapsed > 0 else None,
        "capacity": capacity, "backend": cfg["backend"], "capture": capture, "gate": gate,
    })
    if index["rejected"]:
        log.warning("hidden states: %d samples rejected (non-finite states), listed in %s",
                    len(index["rejected"]), out_dir / HIDDEN_INDEX)
    return index


def gate_stored_states(out_dir: Path, part_paths: list[str], target_dir: Path,
                       sampling: dict, layer_ids: list[int]) -> dict:
    """The hidden-state gate (``draftline.stages.hidden.gate``) on the samples of the first
    stored parts, up to the gate's positions."""
    from draftline.stages.hidden.gate import GATE_POSITIONS, gate_samples
    from draftline.stages.hidden.store import load_part

    samples, positions = [], 0
    for path in part_paths:
        tensors, _ = load_part(out_dir / path)
        offsets = tensors["offsets"].tolist()
        for start, end in zip(offsets[:-1], offsets[1:], strict=True):
            samples.append({key: tensors[key][start:end]
                            for key in ("aux", "final", "input_ids", "loss_mask")})
            positions += int(tensors["loss_mask"][start:end].sum())
        if positions >= GATE_POSITIONS:
            break
    return gate_samples(samples, target_dir, sampling, str(out_dir), layer_ids)


def _machine(backend: str, server_cfg: dict | None) -> dict:
    """What ran the target: its GPUs (and vLLM release) shape the states training learns from.
    The hf backend spreads the target over every CUDA device torch sees."""
    if backend == "vllm":
        return {"backend": "vllm", **engine_machine(server_cfg)}
    import torch

    return {"backend": "hf", "device": "cuda" if torch.cuda.is_available() else "cpu",
            "gpus": torch_gpus(torch)}


def _build_index(target_dir: Path, info: dict, layer_ids: list[int], backend: str,
                 records: list[dict], machine: dict) -> dict:
    files = [r["entry"] for r in records]
    return {
        "format_version": FORMAT_VERSION,
        "target": str(target_dir),
        "num_layers": info["num_layers"],
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "layer_ids": layer_ids,
        "final_layer_id": info["num_layers"],
        "dtype": info["dtype"],
        "backend": backend,
        "machine": machine,
        "num_samples": sum(len(f["sample_ids"]) for f in files),
        "num_tokens": sum(f["num_tokens"] for f in files),
        "bytes": sum(f["bytes"] for f in files),
        "files": files,
        "rejected": [r for record in records for r in record["rejected"]],
    }


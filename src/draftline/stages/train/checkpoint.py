"""Checkpoints and outputs of a training run, under ``out_dir``.

``state/``: the latest resumable checkpoint ``step-N/`` (weights, optimizer, scheduler, RNG,
the trainer record with data position and best so far, the metrics log up to N and hard links
to the best weights of that moment), ``latest.json`` pointing at it, and the live ``best/``
weights and ``metrics.jsonl``. Every directory is written to a temp dir and renamed, and
``latest.json`` moves only once its checkpoint is complete. ``publish`` then links ``best/``,
copies ``metrics.jsonl`` and writes ``eval.json`` in ``out_dir``, so that a workflow manager
may delete the outputs of a killed job without losing anything.

A checkpoint is resumed only by a run with the same ``fingerprint`` (config, world size and
inputs); any other run starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from draftline.core.atomic import atomic_dir, copy_file, remove_temps, write_json
from draftline.drafts.layers import FROZEN
from draftline.stages.train.distributed import Runtime, barrier

STATE_DIR, BEST_DIR = "state", "best"
WEIGHTS_FILE, DRAFT_CONFIG_FILE = "model.safetensors", "draft_config.json"
METRICS_FILE = "metrics.jsonl"


def fingerprint(cfg: dict, world: int, states: bytes | str, vocab_map: Path,
                target_dir: Path) -> str:
    """Identity of a run: a checkpoint is resumed only by a run with the same fingerprint.
    ``states`` is the batch source's identity (the stored index, or what online states are
    produced from)."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"cfg": cfg, "world": world}, sort_keys=True).encode())
    digest.update(states.encode() if isinstance(states, str) else states)
    for path in (Path(vocab_map), Path(target_dir) / "config.json"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def full_state(model, optimizer):
    """Full (unsharded) model and optimizer state, keyed by parameter name; on CPU."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    weights = {k: v for k, v in weights.items() if k not in FROZEN}
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer else None
    return weights, optim


def save_weights(weights: dict, directory: Path) -> None:
    """One file of named tensors; a tensor shared by several names (a DFlash draft's k_norm)
    is written under each of them."""
    out, seen = {}, set()
    for name, value in weights.items():
        tensor = value.detach().contiguous().cpu()
        if tensor.data_ptr() in seen:  # safetensors refuses two names over one storage
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[name] = tensor
    save_file(out, str(directory / WEIGHTS_FILE))


def link_tree(src: Path, dest: Path) -> None:
    """``dest`` := a copy of the flat directory ``src`` made of hard links (no data copied;
    files are never rewritten in place, so the links keep their content). Atomic swap."""
    with atomic_dir(dest) as tmp:
        for file in src.iterdir():
            try:
                os.link(file, tmp / file.name)
            except OSError:  # another file system: copy
                shutil.copy2(file, tmp / file.name)


# ----------------------------------------------------------------------------- save


def save_checkpoint(state_root: Path, step: int, model, optimizer, scheduler,
                    trainer: dict, rt: Runtime) -> None:
    """Write ``state/step-N`` atomically (temp dir + rename), then point ``latest.json`` at it.

    Besides weights, optimizer, scheduler, RNG and the trainer record (data position, best so
    far) it keeps the metrics log up to this step and hard links to the best weights of this
    moment, so that a resumed run (or a workflow manager that deleted the outputs of the
    killed job) gets back exactly the state of step N.
    """
    weights, optim = full_state(model, optimizer)  # a collective under FSDP: every rank
    if rt.is_main:
        name = f"step-{step:08d}"
        with atomic_dir(state_root / name) as tmp:
            save_weights(weights, tmp)
            extra = {"optimizer": optim, "scheduler": scheduler.state_dict(),
                     "torch_rng": torch.get_rng_state()}
            if torch.cuda.is_available():
                extra["cuda_rng"] = torch.cuda.get_rng_state_all()
            # through a Python file: a full disk then surfaces as OSError(ENOSPC) (the
            # context of torch's own error), where torch's file writer loses the errno
            with open(tmp / "optimizer.pt", "wb") as fh:
                torch.save(extra, fh)
            trainer = {**trainer, "python_rng": _python_rng_state()}
            (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1) + "\n")
            if (state_root / METRICS_FILE).exists():
                shutil.copy2(state_root / METRICS_FILE, tmp / METRICS_FILE)
            if (state_root / BEST_DIR).exists():
                link_tree(state_root / BEST_DIR, tmp / BEST_DIR)
        # latest.json moves only once the new checkpoint is complete: a failure above leaves
        # the previous one in charge.
        write_json(state_root / "latest.json", {"step": step, "dir": name}, indent=None)
        for old in state_root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    barrier(rt)


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def save_best(state_root: Path, model, draft_cfg, record: dict, rt: Runtime) -> None:
    """``state/best/``: trainable weights (fp32), draft_config.json and best.json, swapped in
    whole (new files each time: checkpoints hold hard links to earlier ones)."""
    weights, _ = full_state(model, None)  # a collective under FSDP: every rank
    if rt.is_main:
        with atomic_dir(state_root / BEST_DIR) as tmp:
            save_weights(weights, tmp)
            (tmp / DRAFT_CONFIG_FILE).write_text(json.dumps(draft_cfg.to_dict(), indent=1) + "\n")
            (tmp / "best.json").write_text(json.dumps(record, indent=1) + "\n")
    barrier(rt)


def publish(state_root: Path, out_dir: Path, record: dict) -> None:
    """The outputs: ``best/`` (hard links to state/best), ``metrics.jsonl``, ``eval.json``."""
    link_tree(state_root / BEST_DIR, out_dir / BEST_DIR)
    copy_file(state_root / METRICS_FILE, out_dir / METRICS_FILE)
    write_json(out_dir / "eval.json", record)


# ----------------------------------------------------------------------------- resume


def resume(state_root: Path, run_id: str, model, optimizer, scheduler,
           rt: Runtime) -> dict | None:
    """The trainer record of the latest checkpoint of this run, with model, optimizer,
    scheduler, RNG, metrics log and best weights restored; None (and ``state/`` cleared when
    it belongs to another run) when there is nothing to resume."""
    if rt.is_main and state_root.exists():
        remove_temps(state_root)  # what a killed run was writing; never part of a checkpoint
    checkpoint = latest_checkpoint(state_root)
    trainer = None
    if checkpoint is not None:
        saved = json.loads((checkpoint / "trainer.json").read_text())
        if saved.get("run_id") == run_id:
            trainer = load_checkpoint(checkpoint, model, optimizer, scheduler)
            if rt.is_main:
                restore_logs(checkpoint, state_root)
        else:
            barrier(rt)
            if rt.is_main:
                shutil.rmtree(state_root, ignore_errors=True)
    barrier(rt)
    return trainer


def latest_checkpoint(state_root: Path) -> Path | None:
    pointer = state_root / "latest.json"
    if not pointer.exists():
        return None
    path = state_root / json.loads(pointer.read_text())["dir"]
    return path if (path / "trainer.json").exists() else None


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    weights = load_file(str(path / WEIGHTS_FILE))
    extra = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=opts)
    set_optimizer_state_dict(model, optimizer, extra["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["torch_rng"])
    if "cuda_rng" in extra and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extra["cuda_rng"])
    trainer = json.loads((path / "trainer.json").read_text())
    version, internal, gauss = trainer.pop("python_rng")
    random.setstate((version, tuple(internal), gauss))
    return trainer


def restore_logs(checkpoint: Path, state_root: Path) -> None:
    """The metrics log and best weights as they were at the checkpoint (rank 0)."""
    shutil.rmtree(state_root / BEST_DIR, ignore_errors=True)
    if (checkpoint / BEST_DIR).exists():
        link_tree(checkpoint / BEST_DIR, state_root / BEST_DIR)
    (state_root / METRICS_FILE).unlink(missing_ok=True)
    if (checkpoint / METRICS_FILE).exists():
        shutil.copy2(checkpoint / METRICS_FILE, state_root / METRICS_FILE)

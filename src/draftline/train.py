"""Train the EAGLE-3 draft on stored target hidden states: one loop for CPU, DDP and FSDP.

Library::

    from draftline.train import train
    record = train(hidden_dir, vocab_map, target_dir, out_dir, train_cfg)

``train_cfg`` is the ``train`` config section (missing keys take the schema defaults). With
``nproc_per_node > 1`` and no torchrun environment, ``train`` launches itself under torchrun
(``--standalone``) and returns when all processes are done. Multi-node runs (``nnodes > 1``)
are launched by the user on every node::

    torchrun --nnodes N --nproc_per_node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m draftline.train \\
        --hidden-dir results/hidden --vocab-map results/vocab/vocab_map.safetensors \\
        --target-dir results/target --out-dir results/draft --config-json '{"epochs": 2}'

(``--config-json`` takes JSON text or a path to a JSON file.)

Outputs in ``out_dir``: ``metrics.jsonl`` (one record per optimizer step and per evaluation),
``eval.json`` (the best evaluation: simulated acceptance length, per-step accuracies,
``layer_ids``, ``ttt_steps``), ``best/`` (weights of the best evaluation, for export),
``tb/`` (TensorBoard events), and ``state/``: the latest resumable checkpoint plus the live
best weights and metrics log, from which ``best/`` and ``eval.json`` are published at the end
(so a workflow manager may delete the outputs of a killed job without losing anything).

Batches: samples are grouped by length and packed into micro-batches of at most
``batch_tokens`` padded tokens (each sample its own row, see draftline.model). One optimizer
step consumes ``grad_accum`` micro-batches on each of the ``world_size`` processes, so one
process with ``grad_accum = 2`` and two processes with ``grad_accum = 1`` take the same steps.
The micro-batches that do not fill a last step of an epoch are dropped.

Resume: a checkpoint (weights, optimizer, scheduler, RNG, data position, best so far) is
written atomically every ``checkpoint_every`` steps and at the end. A rerun with the same
inputs and config continues from it (on CPU the final weights equal an uninterrupted run); a
rerun with anything changed starts afresh. SIGINT or SIGTERM stops the run after the current
optimizer step, with a checkpoint of that step (exit status 128 + signal).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline.atomic import atomic_dir, copy_file, remove_temps, write_json
from draftline.hidden.layers import check_layer_ids
from draftline.target import (
    find_tensor,
    read_target_config,
    read_teacher_config,
    target_weight_map,
    text_config,
)

DISTRIBUTED_ENV = "WORLD_SIZE"
STATE_DIR, BEST_DIR = "state", "best"
WEIGHTS_FILE, DRAFT_CONFIG_FILE = "model.safetensors", "draft_config.json"
METRICS_FILE = "metrics.jsonl"
FROZEN = ("embed_tokens.weight",)  # same as Eagle3Draft.FROZEN, without importing torch


# ----------------------------------------------------------------------------- config


def resolve_train_cfg(train_cfg: dict | None) -> dict:
    """The ``train`` section with schema defaults filled in and validated (errors name keys)."""
    import jsonschema

    from draftline.config import ConfigError, load_schema

    schema = load_schema()["properties"]["train"]
    cfg = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    cfg.update(train_cfg or {})
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(cfg),
                    key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = ".".join(str(p) for p in err.absolute_path)
        raise ConfigError(f"config key 'train{'.' + where if where else ''}': {err.message}")
    return cfg


# ----------------------------------------------------------------------------- target tensors


def load_target_tensors(target_dir: Path) -> dict:
    """The only target tensors the draft needs: embedding, final norm and lm_head.

    Read through safetensors' memory map, one tensor at a time: the rest of the checkpoint
    (for Kimi-K2.5, about 600 GB of experts) is never touched.
    """
    from safetensors import safe_open

    target_dir = Path(target_dir)
    cfg = read_teacher_config(target_dir)
    weight_map = target_weight_map(target_dir)
    names = {key: find_tensor(weight_map, suffix, target_dir) for key, suffix in
             (("embed", "embed_tokens.weight"), ("norm", "model.norm.weight"),
              ("lm_head", "lm_head.weight"))}
    tied = bool(cfg.get("tie_word_embeddings") or
                (cfg.get("text_config") or {}).get("tie_word_embeddings"))
    if tied or names["lm_head"] is None:
        if not tied:
            raise ValueError(f"target {target_dir}: no lm_head.weight and tie_word_embeddings "
                             "is not set")
        names["lm_head"] = names["embed"]
    tensors = {}
    for key, name in names.items():
        if name is None:
            raise ValueError(f"target {target_dir}: tensor '{key}' not found in the weights")
        file = weight_map[name]
        if not file.exists():
            raise FileNotFoundError(f"target {target_dir}: weights file {file} (for {name}) "
                                    "is missing")
        with safe_open(str(file), framework="pt") as f:
            tensors[key] = f.get_tensor(name)
    return tensors


# ----------------------------------------------------------------------------- hidden states


@dataclass(frozen=True)
class SampleRef:
    file: Path
    start: int
    end: int
    sample_id: str

    @property
    def length(self) -> int:
        return self.end - self.start


class HiddenStates:
    """The hidden-state store of docs/contracts.md, read lazily one sample slice at a time."""

    MAX_OPEN = 8

    def __init__(self, hidden_dir: Path):
        from safetensors import safe_open

        self.root = Path(hidden_dir)
        index_path = self.root / "index.json"
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
        if out["aux"].shape[-1] != 3 * self.hidden_size or out["final"].shape[-1] != (
                self.hidden_size):
            raise ValueError(f"{ref.file}: sample {ref.sample_id}: aux/final widths "
                             f"{out['aux'].shape[-1]}/{out['final'].shape[-1]} do not match "
                             f"hidden_size {self.hidden_size} x 3 aux layers")
        return out


def plan_micro_batches(lengths: list[int], batch_tokens: int,
                       seed: int | None) -> list[list[int]]:
    """Sample indices per micro-batch: similar lengths together, at most ``batch_tokens`` padded
    tokens each (a longer sample goes alone). ``seed`` shuffles samples and batch order (None:
    length order, for evaluation)."""
    import torch

    n = len(lengths)
    if seed is None:
        order = sorted(range(n), key=lambda i: (-lengths[i], i))
    else:
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n, generator=gen).tolist()
        window = 256  # sort within windows: batches stay full and the order stays random
        order = []
        for start in range(0, n, window):
            order += sorted(perm[start:start + window], key=lambda i: (-lengths[i], i))
    batches, current, longest = [], [], 0
    for idx in order:
        new_longest = max(longest, lengths[idx])
        if current and (len(current) + 1) * new_longest > batch_tokens:
            batches.append(current)
            current, new_longest = [], lengths[idx]
        current.append(idx)
        longest = new_longest
    if current:
        batches.append(current)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
    return batches


def collate(samples: list[dict]) -> dict:
    """Right-pad samples into ``[B, T, ...]`` rows; padding has loss_mask 0."""
    import torch

    length = max(s["input_ids"].shape[0] for s in samples)
    batch = {
        "aux": torch.zeros(len(samples), length, samples[0]["aux"].shape[-1],
                           dtype=samples[0]["aux"].dtype),  # [B, T, 3Ht]
        "final": torch.zeros(len(samples), length, samples[0]["final"].shape[-1],
                             dtype=samples[0]["final"].dtype),  # [B, T, Ht]
        "input_ids": torch.zeros(len(samples), length, dtype=torch.long),  # [B, T]
        "loss_mask": torch.zeros(len(samples), length, dtype=torch.bool),  # [B, T]
    }
    for row, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        batch["aux"][row, :n] = s["aux"]
        batch["final"][row, :n] = s["final"]
        batch["input_ids"][row, :n] = s["input_ids"].long()
        batch["loss_mask"][row, :n] = s["loss_mask"].bool()
    batch["tokens"] = sum(s["input_ids"].shape[0] for s in samples)
    return batch


class MicroBatches:
    """Map-style dataset: item i is micro-batch i, read and collated (picklable for workers)."""

    def __init__(self, store: HiddenStates, refs: list[SampleRef], batches: list[list[int]]):
        self.store, self.refs, self.batches = store, refs, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return collate([self.store.read(self.refs[j]) for j in self.batches[i]])


def micro_batch_loader(store: HiddenStates, refs: list[SampleRef], batches: list[list[int]],
                       workers: int):
    """Iterator of collated micro-batches, prefetched by ``workers`` processes (0: inline)."""
    from torch.utils.data import DataLoader

    return iter(DataLoader(MicroBatches(store, refs, batches), batch_size=None, shuffle=False,
                           num_workers=workers))


# ----------------------------------------------------------------------------- runtime


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: Any
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_runtime() -> Runtime:
    import torch
    import torch.distributed as dist

    world = int(os.environ.get(DISTRIBUTED_ENV, "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        owns = True
    return Runtime(rank, world, local_rank, device, owns)


def all_reduce_sum(tensor, rt: Runtime):
    import torch.distributed as dist

    if rt.distributed:
        moved = tensor.to(rt.device)
        dist.all_reduce(moved)
        return moved.to(tensor.device)
    return tensor


class StopRequest:
    """SIGINT/SIGTERM ask the loop to stop at the end of the current optimizer step, after a
    checkpoint, so that a rerun continues from that very step (a second signal stops at once).

    Every rank sees the request in the same step (a max over ranks), so the checkpoint, a
    collective under FSDP, is written by all or none.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second signal {signum}: stopping now")
        self.signum = signum
        print(f"\nsignal {signum}: stopping after this step with a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def requested(self, rt: Runtime) -> int | None:
        """The signal number when any rank was asked to stop, else None."""
        import torch

        mine = torch.tensor([float(self.signum or 0)])
        if rt.distributed:
            import torch.distributed as dist

            moved = mine.to(rt.device)
            dist.all_reduce(moved, op=dist.ReduceOp.MAX)
            mine = moved.cpu()
        return int(mine.item()) or None


def barrier(rt: Runtime) -> None:
    import torch.distributed as dist

    if rt.distributed:
        dist.barrier()


def wrap_model(model, strategy: str, rt: Runtime):
    """DDP or FSDP2 around the draft; returns the module to call for training."""
    import torch

    if not rt.distributed:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [rt.local_rank] if rt.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if rt.device.type == "cuda" else MixedPrecisionPolicy()
    fully_shard(model.midlayer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # fc, norm, lm_head and the frozen embedding
    return model


def gradient_sync(wrapped, strategy: str, rt: Runtime, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if not rt.distributed or sync:
        return contextlib.nullcontext()
    if strategy == "ddp":
        return wrapped.no_sync()
    wrapped.set_requires_gradient_sync(False)
    return _restore_fsdp_sync(wrapped)


@contextlib.contextmanager
def _restore_fsdp_sync(wrapped):
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------- checkpoints


def full_state(model, optimizer):
    """Full (unsharded) model and optimizer state, keyed by parameter name; on CPU."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    weights = {k: v for k, v in weights.items() if k not in FROZEN}
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer else None
    return weights, optim


def save_weights(weights: dict, directory: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
              str(directory / WEIGHTS_FILE))


def link_tree(src: Path, dest: Path) -> None:
    """``dest`` := a copy of the flat directory ``src`` made of hard links (no data copied;
    files are never rewritten in place, so the links keep their content). Atomic swap."""
    with atomic_dir(dest) as tmp:
        for file in src.iterdir():
            try:
                os.link(file, tmp / file.name)
            except OSError:  # another file system: copy
                shutil.copy2(file, tmp / file.name)


def save_checkpoint(state_root: Path, step: int, model, optimizer, scheduler,
                    trainer: dict, rt: Runtime) -> None:
    """Write ``state/step-N`` atomically (temp dir + rename), then point ``latest.json`` at it.

    Besides weights, optimizer, scheduler, RNG and the trainer record (data position, best so
    far) it keeps the metrics log up to this step and hard links to the best weights of this
    moment, so that a resumed run (or a workflow manager that deleted the outputs of the
    killed job) gets back exactly the state of step N.
    """
    import torch

    weights, optim = full_state(model, optimizer)  # a collective under FSDP: every rank
    if rt.is_main:
        name = f"step-{step:08d}"
        with atomic_dir(state_root / name) as tmp:
            save_weights(weights, tmp)
            extra = {"optimizer": optim, "scheduler": scheduler.state_dict(),
                     "torch_rng": torch.get_rng_state()}
            if torch.cuda.is_available():
                extra["cuda_rng"] = torch.cuda.get_rng_state_all()
            torch.save(extra, tmp / "optimizer.pt")
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


def latest_checkpoint(state_root: Path) -> Path | None:
    pointer = state_root / "latest.json"
    if not pointer.exists():
        return None
    path = state_root / json.loads(pointer.read_text())["dir"]
    return path if (path / "trainer.json").exists() else None


def restore_logs(checkpoint: Path, state_root: Path) -> None:
    """The metrics log and best weights as they were at the checkpoint (rank 0)."""
    shutil.rmtree(state_root / BEST_DIR, ignore_errors=True)
    if (checkpoint / BEST_DIR).exists():
        link_tree(checkpoint / BEST_DIR, state_root / BEST_DIR)
    (state_root / METRICS_FILE).unlink(missing_ok=True)
    if (checkpoint / METRICS_FILE).exists():
        shutil.copy2(checkpoint / METRICS_FILE, state_root / METRICS_FILE)


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

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


def fingerprint(cfg: dict, world: int, hidden_dir: Path, vocab_map: Path,
                target_dir: Path) -> str:
    """Identity of a run: a checkpoint is resumed only by a run with the same fingerprint."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"cfg": cfg, "world": world}, sort_keys=True).encode())
    for path in (Path(hidden_dir) / "index.json", Path(vocab_map),
                 Path(target_dir) / "config.json"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------- logging


class RunLog:
    """Metrics on rank 0: ``state/metrics.jsonl`` (restored with a checkpoint), mirrored live
    to ``out_dir/metrics.jsonl``, and TensorBoard events in ``out_dir/tb``.

    A resumed run continues the log of its checkpoint; TensorBoard drops the events past the
    resumed step.
    """

    def __init__(self, state_root: Path, out_dir: Path, resumed_step: int | None,
                 rt: Runtime):
        self.path = state_root / METRICS_FILE
        self.mirror = out_dir / METRICS_FILE
        self.writer = None
        if not rt.is_main:
            return
        if resumed_step is None:  # a fresh run: nothing of an earlier one may remain
            for stale in (self.path, out_dir / "eval.json"):
                stale.unlink(missing_ok=True)
            for stale_dir in (out_dir / "tb", out_dir / BEST_DIR, state_root / BEST_DIR):
                shutil.rmtree(stale_dir, ignore_errors=True)
        state_root.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        shutil.copy2(self.path, self.mirror)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is a dependency; say what is missing
            raise ImportError("TensorBoard logging needs the 'tensorboard' package") from exc
        purge = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(str(out_dir / "tb"), purge_step=purge)

    def write(self, record: dict, prefix: str) -> None:
        if self.writer is None:
            return
        for path in (self.path, self.mirror):
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
            elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
                for k, v in enumerate(value):
                    self.writer.add_scalar(f"{prefix}/{key}/step{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ----------------------------------------------------------------------------- steps


def run_micro_batch(model, head, batch: dict, cfg: dict, rt: Runtime):
    """Forward one micro-batch: (loss, counts ``[6, K]``)."""
    import torch

    from draftline.model import on_greedy_path, ttt_loss

    cuda = rt.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    aux = batch["aux"].to(rt.device, dtype, non_blocking=True)  # [B, T, 3Ht]
    final = batch["final"].to(rt.device, dtype, non_blocking=True)  # [B, T, Ht]
    input_ids = batch["input_ids"].to(rt.device, non_blocking=True)  # [B, T]
    loss_mask = batch["loss_mask"].to(rt.device, non_blocking=True)  # [B, T]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with amp:
        target_logp, target_in_draft, argmax = head(final, with_argmax=True)  # [B, T, (D)]
        logits = model(aux, input_ids, cfg["ttt_steps"])  # K x [B, T, D]
        return ttt_loss(logits, target_logp, target_in_draft, loss_mask, cfg["loss_decay"],
                        greedy_path=on_greedy_path(input_ids, argmax))


def evaluate(model, head, store: HiddenStates, refs: list[SampleRef], cfg: dict,
             rt: Runtime) -> dict:
    """Metrics over the whole eval split; micro-batches are spread over the ranks."""
    import torch

    from draftline.model import COUNT_KEYS, metrics_from_counts

    batches = plan_micro_batches([r.length for r in refs], cfg["batch_tokens"], seed=None)
    # FSDP needs every rank in every forward: all ranks run the same number of batches and
    # a rank without one left reruns batch 0 and drops its counts.
    rounds = math.ceil(len(batches) / rt.world)
    mine = [rt.rank + rt.world * r for r in range(rounds)]
    counts = torch.zeros(len(COUNT_KEYS), cfg["ttt_steps"], dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for i in mine:
            batch = collate([store.read(refs[j]) for j in batches[min(i, len(batches) - 1)]])
            _, c = run_micro_batch(model, head, batch, cfg, rt)
            if i < len(batches):
                counts += c
    model.train()
    return metrics_from_counts(all_reduce_sum(counts, rt))


# ----------------------------------------------------------------------------- the loop


def train(hidden_dir, vocab_map, target_dir, out_dir, train_cfg: dict | None = None) -> dict:
    """Train the draft; returns the eval.json record (also written to ``out_dir``)."""
    cfg = resolve_train_cfg(train_cfg)
    hidden_dir, vocab_map, target_dir, out_dir = map(Path, (hidden_dir, vocab_map, target_dir,
                                                          out_dir))
    read_teacher_config(target_dir)  # refuse an unsupported target before any process starts
    processes = cfg["nproc_per_node"] * cfg["nnodes"]
    if processes > 1 and DISTRIBUTED_ENV not in os.environ:
        if cfg["nnodes"] > 1:
            raise ValueError("train.nnodes > 1: start `torchrun ... -m draftline.train` on every "
                             "node (see the draftline.train docstring)")
        return launch_torchrun(hidden_dir, vocab_map, target_dir, out_dir, cfg)
    rt = init_runtime()
    try:
        return _train(rt, hidden_dir, vocab_map, target_dir, out_dir, cfg)
    finally:
        if rt.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def build_draft(target_dir: Path, vocab_map: Path, seed: int, device=None,
                architecture: dict | None = None):
    """(untrained draft, target head, DraftConfig) from the target, the vocab map and the
    ``train.draft`` sizes (``architecture``; null entries keep the target's).

    The draft's lm_head starts from the target's lm_head rows of the draft tokens; the
    embedding is the target's, frozen. Tensors stay in bf16 on GPU, fp32 on CPU.
    """
    import torch
    from safetensors.torch import load_file

    from draftline.model import DraftConfig, Eagle3Draft, TargetHead, init_draft_weights

    device = device or torch.device("cpu")
    vocab = load_file(str(vocab_map))
    d2t, t2d = vocab["d2t"], vocab["t2d"]  # [D] int64, [V] bool
    draft_cfg = DraftConfig.from_target(read_target_config(target_dir), d2t.shape[0],
                                        architecture)
    target = load_target_tensors(target_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    draft_ids = torch.arange(d2t.shape[0]) + d2t  # [D]
    model = Eagle3Draft(draft_cfg, target["embed"].to(dtype),
                        lm_head_init=target["lm_head"][draft_ids].float())
    init_draft_weights(model, seed)
    head = TargetHead(target["norm"].to(dtype), target["lm_head"].to(dtype),
                      draft_cfg.rms_norm_eps, d2t, t2d)
    return model.to(device), head.to(device), draft_cfg


def save_untrained(target_dir: Path, vocab_map: Path, out_dir: Path, seed: int = 0,
                   architecture: dict | None = None) -> Path:
    """Write the untrained draft in the ``best/`` layout (a baseline for export and serving)."""
    model, _, draft_cfg = build_draft(target_dir, vocab_map, seed, architecture=architecture)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_weights(model.trainable_state_dict(), out_dir)
    (out_dir / DRAFT_CONFIG_FILE).write_text(json.dumps(draft_cfg.to_dict(), indent=1) + "\n")
    return out_dir


def launch_torchrun(hidden_dir: Path, vocab_map: Path, target_dir: Path, out_dir: Path,
                    cfg: dict) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", str(cfg["nproc_per_node"]), "-m", "draftline.train",
           "--hidden-dir", str(hidden_dir), "--vocab-map", str(vocab_map),
           "--target-dir", str(target_dir), "--out-dir", str(out_dir),
           "--config-json", json.dumps(cfg)]
    subprocess.run(cmd, check=True)
    return json.loads((out_dir / "eval.json").read_text())


def _train(rt: Runtime, hidden_dir: Path, vocab_map: Path, target_dir: Path, out_dir: Path,
           cfg: dict) -> dict:
    import torch
    from tqdm import tqdm

    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"])
    out_dir.mkdir(parents=True, exist_ok=True)
    store = HiddenStates(hidden_dir)
    check_inputs(store, hidden_dir, vocab_map, target_dir, cfg["draft"])  # before big reads
    model, head, draft_cfg = build_draft(target_dir, vocab_map, cfg["seed"], rt.device,
                                         cfg["draft"])
    wrapped = wrap_model(model, cfg["strategy"], rt)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                                  betas=(0.9, 0.95))

    train_refs = store.samples.get("train", [])
    eval_refs = store.samples.get("eval") or train_refs  # no eval split: judge on train
    if not train_refs:
        raise ValueError(f"{hidden_dir / 'index.json'}: no samples in split 'train'")
    group = rt.world * cfg["grad_accum"]  # micro-batches per optimizer step, all ranks
    plans = [plan_micro_batches([r.length for r in train_refs], cfg["batch_tokens"],
                                seed=cfg["seed"] * 1000 + epoch) for epoch in range(cfg["epochs"])]
    steps_per_epoch = [len(p) // group for p in plans]
    if sum(steps_per_epoch) == 0:
        raise ValueError(f"train split too small: {len(plans[0])} micro-batches for "
                         f"{group} per step (world {rt.world} x grad_accum {cfg['grad_accum']})")
    total = sum(steps_per_epoch)
    if cfg["max_steps"]:
        total = min(total, cfg["max_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg["warmup_steps"], total))

    state_root = out_dir / STATE_DIR
    run_id = fingerprint(cfg, rt.world, hidden_dir, vocab_map, target_dir)
    trainer = {"run_id": run_id, "step": 0, "epoch": 0, "group": 0, "tokens": 0,
               "best": None, "last_eval": None}
    if rt.is_main and state_root.exists():
        remove_temps(state_root)  # what a killed run was writing; never part of a checkpoint
    checkpoint = latest_checkpoint(state_root)
    resumed = None
    if checkpoint is not None:
        saved = json.loads((checkpoint / "trainer.json").read_text())
        if saved.get("run_id") == run_id:
            trainer = load_checkpoint(checkpoint, model, optimizer, scheduler)
            resumed = trainer["step"]
            if rt.is_main:
                restore_logs(checkpoint, state_root)
        else:
            barrier(rt)
            if rt.is_main:
                shutil.rmtree(state_root, ignore_errors=True)
    barrier(rt)
    log = RunLog(state_root, out_dir, resumed, rt)
    workers = 2 if rt.device.type == "cuda" else 0
    progress = tqdm(total=total, initial=trainer["step"], disable=not rt.is_main,
                    unit="step", dynamic_ncols=True, desc="draft")
    meta = {"layer_ids": store.layer_ids, "ttt_steps": cfg["ttt_steps"],
            "draft_config": draft_cfg.to_dict(), "world_size": rt.world,
            "eval_split": "eval" if store.samples.get("eval") else "train"}

    # the bar and the log are closed however the loop ends (a signal, a full disk, ...)
    with StopRequest() as stop, contextlib.closing(progress), contextlib.closing(log):
        step = trainer["step"]
        for epoch in range(trainer["epoch"], len(plans)):
            if step >= total:
                break
            first = trainer["group"] if epoch == trainer["epoch"] else 0
            plan = plans[epoch]
            mine = [plan[g * group + a * rt.world + rt.rank]
                    for g in range(first, steps_per_epoch[epoch]) for a in range(cfg["grad_accum"])]
            loader = micro_batch_loader(store, train_refs, mine, workers)
            for g in range(first, steps_per_epoch[epoch]):
                started = time.perf_counter()
                loss_sum, counts, tokens = 0.0, 0, 0
                for a in range(cfg["grad_accum"]):
                    batch = next(loader)
                    with gradient_sync(wrapped, cfg["strategy"], rt, a == cfg["grad_accum"] - 1):
                        loss, c = run_micro_batch(wrapped, head, batch, cfg, rt)
                        (loss / cfg["grad_accum"]).backward()
                    loss_sum += float(loss.detach()) / cfg["grad_accum"]
                    counts = counts + c
                    tokens += batch["tokens"]
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
                totals = all_reduce_sum(totals, rt)
                counts = all_reduce_sum(counts, rt)
                trainer.update(step=step, epoch=epoch, group=g + 1,
                               tokens=trainer["tokens"] + int(totals[1]))
                elapsed = time.perf_counter() - started
                record = train_record(step, epoch, scheduler, totals, counts, grad_norm, elapsed,
                                      rt)
                log.write(record, "train")
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.3f}",
                                     acc0=f"{record['accuracy'][0]:.2f}",
                                     tok_s=f"{record['tokens_per_s']:.0f}")
                if step % cfg["eval_every"] == 0 or step == total:
                    result = {"step": step, **evaluate(model, head, store, eval_refs, cfg, rt)}
                    log.write(result, "eval")
                    trainer["last_eval"] = result
                    best = trainer["best"]
                    if best is None or (result["simulated_acceptance_length"]
                                        > best["simulated_acceptance_length"]):
                        trainer["best"] = result
                        save_best(state_root, model, draft_cfg, {**result, **meta}, rt)
                signum = stop.requested(rt)
                if signum or step % cfg["checkpoint_every"] == 0 or step == total:
                    save_checkpoint(state_root, step, model, optimizer, scheduler, trainer, rt)
                if signum and step < total:
                    print(f"stopped by signal {signum} after step {step}/{total}; the checkpoint "
                          f"in {state_root} resumes it", file=sys.stderr, flush=True)
                    raise SystemExit(128 + signum)
                if step >= total:
                    break
            if step >= total:
                break
            trainer.update(epoch=epoch + 1, group=0)
    record = {**trainer["best"], "best_step": trainer["best"]["step"], "steps": total,
              "train_tokens": trainer["tokens"], "final_eval": trainer["last_eval"], **meta}
    record.pop("step")
    if rt.is_main:
        publish(state_root, out_dir, record)
    barrier(rt)
    return record


def train_record(step, epoch, scheduler, totals, counts, grad_norm, elapsed, rt) -> dict:
    from draftline.model import metrics_from_counts

    metrics = metrics_from_counts(counts)
    return {"step": step, "epoch": epoch, "lr": scheduler.get_last_lr()[0],
            "loss": float(totals[0]) / rt.world, "grad_norm": float(grad_norm),
            "tokens": int(totals[1]), "tokens_per_s": float(totals[1]) / max(elapsed, 1e-9),
            "accuracy": metrics["accuracy"], "cond_accuracy": metrics["cond_accuracy"],
            "step_loss": metrics["loss"],
            "simulated_acceptance_length": metrics["simulated_acceptance_length"]}


def check_inputs(store: HiddenStates, hidden_dir: Path, vocab_map: Path,
                 target_dir: Path, architecture: dict | None = None) -> None:
    """Hidden states, vocab map and target agree on widths, layer count and vocab size."""
    from safetensors import safe_open

    from draftline.model import DraftConfig

    with safe_open(str(vocab_map), framework="pt") as f:
        missing = {"d2t", "t2d"} - set(f.keys())
        if missing:
            raise ValueError(f"{vocab_map}: missing tensor(s) {sorted(missing)}")
        draft_vocab = f.get_slice("d2t").get_shape()[0]
        t2d_size = f.get_slice("t2d").get_shape()[0]
    target_cfg = read_teacher_config(target_dir)
    draft_cfg = DraftConfig.from_target(target_cfg, draft_vocab, architecture)
    if store.hidden_size != draft_cfg.target_hidden_size:
        raise ValueError(f"{hidden_dir / 'index.json'}: hidden_size {store.hidden_size} != "
                         f"target hidden_size {draft_cfg.target_hidden_size}")
    if len(store.layer_ids) != draft_cfg.num_aux_hidden_states:
        raise ValueError(f"{hidden_dir / 'index.json'}: {len(store.layer_ids)} layer_ids, the "
                         f"draft takes {draft_cfg.num_aux_hidden_states}")
    # States concatenated in another order than vLLM's would train fc on a permutation.
    check_layer_ids(store.layer_ids, int(text_config(target_cfg)["num_hidden_layers"]), target_cfg,
                    source=f"{hidden_dir / 'index.json'}: layer_ids")
    if t2d_size != draft_cfg.vocab_size:
        raise ValueError(f"{vocab_map}: t2d has {t2d_size} entries, target vocab_size is "
                         f"{draft_cfg.vocab_size}")


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftline.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-dir", required=True)
    parser.add_argument("--vocab-map", required=True)
    parser.add_argument("--target-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--config-json", default="{}",
                        help="the train config section: JSON text or a JSON file path")
    args = parser.parse_args(argv)
    text = args.config_json
    cfg = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
    train(args.hidden_dir, args.vocab_map, args.target_dir, args.out_dir, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The processes of a training run: one (CPU or one GPU), or several under torchrun.

With ``nproc_per_node > 1`` and no torchrun environment, ``launch_torchrun`` starts the run
under ``torchrun --standalone``; inside it every process calls ``init_runtime``. Several
processes train one draft with DDP or FSDP2 (``wrap_model``); the collectives here are no-ops
for a single process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

DISTRIBUTED_ENV = "WORLD_SIZE"


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


def under_torchrun() -> bool:
    return DISTRIBUTED_ENV in os.environ


def init_runtime() -> Runtime:
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


def close_runtime(rt: Runtime) -> None:
    if rt.owns_group:
        dist.destroy_process_group()


def launch_torchrun(hidden_dir: Path | None, vocab_map: Path, target_dir: Path, out_dir: Path,
                    cfg: dict, online: dict | None = None) -> dict:
    """Run ``python -m draftline.stages.train`` under torchrun on this node; the eval.json
    record."""
    source = (["--hidden-dir", str(hidden_dir)] if online is None else
              ["--online-json", json.dumps(online, default=str)])  # paths as text
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", str(cfg["nproc_per_node"]), "-m", "draftline.stages.train",
           *source, "--vocab-map", str(vocab_map),
           "--target-dir", str(target_dir), "--out-dir", str(out_dir),
           "--config-json", json.dumps(cfg)]
    subprocess.run(cmd, check=True)
    return json.loads((out_dir / "eval.json").read_text())


def all_reduce_sum(tensor, rt: Runtime):
    if rt.distributed:
        moved = tensor.to(rt.device)
        dist.all_reduce(moved)
        return moved.to(tensor.device)
    return tensor


def all_reduce_max(tensor, rt: Runtime):
    if rt.distributed:
        moved = tensor.to(rt.device)
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        return moved.cpu()
    return tensor


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def wrap_model(model, strategy: str, rt: Runtime, units: tuple[str, ...] = ()):
    """DDP or FSDP2 around the draft; returns the module to call for training. FSDP shards
    each submodule named in ``units`` (its family's ``FSDP_UNITS``) as one unit, then the rest."""
    if not rt.distributed:
        return model
    if strategy == "ddp":
        ids = [rt.local_rank] if rt.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if rt.device.type == "cuda" else MixedPrecisionPolicy()
    for unit in units:  # e.g. EAGLE-3's midlayer
        fully_shard(getattr(model, unit), mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # the rest: fc, norms, lm_head, the frozen embedding
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

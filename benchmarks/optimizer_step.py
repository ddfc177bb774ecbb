"""Muon's optimizer step in a data-parallel run: torch.optim.Muon's own step against the
Newton-Schulz work shared among the processes (``ShardedMuon``), under DDP and FSDP, in the
same run.

Starts ``--world`` processes under torchrun (gloo on CPU, NCCL on GPUs). Each builds four
copies of the same draft at ``--dims``: two plain, as DDP's processes hold it, and two
wrapped with FSDP2 as training wraps it (row-sharded DTensors). Every copy gets the same
seeded gradients (DDP's averaged ones; FSDP's rows of them). One copy of each pair steps
torch.optim.Muon's own code (under DDP every process orthogonalises every matrix; under FSDP
every product of Newton-Schulz runs on DTensors), the other ``ShardedMuon``'s. Each round
times one step of each copy, each first in turn, from a barrier to the slowest process's
end. Prints the medians, the ratios within each pair, and how far each copy's weights are
from one process's torch.optim.Muon (``ShardedMuon``'s: equal bit for bit).

    python benchmarks/optimizer_step.py --dims mid --world 2 --repeats 7
    python benchmarks/optimizer_step.py --dims kimi --world 8     # 8 GPUs

Needs torch and draftline only (``PYTHONPATH=src`` from a checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from benchlib import training as ts  # the step's own imports and the dims, before draftline's
from torch.distributed.tensor import DTensor, distribute_tensor

import draftline.drafts as m
from draftline.drafts import registry
from draftline.stages.train.distributed import Runtime, wrap_model

optim = ts.optim
# A draft between the toy and Kimi's, whose Newton-Schulz a 2-core CPU runs in about a second.
MID = {**ts.TOY, "hidden_size": 1024, "target_hidden_size": 1024, "num_attention_heads": 16,
       "num_key_value_heads": 16, "head_dim": 64, "intermediate_size": 2816,
       "vocab_size": 8192, "draft_vocab_size": 4096}
DIMS = {**ts.DIMS, "mid": MID}
ROWS = (("ddp", "torch"), ("ddp", "shared"), ("fsdp", "torch"), ("fsdp", "shared"))
LABELS = {("ddp", "torch"): "DDP, torch.optim.Muon: every process, every matrix",
          ("ddp", "shared"): "DDP, shared: each matrix on one process, broadcast",
          ("fsdp", "torch"): "FSDP, torch.optim.Muon: Newton-Schulz on DTensors",
          ("fsdp", "shared"): "FSDP, shared: rows gathered to one process, scattered back"}


def build(cfg: m.DraftConfig, device: torch.device, strategy: str | None):
    """The draft and its Muon optimizer as training builds them for ``strategy`` (FSDP wraps
    the draft in place; DDP's wrapper only averages gradients, which are given here)."""
    torch.manual_seed(0)
    with device:
        model = m.Eagle3Draft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size))
    if strategy == "fsdp":
        wrap_model(model, strategy, Runtime(dist.get_rank(), dist.get_world_size(), 0, device,
                                            owns_group=False),
                   registry.for_draft(None).FSDP_UNITS)
    optimizer = optim.build_optimizer(model, {**ts.TRAIN, "optimizer": "muon",
                                              "strategy": strategy or "ddp"})
    return model, optimizer


def step_of(optimizer, kind: str):
    """``ShardedMuon``'s step, or torch.optim.Muon's own on the same optimizer."""
    if kind == "shared":
        return optimizer.step

    def torch_step():
        torch.optim.Muon.step(optimizer.muon)
        optimizer.adamw.step()
    return torch_step


def seeded_gradients(model, step: int, device: torch.device) -> None:
    """The same full gradients in every copy (FSDP's: this process's rows of them)."""
    gen = torch.Generator(device=device).manual_seed(step)
    for p in model.parameters():
        if p.requires_grad:
            grad = torch.randn(p.shape, generator=gen, device=device)
            if isinstance(p, DTensor):
                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = grad


def timed_step(model, step_fn, step: int, device: torch.device) -> float:
    """Seconds from a barrier to the slowest process's end of one optimizer step."""
    seeded_gradients(model, step, device)
    dist.barrier()
    started = time.perf_counter()
    step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - started], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


@torch.no_grad()
def reference_weights(cfg: m.DraftConfig, device: torch.device, steps: int):
    """One process's torch.optim.Muon over ``steps`` steps of the seeded gradients: the
    trained weights before and after (on the CPU), and the Newton-Schulz FLOPs of a step."""
    model, optimizer = build(cfg, device, None)
    before = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    for step in range(steps):
        seeded_gradients(model, step, device)
        step_of(optimizer, "torch")()
    group = optimizer.muon.param_groups[0]
    work = sum(optim.newton_schulz_flops(p.shape, group["ns_steps"]) for p in group["params"])
    return before, [p.detach().cpu() for p in model.parameters()], work


@torch.no_grad()
def distance(model, reference: list, initial: list) -> float:
    """The largest difference from the ``reference`` weights, as a share of the largest
    change of that tensor from ``initial``."""
    worst = 0.0
    for p, ref, start in zip(model.parameters(), reference, initial, strict=True):
        full = (p.full_tensor() if isinstance(p, DTensor) else p).cpu()
        change = (ref - start).abs().max()
        if p.requires_grad and change > 0:
            worst = max(worst, float((full - ref).abs().max() / change))
    return worst


def worker(args) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = m.DraftConfig(**DIMS[args.dims])
    initial, reference, work = reference_weights(cfg, device, args.repeats + 1)
    copies = {row: build(cfg, device, row[0]) for row in ROWS}
    steps = {row: step_of(copies[row][1], row[1]) for row in ROWS}
    times = {row: [] for row in ROWS}
    for step in range(args.repeats + 1):  # the first round is a warm-up
        turn = step % len(ROWS)
        for row in ROWS[turn:] + ROWS[:turn]:  # each goes first in turn
            seconds = timed_step(copies[row][0], steps[row], step, device)
            if step:
                times[row].append(seconds)
    distances = {row: distance(copies[row][0], reference, initial) for row in ROWS}
    if dist.get_rank() == 0:
        print(json.dumps({"rows": [{"strategy": row[0], "step": row[1],
                                    "times": times[row], "distance": distances[row]}
                                   for row in ROWS],
                          "world": dist.get_world_size(),
                          "device": torch.cuda.get_device_name() if cuda else "CPU",
                          "ns_gflop": work / 1e9}))
    dist.destroy_process_group()


def report(result: dict, args) -> str:
    by = {(r["strategy"], r["step"]): r for r in result["rows"]}
    lines = [f"Muon optimizer step, {args.dims} dims, {result['world']} processes, "
             f"{result['device']}, {result['ns_gflop']:,.1f} GFLOP of Newton-Schulz a step, "
             f"median of {args.repeats}",
             "| strategy, Newton-Schulz | step (ms) | vs torch.optim.Muon's step | weights vs "
             "one process's torch.optim.Muon |", "|---|---|---|---|"]
    for row in ROWS:
        r = by[row]
        median = statistics.median(r["times"])
        base = statistics.median(by[(row[0], "torch")]["times"])
        off = ("equal bit for bit" if r["distance"] == 0 else
               f"{r['distance']:.2%} of a weight's change")
        lines.append(f"| {LABELS[row]} | {median * 1e3:,.1f} | {base / median:.2f}x | {off} |")
    return "\n".join(lines)


def shared_steps_are_exact(result: dict) -> bool:
    return all(r["distance"] == 0 for r in result["rows"] if r["step"] == "shared")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", choices=sorted(DIMS), default="mid")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads a process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.world), __file__, "--worker", "--dims", args.dims,
           "--repeats", str(args.repeats), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(report(result, args))
    return 0 if shared_steps_are_exact(result) else 1


if __name__ == "__main__":
    sys.exit(main())

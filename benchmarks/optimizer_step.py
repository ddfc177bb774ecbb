"""Muon's optimizer step under DDP: each process orthogonalising every matrix, against the
work shared among the processes (``ShardedMuon``), in the same run.

Starts ``--world`` processes under torchrun (gloo on CPU, NCCL on GPUs). Each builds the same
draft at ``--dims`` with the same seeded gradients (as DDP's averaged ones are) and two
optimizers on two copies of it: ``MuonWithAdamW`` without replicas (torch.optim.Muon's step,
what every process ran before) and with the world as its replicas. Each round times one step
of each, in alternating order, from a barrier to the slowest process's end. Prints the
medians, their ratio, and whether the two copies' weights are still equal bit for bit.

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
import train_step as ts  # benchmarks/train_step.py: the dims, the step's own imports

m, optim = ts.m, ts.optim
# A draft between the toy and Kimi's, whose Newton-Schulz a 2-core CPU runs in about a second.
MID = {**ts.TOY, "hidden_size": 1024, "target_hidden_size": 1024, "num_attention_heads": 16,
       "num_key_value_heads": 16, "head_dim": 64, "intermediate_size": 2816,
       "vocab_size": 8192, "draft_vocab_size": 4096}
DIMS = {**ts.DIMS, "mid": MID}


def build(cfg: m.DraftConfig, device: torch.device, replicas):
    torch.manual_seed(0)
    with device:
        model = m.Eagle3Draft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size))
    optimizer = optim.build_optimizer(model, {**ts.TRAIN, "optimizer": "muon"})
    optimizer.muon.replicas = replicas  # the one setting compared
    return model, optimizer


def seeded_gradients(model, step: int, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(step)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen, device=device)


def timed_step(model, optimizer, step: int, device: torch.device) -> float:
    """Seconds from a barrier to the slowest process's end of one optimizer step."""
    seeded_gradients(model, step, device)
    dist.barrier()
    started = time.perf_counter()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - started], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def worker(args) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = m.DraftConfig(**DIMS[args.dims])
    models = {"every process": build(cfg, device, None),
              "shared": build(cfg, device, dist.group.WORLD)}
    times = {name: [] for name in models}
    for step in range(args.repeats + 1):  # the first round is a warm-up
        order = list(models) if step % 2 == 0 else list(reversed(models))
        for name in order:
            seconds = timed_step(*models[name], step, device)
            if step:
                times[name].append(seconds)
    (a, _), (b, shared) = models.values()
    equal = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    if dist.get_rank() == 0:
        group = shared.muon.param_groups[0]
        work = sum(optim.newton_schulz_flops(p.shape, group["ns_steps"]) for p in group["params"])
        print(json.dumps({"times": times, "equal": equal, "world": dist.get_world_size(),
                          "device": torch.cuda.get_device_name() if cuda else "CPU",
                          "ns_gflop": work / 1e9}))
    dist.destroy_process_group()


def report(result: dict, args) -> str:
    every, shared = (statistics.median(result["times"][k]) for k in ("every process", "shared"))
    return "\n".join([
        f"Muon optimizer step, {args.dims} dims, {result['world']} processes, "
        f"{result['device']}, {result['ns_gflop']:,.1f} GFLOP of Newton-Schulz a step, "
        f"median of {args.repeats}",
        "| Newton-Schulz | step (ms) | vs every process |", "|---|---|---|",
        f"| every process, every matrix | {every * 1e3:,.1f} | 1.00x |",
        f"| shared among the processes | {shared * 1e3:,.1f} | {every / shared:.2f}x |",
        f"weights after {args.repeats + 1} steps equal bit for bit: "
        f"{'yes' if result['equal'] else 'NO'}"])


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
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""One process of tests/test_optim.py's shared Muon check, under torchrun (gloo, CPU).

Every process builds the same toy draft twice: one copy plain, as DDP's processes hold it,
with the world as its optimizer's replicas; one sharded by rows with FSDP2 as training wraps
it. For each of STEPS steps both get the same seeded gradients (DDP's averaged ones; FSDP's
rows of them) and step ``MuonWithAdamW``. Rank 0 writes each copy's final weights to
OUT/<ddp|fsdp>.safetensors; every rank writes how many matrices it orthogonalised a step,
and which strategies share the work, to OUT/rank<r>.json.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/sharded_muon_worker.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

import draftline.drafts as m
from draftline.drafts import registry
from draftline.stages.train import optim
from draftline.stages.train.distributed import Runtime, wrap_model

STEPS = 3
# intermediate_size 385: gate and up have an odd number of rows, so FSDP's shards differ
TOY = {"hidden_size": 128, "target_hidden_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 385,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 2048,
       "draft_vocab_size": 1024, "max_position_embeddings": 8192}


def toy_draft() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = m.DraftConfig(**TOY)
    return m.Eagle3Draft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size))


def seeded_gradients(model: torch.nn.Module, step: int) -> None:
    """The same full gradients on every process (a DTensor parameter gets its rows)."""
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        if p.requires_grad:
            grad = torch.randn(p.shape, generator=gen)
            if isinstance(p, DTensor):
                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = grad


def build(model: torch.nn.Module, replicas) -> optim.MuonWithAdamW:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return optim.MuonWithAdamW([p for n, p in named if optim.muon_matrix(n, p)],
                               [p for n, p in named if not optim.muon_matrix(n, p)],
                               lr=1e-2, weight_decay=0.01, momentum=0.8, replicas=replicas)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
            for n, p in model.named_parameters()}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    calls: dict[str, list[int]] = {}
    original = optim.newton_schulz

    def counted(*args):
        calls[strategy][-1] += 1
        return original(*args)

    optim.newton_schulz = counted
    models = {"ddp": toy_draft(), "fsdp": toy_draft()}
    wrap_model(models["fsdp"], "fsdp", Runtime(rank, world, 0, torch.device("cpu"), False),
               registry.for_draft(None).FSDP_UNITS)
    for strategy, model in models.items():
        calls[strategy] = []
        optimizer = build(model, dist.group.WORLD if strategy == "ddp" else None)
        for step in range(STEPS):
            calls[strategy].append(0)
            seeded_gradients(model, step)
            optimizer.step()
        weights = full_weights(model)  # a collective for FSDP: on every process
        if rank == 0:
            save_file(weights, str(out / f"{strategy}.safetensors"))
    replicas = {strategy: optim.data_parallel_group({"strategy": strategy})
                for strategy in ("ddp", "fsdp")}
    (out / f"rank{rank}.json").write_text(json.dumps({
        "orthogonalised": calls,
        "replicas": {k: "world" if g is dist.group.WORLD else g for k, g in replicas.items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""One process of tests/test_optim.py's sharded Muon check, under torchrun (gloo, CPU).

Every process builds the same toy draft and, for each of STEPS steps, gives it the same
seeded gradients (as DDP's averaged ones are) and steps ``MuonWithAdamW`` with the world as
its replicas. Rank 0 writes the final weights to OUT/weights.safetensors; every rank writes
how many matrices it orthogonalised a step, and which strategies share the work, to
OUT/rank<r>.json.

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

import draftline.model as m
from draftline.stages.train import optim

STEPS = 3
TOY = {"hidden_size": 128, "target_hidden_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 384,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 2048,
       "draft_vocab_size": 1024, "max_position_embeddings": 8192}


def toy_draft() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = m.DraftConfig(**TOY)
    return m.Eagle3Draft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size))


def seeded_gradients(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen)


def build(model: torch.nn.Module, replicas) -> optim.MuonWithAdamW:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return optim.MuonWithAdamW([p for n, p in named if optim.muon_matrix(n, p)],
                               [p for n, p in named if not optim.muon_matrix(n, p)],
                               lr=1e-2, weight_decay=0.01, momentum=0.8, replicas=replicas)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls = []
    original = optim.newton_schulz

    def counted(*args):
        calls[-1] += 1
        return original(*args)

    optim.newton_schulz = counted
    model = toy_draft()
    optimizer = build(model, dist.group.WORLD)
    for step in range(STEPS):
        calls.append(0)
        seeded_gradients(model, step)
        optimizer.step()
    replicas = {strategy: optim.data_parallel_group({"strategy": strategy})
                for strategy in ("ddp", "fsdp")}
    (out / f"rank{rank}.json").write_text(json.dumps({
        "orthogonalised": calls,
        "replicas": {k: "world" if g is dist.group.WORLD else g for k, g in replicas.items()}}))
    if rank == 0:
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                  str(out / "weights.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

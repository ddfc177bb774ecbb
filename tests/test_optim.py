"""Training's optimizer and schedule options: each one does what it says, none is ignored."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sharded_muon_worker as worker
import torch
from safetensors.torch import load_file
from test_train import SMALL, final_weights, run

from draftline.stages.train import build_draft, resolve_train_cfg
from draftline.stages.train.optim import (
    MuonWithAdamW,
    build_optimizer,
    deal_by_cost,
    lr_factor,
    row_counts,
    warmup_steps,
)

MATRICES = {"fc.weight", *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
            *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def draft(inputs: dict):
    model, _, _ = build_draft(inputs["target_dir"], inputs["vocab_map"], 0,
                              architecture={"fc_norm": True})
    return model


def group_names(model, optimizer: torch.optim.Optimizer) -> list[set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)] for p in g["params"]} for g in optimizer.param_groups]


def one_step(model, optimizer, seed: int = 0) -> dict[str, torch.Tensor]:
    """One step on random gradients drawn from ``seed``; returns each tensor's update."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(draft_inputs):
    model = draft(draft_inputs)
    optimizer = build_optimizer(model, resolve_train_cfg({"optimizer": "muon", "lr": 1e-2}))
    assert isinstance(optimizer, MuonWithAdamW)
    muon, adamw = group_names(model, optimizer)
    assert muon == MATRICES
    assert "lm_head.weight" in adamw and "fc_norm.2.weight" in adamw
    assert adamw == {n for n, p in model.named_parameters() if p.requires_grad} - MATRICES
    assert isinstance(optimizer.param_groups[0]["params"][0], torch.nn.Parameter)
    assert optimizer.muon.param_groups[0] is optimizer.param_groups[0]  # one set of groups


def test_muon_updates_are_orthogonalised_and_adamw_updates_are_not(draft_inputs):
    """Muon's update of a matrix is nearly orthogonal (Newton-Schulz on the momentum): its
    stable rank ||U||_F^2 / ||U||_2^2 is about half the full rank (0.55 here). AdamW's first
    update of a random gradient, a random sign matrix, has about a quarter (0.26)."""
    stable_rank = {}
    for name in ("muon", "adamw"):
        model = draft(draft_inputs)
        cfg = resolve_train_cfg({"optimizer": name, "lr": 1e-2})
        update = one_step(model, build_optimizer(model, cfg))["midlayer.self_attn.o_proj.weight"]
        singular = torch.linalg.svdvals(update)
        stable_rank[name] = float(singular.square().sum() / singular.max() ** 2 / len(singular))
    assert stable_rank["muon"] > 0.45 and stable_rank["adamw"] < 0.35, stable_rank


def test_muon_state_round_trips_through_its_state_dict(draft_inputs):
    cfg = resolve_train_cfg({"optimizer": "muon", "lr": 1e-2})
    model = draft(draft_inputs)
    optimizer = build_optimizer(model, cfg)
    one_step(model, optimizer, seed=0)
    twin, fresh = draft(draft_inputs), draft(draft_inputs)
    twin.load_state_dict(model.state_dict())
    fresh.load_state_dict(model.state_dict())
    twin_optimizer = build_optimizer(twin, cfg)
    # a copy, as from a checkpoint file (load_state_dict keeps the tensors it is given)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert twin_optimizer.muon.state is twin_optimizer.state  # shared again after the load
    first, second = one_step(model, optimizer, seed=1), one_step(twin, twin_optimizer, seed=1)
    for name in first:
        torch.testing.assert_close(first[name], second[name], atol=0, rtol=0)
    # the momentum mattered: without the loaded state the step differs
    third = one_step(fresh, build_optimizer(fresh, cfg), seed=1)
    assert (third["fc.weight"] - first["fc.weight"]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def shared_muon_run(tmp_path_factory) -> Path:
    """tests/sharded_muon_worker.py's outputs: two processes, both strategies."""
    out = tmp_path_factory.mktemp("shared-muon")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", worker.__file__, str(out)],
                   check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_processes_share_muons_work_and_reach_one_processs_weights_bit_for_bit(
        shared_muon_run, strategy):
    """Two processes (torchrun, gloo) with the same gradients each orthogonalise part of the
    matrices whole: DDP's broadcast their results, FSDP's gather a matrix's rows first and
    scatter them back (gate and up have an odd number of rows). After three steps the weights
    equal those of one process stepping torch.optim.Muon, exactly; torch's own step on FSDP's
    DTensors misses them by a few percent of a weight's change."""
    model = worker.toy_draft()
    optimizer = worker.build(model, None)  # one process: torch.optim.Muon's own step
    for step in range(worker.STEPS):
        worker.seeded_gradients(model, step)
        optimizer.step()
    shared = load_file(str(shared_muon_run / f"{strategy}.safetensors"))
    for name, p in model.named_parameters():
        torch.testing.assert_close(shared[name], p.detach(), atol=0, rtol=0, msg=name)
    ranks = [json.loads((shared_muon_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    counts = [rank["orthogonalised"][strategy] for rank in ranks]
    matrices = len(optimizer.muon.param_groups[0]["params"])
    assert [a + b for a, b in zip(*counts, strict=True)] == [matrices] * worker.STEPS
    assert all(0 < c < matrices for per_rank in counts for c in per_rank), counts
    # DDP's replicas are named; FSDP's are found from its parameters' mesh
    assert ranks[0]["replicas"] == {"ddp": "world", "fsdp": None}
    assert build_optimizer(worker.toy_draft(), resolve_train_cfg(
        {"strategy": "ddp", "lr": 1e-2})).muon.replicas is None  # one process


def test_row_counts_are_fsdps_chunks():
    assert row_counts(385, 2) == [193, 192]
    assert row_counts(5, 4) == [2, 2, 1, 0]
    assert row_counts(8, 8) == [1] * 8
    for rows, world in ((385, 2), (5, 4), (7, 3)):
        chunks = torch.arange(rows).chunk(world)
        assert row_counts(rows, world)[:len(chunks)] == [len(c) for c in chunks]


def test_matrices_are_dealt_by_cost_the_largest_first():
    assert deal_by_cost([5, 3, 3, 1], 2) == [0, 1, 1, 0]
    assert deal_by_cost([1, 1, 1], 4) == [0, 1, 2]
    assert deal_by_cost([2, 7], 1) == [0, 0]


def test_muon_momentum_is_train_momentum(draft_inputs):
    """train.momentum reaches Muon (not AdamW), and changes Muon's second step."""
    updates = {}
    for momentum in (0.8, 0.95):
        model = draft(draft_inputs)
        optimizer = build_optimizer(model, resolve_train_cfg({"momentum": momentum,
                                                              "lr": 1e-2}))
        assert optimizer.muon.param_groups[0]["momentum"] == momentum
        assert "momentum" not in optimizer.adamw.param_groups[0]
        one_step(model, optimizer, seed=0)
        updates[momentum] = one_step(model, optimizer, seed=1)["fc.weight"]
    assert (updates[0.8] - updates[0.95]).abs().max() > 1e-4
    assert resolve_train_cfg({})["momentum"] == 0.8


def test_default_warm_up_is_a_share_of_the_run(draft_inputs, tmp_path):
    """train.warmup_steps null: 5% of the run's optimizer steps, at least one; a number is
    taken as it is. The run's schedule uses it (the logged rate of step 1 is lr / warm-up)."""
    assert resolve_train_cfg({})["warmup_steps"] is None
    assert resolve_train_cfg({})["schedule"] == "linear"
    default = {"warmup_steps": None}
    assert [warmup_steps(default, n) for n in (10, 64, 178, 4000)] == [1, 3, 9, 200]
    assert warmup_steps({"warmup_steps": 20}, 64) == 20
    first_rate = {}
    for warmup in (None, 4):
        cfg = {**SMALL, "max_steps": 40, "eval_every": 40, "warmup_steps": warmup}
        out = tmp_path / f"warmup-{warmup}"
        run(draft_inputs, out, cfg)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        first_rate[warmup] = next(r["lr"] for r in records if r["step"] == 1 and "epoch" in r)
    assert first_rate[None] == pytest.approx(SMALL["lr"] * lr_factor(1, 2, 40, "linear"))
    assert first_rate[4] == pytest.approx(SMALL["lr"] * lr_factor(1, 4, 40, "linear"))


def test_schedules_warm_up_then_decay_to_zero():
    assert lr_factor(0, 4, 104) == pytest.approx(0.25)
    assert lr_factor(3, 4, 104) == pytest.approx(1.0)
    assert lr_factor(54, 4, 104, "linear") == pytest.approx(0.5)
    assert lr_factor(54, 4, 104, "cosine") == pytest.approx(0.5)
    assert lr_factor(29, 4, 104, "linear") == pytest.approx(0.75)
    assert lr_factor(29, 4, 104, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(104, 4, 104, "linear") == lr_factor(104, 4, 104, "cosine") == 0.0


def test_frozen_lm_head_stays_the_targets_rows(draft_inputs, tmp_path):
    cfg = {**SMALL, "max_steps": 4, "eval_every": 4, "lm_head": "frozen"}
    run(draft_inputs, tmp_path / "frozen", cfg)
    run(draft_inputs, tmp_path / "trained", {**cfg, "lm_head": "trained"})
    initial, _, _ = build_draft(draft_inputs["target_dir"], draft_inputs["vocab_map"], 0)
    frozen, trained = final_weights(tmp_path / "frozen"), final_weights(tmp_path / "trained")
    torch.testing.assert_close(frozen["lm_head.weight"], initial.lm_head.weight.detach(),
                               atol=0, rtol=0)
    assert (trained["lm_head.weight"] - initial.lm_head.weight).abs().max() > 1e-4
    assert (frozen["fc.weight"] - initial.fc.weight).abs().max() > 1e-4

"""The training loop, top to bottom: config, processes, draft and teacher, optimizer, batches,
resume, then optimizer steps with evaluation, best weights, checkpoints and stop requests.

One optimizer step consumes ``grad_accum`` micro-batches on each of the ``world_size``
processes, so one process with ``grad_accum = 2`` and two processes with ``grad_accum = 1``
take the same steps. The batches come from a batch source (``draftline.stages.train.data``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftline.core.atomic import write_json
from draftline.core.config import resolve_section
from draftline.core.layout import ONLINE_STATS
from draftline.core.machine import torch_machine
from draftline.core.target import read_teacher_config
from draftline.drafts import registry
from draftline.drafts.layers import compile_pointwise
from draftline.stages.hidden.store import HiddenStates
from draftline.stages.train.checkpoint import (
    STATE_DIR,
    fingerprint,
    publish,
    resume,
    save_best,
    save_checkpoint,
)
from draftline.stages.train.data import ProducedBatches, StoredBatches, with_feature_noise
from draftline.stages.train.distributed import (
    Runtime,
    all_reduce_sum,
    barrier,
    close_runtime,
    gradient_sync,
    init_runtime,
    launch_torchrun,
    under_torchrun,
    wrap_model,
)
from draftline.stages.train.draft import build_draft, check_inputs
from draftline.stages.train.lr_search import measured_lr
from draftline.stages.train.metrics import RunLog, acceptance_score, train_record
from draftline.stages.train.optim import build_optimizer, lr_factor, warmup_steps
from draftline.stages.train.signals import StopRequest


def resolve_train_cfg(train_cfg: dict | None) -> dict:
    """The ``train`` section with the schema's defaults filled in and validated (errors name
    keys): the schema is the only place its defaults are written."""
    return resolve_section("train", train_cfg)


def train_draft(hidden_dir, vocab_map, target_dir, out_dir, train_cfg: dict | None = None,
                online: dict | None = None) -> dict:
    """Train the draft; returns the eval.json record (also written to ``out_dir``).

    Offline, the states are read from the store in ``hidden_dir``. Online (``online`` =
    ``{"dataset_dir": ..., "hidden": <the hidden config section>}``, ``hidden_dir`` None),
    they are produced while training (``draftline.stages.hidden.online``); the vllm producer also
    reads ``online["server"]`` (the server config section) and ``online["server_state_dir"]``
    (the run's shared servers; None: a server of its own).
    """
    cfg = resolve_train_cfg(train_cfg)
    vocab_map, target_dir, out_dir = map(Path, (vocab_map, target_dir, out_dir))
    hidden_dir = Path(hidden_dir) if online is None else None
    read_teacher_config(target_dir)  # refuse an unsupported target before any process starts
    processes = cfg["nproc_per_node"] * cfg["nnodes"]
    if processes > 1 and not under_torchrun():
        if cfg["nnodes"] > 1:
            raise ValueError("train.nnodes > 1: start `torchrun ... -m draftline.stages.train` on "
                             "every node (see the draftline.stages.train docstring)")
        return launch_torchrun(hidden_dir, vocab_map, target_dir, out_dir, cfg, online)
    rt = init_runtime()
    store = open_states(hidden_dir, online, target_dir, cfg)
    try:
        if online is not None and online.get("sampling") and rt.is_main:
            store.gate(online["sampling"])  # before any training step reads the states
        lr_choice = None
        if cfg["lr"] == "auto":  # measured on this run's data before it trains
            lr_choice = choose_lr(rt, store, vocab_map, target_dir, out_dir, cfg)
            cfg = {**cfg, "lr": lr_choice["lr"]}
        return run(rt, store, vocab_map, target_dir, out_dir, cfg, lr_choice)
    finally:
        store.close()
        close_runtime(rt)


def open_states(hidden_dir: Path | None, online: dict | None, target_dir: Path, cfg: dict):
    """The stored hidden states, or (online) the producer of them from the dataset."""
    if online is None:
        return HiddenStates(hidden_dir)
    from draftline.stages.hidden.online import OnlineStates

    state_dir = online.get("server_state_dir")
    return OnlineStates(Path(online["dataset_dir"]), target_dir, online.get("hidden") or {},
                        cfg["batch_tokens"], online.get("server"),
                        Path(state_dir) if state_dir else None)


def choose_lr(rt: Runtime, store, vocab_map: Path, target_dir: Path, out_dir: Path,
               cfg: dict) -> dict:
    """``train.lr: auto``: short probe runs of the candidate rates on these states
    (``draftline.stages.train.lr_search``; online, the probes have the target produce their states
    too); the choice and its evidence."""
    total = sum(StoredBatches(store, cfg, rt.rank, rt.world, 0).steps_per_epoch)  # plans only
    total = min(total, cfg["max_steps"] or total)
    run_id = fingerprint({**cfg, "lr": "auto"}, rt.world, store.identity(), vocab_map,
                         target_dir)

    def train_probe(probe_cfg: dict, probe_dir: Path) -> dict:
        return run(rt, store, vocab_map, target_dir, probe_dir, probe_cfg,
                   label=f"lr {probe_cfg['lr']:g} probe")

    return measured_lr(train_probe, cfg, total, out_dir, run_id, rt.is_main)


def run(rt: Runtime, store, vocab_map: Path, target_dir: Path, out_dir: Path,
        cfg: dict, lr_choice: dict | None = None, label: str = "draft") -> dict:
    """One process of a training run (rank ``rt.rank`` of ``rt.world``) on the states of
    ``store`` (``open_states``); ``lr_choice`` (``train.lr: auto``) goes to its record."""
    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"])
    out_dir.mkdir(parents=True, exist_ok=True)

    # the draft, its teacher (the target's final norm and lm_head) and the optimizer
    check_inputs(store, vocab_map, target_dir, cfg["draft"])  # before big reads
    model, head, draft_cfg = build_draft(target_dir, vocab_map, cfg["seed"], rt.device,
                                         cfg["draft"])
    family = registry.for_draft(cfg["draft"])
    if family.OWN_LM_HEAD:  # else it drafts through the target's (the teacher's) lm_head
        model.lm_head.weight.requires_grad_(cfg["lm_head"] == "trained")
    if cfg["compile"]:
        compile_pointwise(model)
    wrapped = wrap_model(model, cfg["strategy"], rt, family.FSDP_UNITS)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg)  # after wrapping: FSDP replaces the parameters

    # the batches and the schedule
    workers = 2 if rt.device.type == "cuda" else 0
    online = store.report()["mode"] == "online"
    data = (ProducedBatches if online else StoredBatches)(store, cfg, rt.rank, rt.world, workers)
    total = sum(data.steps_per_epoch)
    if cfg["max_steps"]:
        total = min(total, cfg["max_steps"])
    warmup = warmup_steps(cfg, total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, total, cfg["schedule"]))

    # resume this run's latest checkpoint, or start afresh
    state_root = out_dir / STATE_DIR
    run_id = fingerprint(cfg, rt.world, store.identity(), vocab_map, target_dir)
    trainer = resume(state_root, run_id, model, optimizer, scheduler, rt)
    resumed = None if trainer is None else trainer["step"]
    # "group" is the optimizer step within the epoch to continue from
    trainer = trainer or {"run_id": run_id, "step": 0, "epoch": 0, "group": 0, "tokens": 0,
                          "best": None, "last_eval": None}
    log = RunLog(state_root, out_dir, resumed, rt)
    progress = tqdm(total=total, initial=trainer["step"], disable=not rt.is_main,
                    unit="step", dynamic_ncols=True, desc=label)
    meta = {"layer_ids": data.layer_ids, "hidden_mode": "online" if online else "offline",
            "ttt_steps": cfg["ttt_steps"],
            "draft_config": draft_cfg.to_dict(), "world_size": rt.world,
            "eval_split": data.eval_split, "lr": cfg["lr"], "lr_choice": lr_choice,
            # what trained the draft and what extracted its inputs (the bundle carries this)
            "machine": {"training": torch_machine(torch, rt.device, rt.world),
                        "hidden_states": (online_machine(store, rt) if online
                                          else store.index.get("machine"))}}
    accum = cfg["grad_accum"]

    # the bar and the log are closed however the loop ends (a signal, a full disk, ...)
    with StopRequest() as stop, contextlib.closing(progress), contextlib.closing(log):
        step = trainer["step"]
        for epoch in range(trainer["epoch"], len(data.steps_per_epoch)):
            if step >= total:
                break
            first = trainer["group"] if epoch == trainer["epoch"] else 0
            batches = data.train_batches(epoch, first)
            for g in range(first, data.steps_per_epoch[epoch]):
                # one optimizer step: accumulate gradients over `accum` micro-batches
                started = time.perf_counter()
                loss_sum, counts, tokens = 0.0, 0, 0
                for a in range(accum):
                    batch = with_feature_noise(next(batches), cfg["feature_noise"],
                                               noise_seed(cfg["seed"], step, rt, a, accum))
                    with gradient_sync(wrapped, cfg["strategy"], rt, a == accum - 1):
                        loss, c = run_micro_batch(wrapped, head, batch, cfg, rt)
                        (loss / accum).backward()
                    loss_sum += float(loss.detach()) / accum
                    counts = counts + c
                    tokens += batch["tokens"]
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1

                # log the step (sums over all ranks)
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

                # evaluate; keep the weights of the best evaluation
                if step % cfg["eval_every"] == 0 or step == total:
                    result = {"step": step, **evaluate(model, head, data, cfg, rt)}
                    log.write(result, "eval")
                    trainer["last_eval"] = result
                    best = trainer["best"]
                    if best is None or acceptance_score(result) > acceptance_score(best):
                        trainer["best"] = result
                        save_best(state_root, model, draft_cfg, {**result, **meta}, rt)

                # checkpoint; stop here when asked to
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
        if online:  # the producer's figures of this process's run (resumed: since the resume)
            write_json(out_dir / ONLINE_STATS, store.report())
    barrier(rt)
    return record


def online_machine(store, rt: Runtime) -> dict:
    """What ran the target online: this process (hf), or the producer's vLLM server."""
    if store.producer == "vllm":
        from draftline.core.machine import engine_machine

        return {"backend": "vllm", **engine_machine(store.server_cfg or {})}
    return {"backend": "hf", **torch_machine(torch, rt.device, rt.world)}


def noise_seed(seed: int, step: int, rt: Runtime, micro: int, accum: int) -> int:
    """The seed of one micro-batch's feature noise: its own on every rank and step, the same
    when a resumed run takes that step again."""
    return (seed * 1_000_003 + step) * rt.world * accum + rt.rank * accum + micro


def run_micro_batch(model, head, batch: dict, cfg: dict, rt: Runtime):
    """Forward one training micro-batch: (loss, counts ``[6, K]``), as the draft's family
    (``train.draft``) trains it (``draftline.drafts.registry``: its ``micro_batch``)."""
    micro_batch = registry.hook(registry.for_draft(cfg.get("draft")), "micro_batch")
    loss, counts, _ = micro_batch(model, head, batch, cfg, rt)
    return loss, counts


def evaluate(model, head, data, cfg: dict, rt: Runtime) -> dict:
    """Metrics over the whole eval split, micro-batches spread over the ranks, as the draft's
    family scores it (its ``evaluate``). The headline is ``walked_acceptance_length``: every
    eval answer walked the way a temperature-0 server drafts it
    (``draftline.drafts.acceptance.walked_acceptance_counts``)."""
    family_evaluate = registry.hook(registry.for_draft(cfg.get("draft")), "evaluate")
    return family_evaluate(model, head, data, cfg, rt, lambda t: all_reduce_sum(t, rt))

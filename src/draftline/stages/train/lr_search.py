"""``train.lr: auto``: the peak learning rate measured at the start of training, never tuned.

Each candidate of ``train.lr_search.candidates`` trains a draft from the run's own initial
weights (same seed, same batches) for a short probe: ``probe_fraction`` of the run's optimizer
steps, at least ``min_probe_steps``, with the run's schedule compressed to the probe (warm-up
shortened in proportion, decay to 0 at its last step). Each probe is scored on the eval split
by the walked acceptance length (``acceptance_score``: the eval answers drafted the way a
temperature-0 server drafts them), the figure training keeps its best weights by; the best
candidate wins (a tie goes to the smaller rate). A probe is shorter than the run, and the
best peak rate falls as a run gets longer: the run trains from the start at the winner's rate
times sqrt(probe steps / run steps), the 1/sqrt(steps) horizon scaling of a step size.

Why a measurement and not a constant: the rate that trains the best draft moves with the
data's size and the optimizer (on the toy, AdamW's best is 2e-2 at 64 steps and lower with 3x
the steps; Muon's 2e-2 at 64 steps and 1e-2 at 178; benchmarks/draft_quality.py). A probe
reads the data the run trains on, so the choice follows it. Measured on the toy: 20-step
probes rank 4e-2 first at 64 steps and the scaling gives 2.2e-2, where 2e-2 was the best of
fixed rates. The probes cost ``len(candidates) x probe_fraction`` of the run (3 x 10%
by default) and resume like any run: each is a training run of its own in
``lr-search/lr=<rate>/`` beside ``state/``. The choice is kept in ``lr-search/choice.json``
with the fingerprint of the run it was made for (the probes' folders are then removed): a
rerun of the same run takes it as it is. The choice and every probe's score go to
``eval.json`` (``lr_choice``) and the model card.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from draftline.core.atomic import write_json
from draftline.stages.train.metrics import acceptance_score
from draftline.stages.train.optim import warmup_steps

SEARCH_DIR, CHOICE_FILE = "lr-search", "choice.json"


def probe_steps(total: int, fraction: float, minimum: int) -> int:
    """Optimizer steps of one probe: ``fraction`` of the run's ``total``, at least
    ``minimum``, at most ``total``."""
    return min(total, max(minimum, math.ceil(fraction * total)))


def probe_config(cfg: dict, lr: float, steps: int, total: int) -> dict:
    """The train section of one probe: the run's, at ``lr``, stopped after ``steps`` (the
    schedule decays to 0 there), its warm-up shortened in proportion, evaluated at the end."""
    warmup = math.ceil(warmup_steps(cfg, total) * steps / total)
    return {**cfg, "lr": lr, "max_steps": steps, "warmup_steps": warmup, "eval_every": steps,
            "checkpoint_every": steps}


def choose(scores: list[dict]) -> dict:
    """The probe with the highest walked acceptance (``acceptance_score``, the figure training
    keeps its best weights by); a tie goes to the smaller rate."""
    return max(scores, key=lambda s: (round(acceptance_score(s), 6), -s["lr"]))


def measured_lr(train_probe, cfg: dict, total: int, out_dir: Path, run_id: str,
                is_main: bool = True) -> dict:
    """The choice for the run ``run_id``: the kept one, else a new search (``search_lr``)."""
    choice_file = Path(out_dir) / SEARCH_DIR / CHOICE_FILE
    if choice_file.exists():
        kept = json.loads(choice_file.read_text())
        if kept.get("run_id") == run_id:
            return kept
    choice = {"run_id": run_id, **search_lr(train_probe, cfg, total, out_dir)}
    if is_main:
        write_json(choice_file, choice, indent=1)
        for probe in choice_file.parent.glob("lr=*"):
            shutil.rmtree(probe, ignore_errors=True)
    return choice


def search_lr(train_probe, cfg: dict, total: int, out_dir: Path) -> dict:
    """Run the probes with ``train_probe(probe_cfg, probe_dir) -> eval record`` and return the
    evidence: ``{"lr", "candidates", "probe_steps", "of_steps", "probes": [...]}``."""
    search = cfg["lr_search"]
    steps = probe_steps(total, search["probe_fraction"], search["min_probe_steps"])
    root = Path(out_dir) / SEARCH_DIR
    scores = []
    for lr in sorted(search["candidates"]):
        record = train_probe(probe_config(cfg, lr, steps, total), root / f"lr={lr:g}")
        scores.append({"lr": lr,
                       "walked_acceptance_length": record.get("walked_acceptance_length"),
                       "simulated_acceptance_length": record["simulated_acceptance_length"],
                       "loss": record["loss"], "accuracy": record["accuracy"]})
    best = choose(scores)
    scale = math.sqrt(steps / total)
    return {"lr": best["lr"] * scale, "probe_lr": best["lr"], "horizon_scale": scale,
            "candidates": sorted(search["candidates"]), "probe_steps": steps, "of_steps": total,
            "score": "walked_acceptance_length (eval split)", "probes": scores}

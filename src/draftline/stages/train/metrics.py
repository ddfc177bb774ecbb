"""What a training run logs: one record per optimizer step and per evaluation."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from draftline.drafts.acceptance import metrics_from_counts
from draftline.stages.train.checkpoint import BEST_DIR, METRICS_FILE
from draftline.stages.train.distributed import Runtime

log = logging.getLogger(__name__)


def acceptance_score(record: dict) -> float:
    """The figure an evaluation is ranked by (best weights, ``train.lr: auto``'s probes): the
    walked acceptance length, the tokens per round of a temperature-0 server drafting the
    eval answers (``draftline.drafts.acceptance.walked_acceptance_counts``). A record without
    it (written before the walk was measured) ranks by its per-position
    ``simulated_acceptance_length``."""
    walked = record.get("walked_acceptance_length")
    return record["simulated_acceptance_length"] if walked is None else walked


def train_record(step, epoch, scheduler, totals, counts, grad_norm, elapsed, rt) -> dict:
    """The metrics of one optimizer step; ``totals`` is [loss, tokens] summed over the ranks,
    ``counts`` the summed ``ttt_loss`` counts."""
    metrics = metrics_from_counts(counts)
    return {"step": step, "epoch": epoch, "lr": scheduler.get_last_lr()[0],
            "loss": float(totals[0]) / rt.world, "grad_norm": float(grad_norm),
            "tokens": int(totals[1]), "tokens_per_s": float(totals[1]) / max(elapsed, 1e-9),
            "accuracy": metrics["accuracy"], "cond_accuracy": metrics["cond_accuracy"],
            "step_loss": metrics["loss"],
            "simulated_acceptance_length": metrics["simulated_acceptance_length"]}


class RunLog:
    """Metrics on rank 0: ``state/metrics.jsonl`` (restored with a checkpoint), mirrored live
    to ``out_dir/metrics.jsonl``, and TensorBoard events in ``out_dir/tb`` where the
    ``tensorboard`` extra is installed (the JSON lines are the record; the events a view).

    A resumed run continues the log of its checkpoint; TensorBoard drops the events past the
    resumed step.
    """

    def __init__(self, state_root: Path, out_dir: Path, resumed_step: int | None,
                 rt: Runtime):
        self.path = state_root / METRICS_FILE
        self.mirror = out_dir / METRICS_FILE
        self.active = rt.is_main
        self.writer = None
        if not self.active:
            return
        if resumed_step is None:  # a fresh run: nothing of an earlier one may remain
            for stale in (self.path, out_dir / "eval.json"):
                stale.unlink(missing_ok=True)
            for stale_dir in (out_dir / "tb", out_dir / BEST_DIR, state_root / BEST_DIR):
                shutil.rmtree(stale_dir, ignore_errors=True)
        state_root.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        shutil.copy2(self.path, self.mirror)
        self.writer = tensorboard_writer(out_dir / "tb", resumed_step)

    def write(self, record: dict, prefix: str) -> None:
        if not self.active:
            return
        for path in (self.path, self.mirror):
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.writer is None:
            return
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


def tensorboard_writer(tb_dir: Path, resumed_step: int | None):
    """A TensorBoard SummaryWriter, or None (and a note naming the extra) without tensorboard.

    Imported here, on rank 0 only: the other ranks write no events. A resumed run drops the
    events past its checkpoint's step."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("TensorBoard events are not written: the 'tensorboard' package is not "
                    "installed (pip install 'draftline[tensorboard]'); metrics.jsonl has "
                    "every record")
        return None
    purge = None if resumed_step is None else resumed_step + 1
    return SummaryWriter(str(tb_dir), purge_step=purge)

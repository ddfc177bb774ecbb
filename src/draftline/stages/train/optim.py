"""The optimizer and the learning-rate schedule (``train.optimizer``, ``lr``, ``momentum``,
``schedule``, ``lm_head``, ``warmup_steps``).

``adamw``: AdamW (betas 0.9/0.95) on every trained tensor. ``muon``: Muon
(``torch.optim.Muon``) on the draft's hidden matrices (``fc`` and the layer's projections),
AdamW on the rest: the norms (1-D) and ``lm_head`` (an output layer, whose rows are the
target's own; orthogonalised updates suit hidden matrices, not a classifier over tokens).
Muon's step is scaled to AdamW's update size (``adjust_lr_fn="match_rms_adamw"``: 0.2
sqrt(max(rows, cols)) x lr), so one ``train.lr`` drives both; its momentum is
``train.momentum``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

BETAS = (0.9, 0.95)
WARMUP_FRACTION = 0.05  # train.warmup_steps null: this share of the run's optimizer steps


def muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates this tensor: a 2-D hidden matrix (not ``lm_head``)."""
    return param.ndim == 2 and not name.startswith("lm_head")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for ``matrices``, AdamW for ``others``, as one optimizer.

    The inner optimizers share this optimizer's param groups and state (their parameters are
    disjoint), so a learning-rate scheduler, ``state_dict``/``load_state_dict`` and
    torch.distributed.checkpoint see one ordinary optimizer.
    """

    def __init__(self, matrices: list[nn.Parameter], others: list[nn.Parameter], lr: float,
                 weight_decay: float, momentum: float = 0.95):
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay,
                                     momentum=momentum, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay, betas=BETAS)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share()

    def _share(self) -> None:
        muon_groups = len(self.muon.param_groups)
        self.muon.param_groups = self.param_groups[:muon_groups]
        self.adamw.param_groups = self.param_groups[muon_groups:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the groups and the state: share again
        self._share()


def build_optimizer(model: nn.Module, cfg: dict) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` (the train section) over the model's trained tensors (those
    that require a gradient)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg["optimizer"] == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=cfg["lr"],
                                 weight_decay=cfg["weight_decay"], betas=BETAS)
    matrices = [p for n, p in named if muon_matrix(n, p)]
    others = [p for n, p in named if not muon_matrix(n, p)]
    return MuonWithAdamW(matrices, others, cfg["lr"], cfg["weight_decay"], cfg["momentum"])


def warmup_steps(cfg: dict, total: int) -> int:
    """The warm-up of a run of ``total`` optimizer steps: ``train.warmup_steps``, or (null)
    ``WARMUP_FRACTION`` of the run, at least one step."""
    if cfg["warmup_steps"] is not None:
        return cfg["warmup_steps"]
    return max(1, round(WARMUP_FRACTION * total))


def lr_factor(step: int, warmup: int, total: int, schedule: str = "cosine") -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then ``schedule`` (cosine or linear) to 0 at
    ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))

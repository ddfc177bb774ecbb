"""The optimizer and the learning-rate schedule (``train.optimizer``, ``lr``, ``momentum``,
``schedule``, ``lm_head``, ``warmup_steps``).

``adamw``: AdamW (betas 0.9/0.95) on every trained tensor. ``muon``: Muon
(``torch.optim.Muon``) on the draft's hidden matrices (``fc`` and the layer's projections),
AdamW on the rest: the norms (1-D) and ``lm_head`` (an output layer, whose rows are the
target's own; orthogonalised updates suit hidden matrices, not a classifier over tokens).
Muon's step is scaled to AdamW's update size (``adjust_lr_fn="match_rms_adamw"``: 0.2
sqrt(max(rows, cols)) x lr), so one ``train.lr`` drives both; its momentum is
``train.momentum``.

Muon's Newton-Schulz iterations are a fixed cost per optimizer step: at Kimi-K2.5's sizes
about a 4,096-token micro-batch's forward and backward. In a data-parallel run
``ShardedMuon`` has each process orthogonalise whole matrices, its share of them, and hand
the results to the others (DDP: a broadcast; FSDP: a scatter of the rows), instead of every
DDP process doing all of them, or FSDP running every product on sharded DTensors.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

BETAS = (0.9, 0.95)
WARMUP_FRACTION = 0.05  # train.warmup_steps null: this share of the run's optimizer steps


def muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates this tensor: a 2-D hidden matrix (not ``lm_head``)."""
    return param.ndim == 2 and not name.startswith("lm_head")


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """Muon's orthogonalisation of one matrix, in bf16: torch.optim.Muon's iterations and
    operations in its order, so that the result is its bit for bit (tests/test_optim.py)."""
    a, b, c = coefficients
    x = update.to(torch.bfloat16, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:  # iterate on the short side's Gram matrix
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def newton_schulz_flops(shape: torch.Size | tuple[int, ...], steps: int) -> int:
    """Matrix-product FLOPs of ``newton_schulz`` on a matrix of ``shape``."""
    short, long = sorted(shape)
    return steps * (4 * short * short * long + 2 * short**3)


def deal_by_cost(costs: list[int], processes: int) -> list[int]:
    """Owner of each item: the largest first, each to the least loaded process (the lowest
    rank on a tie), the same on every process."""
    owners = [0] * len(costs)
    load = [0] * processes
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[i] = min(range(processes), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz work is shared by the processes of a data-parallel
    run: each matrix is orthogonalised whole by one process, chosen by ``deal_by_cost``.

    * DDP (``replicas``, a process group whose members hold the same gradients): every
      process updates every momentum buffer (elementwise, cheap); the owner of a matrix
      orthogonalises its update and broadcasts it in bf16 while the others go on with theirs;
      then every process applies every update.
    * FSDP (matrices that are DTensors sharded by rows on a 1-D mesh): every process updates
      its rows of the momentum; the owner gathers the rows of the update in bf16 (the dtype
      Newton-Schulz starts with), orthogonalises the whole matrix and scatters its rows back.
      torch.optim.Muon's own step would run Newton-Schulz on DTensors instead, where every
      product gathers a matrix again (benchmarks/optimizer_step.py times both) and the sums of
      sharded products round differently in bf16.

    Either way the result is one process's torch.optim.Muon step on the whole matrices, bit
    for bit (tests/test_optim.py), and the state is torch.optim.Muon's, so are checkpoints.
    Otherwise (one process, other layouts) the step is torch.optim.Muon's own.
    """

    def __init__(self, params, replicas: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.replicas = replicas

    @torch.no_grad()
    def step(self, closure=None):
        work = [(group, p) for group in self.param_groups for p in group["params"]
                if p.grad is not None]
        rows_group = row_sharded_group([p for _, p in work])
        if self.replicas is None and rows_group is None:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        process_group = rows_group or self.replicas
        owners = deal_by_cost([newton_schulz_flops(p.shape, g["ns_steps"]) for g, p in work],
                              dist.get_world_size(process_group))
        share = self._share_rows if rows_group else self._share_whole
        for (group, p), update in zip(work, share(work, owners, process_group), strict=True):
            lr = group["lr"]
            target = p.to_local() if rows_group else p
            target.mul_(1 - lr * group["weight_decay"])
            target.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss

    def _momentum_update(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        """torch.optim.Muon's momentum step of ``p``; the update to orthogonalise."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad,
                                                        memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _share_whole(self, work, owners, pg):
        """DDP: each update orthogonalised by its owner and broadcast (yields each in turn)."""
        me, sent = dist.get_rank(pg), []
        for (group, p), owner in zip(work, owners, strict=True):
            update = self._momentum_update(group, p)
            if owner == me:
                update = orthogonalise(update, group).contiguous()  # a tall one's is a view
            else:
                update = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
            handle = dist.broadcast(update, dist.get_global_rank(pg, owner), group=pg,
                                    async_op=True)
            sent.append((update, handle))
        for update, handle in sent:
            handle.wait()
            yield update

    def _share_rows(self, work, owners, pg):
        """FSDP: each update's rows gathered by its owner, orthogonalised whole and scattered
        back (yields this process's rows of each in turn). All gathers are posted first, then
        all scatters, in the same order on every process."""
        world, me = dist.get_world_size(pg), dist.get_rank(pg)
        gathers = []
        for (group, p), owner in zip(work, owners, strict=True):
            mine = self._momentum_update(group, p).to_local().to(torch.bfloat16)
            rows = row_counts(p.shape[0], world)
            if mine.shape[0] != rows[me]:
                raise RuntimeError(f"Muon: a {tuple(p.shape)} matrix has {mine.shape[0]} rows "
                                   f"on process {me}, not {rows[me]}: not FSDP2's row sharding")
            parts = ([mine.new_empty((rows[0], *p.shape[1:])) for _ in range(world)]
                     if owner == me else None)
            sent = pad_rows(mine, rows[0])
            handle = dist.gather(sent, parts, dst=dist.get_global_rank(pg, owner), group=pg,
                                 async_op=True)
            gathers.append((parts, handle, rows, sent))  # kept alive until the gather is done
        scatters = []
        for ((group, p), owner), (parts, gathered, rows, _) in zip(
                zip(work, owners, strict=True), gathers, strict=True):
            pieces = None
            if owner == me:
                gathered.wait()
                whole = torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)])
                result = orthogonalise(whole, group)
                pieces = [pad_rows(piece, rows[0])
                          for piece in result.split(rows)]  # contiguous row blocks
            out = torch.empty((rows[0], *p.shape[1:]), dtype=torch.bfloat16, device=p.device)
            handle = dist.scatter(out, pieces, src=dist.get_global_rank(pg, owner), group=pg,
                                  async_op=True)
            scatters.append((out[:rows[me]], handle, pieces))
        for rows_here, handle, _ in scatters:
            handle.wait()
            yield rows_here
        for _, handle, _, _ in gathers:  # a process's sends of the rows it does not own
            handle.wait()


def orthogonalise(update: torch.Tensor, group: dict) -> torch.Tensor:
    """``newton_schulz`` with the settings of ``group`` (a torch.optim.Muon param group)."""
    return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])


def row_sharded_group(params: list[torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group of ``params`` when every one is a DTensor sharded by rows on one
    1-D mesh (FSDP2's layout), else None."""
    if not params or not all(isinstance(p, DTensor) for p in params):
        return None
    mesh = params[0].device_mesh
    if mesh.ndim != 1 or any(p.device_mesh != mesh or tuple(p.placements) != (Shard(0),)
                             for p in params):
        return None
    return mesh.get_group()


def row_counts(rows: int, world: int) -> list[int]:
    """Rows of each process in a row-sharded matrix: torch.chunk's blocks of ceil(rows /
    world), the last ones shorter or empty (FSDP2's sharding)."""
    block = -(-rows // world)
    return [max(0, min(block, rows - r * block)) for r in range(world)]


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (collectives need equal shapes)."""
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    return padded


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's rate for a matrix of ``shape`` (its ``adjust_lr_fn``)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    raise ValueError(f"Muon: unknown adjust_lr_fn {adjust_lr_fn!r}")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for ``matrices``, AdamW for ``others``, as one optimizer.

    The inner optimizers share this optimizer's param groups and state (their parameters are
    disjoint), so a learning-rate scheduler, ``state_dict``/``load_state_dict`` and
    torch.distributed.checkpoint see one ordinary optimizer.
    """

    def __init__(self, matrices: list[nn.Parameter], others: list[nn.Parameter], lr: float,
                 weight_decay: float, momentum: float = 0.95,
                 replicas: dist.ProcessGroup | None = None):
        self.muon = ShardedMuon(matrices, replicas, lr=lr, weight_decay=weight_decay,
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
    that require a gradient). Muon under DDP shares its Newton-Schulz work among the
    processes (``ShardedMuon``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg["optimizer"] == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=cfg["lr"],
                                 weight_decay=cfg["weight_decay"], betas=BETAS)
    matrices = [p for n, p in named if muon_matrix(n, p)]
    others = [p for n, p in named if not muon_matrix(n, p)]
    return MuonWithAdamW(matrices, others, cfg["lr"], cfg["weight_decay"], cfg["momentum"],
                         data_parallel_group(cfg))


def data_parallel_group(cfg: dict) -> dist.ProcessGroup | None:
    """The processes that hold the same gradients: DDP's, when there are several."""
    if cfg.get("strategy") != "ddp" or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


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

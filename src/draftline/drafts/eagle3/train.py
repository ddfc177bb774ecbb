"""How an EAGLE-3 draft trains and is scored: the TTT loss over its unroll and the family's
training hooks (build, init, micro-batch, evaluation, input checks; ``draftline.drafts.registry``).

Shape legend: B samples, T tokens (padded), H draft hidden, Ht target hidden, A = 3*Ht aux
width, D draft vocab, V target vocab, K unroll steps, nh / nkv heads, hd head dim.
"""

from __future__ import annotations

import contextlib

import torch

from draftline.core.target import read_target_config
from draftline.drafts.acceptance import (
    COUNT_KEYS,
    acceptance_length_from,
    empty_walk,
    metrics_from_counts,
    probabilistic_acceptance_counts,
    sampled_acceptance_counts,
    walk_metrics,
    walked_acceptance_counts,
)
from draftline.drafts.eagle3.config import DraftConfig
from draftline.drafts.eagle3.model import Eagle3Draft, init
from draftline.drafts.losses import DraftKL, DraftLK
from draftline.drafts.teacher import TargetHead, on_greedy_path, teacher_at_temperature


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logp: torch.Tensor,
    target_in_draft: torch.Tensor,
    loss_mask: torch.Tensor,
    decay: float,
    greedy_path: torch.Tensor | None = None,
    objective: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted forward KL (``objective`` "kl") or LK loss ("lk", :class:`DraftLK`) over the
    unroll, and per-step counts for the metrics (``kl_sum`` holds the objective's sum).

    step_logits: K x ``[B, T, D]``; target_logp ``[B, T, D]`` and target_in_draft ``[B, T]``
    from :class:`TargetHead` at each position; loss_mask ``[B, T]`` (1 on generated tokens,
    0 on prompt and padding); greedy_path ``[B, T]`` from :func:`on_greedy_path` (None: every
    token counts as on the path).

    Step k, row i is compared with the target at row i+1+k and counts when the token it
    predicts (i+2+k) is a generated one ("valid"). The loss uses valid rows whose target
    argmax is in the draft vocab; accuracy counts out-of-vocab argmaxes as misses, since the
    draft can never propose them. The chain counts follow one drafting run from row i the way
    the server runs it at temperature 0: step k is eligible when steps 0..k-1 were all correct
    and the token it reads (i+1+k: the target's bonus token for k = 0, else the draft's own
    previous token) is the target's argmax, so that the data context is the server's context.
    Data sampled at T > 0 leaves the greedy path; those rounds are not counted.

    Returns (loss scalar, counts ``[len(COUNT_KEYS), K]`` float64, rows in COUNT_KEYS order).
    """
    batch, length = loss_mask.shape
    per_step = []  # K x [len(COUNT_KEYS)] on the compute device; one transfer at the end
    chain = torch.ones(batch, length, dtype=torch.bool, device=loss_mask.device)  # [B, T]
    loss = step_logits[0].new_zeros((), dtype=torch.float32)
    target_p = target_logp.exp()  # [B, T, D] once: every step saves a view of it
    for k, logits in enumerate(step_logits):
        rows = length - 2 - k  # rows i with a predicted token i+2+k inside the sample buffer
        if rows <= 0:
            chain[:] = False
            per_step.append(torch.zeros(len(COUNT_KEYS), dtype=torch.float64,
                                        device=loss_mask.device))
            continue
        tgt_logp = target_logp[:, 1 + k:1 + k + rows]  # [B, n, D]
        in_draft = target_in_draft[:, 1 + k:1 + k + rows]  # [B, n]
        valid = loss_mask[:, 2 + k:2 + k + rows].bool()  # [B, n]
        loss_rows = valid & in_draft
        step_p = target_p[:, 1 + k:1 + k + rows]  # [B, n, D]
        if objective == "lk":
            kl, draft_argmax = DraftLK.apply(logits[:, :rows], step_p)  # [B, n] each
        else:
            kl, draft_argmax = DraftKL.apply(logits[:, :rows], step_p, tgt_logp)
        kl_sum = (kl * loss_rows).sum()
        n_loss = loss_rows.sum()
        loss = loss + decay**k * kl_sum / n_loss.clamp(min=1)
        correct = loss_rows & (draft_argmax == tgt_logp.argmax(-1))  # [B, n]
        eligible = valid & chain[:, :rows]
        if greedy_path is not None:
            eligible = eligible & greedy_path[:, 1 + k:1 + k + rows]
        chain_correct = eligible & correct
        chain[:, :rows] = chain_correct
        chain[:, rows:] = False
        stats = (valid.sum(), n_loss, correct.sum(), eligible.sum(), chain_correct.sum(),
                 kl_sum.detach())
        per_step.append(torch.stack([s.double() for s in stats]))
    counts = torch.stack(per_step, dim=1).cpu()  # [len(COUNT_KEYS), K]
    return loss, counts


# ----------------------------------------------------------------------------- training hooks


def build(target_dir, target: dict, d2t: torch.Tensor, t2d: torch.Tensor, seed: int,
          dtype: torch.dtype, draft: dict | None):
    """(untrained draft, target head, DraftConfig): the draft's lm_head starts from the
    target's lm_head rows of the draft tokens; the embedding is the target's, frozen.
    ``target`` holds the target's embed, norm and lm_head tensors."""
    draft_cfg = DraftConfig.from_target(read_target_config(target_dir), d2t.shape[0], draft)
    draft_ids = torch.arange(d2t.shape[0]) + d2t  # [D]
    model = Eagle3Draft(draft_cfg, target["embed"].to(dtype),
                        lm_head_init=target["lm_head"][draft_ids].float())
    init(model, seed)
    head = TargetHead(target["norm"].to(dtype), target["lm_head"].to(dtype),
                      draft_cfg.rms_norm_eps, d2t, t2d)
    return model, head, draft_cfg


def check_inputs(store, draft: dict | None) -> None:
    """Nothing beyond the checks every family's inputs pass (``draftline.stages.train.draft``)."""


def micro_batch(model, head, batch: dict, cfg: dict, rt, walk: bool = False):
    """(loss, counts ``[6, K]``, walk counts ``[2, K]`` with ``walk``, else None): training's
    micro-batch with the teacher ``train.teacher_head`` names; with ``walk`` evaluation's, the
    full teacher."""
    loss, counts, _, walked = forward_micro_batch(
        model, head, batch, cfg, rt, full_teacher=walk or cfg["teacher_head"] == "full",
        walk=walk)
    return loss, counts, walked


def forward_micro_batch(model, head, batch: dict, cfg: dict, rt,
                        temperatures: tuple[float, ...] = (), full_teacher: bool = True,
                        walk: bool = False):
    """One micro-batch: (loss, counts ``[6, K]``, acceptance counts ``[len(temperatures), 2,
    2, K]`` of a draft served at each temperature, greedy (``sampled_acceptance_counts``) then
    probabilistic (``probabilistic_acceptance_counts``), and with ``walk`` the counts of
    walking its answers as a temperature-0 server drafts (``walked_acceptance_counts``, ``[2,
    K]``; else None))."""
    cuda = rt.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    aux = batch["aux"].to(rt.device, dtype, non_blocking=True)  # [B, T, 3Ht]
    final = batch["final"].to(rt.device, dtype, non_blocking=True)  # [B, T, Ht]
    input_ids = batch["input_ids"].to(rt.device, non_blocking=True)  # [B, T]
    loss_mask = batch["loss_mask"].to(rt.device, non_blocking=True)  # [B, T]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with amp:
        if full_teacher:
            target_logp, target_in_draft, argmax = head(final, with_argmax=True)  # [B, T, (D)]
            greedy_path = on_greedy_path(input_ids, argmax)
        else:  # every generated row in the loss; the step's counts are not the greedy path's
            target_logp = head.draft_rows(final)  # [B, T, D]
            target_in_draft, greedy_path = torch.ones_like(loss_mask, dtype=torch.bool), None
        logits = model(aux, input_ids, cfg["ttt_steps"])  # K x [B, T, D]
        teacher = teacher_at_temperature(target_logp, cfg["teacher_temperature"])
        loss, counts = ttt_loss(logits, teacher, target_in_draft, loss_mask, cfg["loss_decay"],
                                greedy_path=greedy_path, objective=cfg["loss"])
        accepted = torch.stack([
            served_acceptance_counts(logits, head.logp_at_temperature(final, t), input_ids,
                                     loss_mask, head.draft_ids, t)
            for t in temperatures]) if temperatures else None
        walked = (walked_acceptance_counts(logits, target_logp, target_in_draft, loss_mask)
                  if walk else None)
    return loss, counts, accepted, walked


def served_acceptance_counts(logits, target_logp_t, input_ids, loss_mask, draft_ids,
                             temperature: float) -> torch.Tensor:
    """``[2, 2, K]``: the acceptance counts of a greedy and of a probabilistic draft at T."""
    return torch.stack([
        sampled_acceptance_counts(logits, target_logp_t, input_ids, loss_mask, draft_ids),
        probabilistic_acceptance_counts(logits, target_logp_t, loss_mask, temperature)])


def evaluate(model, head, data, cfg: dict, rt, reduce) -> dict:
    """Metrics over the whole eval split; micro-batches are spread over the ranks (``reduce``
    sums a tensor over them). The headline is ``walked_acceptance_length``: every eval answer
    walked the way a temperature-0 server drafts it
    (``draftline.drafts.acceptance.walked_acceptance_counts``), after 1..K drafts in
    ``walked_acceptance_length_by_num_drafts``. Beside it the per-position figures
    (``metrics_from_counts``) and the simulated acceptance of a draft served at each
    ``train.eval_temperatures``, per temperature after 1..K drafts: greedy
    (``simulated_acceptance_length_at``) and probabilistic draft sampling
    (``simulated_acceptance_length_probabilistic_at``)."""
    temperatures = tuple(cfg["eval_temperatures"])
    counts = torch.zeros(len(COUNT_KEYS), cfg["ttt_steps"], dtype=torch.float64)
    accepted = torch.zeros(len(temperatures), 2, 2, cfg["ttt_steps"], dtype=torch.float64)
    walked = empty_walk(cfg["ttt_steps"])
    model.eval()
    with torch.no_grad():
        for batch, keep in data.eval_batches():
            _, c, a, w = forward_micro_batch(model, head, batch, cfg, rt, temperatures,
                                             walk=True)
            if keep:
                counts += c
                walked += w
                if a is not None:
                    accepted += a
    model.train()
    metrics = metrics_from_counts(reduce(counts))
    metrics.update(walk_metrics(reduce(walked)))
    accepted = reduce(accepted)
    for key, method in (("simulated_acceptance_length_at", 0),
                        ("simulated_acceptance_length_probabilistic_at", 1)):
        metrics[key] = {f"{t:g}": acceptance_length_from(a[method])
                        for t, a in zip(temperatures, accepted, strict=True)}
    return metrics

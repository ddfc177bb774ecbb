"""The DSpark objective, its micro-batch and its evaluation.

The loss is DFlash's block loss (``draftline.drafts.dflash.train.block_loss``: slot j against
the target's distribution of the token at a + j, the slots weighed by ``train.slot_weights``)
on the Markov-biased logits, plus ``train.confidence_weight`` times the confidence head's binary
cross entropy.

Teacher forcing: slot j's bias reads the data's token at a + j - 1 (the anchor for j = 1). At
the slots a temperature-0 server reaches, every earlier slot was accepted, so the token it
drafted there is the target's greedy one: the data's, on the target's greedy path.

The confidence head's target is the slot's acceptance given that every earlier slot was
accepted: 1 when the slot's biased argmax is the target's greedy token at a + j. vLLM ranks
slots by the running product of these (``adaptive_verification.py``), which is then the
chance that the whole prefix is accepted. It is scored at the slots whose previous tokens
(a + 1 .. a + j - 1) are the target's greedy path, where the teacher-forced input is what the
server feeds it after accepting them; elsewhere its input is not one the server produces.

Its training hooks (``draftline.drafts.registry``): ``build``, ``check_inputs`` (DFlash's),
``micro_batch`` and ``evaluate``. Shape legend as ``draftline.drafts.dspark.model``'s.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from draftline.core.target import read_target_config
from draftline.drafts.acceptance import (
    COUNT_KEYS,
    empty_walk,
    metrics_from_counts,
    walk_counts,
    walk_metrics,
)
from draftline.drafts.dflash.config import with_live_mask_token
from draftline.drafts.dflash.train import check_inputs as dflash_check_inputs
from draftline.drafts.dflash.train import sample_anchors, slot_loss, teacher_at
from draftline.drafts.dspark.config import DSparkConfig
from draftline.drafts.dspark.model import DSparkDraft, init
from draftline.drafts.losses import SlotWeights, probability_of
from draftline.drafts.teacher import TargetHead

# the confidence loss's weight against the block loss when train.confidence_weight is absent
# (the DSpark recipe weighs them alike)
CONFIDENCE_WEIGHT = 1.0
CONFIDENCE_KEYS = ("scored", "bce_sum", "predicted_sum", "accepted_sum")


def teacher_prev(input_ids: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """``[Bs, A, K]``: slot j's previous token, the data's at a + j - 1 (positions past the
    sample repeat its last token; those slots are not scored)."""
    offsets = torch.arange(block - 1, device=anchors.device)  # [K]: a + j - 1 for j = 1..K
    where = (anchors[..., None] + offsets).clamp(max=input_ids.shape[1] - 1)  # [Bs, A, K]
    return input_ids.gather(1, where.flatten(1)).view_as(where)


def dspark_block_loss(model: DSparkDraft, states: torch.Tensor, lm_head: torch.Tensor,
                      input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                      valid: torch.Tensor, target_argmax: torch.Tensor, weights: SlotWeights,
                      teacher, objective: str = "kl",
                      confidence_weight: float = CONFIDENCE_WEIGHT):
    """(loss, counts ``[len(COUNT_KEYS), K]``, runs ``[Bs, A]``, confidence sums
    ``[len(CONFIDENCE_KEYS)]``) of one pass of blocks.

    Inputs as ``draftline.drafts.dflash.train.block_loss``'s (its teacher and objective too)
    plus the draft (its heads).
    Counts and runs mean what ``block_loss``'s mean, with the biased logits: slot j is correct
    when their argmax is the target's greedy token, the chain follows one temperature-0
    round."""
    length, block = input_ids.shape[1], states.shape[2]
    logits, embed = model.slot_logits(states, lm_head, teacher_prev(input_ids, anchors, block))
    on_path = torch.zeros_like(loss_mask, dtype=torch.bool)  # token p is argmax at p - 1
    on_path[:, 1:] = input_ids[:, 1:] == target_argmax[:, :-1]
    chain = valid & on_path.gather(1, anchors)  # [Bs, A]: the anchor is the bonus token
    path = valid.clone()  # tokens a + 1 .. a + j - 1 on the target's greedy path
    alive = valid.clone()
    runs = torch.zeros_like(anchors)
    losses, greedy_p, correct_all, scored_all, path_all, per_slot = [], [], [], [], [], []
    for j in range(1, block):
        where = (anchors + j).clamp(max=length - 1)  # [Bs, A]
        scored = valid & (anchors + j < length) & loss_mask.gather(1, where).bool()
        slot = logits[:, :, j - 1]  # [Bs, A, V]
        ce = slot_loss(slot, teacher(where - 1), objective) * scored  # [Bs, A]
        greedy = target_argmax.gather(1, where - 1)  # [Bs, A]
        losses.append(ce)
        greedy_p.append(probability_of(slot, greedy))
        correct = scored & (slot.argmax(-1) == greedy)
        eligible = scored & chain
        chain = eligible & correct & on_path.gather(1, where)
        alive = alive & correct
        runs = runs + alive
        correct_all.append(correct)
        scored_all.append(scored)
        path_all.append(path & scored)
        path = path & on_path.gather(1, where)
        stats = (scored.sum(), scored.sum(), correct.sum(), eligible.sum(),
                 (eligible & correct).sum(), ce.detach().sum())
        per_slot.append(torch.stack([s.double() for s in stats]))
    counts = torch.stack(per_slot, dim=1).cpu()
    assert counts.shape[0] == len(COUNT_KEYS)
    loss = weights.loss(torch.stack(losses, -1), torch.stack(scored_all, -1),
                        torch.stack(greedy_p, -1))
    confidence = torch.zeros(len(CONFIDENCE_KEYS), dtype=torch.float64)
    if model.confidence_head is not None:
        conf = model.confidence_logits(states, embed)  # [Bs, A, K]
        accepted = torch.stack(correct_all, dim=-1).float()  # [Bs, A, K]
        mask = torch.stack(path_all, dim=-1).float()
        bce = F.binary_cross_entropy_with_logits(conf, accepted, reduction="none") * mask
        loss = loss + confidence_weight * bce.sum() / mask.sum().clamp(min=1)
        confidence = torch.stack([mask.sum(), bce.detach().sum(),
                                  (torch.sigmoid(conf.detach()) * mask).sum(),
                                  (accepted * mask).sum()]).double().cpu()
    return loss, counts, runs, confidence


def _pass(model, head, batch: dict, cfg: dict, rt, anchors_per_sample: int | None):
    """``micro_batch``'s work over up to ``anchors_per_sample`` blocks of each sample (None:
    every anchor, with the walk counts), with the confidence sums as a fourth result."""
    cuda = rt.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    aux = batch["aux"].to(rt.device, dtype, non_blocking=True)  # [Bs, S, n*Ht]
    final = batch["final"].to(rt.device, dtype, non_blocking=True)  # [Bs, S, Ht]
    input_ids = batch["input_ids"].to(rt.device, non_blocking=True)  # [Bs, S]
    loss_mask = batch["loss_mask"].to(rt.device, non_blocking=True)  # [Bs, S]
    anchors, valid = sample_anchors(loss_mask, anchors_per_sample)  # [Bs, A] each
    every_anchor = anchors_per_sample is None
    draft = getattr(model, "module", model)  # the heads (DDP wraps the module)
    # [Bs, S + 1]: the run of the round anchored at a sits at row a - 1 (as DFlash's)
    runs = torch.zeros(input_ids.shape[0], input_ids.shape[1] + 1, dtype=torch.long,
                       device=input_ids.device)
    confidence = torch.zeros(len(CONFIDENCE_KEYS), dtype=torch.float64)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with amp:
        _, _, target_argmax = head(final, with_argmax=True)  # [Bs, S]
        teacher = teacher_at(head, final, cfg["teacher_temperature"])
        loss, counts = None, 0
        for first in range(0, anchors.shape[1], cfg["anchors"]):
            part = slice(first, first + cfg["anchors"])
            states = model(aux, input_ids, anchors[:, part])  # [Bs, a, B, H]
            loss, c, run, conf = dspark_block_loss(
                draft, states, head.lm_head, input_ids, loss_mask, anchors[:, part],
                valid[:, part], target_argmax, SlotWeights.of(cfg), teacher, cfg["loss"],
                cfg.get("confidence_weight", CONFIDENCE_WEIGHT))
            counts = counts + c
            confidence = confidence + conf
            if every_anchor:
                ok = valid[:, part] & (anchors[:, part] > 0)
                rows = torch.where(ok, anchors[:, part] - 1, input_ids.shape[1])
                runs.scatter_(1, rows, run)
    if not every_anchor:
        return loss, counts, None, confidence
    walked = walk_counts(runs[:, :-1], loss_mask, draft.cfg.block_size - 1)
    return None, counts, walked, confidence


def micro_batch(model, head, batch: dict, cfg: dict, rt, walk: bool = False):
    """Training's micro-batch (``train.anchors`` blocks of each sample): (loss, counts ``[6,
    B - 1]``, None); with ``walk`` evaluation's, every anchor: (None, counts, walk counts ``[2,
    B - 1]``), in passes of ``train.anchors`` blocks, as DFlash's. ``cfg`` reads ``anchors``,
    the slot weights' keys (``draftline.drafts.losses.SlotWeights.of``) and (optional)
    ``confidence_weight``."""
    loss, counts, walked, _ = _pass(model, head, batch, cfg, rt, None if walk else cfg["anchors"])
    return loss, counts, walked


def confidence_metrics(sums: torch.Tensor) -> dict:
    """The confidence head's figures over the scored slots: its loss, and its mean predicted
    against the mean observed acceptance (calibration)."""
    scored = float(sums[0])
    if scored == 0:
        return {"confidence_loss": None, "confidence_mean": None, "acceptance_mean": None}
    return {"confidence_loss": float(sums[1]) / scored,
            "confidence_mean": float(sums[2]) / scored,
            "acceptance_mean": float(sums[3]) / scored}


def evaluate(model, head, data, cfg: dict, rt, reduce) -> dict:
    """A DSpark draft's metrics over the whole eval split (``reduce`` sums over the ranks), as
    DFlash's (every anchor of every sample, temperature 0) plus ``confidence_metrics``."""
    draft = getattr(model, "module", model)
    slots = draft.cfg.block_size - 1
    counts = torch.zeros(len(COUNT_KEYS), slots, dtype=torch.float64)
    walked = empty_walk(slots)
    confidence = torch.zeros(len(CONFIDENCE_KEYS), dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for batch, keep in data.eval_batches():
            _, c, w, conf = _pass(model, head, batch, cfg, rt, None)
            if keep:
                counts += c
                walked += w
                confidence += conf
    model.train()
    metrics = metrics_from_counts(reduce(counts))
    metrics.update(walk_metrics(reduce(walked)))
    metrics.update(confidence_metrics(reduce(confidence)))
    return metrics


def check_inputs(store, draft: dict | None) -> None:
    """DFlash's: its backbone names a layer by its output, so no stored id is 0."""
    dflash_check_inputs(store, draft)


def build(target_dir, target: dict, d2t: torch.Tensor, t2d: torch.Tensor, seed: int,
          dtype: torch.dtype, draft: dict | None):
    """(untrained draft, target head, DSparkConfig), as DFlash's: it drafts over the target's
    whole vocabulary through the target's lm_head (the head's); its embedding is the
    target's."""
    cfg = with_live_mask_token(DSparkConfig.from_target(read_target_config(target_dir),
                                                        draft or {}),
                               target["embed"], (draft or {}).get("mask_token_id"))
    model = DSparkDraft(cfg, target["embed"].to(dtype))
    init(model, seed)
    head = TargetHead(target["norm"].to(dtype), target["lm_head"].to(dtype), cfg.rms_norm_eps,
                      d2t, t2d)
    return model, head, cfg

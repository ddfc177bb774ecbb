"""How a DFlash draft trains and is scored: anchors, the block objective, and the family's
training hooks (build, init, micro-batch, evaluation, input checks; ``draftline.drafts.registry``).

Shape legend: Bs samples, S tokens (padded), A anchors (blocks) per sample, B block size, H
hidden (the target's: the embedding and lm_head are shared), Ht target hidden, n captured
layers, V vocab, nh / nkv heads, hd head dim, L layers, K = B - 1 draft slots.
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
from draftline.drafts.dflash.config import DFlashConfig, with_live_mask_token
from draftline.drafts.dflash.model import DFlashDraft, init
from draftline.drafts.losses import DraftKL, DraftLK, SlotWeights, probability_of
from draftline.drafts.teacher import TargetHead


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[Bs, S]`` bool: positions a that may anchor a block. x_a is a generated token (the
    server anchors every block at its bonus token) with a generated token after it."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    return ok


def sample_anchors(loss_mask: torch.Tensor, per_sample: int | None,
                   generator: torch.Generator | None = None):
    """(anchors ``[Bs, A]`` long, valid ``[Bs, A]`` bool): up to ``per_sample`` candidates
    of each sample drawn without replacement (None: all of them, in order), padded with
    position 0 (not valid)."""
    candidates = anchor_candidates(loss_mask)
    chosen = []
    for row in candidates:
        positions = row.nonzero().flatten()
        if per_sample is not None and positions.numel() > per_sample:
            pick = torch.randperm(positions.numel(), generator=generator)[:per_sample]
            positions = positions[pick.to(positions.device)].sort().values
        chosen.append(positions)
    width = max(1, max(p.numel() for p in chosen))
    anchors = torch.zeros(len(chosen), width, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(len(chosen), width, dtype=torch.bool, device=loss_mask.device)
    for i, positions in enumerate(chosen):
        anchors[i, :positions.numel()] = positions
        valid[i, :positions.numel()] = True
    return anchors, valid


def teacher_at(head: TargetHead, final: torch.Tensor, temperature: float):
    """The teacher of a block's slots: positions ``[Bs, A]`` -> the target's log-probs of the
    token after each ``[Bs, A, V]`` (fp32, at ``temperature``: ``train.teacher_temperature``),
    from its final states ``final`` ``[Bs, S, Ht]``. Made per slot, from the A rows it needs."""

    @torch.no_grad()
    def logp(positions: torch.Tensor) -> torch.Tensor:
        rows = final.gather(1, positions.unsqueeze(-1).expand(-1, -1, final.shape[-1]))
        logits = head.logits(rows.flatten(0, 1)).float() / temperature  # [Bs * A, V]
        return torch.log_softmax(logits, dim=-1).view(*positions.shape, -1)

    return logp


def slot_loss(logits: torch.Tensor, target_logp: torch.Tensor, objective: str) -> torch.Tensor:
    """``[Bs, A]``: a slot's logits ``[Bs, A, V]`` against the target's distribution
    ``[Bs, A, V]`` (log-probs): forward KL (``train.loss`` "kl") or the LK loss ("lk")."""
    target_p = target_logp.exp()
    if objective == "lk":
        return DraftLK.apply(logits, target_p)[0]
    return DraftKL.apply(logits, target_p, target_logp)[0]


def block_loss(states: torch.Tensor, lm_head: torch.Tensor, input_ids: torch.Tensor,
               loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
               target_argmax: torch.Tensor, weights: SlotWeights, teacher,
               objective: str = "kl", with_runs: bool = False):
    """The DFlash objective and the acceptance counts of its blocks.

    states ``[Bs, A, B, H]`` (``DFlashDraft``'s), lm_head ``[V, H]`` (the target's),
    input_ids/loss_mask ``[Bs, S]``, anchors/valid ``[Bs, A]``, target_argmax ``[Bs, S]``
    (the target's choice of the token after each position), teacher (:func:`teacher_at`).
    Slot j >= 1 is scored when the answer's token at a + j is a generated one, against the
    target's distribution of that token (at a + j - 1, after the answer's tokens up to it):
    :func:`slot_loss`, the slots weighed by ``weights`` (``train.slot_weights``). The whole
    distribution teaches more than the one token an answer sampled at T > 0 holds there.

    Counts (``[len(COUNT_KEYS), K]``, as ``draftline.drafts.eagle3.train.ttt_loss``'s, so that
    ``metrics_from_counts`` reads both): slot j is correct when the draft's argmax is the
    target's; the chain follows one served round at temperature 0: slot j is eligible when
    slots 1..j-1 were correct and the answer up to a + j - 1 is the target's greedy path
    (the context the server would hold).

    ``with_runs`` adds a third result, ``[Bs, A]``: the accepted run of the round anchored at
    each anchor (slots right in order from slot 1, up to the first that is not or that falls
    past the answer), what ``draftline.drafts.acceptance.walk_counts`` walks."""
    length = input_ids.shape[1]
    block = states.shape[2]
    on_path = torch.zeros_like(loss_mask, dtype=torch.bool)  # token p is argmax at p - 1
    on_path[:, 1:] = input_ids[:, 1:] == target_argmax[:, :-1]
    chain = valid & on_path.gather(1, anchors)  # [Bs, A]: the anchor is the bonus token
    losses, scored_all, greedy_p, per_slot = [], [], [], []
    alive = valid.clone()  # slots 1..j-1 of the block all right
    runs = torch.zeros_like(anchors)
    for j in range(1, block):
        where = (anchors + j).clamp(max=length - 1)  # [Bs, A]
        scored = valid & (anchors + j < length) & loss_mask.gather(1, where).bool()
        logits = F.linear(states[:, :, j], lm_head.to(states.dtype))  # [Bs, A, V]
        ce = slot_loss(logits, teacher(where - 1), objective) * scored  # [Bs, A]
        greedy = target_argmax.gather(1, where - 1)  # [Bs, A]
        losses.append(ce)
        scored_all.append(scored)
        greedy_p.append(probability_of(logits, greedy))
        correct = scored & (logits.argmax(-1) == greedy)
        eligible = scored & chain
        chain = eligible & correct & on_path.gather(1, where)
        alive = alive & correct
        runs = runs + alive
        stats = (scored.sum(), scored.sum(), correct.sum(), eligible.sum(),
                 (eligible & correct).sum(), ce.detach().sum())
        per_slot.append(torch.stack([s.double() for s in stats]))
    counts = torch.stack(per_slot, dim=1).cpu()  # [len(COUNT_KEYS), K]
    assert counts.shape[0] == len(COUNT_KEYS)
    loss = weights.loss(torch.stack(losses, -1), torch.stack(scored_all, -1),
                        torch.stack(greedy_p, -1))
    return (loss, counts, runs) if with_runs else (loss, counts)


# ----------------------------------------------------------------------------- training hooks


def build(target_dir, target: dict, d2t: torch.Tensor, t2d: torch.Tensor, seed: int,
          dtype: torch.dtype, draft: dict | None):
    """(untrained draft, target head, DFlashConfig): it drafts over the target's whole
    vocabulary through the target's own lm_head (the head's); its embedding is the target's."""
    dflash_cfg = with_live_mask_token(DFlashConfig.from_target(read_target_config(target_dir),
                                                               draft),
                                      target["embed"], (draft or {}).get("mask_token_id"))
    model = DFlashDraft(dflash_cfg, target["embed"].to(dtype))
    init(model, seed)
    head = TargetHead(target["norm"].to(dtype), target["lm_head"].to(dtype),
                      dflash_cfg.rms_norm_eps, d2t, t2d)
    return model, head, dflash_cfg


def check_inputs(store, draft: dict | None) -> None:
    """DFlash names a layer by its output (vLLM's id k is DFlash's k - 1): none is id 0."""
    if 0 in store.layer_ids:
        raise ValueError(f"{store.origin}: layer_ids {store.layer_ids} include 0 (the "
                         "embeddings), which a DFlash draft cannot read: choose hidden.layer_ids "
                         "of at least 1")


def micro_batch(model, head, batch: dict, cfg: dict, rt, walk: bool = False):
    """Training's micro-batch (``train.anchors`` blocks of each sample): (loss, counts, None);
    with ``walk`` evaluation's, every anchor: (None, counts, walk counts)."""
    return block_micro_batch(model, head, batch, cfg, rt, None if walk else cfg["anchors"])


def block_micro_batch(model, head, batch: dict, cfg: dict, rt, anchors_per_sample: int | None):
    """A DFlash draft's micro-batch: (loss, counts ``[6, B - 1]``, None) over up to
    ``anchors_per_sample`` blocks of each sample, or (None, counts, walk counts ``[2, B -
    1]``) as evaluation scores them, over every anchor
    (``draftline.drafts.acceptance.walk_counts``: the round anchored at a is the row a - 1 of
    an EAGLE unroll), ``train.anchors`` blocks a pass (the attention holds [anchors, block,
    context] scores a pass)."""
    cuda = rt.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    aux = batch["aux"].to(rt.device, dtype, non_blocking=True)  # [Bs, S, n*Ht]
    final = batch["final"].to(rt.device, dtype, non_blocking=True)  # [Bs, S, Ht]
    input_ids = batch["input_ids"].to(rt.device, non_blocking=True)  # [Bs, S]
    loss_mask = batch["loss_mask"].to(rt.device, non_blocking=True)  # [Bs, S]
    anchors, valid = sample_anchors(loss_mask, anchors_per_sample)  # [Bs, A] each
    every_anchor = anchors_per_sample is None
    # [Bs, S + 1]: the run of the round anchored at a sits at row a - 1; padded anchors (and
    # an anchor at 0, which no row precedes) write to the extra last column
    runs = torch.zeros(input_ids.shape[0], input_ids.shape[1] + 1, dtype=torch.long,
                       device=input_ids.device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with amp:
        _, _, target_argmax = head(final, with_argmax=True)  # [Bs, S]
        teacher = teacher_at(head, final, cfg["teacher_temperature"])
        loss, counts = None, 0
        for first in range(0, anchors.shape[1], cfg["anchors"]):
            part = slice(first, first + cfg["anchors"])
            states = model(aux, input_ids, anchors[:, part])  # [Bs, a, B, H]
            loss, c, run = block_loss(states, head.lm_head, input_ids, loss_mask,
                                      anchors[:, part], valid[:, part], target_argmax,
                                      SlotWeights.of(cfg), teacher, cfg["loss"],
                                      with_runs=True)
            counts = counts + c
            if every_anchor:
                ok = valid[:, part] & (anchors[:, part] > 0)
                rows = torch.where(ok, anchors[:, part] - 1, input_ids.shape[1])
                runs.scatter_(1, rows, run)
    if not every_anchor:
        return loss, counts, None
    return None, counts, walk_counts(runs[:, :-1], loss_mask, model.cfg.block_size - 1)


def evaluate(model, head, data, cfg: dict, rt, reduce) -> dict:
    """A DFlash draft's metrics over the whole eval split (``reduce`` sums over the ranks):
    every anchor of every sample, the temperature-0 figures (its served temperatures above 0
    are not simulated)."""
    counts = torch.zeros(len(COUNT_KEYS), model.cfg.block_size - 1, dtype=torch.float64)
    walked = empty_walk(model.cfg.block_size - 1)
    model.eval()
    with torch.no_grad():
        for batch, keep in data.eval_batches():
            _, c, w = block_micro_batch(model, head, batch, cfg, rt, None)
            if keep:
                counts += c
                walked += w
    model.train()
    metrics = metrics_from_counts(reduce(counts))
    metrics.update(walk_metrics(reduce(walked)))
    return metrics

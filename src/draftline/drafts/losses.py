"""The per-row losses of a draft's logits against the teacher, as custom autograd functions
that save only the logits and the target probabilities (the backward recomputes the softmax),
and how the slots of a block weigh in its loss (``SlotWeights``).

Shape legend: B samples, n rows, D draft vocab, K a block's draft slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class DraftKL(torch.autograd.Function):
    """Per row, KL(target || softmax(logits)) in fp32, and the argmax of the draft's log-probs.

    Saves only the logits (the step's lm_head output, ``[B, n, D]`` in the compute dtype) and
    the target probabilities (a view of one tensor shared by all steps); the backward
    recomputes the softmax. Autograd would keep the fp32 log-softmax and the fp32 target
    probabilities of every step, 8 bytes per draft-vocab entry per token per step: at K = 7
    and D = 32,000 that is 1.7 MB a token, a third of the step's activations.
    logits ``[B, n, D]``, target_p and target_logp ``[B, n, D]`` fp32 -> kl ``[B, n]`` fp32,
    argmax ``[B, n]``.
    """

    @staticmethod
    def forward(ctx, logits, target_p, target_logp):
        draft_logp = torch.log_softmax(logits.float(), dim=-1)  # [B, n, D]
        kl = (target_p * (target_logp - draft_logp)).sum(-1)  # [B, n]
        argmax = draft_logp.argmax(-1)
        ctx.save_for_backward(logits, target_p)
        ctx.mark_non_differentiable(argmax)
        return kl, argmax

    @staticmethod
    def backward(ctx, grad_kl, _):
        logits, target_p = ctx.saved_tensors
        # d kl / d logits_j = softmax_j * sum(target_p) - target_p_j
        probs = torch.softmax(logits.float(), dim=-1)  # [B, n, D]
        grad = grad_kl.unsqueeze(-1) * (probs * target_p.sum(-1, keepdim=True) - target_p)
        return grad.to(logits.dtype), None, None


class DraftLK(torch.autograd.Function):
    """Per row, the LK loss -log(alpha), alpha = sum_x min(p_x, q_x) with q = softmax(logits):
    the probability that a token sampled from the draft is accepted (LK losses, arXiv
    2602.23881: the acceptance rate itself, where KL is its proxy), and the draft's argmax.

    Saves what :class:`DraftKL` saves; the backward recomputes q.
    d alpha / d logits_j = q_j (m_j - sum_x q_x m_x), m = [q < p] (where the draft is below the
    target, raising it raises alpha). logits ``[B, n, D]``, target_p ``[B, n, D]`` fp32 ->
    loss ``[B, n]`` fp32, argmax ``[B, n]``.
    """

    EPS = 1e-6  # alpha floor: an untrained draft can share almost no mass with the target

    @staticmethod
    def forward(ctx, logits, target_p):
        probs = torch.softmax(logits.float(), dim=-1)  # [B, n, D]
        alpha = torch.minimum(probs, target_p).sum(-1).clamp(min=DraftLK.EPS)  # [B, n]
        argmax = probs.argmax(-1)
        ctx.save_for_backward(logits, target_p, alpha)
        ctx.mark_non_differentiable(argmax)
        return -alpha.log(), argmax

    @staticmethod
    def backward(ctx, grad_loss, _):
        logits, target_p, alpha = ctx.saved_tensors
        probs = torch.softmax(logits.float(), dim=-1)  # [B, n, D]
        below = (probs < target_p).float()
        d_alpha = probs * (below - (probs * below).sum(-1, keepdim=True))
        grad = -(grad_loss / alpha).unsqueeze(-1) * d_alpha
        return grad.to(logits.dtype), None


LOSSES = ("kl", "lk")


def acceptance_weights(confidence: torch.Tensor, scored: torch.Tensor,
                       alpha: float) -> torch.Tensor:
    """``[..., K]``: the weight of each slot of a block in the loss, by how much the block's
    expected accepted run depends on it (D-PACE).

    With q_i the draft's probability of the target's token at slot i (``confidence``), a
    round accepts sum_k prod_{i <= k} q_i tokens in expectation; its derivative in log q_j is
    sum_{k >= j} prod_{i <= k} q_i: a slot weighs the expected run it opens, so a slot behind
    one the draft gets wrong weighs little. q is smoothed to alpha + (1 - alpha) q, so that
    early in training (q near 0) the later slots still learn; a slot that is not scored
    (``scored`` false: past the answer) weighs 0 and counts as 1 in the products. No gradient.
    """
    with torch.no_grad():
        scored = scored.to(confidence.dtype)
        smooth = torch.where(scored > 0, alpha + (1 - alpha) * confidence,
                             torch.ones_like(confidence))
        reached = torch.cumprod(smooth, dim=-1) * scored  # [..., K]: prod_{i <= k} q_i
        return reached.flip(-1).cumsum(-1).flip(-1) * scored


@dataclass(frozen=True)
class SlotWeights:
    """How a block's slots weigh in its loss (``train.slot_weights``): "acceptance" weighs
    slot j by :func:`acceptance_weights` (``alpha``: ``train.acceptance_alpha``) and divides
    by the scored slots; "decay" weighs it ``decay`` ** (j - 1) (``train.loss_decay``, the
    DFlash paper's exp(-(j - 1) / gamma)) and divides by the weights."""

    kind: str = "acceptance"
    decay: float = 0.8
    alpha: float = 0.5

    @classmethod
    def of(cls, train: dict) -> SlotWeights:
        return cls(train["slot_weights"], train["loss_decay"], train["acceptance_alpha"])

    def loss(self, losses: torch.Tensor, scored: torch.Tensor,
             confidence: torch.Tensor) -> torch.Tensor:
        """The blocks' loss from their slots' ``losses`` ``[..., K]`` (zero where not
        ``scored``) and the draft's probability of the target's token there
        (``confidence``)."""
        scored = scored.to(losses.dtype)
        if self.kind == "acceptance":
            weights = acceptance_weights(confidence, scored, self.alpha)
            return (losses * weights).sum() / scored.sum().clamp(min=1)
        steps = torch.arange(losses.shape[-1], device=losses.device, dtype=losses.dtype)
        weights = self.decay ** steps * scored
        return (losses * weights).sum() / weights.sum().clamp(min=1)


def probability_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[...]``: softmax(logits ``[..., V]``) at ``tokens`` ``[...]``, fp32, no gradient."""
    with torch.no_grad():
        picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
        return torch.exp(picked - torch.logsumexp(logits.float(), dim=-1))

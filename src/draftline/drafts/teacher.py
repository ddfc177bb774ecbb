"""The frozen target head that makes the training targets: the target's final norm and
lm_head over its captured final state, and what the teacher is at a temperature.

Shape legend: B samples, T tokens, Ht target hidden, D draft vocab, V target vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TargetHead(nn.Module):
    """The target's final norm and lm_head, frozen: the teacher distribution per position."""

    def __init__(self, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float,
                 d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight, persistent=False)  # [Ht]
        self.register_buffer("lm_head", lm_head, persistent=False)  # [V, Ht]
        self.register_buffer("t2d", t2d.bool(), persistent=False)  # [V]
        draft_ids = torch.arange(d2t.shape[0]) + d2t  # [D] target id of each draft id
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        self.eps = eps

    @torch.no_grad()
    def forward(self, final: torch.Tensor, chunk_rows: int = 2048, with_argmax: bool = False):
        """final ``[..., Ht]`` (pre-norm last layer) ->
        log-probs over the draft vocab ``[..., D]`` (fp32), and whether the target's argmax
        over its full vocab lies in the draft vocab ``[...]`` bool; with ``with_argmax`` also
        that argmax (target token ids ``[...]``, the token the server takes at T=0)."""
        flat = final.reshape(-1, final.shape[-1])  # [N, Ht]
        logps, argmax = [], []
        for rows in flat.split(chunk_rows):  # bounds the [rows, V] logits (V = 163,840 at Kimi)
            logits = self.logits(rows)  # [n, V]
            argmax.append(logits.argmax(-1))  # [n]
            logps.append(torch.log_softmax(logits[:, self.draft_ids].float(), dim=-1))  # [n, D]
        shape = final.shape[:-1]
        argmax_ids = torch.cat(argmax).view(shape)
        out = (torch.cat(logps).view(*shape, -1), self.t2d[argmax_ids])
        return (*out, argmax_ids) if with_argmax else out


    @torch.no_grad()
    def draft_rows(self, final: torch.Tensor, chunk_rows: int = 2048) -> torch.Tensor:
        """final ``[..., Ht]`` -> ``forward``'s log-probs over the draft vocab ``[..., D]``
        (fp32) from the draft vocabulary's lm_head rows alone: the softmax over the draft
        vocab needs no other row, so this is D / V of the full head's work (32,000 of 163,840
        rows at Kimi-K2.5). It cannot say where the target's full-vocab argmax lies: a loss
        fed from it counts every generated row (``train.teacher_head``)."""
        if getattr(self, "_draft_lm_head", None) is None:  # [D, Ht], made once
            self._draft_lm_head = self.lm_head[self.draft_ids].contiguous()
        flat = final.reshape(-1, final.shape[-1])  # [N, Ht]
        logps = [torch.log_softmax(self.logits(rows, self._draft_lm_head).float(), dim=-1)
                 for rows in flat.split(chunk_rows)]  # [n, D] each
        return torch.cat(logps).view(*final.shape[:-1], -1)

    def logits(self, rows: torch.Tensor, lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """rows ``[n, Ht]`` (pre-norm last-layer states) -> the target's logits ``[n, V]``
        (``[n, rows of lm_head]`` given some of its rows): its final RMSNorm (in fp32) and
        lm_head."""
        lm_head = self.lm_head if lm_head is None else lm_head
        x32 = rows.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))
        normed = self.norm_weight * normed.to(self.norm_weight.dtype)
        return F.linear(normed.to(lm_head.dtype), lm_head)

    @torch.no_grad()
    def full_logits(self, states: torch.Tensor, chunk_rows: int = 2048) -> torch.Tensor:
        """states ``[N, Ht]`` -> the target's logits over its full vocab ``[N, V]`` fp32."""
        return torch.cat([self.logits(rows.to(self.lm_head.dtype)).float()
                          for rows in states.split(chunk_rows)])

    @torch.no_grad()
    def logp_at_temperature(self, final: torch.Tensor, temperature: float,
                            chunk_rows: int = 2048) -> torch.Tensor:
        """final ``[..., Ht]`` -> the target's log-probability at ``temperature`` (softmax of
        logits / T over its full vocab, as a server samples it) of each draft-vocab token
        ``[..., D]`` fp32. Evaluation only: the training targets are ``forward``'s."""
        flat = final.reshape(-1, final.shape[-1])  # [N, Ht]
        out = []
        for rows in flat.split(chunk_rows):
            logits = self.logits(rows).float()  # [n, V]
            logp = torch.log_softmax(logits / temperature, dim=-1)  # [n, V]
            out.append(logp[:, self.draft_ids])  # [n, D]
        return torch.cat(out).view(*final.shape[:-1], -1)


def on_greedy_path(input_ids: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: token j is the target's argmax at row j-1 (what the server would have
    taken there at temperature 0). Token 0 has no row before it: False."""
    path = torch.zeros_like(input_ids, dtype=torch.bool)
    path[:, 1:] = input_ids[:, 1:] == target_argmax[:, :-1]
    return path


def teacher_at_temperature(target_logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """The training targets ``[..., D]`` (``TargetHead`` log-probs over the draft vocab) at
    ``temperature`` (``train.teacher_temperature``): softmax(log p / T) over the draft vocab is
    the target's softmax(logits / T) restricted to it. Below 1 the targets sharpen around the
    target's likeliest tokens, whose order is all that a greedily drafted token depends on."""
    if temperature == 1.0:
        return target_logp
    return torch.log_softmax(target_logp.float() / temperature, dim=-1).to(target_logp.dtype)

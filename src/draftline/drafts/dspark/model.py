"""The DSpark draft: a DFlash block drafter plus a Markov logit bias and a confidence head.

DSpark drafts a block in one parallel pass exactly as DFlash does (``draftline.drafts.dflash``:
read its docstring first; the backbone, its weights and its block layout are DFlash's), then
drafts the block's tokens left to right, adding to each slot's logits a bias conditioned on
the token drafted just before it. A confidence head predicts, per slot, the chance that the
server accepts the slot's token given that it accepted every slot before it.

Layout and names follow vLLM's ``Qwen3DSparkForCausalLM`` (``qwen3_dspark.py``, served with
``"method": "dspark"``), whose backbone is ``DFlashQwen3Model``; the heads' weights export
without renaming (vLLM's loader prefixes ``model.``):

    states = DFlashDraft(aux, ids, anchors)          [.., B, H]: slot j predicts token a + j
    for j in 1..K (K = B - 1), left to right:
        prev_j   = x_a (j = 1), else the token of slot j - 1
        e_j      = markov_head.markov_w1[prev_j]                       [r]
        logits_j = lm_head(states_j) + markov_head.markov_w2 @ e_j     [V]
        token_j  = argmax(logits_j)                    (vLLM's greedy drafting)
        conf_j   = sigmoid(confidence_head.proj([states_j ; e_j]))    ([states_j] without
                                                        confidence_head_with_markov)

The block is DFlash's fill-in layout (config.json ``sample_from_anchor: false``): the anchor
is the server's bonus token and only the mask slots predict, so vLLM serves
``num_speculative_tokens`` = B - 1 and runs the same backbone pass as for DFlash
(``DSparkSpeculator``: ``num_query_per_req = 1 + N``). Training feeds the bias the data's
token at a + j - 1 (teacher forcing): at the slots the server reaches (every earlier slot
accepted, so drafted = the target's greedy token) that is the token vLLM's drafting feeds it,
whenever the data is the target's greedy path.

Why a bias, not another layer: the backbone fills every slot at once, so slot j cannot see
which token slot j - 1 chose (two plausible continuations blend); the low-rank V x r x V
transition ``markov_w2 @ markov_w1[prev]`` is the cheapest dependency on it, run per slot.
Why the confidence is conditional: vLLM's adaptive verification ranks slots by the running
product of the confidences (``adaptive_verification.py``, ``_assign_draft_token_budget``),
so each must be the acceptance of its slot given the ones before.

Shape legend (as ``draftline.drafts.dflash``): Bs samples, S tokens, A anchors a sample, B
block size, K = B - 1 draft slots, H hidden, V vocab (the draft's is the target's), r markov
rank. Reading order: ``DSparkDraft`` (``markov_embed``, ``markov_bias``,
``slot_logits``, ``confidence_logits``, ``draft_greedy``), ``expected_shapes``,
``init``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftline.drafts.dflash.model import DFlashDraft
from draftline.drafts.dflash.model import expected_shapes as dflash_shapes
from draftline.drafts.dflash.model import init as init_dflash
from draftline.drafts.dspark.config import DSparkConfig

# ----------------------------------------------------------------------------- the heads


class MarkovHead(nn.Module):
    """vLLM's ``DSparkMarkovHead``: ``markov_w1`` embeds the previous token ``[V, r]``,
    ``markov_w2`` maps the embedding to a bias over the vocabulary (weight ``[V, r]``)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """vLLM's ``DSparkConfidenceHead``: one logit from the slot's state (and, with
    ``with_markov``, its Markov embedding), in float32 as vLLM computes it."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, states: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([states, markov_embed], dim=-1) if self.with_markov else states
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float())[..., 0]


# ----------------------------------------------------------------------------- the draft


class DSparkDraft(DFlashDraft):
    """``DFlashDraft`` (its forward gives the block states) with ``markov_head`` and
    ``confidence_head`` (None without ``enable_confidence_head``, as vLLM drops it)."""

    def __init__(self, cfg: DSparkConfig, embed_weight: torch.Tensor):
        super().__init__(cfg, embed_weight)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width, cfg.confidence_head_with_markov)

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev ``[...]`` token ids -> ``[..., r]``."""
        return self.markov_head.markov_w1(prev)

    def markov_bias(self, embed: torch.Tensor) -> torch.Tensor:
        """``[..., r]`` -> the bias ``[..., V]`` (vLLM's logits processor, logit_scale 1)."""
        return self.markov_head.markov_w2(embed)

    def slot_logits(self, states: torch.Tensor, lm_head: torch.Tensor,
                    prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask slots' biased logits given their previous tokens.

        states ``[..., B, H]`` (``forward``'s), lm_head ``[V, H]`` (the target's), prev
        ``[..., K]`` (slot j's previous token: the anchor for j = 1) -> (logits ``[..., K,
        V]`` float32, Markov embeddings ``[..., K, r]``)."""
        slots = states[..., 1:, :]  # [..., K, H]
        embed = self.markov_embed(prev).to(slots.dtype)  # [..., K, r]
        base = F.linear(slots, lm_head.to(slots.dtype))  # [..., K, V]
        return (base + self.markov_bias(embed)).float(), embed

    def confidence_logits(self, states: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """states ``[..., B, H]``, embed ``[..., K, r]`` (``slot_logits``') -> the mask slots'
        confidence logits ``[..., K]`` (sigmoid: the predicted acceptance)."""
        if self.confidence_head is None:
            raise ValueError("this DSpark draft has no confidence head "
                             "(train.draft.confidence_head: false)")
        return self.confidence_head(states[..., 1:, :], embed)

    def draft_greedy(self, states: torch.Tensor, lm_head: torch.Tensor,
                     anchor_tokens: torch.Tensor):
        """The block drafted as vLLM's ``DSparkSpeculator._sample_sequential`` drafts it at
        temperature 0: slot by slot, each biased by the token drafted before it.

        states ``[N, B, H]``, anchor_tokens ``[N]`` -> (tokens ``[N, K]``, biased logits
        ``[N, K, V]``, confidences ``[N, K]`` (None without a confidence head))."""
        prev = anchor_tokens
        slots = states[:, 1:]  # [N, K, H]
        base = F.linear(slots, lm_head.to(slots.dtype))  # [N, K, V]
        tokens, logits, embeds = [], [], []
        for j in range(slots.shape[1]):
            embed = self.markov_embed(prev).to(slots.dtype)  # [N, r]
            logit = (base[:, j] + self.markov_bias(embed)).float()  # [N, V]
            prev = logit.argmax(-1)
            tokens.append(prev)
            logits.append(logit)
            embeds.append(embed)
        embed = torch.stack(embeds, dim=1)  # [N, K, r]
        confidence = (torch.sigmoid(self.confidence_logits(states, embed))
                      if self.confidence_head is not None else None)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), confidence


def expected_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every exported tensor's shape (vLLM's names: no ``model.`` prefix): DFlash's, the
    Markov head's and (when enabled) the confidence head's."""
    shapes = dflash_shapes(cfg)
    shapes["markov_head.markov_w1.weight"] = (cfg.vocab_size, cfg.markov_rank)
    shapes["markov_head.markov_w2.weight"] = (cfg.vocab_size, cfg.markov_rank)
    if cfg.enable_confidence_head:
        width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def init(model: DSparkDraft, seed: int) -> None:
    """DFlash's init of the backbone, then the heads from a generator of their own (so the
    backbone of a DSpark draft is the DFlash draft of the same seed): ``markov_w1`` normal
    with std r^-1/2, ``markov_w2`` zero (the bias starts at nothing: an untrained DSpark draft
    drafts what its backbone drafts), the confidence projection Linear's default bound with a
    zero bias (confidence 1/2)."""
    init_dflash(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rank = model.cfg.markov_rank
    with torch.no_grad():
        w1 = model.markov_head.markov_w1.weight
        w1.copy_(torch.randn(w1.shape, generator=gen) / math.sqrt(rank))
        model.markov_head.markov_w2.weight.zero_()
        if model.confidence_head is not None:
            proj = model.confidence_head.proj
            bound = 1.0 / math.sqrt(proj.weight.shape[1])
            proj.weight.copy_(torch.empty(proj.weight.shape).uniform_(-bound, bound,
                                                                      generator=gen))
            proj.bias.zero_()

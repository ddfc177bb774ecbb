"""The hidden-state gate: do the captured final states give the target's own tokens?

A capture one layer off trains "fine" and serves badly (the wrong tensor still agrees with the
target most of the time), and in production no HF forward of the target exists to compare
with. But the dataset holds the target's own sampled answers: every generated token was drawn
by the serving engine from ``softmax(logits / T)`` restricted to its top-p nucleus. So the
target's head on the captured final state (``draftline.drafts.teacher.TargetHead``: the final
norm and lm_head) must put each generated token inside that nucleus (at T = 0: make it the argmax),
for all but the positions where bf16 numerics move the nucleus boundary; and at T > 0 the
tokens must be as likely under it as its own samples would be (a wrong tensor can still keep
most sampled tokens inside a wide nucleus, but assigns them lower probability: the excess
negative log-likelihood is its KL from the target's). The gate checks a spread sample of
generated positions before training, after extraction. It costs one lm_head pass over them.

It also checks that the captured layers are distinct layers: along the residual stream
(the embeddings, each aux layer by id, the final state) each state must differ from the one
before it as a layer's output does. The same tensor stored twice, or the embeddings stored for
a layer, is the other capture mistake that still trains.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

# Generated positions checked: spread over the samples given, enough for a tight fraction.
GATE_POSITIONS = 1024
# The captured head must put at least this fraction of the target's sampled tokens in its
# nucleus (T = 0: as its argmax). Right captures give about 1.0 (bf16 rounding at the boundary
# aside); on the toy a final state one layer early gives 0.80 at T = 0 but 0.949 at T = 0.7,
# where a wide nucleus keeps most tokens: the likelihood check below is the one that catches it.
MIN_AGREEMENT = 0.95
# At T > 0: the sampled tokens' mean negative log-likelihood under the captured head, less
# what its own samples would give, in nats. Right captures give 0 within noise (toy: -0.02 and
# 0.07); a final state one layer early 0.47-0.57. Refused above this and 3 standard errors.
MAX_EXCESS_NLL = 0.2
# Mean relative change ``|s_b - s_a| / |s_b|`` between consecutive captured states along the
# residual stream. On the toy one layer changes it by 0.30 (ids 4 -> 5), the embeddings to
# layer 2 by 1.0; the same tensor twice gives 0. Refused below this.
MIN_LAYER_CHANGE = 0.01


class HiddenStateGateError(ValueError):
    """The captured final states do not give the target's own tokens."""


def in_nucleus(logits, tokens, temperature: float, top_p: float):
    """``[N]`` bool: each token lies in the top-p nucleus of ``softmax(logits / T)`` (at T = 0:
    is the argmax). logits ``[N, V]`` fp32, tokens ``[N]``."""
    import torch

    if temperature == 0:
        return logits.argmax(-1) == tokens
    probs = torch.softmax(logits / temperature, dim=-1)  # [N, V]
    token_p = probs.gather(-1, tokens.unsqueeze(-1))  # [N, 1]
    # the mass of strictly more probable tokens: the nucleus keeps a token while it is < top_p
    above = (probs * (probs > token_p)).sum(-1)  # [N]
    return above < top_p


def gate_positions(samples: Iterable[dict], limit: int = GATE_POSITIONS):
    """(final states ``[N, Ht]``, the generated tokens they predict ``[N]``) over at most
    ``limit`` generated positions, spread over ``samples`` (each with ``final`` ``[T, Ht]``,
    ``input_ids`` ``[T]``, ``loss_mask`` ``[T]``): the state at j predicts token j + 1."""
    import torch

    states, tokens = [], []
    for sample in samples:
        mask = torch.as_tensor(sample["loss_mask"]).bool()
        rows = torch.nonzero(mask[1:]).squeeze(-1)  # j with token j + 1 generated
        states.append(torch.as_tensor(sample["final"])[rows])
        tokens.append(torch.as_tensor(sample["input_ids"])[rows + 1])
    if not states:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    states, tokens = torch.cat(states), torch.cat(tokens)
    if len(tokens) > limit:  # evenly spread: every part of the sample order is seen
        keep = torch.linspace(0, len(tokens) - 1, limit).long()
        states, tokens = states[keep], tokens[keep]
    return states, tokens


def excess_nll(logits, tokens, temperature: float, top_p: float) -> tuple[float, float]:
    """(mean, standard error) over positions of -log q(token) minus the same quantity's
    expectation under q's own nucleus-sampled distribution, q = softmax(logits / T): about 0
    when the tokens were sampled from q, the KL from their true distribution otherwise."""
    import torch

    logq = torch.log_softmax(logits / temperature, dim=-1)  # [N, V]
    probs = logq.exp()
    ranked, order = probs.sort(-1, descending=True)
    kept = (ranked.cumsum(-1) - ranked) < top_p  # the nucleus, in rank order
    nucleus = torch.zeros_like(kept).scatter(-1, order, kept)
    sampled = probs * nucleus
    sampled = sampled / sampled.sum(-1, keepdim=True)
    expected = -(sampled * logq).sum(-1)  # [N]
    observed = -logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N]
    excess = observed - expected
    return float(excess.mean()), float(excess.std() / max(1, len(excess)) ** 0.5)


def check_final_states(samples: Iterable[dict], head, temperature: float, top_p: float,
                       final_layer_id: int, origin: str) -> dict:
    """The gate (module docstring): the fraction of generated tokens the captured final
    states' head puts in the sampling nucleus, and at T > 0 their excess negative
    log-likelihood; raises HiddenStateGateError, naming the layer and the figures, below
    MIN_AGREEMENT or above MAX_EXCESS_NLL. ``head`` is a ``draftline.drafts.teacher.TargetHead``."""
    import torch

    states, tokens = gate_positions(samples)
    if len(tokens) == 0:
        return {"positions": 0, "agreement": None}
    with torch.no_grad():
        logits = head.full_logits(states)  # [N, V] fp32
    agreement = float(in_nucleus(logits, tokens, temperature, top_p).float().mean())
    report = {"positions": len(tokens), "agreement": round(agreement, 4),
              "temperature": temperature, "top_p": top_p, "minimum": MIN_AGREEMENT}
    rule = ("its argmax" if temperature == 0 else
            f"the top-{top_p:g} nucleus of softmax(logits / {temperature:g})")
    problems = []
    if agreement < MIN_AGREEMENT:
        problems.append(f"it puts {agreement:.1%} of {len(tokens)} generated tokens in {rule}, "
                        f"where the states the target sampled from put at least "
                        f"{MIN_AGREEMENT:.0%}")
    if temperature > 0:
        excess, error = excess_nll(logits, tokens, temperature, top_p)
        report.update(excess_nll=round(excess, 4), excess_nll_se=round(error, 4),
                      max_excess_nll=MAX_EXCESS_NLL)
        if excess > MAX_EXCESS_NLL and excess > 3 * error:
            problems.append(f"the generated tokens are {excess:.2f} nats (standard error "
                            f"{error:.2f}) less likely under it than its own samples would be "
                            f"(at most {MAX_EXCESS_NLL} allowed)")
    if problems:
        raise HiddenStateGateError(
            f"{origin}: the final hidden states (layer id {final_layer_id}) do not give the "
            f"target's own tokens under the target's head: {'; '.join(problems)}. The capture "
            "is wrong (a layer off, the state after the final norm, another model's states); "
            "training on it would not learn the served target")
    log.info("hidden-state gate: %s (final layer id %d)", report, final_layer_id)
    return report


def layer_changes(samples: Iterable[dict], embed, layer_ids: list[int], final_layer_id: int,
                  limit: int = GATE_POSITIONS) -> list[tuple[int, int, float]]:
    """``(id a, id b, mean relative change)`` for each consecutive pair of the residual stream's
    captured states, in depth order: the embeddings (id 0), the aux layers, the final state.
    Samples hold ``aux`` ``[T, n * H]`` (``layer_ids`` order), ``final`` and ``input_ids``."""
    import torch

    chain = {0: [], final_layer_id: []}
    for layer_id in layer_ids:
        chain[layer_id] = []
    for sample in samples:
        ids = torch.as_tensor(sample["input_ids"])
        chain[0].append(embed[ids].float())
        aux = torch.as_tensor(sample["aux"]).float()
        for j, layer_id in enumerate(layer_ids):
            chain[layer_id].append(aux.view(len(ids), len(layer_ids), -1)[:, j])
        chain[final_layer_id].append(torch.as_tensor(sample["final"]).float())
    if not chain[0]:
        return []
    states = {layer_id: torch.cat(parts)[:limit] for layer_id, parts in chain.items()}
    order = sorted(states)
    changes = []
    for a, b in zip(order[:-1], order[1:], strict=True):
        change = (states[b] - states[a]).norm(dim=-1) / states[b].norm(dim=-1).clamp_min(1e-6)
        changes.append((a, b, float(change.mean())))
    return changes


def check_layer_chain(samples: Iterable[dict], embed, layer_ids: list[int],
                      final_layer_id: int, origin: str) -> dict:
    """Each captured state differs from the one before it along the residual stream (module
    docstring); raises HiddenStateGateError naming both layer ids below MIN_LAYER_CHANGE."""
    changes = layer_changes(samples, embed, layer_ids, final_layer_id)
    same = [(a, b, change) for a, b, change in changes if change < MIN_LAYER_CHANGE]
    if same:
        pairs = "; ".join(f"layer id {b} differs from layer id {a} by {change:.4f}"
                          for a, b, change in same)
        raise HiddenStateGateError(
            f"{origin}: the captured states are not distinct layers (id 0: the embeddings): "
            f"{pairs} (mean relative change; a layer's output changes it by at least "
            f"{MIN_LAYER_CHANGE}). The capture stored one tensor for two layers")
    return {f"{a}->{b}": round(change, 4) for a, b, change in changes}


def gate_samples(samples: list[dict], target_dir, sampling: dict, origin: str,
                 layer_ids: list[int] | None = None) -> dict:
    """``check_final_states`` with the target's own head (its final norm and lm_head, read
    from its weights) and the sampling the answers were generated with (``temperature``,
    ``top_p``); then, given the aux ``layer_ids`` (samples with ``aux``),
    ``check_layer_chain`` with the target's embeddings."""
    import torch

    from draftline.core.target import load_target_tensors, read_target_config, text_config
    from draftline.drafts.teacher import TargetHead

    text = text_config(read_target_config(target_dir))
    weights = load_target_tensors(target_dir)
    vocab = weights["lm_head"].shape[0]
    head = TargetHead(weights["norm"].float(), weights["lm_head"].float(),
                      text.get("rms_norm_eps", 1e-6), torch.zeros(vocab, dtype=torch.long),
                      torch.ones(vocab, dtype=torch.bool))
    final_layer_id = int(text["num_hidden_layers"])
    report = check_final_states(samples, head, float(sampling["temperature"]),
                                float(sampling["top_p"]), final_layer_id, origin)
    if layer_ids:
        report["layer_change"] = check_layer_chain(samples, weights["embed"], list(layer_ids),
                                                   final_layer_id, origin)
        report["min_layer_change"] = MIN_LAYER_CHANGE
    return report

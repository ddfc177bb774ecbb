"""What a draft's predictions are worth served: per-step counts and metrics, the walk of
every answer as a temperature-0 server drafts it, and the simulated acceptance at T > 0
(greedy drafts accepted with the target's probability, probabilistic drafts by rejection
sampling). Every family's training reports through these.

Shape legend: B samples, T tokens, K draft steps, D draft vocab.
"""

from __future__ import annotations

import torch

COUNT_KEYS = ("valid", "loss_rows", "correct", "chain_eligible", "chain_correct", "kl_sum")


def metrics_from_counts(counts: torch.Tensor) -> dict:
    """Per-step accuracy, conditional accuracy, loss and simulated acceptance length.

    ``simulated_acceptance_length`` = 1 + sum_k prod_{j<=k} cond_accuracy_j, with the
    conditional accuracies counted along the target's greedy path (``ttt_loss``): the expected
    tokens per drafting round at temperature 0 (the bonus token plus accepted drafts), the
    same quantity as vLLM's 1 + accepted / drafts at T=0. It is a T=0 figure only: at T > 0
    vLLM accepts a greedy draft token with the target's probability of it, which is lower.
    ``..._by_num_drafts[n-1]`` stops after n drafts. It averages a round started at every
    answer position; a server starts one only after the previous round's accepted run, so
    hard positions start more of its rounds. Training's model selection, the model card and
    the benchmark's train-serve gap read the walked figure instead
    (:func:`walked_acceptance_counts`), which drafts the answers the way the server does;
    this one stays as a per-step figure for every training step, where no walk is made.
    """
    c = dict(zip(COUNT_KEYS, counts.double().tolist(), strict=True))

    def ratio(num, den):
        return [n / d if d else 0.0 for n, d in zip(num, den, strict=True)]

    accuracy = ratio(c["correct"], c["valid"])
    cond = ratio(c["chain_correct"], c["chain_eligible"])
    by_drafts, accept, joint = [], 1.0, 1.0
    for acc in cond:
        joint *= acc
        accept += joint
        by_drafts.append(accept)
    return {
        "accuracy": accuracy,
        "cond_accuracy": cond,
        "loss": ratio(c["kl_sum"], c["loss_rows"]),
        "valid_tokens": [int(v) for v in c["valid"]],
        "simulated_acceptance_length": accept,
        "simulated_acceptance_length_by_num_drafts": by_drafts,
        "simulated_acceptance_temperature": 0.0,
    }


WALK_KEYS = ("tokens", "rounds")
# The answer lengths at which the walk is reported too: a server asked for at most N tokens an
# answer (``max_tokens``, the deployment benchmark's ``bench.max_tokens``) drafts only their
# first N, and acceptance changes along an answer (on SmolLM2's eval answers of up to 1,024
# tokens: 1.66 over the first 128, 1.54 over whole answers).
WALK_HORIZONS = tuple(2 ** i for i in range(4, 16))  # 16 .. 32,768 tokens


def accepted_runs(step_logits: list[torch.Tensor], target_logp: torch.Tensor,
                  target_in_draft: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int: the accepted run of a temperature-0 round started at each row, up to
    K = ``len(step_logits)`` drafts (inputs as :func:`ttt_loss`'s).

    Row i of the unroll holds the target's state at position i and reads token i+1: it is
    the round whose bonus token (the last token the target emitted) sits at i+1. Its step k
    is the draft's k+1-th token of that round, the prediction of token i+2+k: the unroll
    feeds step k the state step k-1 produced at the same row and the answer's token i+1+k,
    which is the draft's own token k-1 wherever that token was right on an answer that
    follows the target's greedy choices (every answer generated at T = 0), as vLLM's
    proposer feeds it. Step k is accepted when the draft's argmax is the target's greedy
    token at that position given the answer's context (the target's argmax at row i+1+k,
    an argmax outside the draft vocab a miss) and token i+2+k is a generated one; the run
    is the number of steps accepted before the first that is not. Answers sampled at T > 0
    give the answer's context where the server would hold its own greedy one."""
    target_argmax = target_logp.argmax(-1)  # [B, T]
    length = loss_mask.shape[1]
    run = torch.zeros_like(loss_mask, dtype=torch.long)  # [B, T]
    alive = torch.ones_like(loss_mask, dtype=torch.bool)  # steps 0..k-1 all accepted
    for k, logits in enumerate(step_logits):
        rows = length - 2 - k
        if rows <= 0:
            break
        hit = ((logits[:, :rows].argmax(-1) == target_argmax[:, 1 + k:1 + k + rows])
               & target_in_draft[:, 1 + k:1 + k + rows].bool()
               & loss_mask[:, 2 + k:2 + k + rows].bool())  # [B, n]
        alive[:, :rows] &= hit
        alive[:, rows:] = False
        run += alive
    return run


def walk_rounds(runs: list[int], first: int, last: int, num_drafts: int) -> list[tuple[int, int]]:
    """(row, accepted) of each round of :func:`walk_answer`, in order."""
    rounds = []
    row = max(first - 1, 0)
    while row + 2 <= last:
        accepted = min(runs[row], num_drafts)
        rounds.append((row, accepted))
        row += accepted + 1
    return rounds


def walk_answer(runs: list[int], first: int, last: int, num_drafts: int) -> tuple[int, int]:
    """(tokens, rounds) of serving the answer at positions ``first..last`` (inclusive) of a
    sample with ``runs`` (:func:`accepted_runs`' row) the way vLLM does at temperature 0.

    The prefill emits the answer's first token; the first round is row ``first - 1`` (its
    bonus token is that first token). A round drafts ``num_drafts`` tokens, accepts its run
    a and emits a + 1 (the accepted drafts and the target's token after them), so the next
    round is row i + a + 1; positions inside an accepted run never start a round. Rounds
    continue while a token of the answer is left to emit (row i with i + 2 <= ``last``).
    Tokens are counted as vLLM's counters count them, 1 + accepted per round: a run that
    reaches the answer's end counts its bonus token, and drafts past the end (which the
    server may accept after the end-of-answer token) count as rejected."""
    rounds = walk_rounds(runs, first, last, num_drafts)
    return sum(accepted + 1 for _, accepted in rounds), len(rounds)


def answer_spans(mask: list[bool]) -> list[tuple[int, int]]:
    """The (first, last) positions of each run of generated tokens in one sample's mask."""
    spans, start = [], None
    for pos, generated in enumerate([*mask, False]):
        if generated and start is None:
            start = pos
        elif not generated and start is not None:
            spans.append((start, pos - 1))
            start = None
    return spans


def walked_acceptance_counts(step_logits: list[torch.Tensor], target_logp: torch.Tensor,
                             target_in_draft: torch.Tensor,
                             loss_mask: torch.Tensor) -> torch.Tensor:
    """``[len(WALK_KEYS), K]`` float64: tokens emitted and rounds of walking every answer of
    the batch as a temperature-0 server drafting n = 1..K tokens a round does
    (:func:`walk_answer` over :func:`accepted_runs`). Summed over batches and processes,
    tokens / rounds is the walked acceptance length (:func:`walked_acceptance_lengths`)."""
    runs = accepted_runs(step_logits, target_logp, target_in_draft, loss_mask)
    return walk_counts(runs, loss_mask, len(step_logits))


def empty_walk(max_drafts: int) -> torch.Tensor:
    """Zero walk counts, ``[1 + len(WALK_HORIZONS), len(WALK_KEYS), max_drafts]`` float64:
    row 0 walks whole answers, row 1 + h only their first ``WALK_HORIZONS[h]`` tokens."""
    return torch.zeros(1 + len(WALK_HORIZONS), len(WALK_KEYS), max_drafts, dtype=torch.float64)


def walk_counts(runs: torch.Tensor, loss_mask: torch.Tensor, max_drafts: int) -> torch.Tensor:
    """:func:`empty_walk`'s counts of :func:`walk_answer` over every answer of the batch with
    1..``max_drafts`` drafts a round; runs ``[B, T]`` as :func:`accepted_runs`' (the run of the
    round whose bonus token sits at row + 1), loss_mask ``[B, T]``. A server stopped at N
    tokens (positions first .. first + N - 1) runs the rounds at rows i <= first + N - 3, a
    prefix of the whole answer's rounds."""
    masks = loss_mask.bool().cpu().tolist()
    counts = empty_walk(max_drafts)
    for row_runs, mask in zip(runs.cpu().tolist(), masks, strict=True):
        for first, last in answer_spans(mask):
            for n in range(1, max_drafts + 1):
                rounds = walk_rounds(row_runs, first, last, n)
                for h, horizon in enumerate((None, *WALK_HORIZONS)):
                    kept = [a for row, a in rounds if horizon is None or row <= first + horizon - 3]
                    counts[h, 0, n - 1] += sum(kept) + len(kept)
                    counts[h, 1, n - 1] += len(kept)
    return counts


def walked_acceptance_lengths(counts: torch.Tensor) -> list[float]:
    """``[len(WALK_KEYS), K]`` walk counts -> tokens per round after 1..K drafts (0.0 where
    no answer had a round)."""
    tokens, rounds = counts.double().tolist()
    return [t / r if r else 0.0 for t, r in zip(tokens, rounds, strict=True)]


def walk_metrics(counts: torch.Tensor) -> dict:
    """An evaluation's walk figures from :func:`walk_counts`' (summed over its batches):
    ``walked_acceptance_length`` (whole answers, all K drafts), ``..._by_num_drafts`` (after
    1..K) and ``..._by_max_tokens`` (N -> after 1..K, whole answers cut at N tokens, for each
    N of ``WALK_HORIZONS`` that cuts some answer: beyond the longest it is the whole walk)."""
    by_drafts = walked_acceptance_lengths(counts[0])
    cut = {str(horizon): walked_acceptance_lengths(counts[1 + h])
           for h, horizon in enumerate(WALK_HORIZONS) if not torch.equal(counts[1 + h], counts[0])}
    return {"walked_acceptance_length": by_drafts[-1],
            "walked_acceptance_length_by_num_drafts": by_drafts,
            "walked_acceptance_length_by_max_tokens": cut}


def sampled_acceptance_counts(step_logits: list[torch.Tensor], target_logp_t: torch.Tensor,
                              input_ids: torch.Tensor, loss_mask: torch.Tensor,
                              draft_ids: torch.Tensor) -> torch.Tensor:
    """Per unroll step, what vLLM's rule gives a greedy draft at temperature T > 0: the draft's
    argmax token d is accepted with the target's probability of it at T. Step k of row i counts
    (is eligible) when the token it predicts is a generated one and the draft's tokens before
    it equal the data's, so that the data context is the server's context after accepting
    them. step_logits K x ``[B, T, D]``; target_logp_t ``[B, T, D]`` from
    :meth:`TargetHead.logp_at_temperature`; draft_ids ``[D]`` the target id of each draft id.
    Returns ``[2, K]`` float64: the summed acceptance probabilities and the eligible rows."""
    batch, length = loss_mask.shape
    chain = torch.ones(batch, length, dtype=torch.bool, device=loss_mask.device)  # [B, T]
    per_step = []
    for k, logits in enumerate(step_logits):
        rows = length - 2 - k
        if rows <= 0:
            per_step.append(torch.zeros(2, dtype=torch.float64, device=loss_mask.device))
            continue
        drafted = logits[:, :rows].argmax(-1)  # [B, n] draft ids
        p_accept = target_logp_t[:, 1 + k:1 + k + rows].gather(
            -1, drafted.unsqueeze(-1)).squeeze(-1).exp()  # [B, n]
        eligible = loss_mask[:, 2 + k:2 + k + rows].bool() & chain[:, :rows]
        per_step.append(torch.stack([(p_accept * eligible).sum().double(),
                                     eligible.sum().double()]))
        chain[:, :rows] = eligible & (draft_ids[drafted] == input_ids[:, 2 + k:2 + k + rows])
        chain[:, rows:] = False
    return torch.stack(per_step, dim=1).cpu()


def probabilistic_acceptance_counts(step_logits: list[torch.Tensor], target_logp_t: torch.Tensor,
                                    loss_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per unroll step, what vLLM's standard rejection sampling gives a draft that samples its
    token from q = softmax(draft logits / T) (``draft_sample_method: probabilistic``): token x
    is accepted with min(1, p(x) / q(x)), so a step accepts with probability
    sum_x min(p(x), q(x)), p the target's distribution at T. Step k of row i counts where the
    token it predicts and those before it in the round are generated ones: the draft's
    contexts along the target's own sampled answer (which the accepted tokens follow in
    distribution). step_logits K x ``[B, T, D]``; target_logp_t ``[B, T, D]`` from
    :meth:`TargetHead.logp_at_temperature`. Returns ``[2, K]`` float64 as
    :func:`sampled_acceptance_counts`."""
    batch, length = loss_mask.shape
    chain = torch.ones(batch, length, dtype=torch.bool, device=loss_mask.device)  # [B, T]
    per_step = []
    for k, logits in enumerate(step_logits):
        rows = length - 2 - k
        if rows <= 0:
            per_step.append(torch.zeros(2, dtype=torch.float64, device=loss_mask.device))
            continue
        q = torch.softmax(logits[:, :rows].float() / temperature, dim=-1)  # [B, n, D]
        p = target_logp_t[:, 1 + k:1 + k + rows].exp()  # [B, n, D]
        p_accept = torch.minimum(p, q).sum(-1)  # [B, n]
        eligible = loss_mask[:, 2 + k:2 + k + rows].bool() & chain[:, :rows]
        per_step.append(torch.stack([(p_accept * eligible).sum().double(),
                                     eligible.sum().double()]))
        chain[:, :rows] = eligible
        chain[:, rows:] = False
    return torch.stack(per_step, dim=1).cpu()


def acceptance_length_from(accept_counts: torch.Tensor) -> list[float]:
    """``[2, K]`` summed acceptance probabilities and eligible rows per step -> the expected
    tokens per drafting round after 1..K drafts: 1 + sum_k prod_{j<=k} a_j."""
    by_drafts, total, joint = [], 1.0, 1.0
    for accepted, eligible in accept_counts.double().t().tolist():
        joint *= accepted / eligible if eligible else 0.0
        total += joint
        by_drafts.append(total)
    return by_drafts

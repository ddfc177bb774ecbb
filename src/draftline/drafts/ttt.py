"""Training-time-test (TTT) attention: the attention of unroll step k, on the flash kernel.

Attention at step k: row i sees the step-0 keys/values of rows j <= i (the real context, as
in vLLM's draft KV cache) plus its own keys/values of steps 1..k (a diagonal). The diagonal
is computed as k extra scores per row and softmaxed jointly with the causal scores, never as
a dense [T, T*K] mask, so a step costs about what plain causal attention costs. The causal
part runs on the fused flash kernel and joins the diagonal through its log-sum-exp
(``FusedTTTAttention``; verified against the eager reference once per device and dtype).

Shape legend: B samples, T tokens, K unroll steps, nh heads, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ttt_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_diag: list[torch.Tensor],
    v_diag: list[torch.Tensor],
) -> torch.Tensor:
    """Attention of unroll step k = len(k_diag); all tensors ``[B, nh, T, hd]``.

    Row i attends to ``k_ctx[j]`` for j <= i (step 0, causal) and to ``k_diag[s][i]`` for each
    step 1 <= s <= k (the same row only). Uses the fused flash-kernel path where it is
    available and verified, else the reference below; both give the same values and grads.
    """
    if not k_diag:  # step 0: plain causal attention
        return F.scaled_dot_product_attention(q, k_ctx, v_ctx, is_causal=True)
    if fused_attention_ok(q):
        return FusedTTTAttention.apply(q, k_ctx, v_ctx, *k_diag, *v_diag)
    return ttt_attention_reference(q, k_ctx, v_ctx, k_diag, v_diag)


def ttt_attention_reference(q, k_ctx, v_ctx, k_diag, v_diag) -> torch.Tensor:
    """The definition: ``[B, nh, T, T]`` causal scores plus ``[B, nh, T, k]`` diagonal scores,
    one softmax over both. Materialises the [T, T] probabilities (eager attention)."""
    if not k_diag:
        return F.scaled_dot_product_attention(q, k_ctx, v_ctx, is_causal=True)
    length, steps = q.shape[-2], len(k_diag)
    scale = q.shape[-1] ** -0.5
    ctx_scores = torch.matmul(q, k_ctx.transpose(-1, -2)) * scale  # [B, nh, T, T]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # [T, T]
    ctx_scores = ctx_scores.masked_fill(~causal, float("-inf"))
    keys = torch.stack(k_diag, dim=-2)  # [B, nh, T, k, hd]
    values = torch.stack(v_diag, dim=-2)  # [B, nh, T, k, hd]
    diag_scores = (q.unsqueeze(-2) * keys).sum(-1) * scale  # [B, nh, T, k]
    scores = torch.cat([ctx_scores, diag_scores], dim=-1)  # [B, nh, T, T+k]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    p_ctx, p_diag = probs.split([length, steps], dim=-1)  # [B,nh,T,T], [B,nh,T,k]
    out = torch.matmul(p_ctx, v_ctx)  # [B, nh, T, hd]
    return out + (p_diag.unsqueeze(-1) * values).sum(-2)  # [B, nh, T, hd]


def _flash_forward(q, k, v, scale):
    """Causal flash attention: (out ``[B, nh, T, hd]``, logsumexp ``[B, nh, T]`` fp32, extras)."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True,
                                                                    scale=scale)
        return out, lse, ()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
        aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(grad_out, q, k, v, out, lse, extras, scale):
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = extras
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
        scale=scale)


class FusedTTTAttention(torch.autograd.Function):
    """TTT attention on the flash kernel: the causal part runs fused (no [T, T] tensor), the k
    diagonal scores join it through the log-sum-exp.

    Forward: (O_c, lse_c) = flash(q, K_c, V_c); s = scale * q . k_diag; L = logaddexp(lse_c,
    logsumexp(s)); O = exp(lse_c - L) O_c + sum_s exp(s - L) v_s. Backward: the flash backward
    called with the joint output O and joint L recomputes the joint probabilities of the
    context keys and the joint delta rowsum(dO * O), so it returns the exact gradients of the
    causal part; the diagonal part is [T, k] arithmetic.

    The diagonal keys and values come one tensor per step (``apply(q, k_ctx, v_ctx, k_1..k_s,
    v_1..v_s)``) and are saved as they are: every later step saves the same tensors again, so
    a K-step unroll keeps 2 (K - 1) of them, where stacking them per step would keep K (K - 1).
    """

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, *diag):
        # q, k_ctx, v_ctx [B, nh, T, hd]; diag: k_1..k_s, v_1..v_s, each [B, nh, T, hd]
        steps = len(diag) // 2
        k_diag, v_diag = diag[:steps], diag[steps:]
        scale = q.shape[-1] ** -0.5
        out_ctx, lse_ctx, extras = _flash_forward(q, k_ctx, v_ctx, scale)
        q32 = q.float()
        scores = torch.stack([(q32 * k.float()).sum(-1) for k in k_diag], dim=-1) * scale
        joint_lse = torch.logaddexp(lse_ctx, torch.logsumexp(scores, dim=-1))  # [B, nh, T]
        p_diag = torch.exp(scores - joint_lse.unsqueeze(-1))  # [B, nh, T, s]
        # In place from the flash output on, so that ``out`` keeps its memory layout (the
        # o_proj reshape is then a view, not a copy).
        out = torch.exp(lse_ctx - joint_lse).unsqueeze(-1) * out_ctx.float()  # [B, nh, T, hd]
        for i, v in enumerate(v_diag):
            out.addcmul_(p_diag[..., i:i + 1], v.float())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_ctx, v_ctx, out, joint_lse, p_diag, *diag)
        ctx.extras = extras  # CUDA only: sequence bookkeeping and (unused) dropout RNG state
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_ctx, v_ctx, out, joint_lse, p_diag, *diag = ctx.saved_tensors
        steps = len(diag) // 2
        k_diag, v_diag = diag[:steps], diag[steps:]
        grad_out = grad_out.contiguous()
        dq, dk_ctx, dv_ctx = _flash_backward(grad_out, q, k_ctx, v_ctx, out, joint_lse,
                                             ctx.extras, ctx.scale)
        g32 = grad_out.float()
        delta = (g32 * out.float()).sum(-1)  # [B, nh, T]
        q32, dq = q.float(), dq.float()
        dk, dv = [], []
        for i in range(steps):
            p = p_diag[..., i].unsqueeze(-1)  # [B, nh, T, 1]
            ds = p * ((g32 * v_diag[i].float()).sum(-1, keepdim=True)
                      - delta.unsqueeze(-1))  # [B, nh, T, 1] d(score)
            dq.addcmul_(ds, k_diag[i].float(), value=ctx.scale)
            dk.append((ctx.scale * ds * q32).to(k_diag[i].dtype))
            dv.append((p * g32).to(v_diag[i].dtype))
        return (dq.to(q.dtype), dk_ctx, dv_ctx, *dk, *dv)


_FUSED_OK: dict[tuple[str, torch.dtype, int], bool] = {}


def fused_attention_ok(q: torch.Tensor) -> bool:
    """Whether the fused path works here: checked once per (device, dtype, head_dim) against
    the reference on a small problem (values and gradients); any failure -> reference path."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _FUSED_OK:
        _FUSED_OK[key] = _check_fused(q.device, q.dtype, q.shape[-1])
    return _FUSED_OK[key]


def _check_fused(device, dtype, head_dim: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    shape = (1, 2, 37, head_dim)
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            tensors = [torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
                       for _ in range(7)]  # q, k0, v0, k1, v1, k2, v2
            got, *got_grads = _attention_and_grads(True, tensors)
            # The truth: the reference in fp32 from the same (rounded) inputs. In bf16 the
            # reference has the same rounding error as the fused path (each rounds its
            # [T, k] and [T, T] intermediates differently), so comparing the two against
            # each other would refuse a correct kernel.
            truth, *true_grads = _attention_and_grads(
                False, [t.detach().float().requires_grad_() for t in tensors])
        pairs = [(got, truth), *zip(got_grads, true_grads, strict=True)]
        return all(fused_error(a, b) <= fused_tolerance(dtype) for a, b in pairs)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def _attention_and_grads(fused: bool, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """TTT attention of step 2 (q, k0, v0, k1, v1, k2, v2) and the gradients of
    ``sum(out^2)`` with respect to all seven inputs."""
    q, k0, v0, k1, v1, k2, v2 = tensors
    if fused:
        out = FusedTTTAttention.apply(q, k0, v0, k1, k2, v1, v2)
    else:
        out = ttt_attention_reference(q, k0, v0, [k1, k2], [v1, v2])
    return [out, *torch.autograd.grad(out.float().square().sum(), tensors)]


def fused_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of the true tensor."""
    got, truth = got.detach().float(), truth.detach().float()
    return float((got - truth).abs().max() / truth.abs().max())


def fused_tolerance(dtype: torch.dtype) -> float:
    """What ``fused_error`` may reach: a few units of the dtype's rounding (bf16 rounds to
    2^-8 relative; its sums of up to 39 terms lose a few of those). A kernel that drops or
    misweights a term is off by O(1) on the early rows, where the diagonal holds most of
    the probability."""
    return 1e-5 if dtype == torch.float32 else 3e-2


class TTTCache:
    """Keys/values of one unroll: step 0 (the context) and the diagonal of steps 1..k."""

    def __init__(self):
        self.k_ctx: torch.Tensor | None = None  # [B, nh, T, hd]
        self.v_ctx: torch.Tensor | None = None
        self.k_diag: list[torch.Tensor] = []  # per step >= 1: [B, nh, T, hd]
        self.v_diag: list[torch.Tensor] = []

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k_ctx is None:
            self.k_ctx, self.v_ctx = k, v
        else:
            self.k_diag.append(k)
            self.v_diag.append(v)

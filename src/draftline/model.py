"""The EAGLE-3 draft model, its training-time-test (TTT) unroll, loss and metrics.

Kept whole (about 1,100 lines) on purpose, like nanoGPT's model.py. One file, top to bottom:
config, norms and rotary (Llama's and DeepSeek's), the attention with its TTT diagonal
(multi-head, and DeepSeek's latent attention), the decoder layer, the draft, the frozen target
head that makes the training targets, the loss and the simulated acceptance.

Layout and names follow vLLM's ``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``) so that the
state dict exports without renaming (``fc``, ``midlayer.*``, ``norm``, ``lm_head``):

    h0     = fc(aux)                                   aux = 3 target layers, concatenated
    x      = [input_layernorm(embed(token)), hidden_norm(h)]       -> attention input (2H)
    r      = h + self_attn(x)                          residual is the un-normed state h
    h_next = r + mlp(post_attention_layernorm(r))      "prenorm" state, fed to the next step
    logits = lm_head(norm(h_next))                     over the draft vocab

Four flags of vLLM's ``Eagle3LlamaForCausalLM`` change where norms sit (``DraftConfig``; the
exported config.json carries them): ``norm_before_fc`` normalises the concatenated aux states
before ``fc`` (``input_norm``, [A]); ``fc_norm`` (EAGLE-3.1) normalises each aux state on its
own (``fc_norm.{i}``, after ``input_norm`` where both are set); ``norm_before_residual``
makes the residual the normed state, r = hidden_norm(h) + self_attn(x); ``norm_output``
(EAGLE-3.1) feeds the next step norm(h_next) instead of the prenorm state.

Alignment (as vLLM's EAGLE proposer): row i of step 0 holds the target state at position i and
the token at i+1, sits at rotary position i, and predicts token i+2. Step k feeds row i its
own step k-1 state, the token at i+1+k, at rotary position i+k, and predicts token i+2+k.

The MLA draft (``arch`` "deepseek_mla"; vLLM's ``Eagle3DeepseekV3ForCausalLM``) is the same
layer with DeepSeek's multi-head latent attention in place of the Llama one (``DraftMLA``):
queries through a low-rank ``q_a_proj``/``q_b_proj``, keys and values from one compressed
latent (``kv_a_proj_with_mqa``, ``kv_b_proj``) plus a rotary part shared by all heads, rotated
GPT-J style (interleaved pairs) with DeepSeek's YaRN. It has no ``norm_before_fc``.

Parallel drafting (P-EAGLE, ``parallel_drafting``; vLLM's ``parallel_drafting`` speculative
setting): vLLM drafts all K tokens in one forward pass, appending K-1 mask slots after the last
real token, each with the token ``mask_token_id`` and the state ``fc(mask_hidden)`` (a trained
``[A]`` vector, combined like the aux states). Training is the same unroll with those constant
inputs at steps k >= 1: step k of row i is the mask slot at position i+k, and the TTT
attention below is exactly the causal attention of that appended sequence.

Attention at step k: row i sees the step-0 keys/values of rows j <= i (the real context, as
in vLLM's draft KV cache) plus its own keys/values of steps 1..k (a diagonal). The diagonal
is computed as k extra scores per row and softmaxed jointly with the causal scores, never as
a dense [T, T*K] mask, so a step costs about what plain causal attention costs. The causal
part runs on the fused flash kernel and joins the diagonal through its log-sum-exp
(``FusedTTTAttention``; verified against the eager reference once per device and dtype).

Samples are not packed into one row: a batch is ``[B, T]`` with each sample in its own row,
right-padded. Causal masking then keeps attention inside a sample (padding comes after the
real tokens, so no real row can see it) without any block-diagonal mask.

Shape legend: B samples, T tokens (padded), H draft hidden, Ht target hidden, A = 3*Ht aux
width, D draft vocab, V target vocab, K unroll steps, nh / nkv heads, hd head dim.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftline.core.target import NUM_AUX_LAYERS, rope_theta_of, text_config

# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    max_position_embeddings: int
    num_aux_hidden_states: int = NUM_AUX_LAYERS
    rope_scaling: dict | None = None  # None, or {"rope_type": "yarn", "factor", ...} as vLLM's
    # Norm placements vLLM's Eagle3LlamaForCausalLM serves (module docstring).
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # P-EAGLE (module docstring): mask slots instead of the draft's own tokens and states
    parallel_drafting: bool = False
    mask_token_id: int = 0
    # the attention: "llama" (multi-head, GQA) or "deepseek_mla" (DraftMLA, these sizes)
    arch: str = "llama"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    # The draft layer's own sizes, settable in config (train.draft); null keeps the target's.
    ARCHITECTURE_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                         "head_dim", "rope_theta", "rope_scaling")
    NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
    MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim")

    @classmethod
    def from_target(cls, target_config: dict, draft_vocab_size: int,
                    architecture: dict | None = None) -> DraftConfig:
        """Draft dimensions from the target's config.json (``text_config`` for multimodal),
        with the ``train.draft`` settings (``architecture``) where they are not null."""
        cfg = text_config(target_config)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        sizes = {
            "num_attention_heads": heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
            # MLA targets (DeepSeek-V3 family) have no plain head_dim: use H / heads.
            "head_dim": int(cfg.get("head_dim") or hidden // heads),
            "intermediate_size": int(cfg["intermediate_size"]),
            "rope_theta": rope_theta_of(cfg),
            "rope_scaling": None,
        }
        architecture = architecture or {}
        sizes.update({k: v for k, v in architecture.items()
                      if k in cls.ARCHITECTURE_KEYS and v is not None})
        check_architecture(sizes, architecture.get("arch", "llama"))
        flags = {k: bool(architecture.get(k, False)) for k in cls.NORM_FLAGS}
        if architecture.get("drafting") == "parallel":
            flags.update(parallel_drafting=True,
                         mask_token_id=mask_token_of(cfg, target_config,
                                                     architecture.get("mask_token_id")))
        if architecture.get("arch") == "deepseek_mla":
            flags.update(arch="deepseek_mla", **mla_sizes(cfg, architecture, flags))
        return cls(
            hidden_size=hidden,
            target_hidden_size=hidden,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            **{k: sizes[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                     "intermediate_size", "rope_scaling")},
            rope_theta=float(sizes["rope_theta"]),
            **flags,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DraftConfig:
        return cls(**data)


def mla_sizes(text_cfg: dict, architecture: dict, flags: dict) -> dict:
    """The MLA draft's sizes: train.draft's, else an MLA target's own (Kimi-K2.5, DeepSeek)."""
    sizes = {}
    for key in DraftConfig.MLA_KEYS:
        value = architecture.get(key)
        value = text_cfg.get(key) if value is None else value
        if not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"config key 'train.draft.{key}': the MLA draft (train.draft.arch deepseek_mla) "
                f"needs it, and the target has none: set it (a positive integer; vLLM cannot "
                f"load an MLA draft without q_lora_rank)")
        sizes[key] = value
    if sizes["qk_rope_head_dim"] % 2:
        raise ValueError("config key 'train.draft.qk_rope_head_dim': must be even (rotary)")
    if flags.get("norm_before_fc"):
        raise ValueError("config key 'train.draft.norm_before_fc': vLLM's "
                         "Eagle3DeepseekV3ForCausalLM has no norm before fc: set it to false "
                         "for train.draft.arch deepseek_mla")
    return sizes


def mask_token_of(text_cfg: dict, target_config: dict, configured: int | None) -> int:
    """The token of P-EAGLE's mask slots: the configured one, else the target's padding, end
    or first token (its embedding is the target's, frozen; ``mask_hidden`` is what learns)."""
    if configured is not None:
        chosen = int(configured)
    else:
        chosen = 0
        for key in ("pad_token_id", "eos_token_id"):
            value = text_cfg.get(key, target_config.get(key))
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int):
                chosen = value
                break
    vocab = int(text_cfg["vocab_size"])
    if not 0 <= chosen < vocab:
        raise ValueError(f"config key 'train.draft.mask_token_id': {chosen} is outside the "
                         f"target's vocabulary [0, {vocab})")
    return chosen


YARN_KEYS = frozenset({"rope_type", "factor", "original_max_position_embeddings", "beta_fast",
                       "beta_slow", "attention_factor", "truncate"})
# DeepSeek's YaRN (the MLA draft) also reads its two magnitudes; vLLM's Llama YaRN ignores them
DEEPSEEK_YARN_KEYS = YARN_KEYS | {"mscale", "mscale_all_dim"}


def check_architecture(sizes: dict, arch: str = "llama") -> None:
    """Refuse draft sizes that vLLM's Llama EAGLE-3 layer cannot take (keys of train.draft)."""
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"config key 'train.draft.num_key_value_heads': {kv_heads} does not "
                         f"divide num_attention_heads {heads}")
    if sizes["head_dim"] % 2:
        raise ValueError(f"config key 'train.draft.head_dim': {sizes['head_dim']} must be even "
                         "(rotary embedding)")
    scaling = sizes["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") != "yarn":
        raise ValueError("config key 'train.draft.rope_scaling': only rope_type 'yarn' is "
                         f"supported, got {scaling!r}")
    if scaling is not None and not {"factor", "original_max_position_embeddings"} <= set(
            scaling):
        raise ValueError("config key 'train.draft.rope_scaling': yarn needs 'factor' and "
                         "'original_max_position_embeddings'")
    supported = DEEPSEEK_YARN_KEYS if arch == "deepseek_mla" else YARN_KEYS
    unknown = set(scaling or {}) - supported
    if unknown:
        raise ValueError(f"config key 'train.draft.rope_scaling': unsupported keys "
                         f"{sorted(unknown)} (supported: {sorted(supported)})")




# ----------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Llama RMSNorm, normalised in fp32, scaled in the input dtype (as vLLM's)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  scaling: dict | None = None):
    """cos, sin ``[T, hd]`` for neox-style rotary: vLLM's Llama default, or its YaRN."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device,
                             dtype=torch.float32) / head_dim  # [hd/2]
    inv_freq = 1.0 / theta ** exponents  # [hd/2]
    magnitude = 1.0
    if scaling is not None:  # rope_type yarn (check_architecture)
        inv_freq, magnitude = yarn_frequencies(inv_freq, head_dim, theta, scaling)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
    return angles.cos() * magnitude, angles.sin() * magnitude


def yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float,
                     scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al.) as vLLM computes it: dimensions that turn fewer than ``beta_slow``
    times over the original context are interpolated by ``factor``, those that turn more than
    ``beta_fast`` times are kept, a linear ramp in between; cos and sin are scaled by
    ``0.1 ln(factor) + 1`` (or ``attention_factor``)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, device=inv_freq.device, dtype=torch.float32) - low)
            / (high - low)).clamp(0, 1)  # [hd/2]: 0 keeps, 1 interpolates
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    magnitude = scaling.get("attention_factor") or (
        0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq, float(magnitude)


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude ``0.1 * mscale * ln(factor) + 1`` (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_rotary_tables(positions: torch.Tensor, rope_dim: int, theta: float,
                           scaling: dict | None = None):
    """cos, sin ``[T, rope_dim/2]`` of DeepSeek's rotary (one angle per interleaved pair), and
    the factor its YaRN puts on the attention scores (vLLM's deepseek_yarn: the same
    frequencies as ``yarn_frequencies``, cos and sin scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), the scores by mscale(factor, mscale_all_dim)^2)."""
    exponents = torch.arange(0, rope_dim, 2, device=positions.device,
                             dtype=torch.float32) / rope_dim  # [R/2]
    inv_freq = 1.0 / theta ** exponents
    magnitude, score_gain = 1.0, 1.0
    if scaling is not None:
        inv_freq, _ = yarn_frequencies(inv_freq, rope_dim, theta, {**scaling, "truncate": True})
        factor = float(scaling["factor"])
        all_dim = yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0)))
        magnitude = yarn_mscale(factor, float(scaling.get("mscale", 1))) / all_dim
        score_gain = all_dim * all_dim
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    return angles.cos() * magnitude, angles.sin() * magnitude, score_gain


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., T, n, R]`` rotated pair by pair (GPT-J style: (x0, x1) -> (x0 c - x1 s,
    x1 c + x0 s)) by cos/sin ``[T, R/2]``."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [..., T, n, R/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, n, T, hd]`` rotated by cos/sin ``[T, hd]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, nkv, T, hd]`` -> ``[B, nkv*groups, T, hd]`` for grouped-query attention."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ----------------------------------------------------------------------------- TTT attention


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


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, hd]`` at ``positions`` (vLLM's Llama rotary, neox style)."""
        return rotary_tables(positions, self.head_dim, self.cfg.rope_theta,
                             self.cfg.rope_scaling)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: TTTCache) -> torch.Tensor:
        """x ``[B, T, 2H]`` -> ``[B, T, H]``; appends this step's keys/values to ``cache``."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # [B, n, T, hd]
        groups = self.heads // self.kv_heads
        cache.add(repeat_kv(k, groups), repeat_kv(v, groups))  # [B, nh, T, hd] each
        out = ttt_attention(q, cache.k_ctx, cache.v_ctx, cache.k_diag, cache.v_diag)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DraftMLA(nn.Module):
    """DeepSeek's multi-head latent attention as vLLM's ``DeepseekV2MLAAttention`` computes it,
    in its plain multi-head form (keys and values expanded from the latent by ``kv_b_proj``).
    Sizes: N heads, P = qk_nope_head_dim, R = qk_rope_head_dim, Vd = v_head_dim,
    Lq = q_lora_rank, Lkv = kv_lora_rank. The flash kernel wants one head size, so values are
    padded from Vd to P + R with zeros and the output cut back."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                            cfg.v_head_dim)
        width = 2 * cfg.hidden_size  # [embedding, state]
        self.q_a_proj = nn.Linear(width, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * (self.nope + self.rope),
                                  bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.heads * (self.nope + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, cfg.hidden_size, bias=False)
        self.score_gain = deepseek_rotary_tables(torch.zeros(1), 2, cfg.rope_theta,
                                                 cfg.rope_scaling)[2]

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, R/2]`` at ``positions`` (DeepSeek's interleaved rotary)."""
        cos, sin, _ = deepseek_rotary_tables(positions, self.rope, self.cfg.rope_theta,
                                             self.cfg.rope_scaling)
        return cos, sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: TTTCache) -> torch.Tensor:
        """x ``[B, T, 2H]`` -> ``[B, T, H]``; appends this step's keys/values to ``cache``."""
        batch, length, _ = x.shape
        heads, nope, rope = self.heads, self.nope, self.rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, length, heads, nope + rope)  # [B, T, N, P+R]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, length, heads, -1)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)  # [B, T, N, P], [B, T, N, Vd]
        q_rope = apply_rotary_interleaved(q[..., nope:], cos, sin)
        k_rope = apply_rotary_interleaved(k_rope.unsqueeze(2), cos, sin)  # [B, T, 1, R]
        # DeepSeek's YaRN scales the scores: folded into q (the kernels use 1/sqrt(P+R))
        q = torch.cat([q[..., :nope], q_rope], dim=-1) * self.score_gain
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        v = F.pad(v, (0, nope + rope - self.v_dim))  # [B, T, N, P+R]
        cache.add(k.transpose(1, 2), v.transpose(1, 2))  # [B, N, T, P+R] each
        out = ttt_attention(q.transpose(1, 2), cache.k_ctx, cache.v_ctx, cache.k_diag,
                            cache.v_diag)[..., :self.v_dim]  # [B, N, T, Vd]
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# Modules whose forward is a chain of pointwise ops around at most a few matmuls: compiled, each
# chain is one kernel, and the fp32 copies a norm saves for backward are not kept.
POINTWISE_MODULES = (RMSNorm, DraftMLP)


def compile_pointwise(model: nn.Module) -> int:
    """``torch.compile`` each norm and MLP of ``model`` in place (``train.compile``): dynamic
    shapes, so a new sample length does not recompile; parameter names and state dicts are
    unchanged. Returns how many modules were compiled."""
    modules = [mod for mod in model.modules() if isinstance(mod, POINTWISE_MODULES)]
    for mod in modules:
        mod.compile(dynamic=True)
    return len(modules)


class DraftDecoderLayer(nn.Module):
    """vLLM's EAGLE-3 first layer: attention over [embedding, state], residual = the state."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftMLA(cfg) if cfg.arch == "deepseek_mla" else DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: TTTCache) -> torch.Tensor:
        """embeds, hidden ``[B, T, H]`` -> prenorm state ``[B, T, H]``."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        hidden = residual + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# ----------------------------------------------------------------------------- the draft


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """Row i takes row i+n along dim 1; the last n rows get ``fill``. x ``[B, T, ...]``."""
    if n == 0:
        return x
    tail = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], tail], dim=1)


class Eagle3Draft(nn.Module):
    """The trainable draft plus the target's frozen input embedding.

    ``embed_tokens`` is a frozen parameter (not a buffer: DDP would broadcast a buffer every
    step) and is never saved or exported: vLLM shares the target's.
    """

    FROZEN = ("embed_tokens.weight",)

    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor,
                 lm_head_init: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)  # [V, H]
        aux_width = cfg.num_aux_hidden_states * cfg.target_hidden_size  # A
        if cfg.norm_before_fc:  # one norm over all aux states, [A]
            self.input_norm = RMSNorm(aux_width, cfg.rms_norm_eps)
        if cfg.fc_norm:  # one norm per aux state, [Ht] each
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                         for _ in range(cfg.num_aux_hidden_states))
        self.fc = nn.Linear(aux_width, cfg.hidden_size, bias=False)
        if cfg.parallel_drafting:  # the aux states of a mask slot (vLLM's mask_hidden), [A]
            self.mask_hidden = nn.Parameter(torch.randn(aux_width))
        self.midlayer = DraftDecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if lm_head_init is not None:  # the target's lm_head rows of the draft tokens
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_init)

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor,
                ttt_steps: int) -> list[torch.Tensor]:
        """aux ``[B, T, A]``, input_ids ``[B, T]`` -> K logits ``[B, T, D]`` (see module doc)."""
        length = input_ids.shape[1]
        positions = torch.arange(length + ttt_steps, device=input_ids.device)  # [T+K]
        cos_all, sin_all = self.midlayer.self_attn.rotary(positions)  # [T+K, ...]
        hidden = self.combine_aux(aux)  # [B, T, H]
        cache = TTTCache()
        logits = []
        for step in range(ttt_steps):
            if step and self.cfg.parallel_drafting:  # a mask slot: constant token and state
                tokens = torch.full_like(input_ids, self.cfg.mask_token_id)
                hidden = self.combine_aux(self.mask_hidden).to(hidden.dtype).expand_as(hidden)
            else:
                tokens = shift_left(input_ids, step + 1)  # [B, T]: row i -> token i+1+step
            embeds = self.embed_tokens(tokens).to(hidden.dtype)  # [B, T, H]
            cos = cos_all[step:step + length]  # positions shift by one per step, [T, ...]
            sin = sin_all[step:step + length]
            prenorm = self.midlayer(embeds, hidden, cos, sin, cache)  # [B, T, H]
            normed = self.norm(prenorm)
            logits.append(self.lm_head(normed))  # [B, T, D]
            hidden = normed if self.cfg.norm_output else prenorm  # the next step's state
        return logits

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux ``[B, T, A]`` -> the first state ``[B, T, H]`` (vLLM's combine_hidden_states)."""
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        if self.cfg.fc_norm:
            chunks = aux.chunk(self.cfg.num_aux_hidden_states, dim=-1)  # each [B, T, Ht]
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)],
                            dim=-1)
        return self.fc(aux)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k not in self.FROZEN}


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every trainable tensor of the draft and its shape (the exported names minus d2t/t2d)."""
    hidden, heads, kv, hd = (cfg.hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim)
    attn = "midlayer.self_attn."
    mlp = "midlayer.mlp."
    aux_width = cfg.num_aux_hidden_states * cfg.target_hidden_size
    norms = {"input_norm.weight": (aux_width,)} if cfg.norm_before_fc else {}
    norms.update({f"fc_norm.{i}.weight": (cfg.target_hidden_size,)
                  for i in range(cfg.num_aux_hidden_states)} if cfg.fc_norm else {})
    if cfg.parallel_drafting:
        norms["mask_hidden"] = (aux_width,)
    if cfg.arch == "deepseek_mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attention = {
            attn + "q_a_proj.weight": (cfg.q_lora_rank, 2 * hidden),
            attn + "q_a_layernorm.weight": (cfg.q_lora_rank,),
            attn + "q_b_proj.weight": (heads * qk, cfg.q_lora_rank),
            attn + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                                 2 * hidden),
            attn + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            attn + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                        cfg.kv_lora_rank),
            attn + "o_proj.weight": (hidden, heads * cfg.v_head_dim),
        }
    else:
        attention = {
            attn + "q_proj.weight": (heads * hd, 2 * hidden),
            attn + "k_proj.weight": (kv * hd, 2 * hidden),
            attn + "v_proj.weight": (kv * hd, 2 * hidden),
            attn + "o_proj.weight": (hidden, heads * hd),
        }
    return {
        **norms,
        "fc.weight": (hidden, aux_width),
        **attention,
        mlp + "gate_proj.weight": (cfg.intermediate_size, hidden),
        mlp + "up_proj.weight": (cfg.intermediate_size, hidden),
        mlp + "down_proj.weight": (hidden, cfg.intermediate_size),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (cfg.draft_vocab_size, hidden),
    }


# ----------------------------------------------------------------------------- targets


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


# ----------------------------------------------------------------------------- loss, metrics

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
COUNT_KEYS = ("valid", "loss_rows", "correct", "chain_eligible", "chain_correct", "kl_sum")


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
    tokens = rounds = 0
    row = max(first - 1, 0)
    while row + 2 <= last:
        accepted = min(runs[row], num_drafts)
        tokens += accepted + 1
        rounds += 1
        row += accepted + 1
    return tokens, rounds


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


def walk_counts(runs: torch.Tensor, loss_mask: torch.Tensor, max_drafts: int) -> torch.Tensor:
    """``[len(WALK_KEYS), max_drafts]`` float64: :func:`walk_answer` over every answer of the
    batch with 1..``max_drafts`` drafts a round; runs ``[B, T]`` as :func:`accepted_runs`'
    (the run of the round whose bonus token sits at row + 1), loss_mask ``[B, T]``."""
    masks = loss_mask.bool().cpu().tolist()
    counts = torch.zeros(len(WALK_KEYS), max_drafts, dtype=torch.float64)
    for row_runs, mask in zip(runs.cpu().tolist(), masks, strict=True):
        for first, last in answer_spans(mask):
            for n in range(1, max_drafts + 1):
                tokens, rounds = walk_answer(row_runs, first, last, n)
                counts[0, n - 1] += tokens
                counts[1, n - 1] += rounds
    return counts


def walked_acceptance_lengths(counts: torch.Tensor) -> list[float]:
    """``[len(WALK_KEYS), K]`` walk counts -> tokens per round after 1..K drafts (0.0 where
    no answer had a round)."""
    tokens, rounds = counts.double().tolist()
    return [t / r if r else 0.0 for t, r in zip(tokens, rounds, strict=True)]


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


def init_draft_weights(model: Eagle3Draft, seed: int) -> None:
    """Deterministic init of the trainable projections (norms stay at one, lm_head as given)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name == "mask_hidden":  # a state like the aux ones: unit scale per element
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen))
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) or name == "fc.weight":
            bound = 1.0 / math.sqrt(param.shape[1])
            with torch.no_grad():
                param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=gen))

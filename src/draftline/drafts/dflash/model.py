"""The DFlash draft: Qwen3 attention over [context ; own block], its layer, the draft, the
shapes it exports and its initialisation (the package docstring has the equations).

Shape legend: Bs samples, S tokens (padded), A anchors (blocks) per sample, B block size, H
hidden (the target's: the embedding and lm_head are shared), Ht target hidden, n captured
layers, V vocab, nh / nkv heads, hd head dim, L layers, K = B - 1 draft slots.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from draftline.drafts.dflash.config import DFlashConfig
from draftline.drafts.layers import (
    FROZEN,
    DraftMLP,
    RMSNorm,
    apply_rotary,
    repeat_kv,
    rotary_tables,
)


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q/k norms before rotary) over [context ; own block]."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
            cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def heads(self, proj: nn.Linear, x: torch.Tensor, n: int) -> torch.Tensor:
        """x ``[..., T, H]`` -> ``[..., n, T, hd]``."""
        out = proj(x).unflatten(-1, (n, self.hd))  # [..., T, n, hd]
        return out.transpose(-3, -2)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """ctx ``[Bs, S, H]`` at positions 0..S-1 -> keys, values ``[Bs, nh, S, hd]``."""
        k = apply_rotary(self.k_norm(self.heads(self.k_proj, ctx, self.nkv)), cos, sin)
        v = self.heads(self.v_proj, ctx, self.nkv)
        groups = self.nh // self.nkv
        return repeat_kv(k, groups), repeat_kv(v, groups)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """h ``[Bs, A, B, H]`` (normed block states), cos/sin ``[Bs, A, 1, B, hd]`` at the
        block positions, ctx_k/ctx_v ``[Bs, nh, S, hd]``, visible ``[Bs, A, S]`` (context
        position < anchor) -> ``[Bs, A, B, H]``."""
        q = apply_rotary(self.q_norm(self.heads(self.q_proj, h, self.nh)), cos, sin)
        k = apply_rotary(self.k_norm(self.heads(self.k_proj, h, self.nkv)), cos, sin)
        v = self.heads(self.v_proj, h, self.nkv)  # q [Bs, A, nh, B, hd]; k, v [.., nkv, ..]
        groups = self.nh // self.nkv
        k, v = repeat_kv(k.flatten(0, 1), groups), repeat_kv(v.flatten(0, 1), groups)
        k, v = k.unflatten(0, q.shape[:2]), v.unflatten(0, q.shape[:2])
        scale = self.hd ** -0.5
        to_ctx = torch.einsum("bahqd,bhsd->bahqs", q, ctx_k) * scale  # [Bs, A, nh, B, S]
        to_ctx = to_ctx.masked_fill(~visible[:, :, None, None, :], float("-inf"))
        to_block = torch.einsum("bahqd,bahkd->bahqk", q, k) * scale  # [Bs, A, nh, B, B]
        probs = torch.softmax(torch.cat([to_ctx, to_block], dim=-1).float(), dim=-1)
        probs = probs.to(q.dtype)
        context_len = ctx_k.shape[-2]
        out = (torch.einsum("bahqs,bhsd->bahqd", probs[..., :context_len], ctx_v)
               + torch.einsum("bahqk,bahkd->bahqd", probs[..., context_len:], v))
        return self.o_proj(out.transpose(-3, -2).flatten(-2))  # [Bs, A, B, H]


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, x, cos, sin, ctx, ctx_cos, ctx_sin, visible):
        ctx_k, ctx_v = self.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- the draft


class DFlashDraft(nn.Module):
    """The trainable DFlash layers plus the target's frozen embedding (its lm_head is the
    teacher's, ``TargetHead.lm_head``, applied by ``logits``)."""

    FROZEN = FROZEN  # the target's embedding, never saved (draftline.drafts.layers)

    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)  # [V, H]
        self.fc = nn.Linear(cfg.num_aux_hidden_states * cfg.target_hidden_size,
                            cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        for layer in self.layers[1:]:  # one k_norm for every layer (see the module docstring)
            layer.self_attn.k_norm = self.layers[0].self_attn.k_norm
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """aux ``[Bs, S, n*Ht]``, input_ids ``[Bs, S]``, anchors ``[Bs, A]`` (positions, each
        < S) -> the normed block states ``[Bs, A, B, H]``; slot j of block a reads token
        x_a (j = 0) or the mask token, and predicts the token at a + j."""
        cfg = self.cfg
        length = aux.shape[1]
        ctx = self.hidden_norm(self.fc(aux))  # [Bs, S, H]
        ctx_cos, ctx_sin = rotary_tables(torch.arange(length, device=aux.device),
                                         cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        offsets = torch.arange(cfg.block_size, device=aux.device)  # [B]
        positions = anchors[..., None] + offsets  # [Bs, A, B]
        cos, sin = rotary_tables(positions.flatten(), cfg.head_dim, cfg.rope_theta,
                                 cfg.rope_scaling)  # [Bs*A*B, hd]
        cos = cos.view(*positions.shape, -1)[:, :, None]  # [Bs, A, 1, B, hd]
        sin = sin.view(*positions.shape, -1)[:, :, None]
        tokens = torch.full_like(positions, cfg.mask_token_id)  # [Bs, A, B]
        tokens[..., 0] = input_ids.gather(1, anchors)
        x = self.embed_tokens(tokens).to(ctx.dtype)  # [Bs, A, B, H]
        visible = (torch.arange(length, device=aux.device)[None, None, :]
                   < anchors[..., None])  # [Bs, A, S]
        for layer in self.layers:
            x = layer(x, cos, sin, ctx, ctx_cos, ctx_sin, visible)
        return self.norm(x)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every layer's names, as vLLM loads them (the shared k_norm under each layer's)."""
        return {k: v for k, v in self.state_dict().items() if k not in self.FROZEN}


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every exported tensor's shape (vLLM's names: no ``model.`` prefix)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"fc.weight": (h, cfg.num_aux_hidden_states * cfg.target_hidden_size),
              "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    return shapes


def init(model: DFlashDraft, seed: int) -> None:
    """Deterministic init of the projections (Linear's default bound); norms stay at one."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("proj.weight") or name == "fc.weight":
            bound = 1.0 / math.sqrt(param.shape[1])
            with torch.no_grad():
                param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=gen))


# ----------------------------------------------------------------------------- training blocks

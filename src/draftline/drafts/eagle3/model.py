"""The EAGLE-3 draft: its attention (Llama's multi-head, DeepSeek's latent), the decoder
layer, the draft with its unroll, the shapes it exports and its initialisation (the package
docstring has the equations).

Shape legend: B samples, T tokens (padded), H draft hidden, Ht target hidden, A = 3*Ht aux
width, D draft vocab, V target vocab, K unroll steps, nh / nkv heads, hd head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftline.drafts.eagle3.config import DraftConfig
from draftline.drafts.layers import (
    FROZEN,
    DraftMLP,
    RMSNorm,
    apply_rotary,
    apply_rotary_interleaved,
    deepseek_rotary_tables,
    repeat_kv,
    rotary_tables,
    shift_left,
)
from draftline.drafts.ttt import TTTCache, ttt_attention


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



class Eagle3Draft(nn.Module):
    """The trainable draft plus the target's frozen input embedding.

    ``embed_tokens`` is a frozen parameter (not a buffer: DDP would broadcast a buffer every
    step) and is never saved or exported: vLLM shares the target's.
    """

    FROZEN = FROZEN  # the target's embedding, never saved (draftline.drafts.layers)

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


def init(model: Eagle3Draft, seed: int) -> None:
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

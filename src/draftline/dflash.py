"""The DFlash draft (block-diffusion drafting, arXiv 2602.06036): model, objective and metrics.

A DFlash draft proposes a whole block of tokens in one forward pass. Its inputs are the
target's captured states of every accepted position (the context) and one block: the last
accepted token followed by mask tokens. Every block token attends to the whole context and to
the whole block (no causal mask inside the block), so one pass fills every mask slot.

Layout and names follow vLLM's ``DFlashQwen3ForCausalLM`` (``qwen3_dflash.py``, served with
``"method": "dflash"``) so that the state dict exports without renaming (``fc``,
``hidden_norm``, ``layers.{i}.*``, ``norm``); the embedding and lm_head are the target's:

    ctx    = hidden_norm(fc(aux))                 aux = the captured target layers, concatenated
    x      = embed([x_a, MASK, ..., MASK])        one block of B tokens at positions a..a+B-1
    for each layer (Qwen3, pre-norm):
        h  = input_layernorm(x)
        q  = rope(q_norm(q_proj(h)))                               per head
        k  = [rope(k_norm(k_proj(ctx))) ; rope(k_norm(k_proj(h)))]   the context, then the block
        v  = [v_proj(ctx) ; v_proj(h)]
        x  = x + o_proj(attention(q, k, v))       the block sees context positions < a, and itself
        x  = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                     the target's lm_head, its full vocabulary

The context never passes through a layer's input norm or MLP: every layer projects the same
``ctx`` with its own ``k_proj``/``v_proj``. Its layers share one ``k_norm`` (exported under
every layer's name): vLLM norms all layers' context keys in one grouped RMSNorm whose CPU
kernel reads only the first layer's weight (tests/test_dflash.py), so a draft with one k_norm
is served the same by vLLM's CPU and GPU builds, and the toy's benchmark measures the draft
that was trained. Slot j >= 1 of a block anchored at a
predicts the token at a + j; vLLM serves ``num_speculative_tokens`` = B - 1 (the bonus token
then B - 1 masks).

Training (the paper's objective): for each sample, anchors a are drawn among the generated
positions (``train.anchors`` per sample and step; evaluation takes every one). Each anchor is one
block ``[x_a, MASK, ...]`` that sees the target's states of positions < a, as the server's
draft sees the accepted context. The loss is the cross entropy of slot j against the answer's
token at a + j, weighted by ``train.loss_decay`` ** (j - 1) (the paper's exp(-(j-1)/gamma)),
over slots whose token is a generated one. All of a sample's blocks run in one pass: the
attention below scores each block against the context ``[A, B, S]`` and against its own block
``[A, B, B]``, never against the other blocks.

Shape legend: Bs samples, S tokens (padded), A anchors (blocks) per sample, B block size, H
hidden (the target's: the embedding and lm_head are shared), Ht target hidden, n captured
layers, V vocab, nh / nkv heads, hd head dim, L layers, K = B - 1 draft slots.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftline.core.target import NUM_AUX_LAYERS
from draftline.model import (
    COUNT_KEYS,
    DraftConfig,
    DraftMLP,
    RMSNorm,
    apply_rotary,
    mask_token_of,
    repeat_kv,
    rotary_tables,
)

# ----------------------------------------------------------------------------- config

# train.draft.num_layers null: the toy's simulated acceptance with 1, 2 and 3 layers was 1.23,
# 2.48 and 2.65 (one layer cannot carry the anchor token to the mask slots and attend to the
# context too)
DEFAULT_LAYERS = 3


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    block_size: int
    mask_token_id: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    rope_scaling: dict | None = None
    num_aux_hidden_states: int = NUM_AUX_LAYERS
    drafting: str = "dflash"  # what the saved config says it is (export reads it)

    @classmethod
    def from_target(cls, target_config: dict, architecture: dict) -> DFlashConfig:
        """The layer sizes as the Llama draft takes them from the target and ``train.draft``
        (``DraftConfig.from_target``: the same checks), plus DFlash's own keys."""
        from draftline.core.target import text_config

        text = text_config(target_config)
        sizes = {k: v for k, v in architecture.items() if k in DraftConfig.ARCHITECTURE_KEYS}
        base = DraftConfig.from_target(target_config, int(text["vocab_size"]), sizes)
        return cls(
            hidden_size=base.hidden_size, target_hidden_size=base.target_hidden_size,
            intermediate_size=base.intermediate_size,
            num_attention_heads=base.num_attention_heads,
            num_key_value_heads=base.num_key_value_heads, head_dim=base.head_dim,
            num_layers=int(architecture.get("num_layers") or DEFAULT_LAYERS),
            block_size=int(architecture.get("block_size") or 16),
            mask_token_id=mask_token_of(text, target_config, architecture.get("mask_token_id")),
            rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta,
            rope_scaling=base.rope_scaling, vocab_size=base.vocab_size,
            max_position_embeddings=base.max_position_embeddings)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DFlashConfig:
        return cls(**data)


def is_dflash(saved_config: dict) -> bool:
    """A saved draft config (``best/draft_config.json``) of a DFlash draft."""
    return saved_config.get("drafting") == "dflash"


# ----------------------------------------------------------------------------- the layer


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

    FROZEN = ("embed_tokens.weight",)

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


def init_dflash_weights(model: DFlashDraft, seed: int) -> None:
    """Deterministic init of the projections (Linear's default bound); norms stay at one."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("proj.weight") or name == "fc.weight":
            bound = 1.0 / math.sqrt(param.shape[1])
            with torch.no_grad():
                param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=gen))


# ----------------------------------------------------------------------------- training blocks


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[Bs, S]`` bool: positions a that may anchor a block. x_a is a generated token (the
    server anchors every block at its bonus token) with a generated token after it."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    return ok


def sample_anchors(loss_mask: torch.Tensor, per_sample: int | None,
                   generator: torch.Generator | None = None):
    """(anchors ``[Bs, A]`` long, valid ``[Bs, A]`` bool): up to ``per_sample`` candidates
    of each sample drawn without replacement (None: all of them, in order), padded with
    position 0 (not valid)."""
    candidates = anchor_candidates(loss_mask)
    chosen = []
    for row in candidates:
        positions = row.nonzero().flatten()
        if per_sample is not None and positions.numel() > per_sample:
            pick = torch.randperm(positions.numel(), generator=generator)[:per_sample]
            positions = positions[pick.to(positions.device)].sort().values
        chosen.append(positions)
    width = max(1, max(p.numel() for p in chosen))
    anchors = torch.zeros(len(chosen), width, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(len(chosen), width, dtype=torch.bool, device=loss_mask.device)
    for i, positions in enumerate(chosen):
        anchors[i, :positions.numel()] = positions
        valid[i, :positions.numel()] = True
    return anchors, valid


def block_loss(states: torch.Tensor, lm_head: torch.Tensor, input_ids: torch.Tensor,
               loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
               target_argmax: torch.Tensor, decay: float, with_runs: bool = False):
    """The DFlash objective and the acceptance counts of its blocks.

    states ``[Bs, A, B, H]`` (``DFlashDraft``'s), lm_head ``[V, H]`` (the target's),
    input_ids/loss_mask ``[Bs, S]``, anchors/valid ``[Bs, A]``, target_argmax ``[Bs, S]``
    (the target's choice of the token after each position). Slot j >= 1 is scored against
    the answer's token at a + j when that is a generated one: cross entropy weighted by
    ``decay`` ** (j - 1), averaged over the weights.

    Counts (``[len(COUNT_KEYS), K]``, as ``draftline.model.ttt_loss``'s, so that
    ``metrics_from_counts`` reads both): slot j is correct when the draft's argmax is the
    target's; the chain follows one served round at temperature 0: slot j is eligible when
    slots 1..j-1 were correct and the answer up to a + j - 1 is the target's greedy path
    (the context the server would hold).

    ``with_runs`` adds a third result, ``[Bs, A]``: the accepted run of the round anchored at
    each anchor (slots right in order from slot 1, up to the first that is not or that falls
    past the answer), what ``draftline.model.walk_counts`` walks."""
    length = input_ids.shape[1]
    block = states.shape[2]
    on_path = torch.zeros_like(loss_mask, dtype=torch.bool)  # token p is argmax at p - 1
    on_path[:, 1:] = input_ids[:, 1:] == target_argmax[:, :-1]
    chain = valid & on_path.gather(1, anchors)  # [Bs, A]: the anchor is the bonus token
    loss_sum = states.new_zeros((), dtype=torch.float32)
    weight_sum = states.new_zeros((), dtype=torch.float32)
    per_slot = []
    alive = valid.clone()  # slots 1..j-1 of the block all right
    runs = torch.zeros_like(anchors)
    for j in range(1, block):
        where = (anchors + j).clamp(max=length - 1)  # [Bs, A]
        scored = valid & (anchors + j < length) & loss_mask.gather(1, where).bool()
        labels = input_ids.gather(1, where)  # [Bs, A]
        logits = F.linear(states[:, :, j], lm_head.to(states.dtype)).float()  # [Bs, A, V]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        ce = ce.view_as(labels) * scored
        weight = decay ** (j - 1)
        loss_sum = loss_sum + weight * ce.sum()
        weight_sum = weight_sum + weight * scored.sum()
        correct = scored & (logits.argmax(-1) == target_argmax.gather(1, where - 1))
        eligible = scored & chain
        chain = eligible & correct & on_path.gather(1, where)
        alive = alive & correct
        runs = runs + alive
        stats = (scored.sum(), scored.sum(), correct.sum(), eligible.sum(),
                 (eligible & correct).sum(), ce.detach().sum())
        per_slot.append(torch.stack([s.double() for s in stats]))
    counts = torch.stack(per_slot, dim=1).cpu()  # [len(COUNT_KEYS), K]
    assert counts.shape[0] == len(COUNT_KEYS)
    loss = loss_sum / weight_sum.clamp(min=1)
    return (loss, counts, runs) if with_runs else (loss, counts)

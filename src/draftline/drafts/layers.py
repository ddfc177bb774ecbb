"""What every draft family's layers are made of: vLLM's RMSNorm, the two rotary schemes
(Llama's neox-style with its YaRN, DeepSeek's interleaved with its own YaRN), grouped-query
key/value repetition, the gated MLP, the compiled pointwise modules and the row shift of an
unroll.

Shape legend: B samples, T tokens, H hidden, n heads, hd head dim, R rotary dims (DeepSeek).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The target's input embedding: every draft holds it frozen (a parameter, not a buffer: DDP would
# broadcast a buffer every step) and never saves or exports it (vLLM shares the target's).
FROZEN = ("embed_tokens.weight",)


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


class DraftMLP(nn.Module):
    """The gated MLP (SiLU) of every family's layer; ``cfg`` has hidden_size and
    intermediate_size."""

    def __init__(self, cfg):
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


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """Row i takes row i+n along dim 1; the last n rows get ``fill``. x ``[B, T, ...]``."""
    if n == 0:
        return x
    tail = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], tail], dim=1)

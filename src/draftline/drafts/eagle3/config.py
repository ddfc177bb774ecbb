"""The EAGLE-3 draft's configuration: its sizes from the target and ``train.draft``, the
MLA sizes, P-EAGLE's mask token and the checks of what vLLM's layers can take.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from draftline.core.target import NUM_AUX_LAYERS, rope_theta_of, text_config


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

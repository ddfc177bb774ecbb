"""The DFlash draft's configuration: the Llama draft's layer sizes from the target and
``train.draft``, plus its layers, block size and mask token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from draftline.core.target import NUM_AUX_LAYERS
from draftline.drafts.dflash.family import DEFAULT_LAYERS
from draftline.drafts.eagle3.config import DraftConfig, mask_token_of


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


def with_live_mask_token(cfg: DFlashConfig, embed, configured: int | None) -> DFlashConfig:
    """``cfg`` with a mask token whose embedding (the target's, frozen; ``embed`` ``[V, H]``) is
    not all zeros.

    Every mask slot of a block starts from that row. A row of zeros stays zero through the
    first layer's RMSNorm and its projections (no bias), so the slots' queries, keys and values
    are zero whatever their positions, every mask slot attends alike, and a 1-layer draft
    drafts one token in all of them (the toy's padding token 0 has such a row: its 1-layer
    draft walked 1.27 with it, 2.29 with token 1). A configured token with a zero row is
    refused, naming the key; the default (``mask_token_of``) gives way to the highest token id
    whose row is not zero."""
    live = embed.detach().float().abs().sum(-1) > 0  # [V]
    if bool(live[cfg.mask_token_id]):
        return cfg
    if configured is not None:
        raise ValueError(f"config key 'train.draft.mask_token_id': token {configured}'s "
                         "embedding in the target is all zeros, so every mask slot of a "
                         "block would compute the same state; choose a token whose embedding "
                         "is not zero (or leave the key unset)")
    if not bool(live.any()):
        raise ValueError("the target's embedding is all zeros: no token can be the mask token")
    return replace(cfg, mask_token_id=int(live.nonzero().max()))

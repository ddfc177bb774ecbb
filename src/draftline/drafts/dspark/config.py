"""The DSpark draft's configuration: DFlash's (``DFlashConfig``: the backbone's sizes, layers,
block size and mask token) plus what vLLM's ``Qwen3DSparkModel`` reads of its heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftline.drafts.dflash.config import DFlashConfig
from draftline.drafts.dspark.family import DEFAULT_MARKOV_RANK


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlash's sizes plus ``markov_rank``, ``enable_confidence_head`` and
    ``confidence_head_with_markov`` (config.json keys of the same names)."""

    markov_rank: int = DEFAULT_MARKOV_RANK
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    drafting: str = "dspark"

    @classmethod
    def from_target(cls, target_config: dict, architecture: dict) -> DSparkConfig:
        """DFlash's sizes (``DFlashConfig.from_target``: the same checks and defaults) plus
        ``train.draft``'s ``markov_rank``, ``confidence_head`` and
        ``confidence_head_with_markov`` (null: the defaults above)."""
        architecture = architecture or {}
        base = DFlashConfig.from_target(target_config, architecture)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DFlashConfig)}
        rank = int(architecture.get("markov_rank") or DEFAULT_MARKOV_RANK)
        if rank < 1:
            raise ValueError(f"config key 'train.draft.markov_rank': {rank} must be >= 1")
        flags = {key: architecture.get(name) for key, name in (
            ("enable_confidence_head", "confidence_head"),
            ("confidence_head_with_markov", "confidence_head_with_markov"))}
        flags = {key: bool(value) for key, value in flags.items() if value is not None}
        return cls(**{**fields, "drafting": "dspark"}, markov_rank=rank, **flags)

    @classmethod
    def from_dict(cls, data: dict) -> DSparkConfig:
        return cls(**data)

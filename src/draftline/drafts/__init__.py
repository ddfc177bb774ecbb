"""The draft families draftline trains, one folder each, and what they share.

Reading order: ``registry`` (which family a ``train.draft`` or a saved or exported config is,
and everything the rest of draftline asks of a family), then the shared modules ``layers``
(norms, rotary, MLP), ``ttt`` (the TTT attention of an unrolled draft), ``teacher`` (the
frozen target head), ``losses`` and ``acceptance`` (what a draft's predictions are worth
served), then one folder per family: ``eagle3/`` (EAGLE-3, EAGLE-3.1, the MLA draft and
P-EAGLE), ``dflash/`` and ``dspark/`` (DFlash's backbone and two heads). Each folder has
``family`` (its facts and config checks, standard library only), ``config``, ``model``,
``train`` and ``export``.

Names are re-exported here lazily (``from draftline.drafts import TargetHead``): importing the
package, or its standard-library ``registry``, does not import torch.
"""

from __future__ import annotations

import importlib

# module (under this package) -> the names it defines. Not the modules' full names: a string
# naming a module puts it in the code of every stage importing this package
# (draftline.core.codehash), and the stages that need a family's torch modules reach them
# through the registry.
_EXPORTS = {
    "layers": (
        "FROZEN", "RMSNorm", "DraftMLP", "rotary_tables", "yarn_frequencies", "yarn_mscale",
        "deepseek_rotary_tables", "apply_rotary", "apply_rotary_interleaved", "repeat_kv",
        "compile_pointwise", "shift_left"),
    "ttt": (
        "ttt_attention", "ttt_attention_reference", "FusedTTTAttention", "fused_attention_ok",
        "fused_error", "fused_tolerance", "TTTCache"),
    "teacher": ("TargetHead", "on_greedy_path", "teacher_at_temperature"),
    "losses": ("DraftKL", "DraftLK", "LOSSES"),
    "acceptance": (
        "COUNT_KEYS", "WALK_KEYS", "WALK_HORIZONS", "metrics_from_counts", "accepted_runs",
        "walk_answer", "walk_rounds", "empty_walk", "walk_metrics",
        "answer_spans", "walked_acceptance_counts", "walk_counts", "walked_acceptance_lengths",
        "sampled_acceptance_counts", "probabilistic_acceptance_counts",
        "acceptance_length_from"),
    "eagle3.config": ("DraftConfig", "mla_sizes", "mask_token_of", "check_architecture"),
    "eagle3.model": ("Eagle3Draft", "expected_shapes"),
    "eagle3.train": ("ttt_loss",),
    "dflash.config": ("DFlashConfig",),
    "dflash.model": ("DFlashDraft",),
    "dspark.config": ("DSparkConfig",),
    "dspark.model": ("DSparkDraft",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'draftline.drafts' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)

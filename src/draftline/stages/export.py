"""Export trained draft weights as a checkpoint that vLLM (and, for some families, SGLang)
loads: the draft's family (``draftline.drafts.registry``, by the ``draft_config.json`` beside
the weights) writes it. The formats are in docs/formats.md and in each family's ``export``
module (``draftline.drafts.eagle3.export``, ``draftline.drafts.dflash.export``).

Every tensor is checked against the shapes the config implies before anything is written;
a missing, mis-shaped, unexpected or non-finite tensor refuses the export.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline.core.target import read_teacher_config, text_config
from draftline.drafts import registry
from draftline.drafts.checkpoint import DRAFT_CONFIG_FILE, WEIGHTS_FILE, ExportError
from draftline.stages.hidden.layers import LayerIdError, check_layer_ids

__all__ = ["ExportError", "draft_layer_ids", "export_draft"]


def _weights_file(best_weights: Path) -> Path:
    path = Path(best_weights)
    path = path / WEIGHTS_FILE if path.is_dir() else path
    if not path.exists():
        raise ExportError(f"draft weights not found: {path}")
    return path


def draft_layer_ids(layer_ids, target_cfg: dict) -> list[int]:
    """The aux ids vLLM will capture for this draft, checked as extraction checked them."""
    num_layers = int(text_config(target_cfg)["num_hidden_layers"])
    try:
        return check_layer_ids(layer_ids, num_layers, target_cfg, source="layer_ids")
    except LayerIdError as exc:
        raise ExportError(str(exc)) from exc


def export_draft(best_weights, target_dir, vocab_map, layer_ids, out_dir) -> Path:
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors``; return ``out_dir``.

    ``best_weights`` is the training's ``best/`` dir (or its model.safetensors); ``layer_ids``
    the aux layer ids used in extraction. The checkpoint is assembled next to ``out_dir`` and
    renamed into place, so a refused or interrupted export leaves no partial directory.
    """
    weights_file = _weights_file(Path(best_weights))
    target_cfg = read_teacher_config(Path(target_dir))
    saved = weights_file.parent / DRAFT_CONFIG_FILE
    family = registry.of_config(json.loads(saved.read_text()) if saved.exists() else {})
    ids = draft_layer_ids(layer_ids, target_cfg)
    return registry.hook(family, "export")(weights_file, target_cfg, vocab_map, ids,
                                           Path(out_dir))

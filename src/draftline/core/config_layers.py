"""Which settings a run uses: the config files layered in one order, for the CLI and Snakemake.

A run's configuration is, lowest layer first:

1. the schema's defaults (``config.schema.yaml``): settings for a real model on real hardware;
2. the settings of a built-in target, when ``target.model`` names one that has them
   (``data/<target>/config.yaml``): the toy's demo settings (short answers, a small draft
   vocabulary, a quick sweep) apply to the toy and to nothing else;
3. the workflow's default file, ``config/config.yaml`` (Snakemake's ``configfile:``);
4. the files the user gives (``--configfile`` / ``draftline --config``), in their order;
5. single keys (``draftline --set KEY=VALUE``, Snakemake's ``--config KEY=VALUE``).

A mapping is merged key by key; any other value (a list included) replaces the lower one.
Snakemake merges layers 3-5 itself and hands the Snakefile the result, so layer 2 is put under
the merged dict (``with_target_settings``); the CLI merges layers 3-5 with ``merge`` and then
does the same. The schema's defaults fill what is still missing when the config is validated.

Standard library and PyYAML only (a Snakemake dependency): the Snakefile loads this file by its
path, before the draftline package could be imported.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

# Folder of the package's data: data/<target>/config.yaml holds a built-in target's settings.
DATA_DIR = Path(__file__).parents[1] / "data"
# The schema's default target, for a config that names none.
DEFAULT_TARGET = "toy"


def merge(lower: dict, upper: dict) -> dict:
    """``upper`` over ``lower``: mappings merged key by key, anything else replaced (a copy)."""
    merged = copy.deepcopy(lower)
    for key, value in upper.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def target_settings_file(model: str) -> Path | None:
    """The settings file of a built-in target (``toy``); None for any other model."""
    if not isinstance(model, str) or "/" in model or model.startswith("."):
        return None  # a folder or a hub id: the user's own target
    path = DATA_DIR / model / "config.yaml"
    return path if path.is_file() else None


def target_settings(model: str) -> dict[str, Any]:
    """What a built-in target sets under every config file; empty for the user's own model."""
    path = target_settings_file(model)
    if path is None:
        return {}
    return yaml.safe_load(path.read_text()) or {}


def with_target_settings(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (layers 3-5, merged) over its target's settings (layer 2)."""
    model = (config.get("target") or {}).get("model", DEFAULT_TARGET)
    return merge(target_settings(model), config)

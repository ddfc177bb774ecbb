"""Draft variants: further drafts trained in the same run (``train.variants``).

A variant is ``train.draft`` with some keys changed (``{name: p-eagle, draft: {drafting:
parallel}}``): the same training loop, the same states and every other ``train`` key. Each
lives in its own folder (``draftline.core.layout.Layout.variant``), is exported the same way
and is benchmarked beside the main draft as ``{name}-k{n}``, so one run says which family to
serve at which concurrency.

Standard library only: ``rules/common.smk`` and ``draftline.core.config_check`` load this
file by its path.
"""

from __future__ import annotations

import copy

# Names a variant cannot take: the benchmark's configurations are named after them.
RESERVED_NAMES = ("baseline", "eagle3")


def main_train(train: dict) -> dict:
    """The main draft's training config: ``train`` without the variants, so adding a variant
    leaves the main draft's training valid."""
    return {key: value for key, value in train.items() if key != "variants"}


def variant_train(train: dict, name: str) -> dict:
    """The training config of variant ``name``: the main one with its draft keys changed."""
    entry = next((v for v in train["variants"] if v["name"] == name), None)
    if entry is None:
        raise KeyError(f"config key 'train.variants': no variant named {name!r}")
    out = copy.deepcopy(main_train(train))
    out["draft"] = {**out["draft"], **entry["draft"]}
    return out


def variant_names(train: dict) -> list[str]:
    return [v["name"] for v in train.get("variants") or []]


def drafts(train: dict) -> list[tuple[str, dict]]:
    """(config key, resolved draft) of the main draft and of every variant, for the checks
    that hold for each."""
    return [("train.draft", train["draft"])] + [
        (f"train.variants[{i}].draft", variant_train(train, v["name"])["draft"])
        for i, v in enumerate(train.get("variants") or [])]

"""Further drafts benchmarked beside the trained one (``bench.compare_drafts``).

A user training a draft for a target that already has a public one wants to know which to
serve. Each further draft is a local folder or a hub id in the local Hugging Face cache
(nothing is downloaded here, as for the target), served with the same flags, levels and
temperatures as the trained draft, at the same ``num_speculative_tokens``.

Its config names the aux layers in one of two conventions. vLLM's id k is the residual stream
entering decoder layer k; SGLang adds 1 to every id it reads (``draftline.stages.modelcard.
sglang_layer_ids``), so a draft published for SGLang (the Kimi-K2.5 drafts list [1, 29, 57])
is served by vLLM from a copy whose config lists each id + 1: the weights are linked, only
config.json is rewritten.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from draftline.core.atomic import write_json
from draftline.core.hub import local_dir

LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
CONVENTIONS = ("vllm", "sglang")


class FurtherDraftError(ValueError):
    """A ``bench.compare_drafts`` entry cannot be served."""


def draft_folder(entry: dict, index: int) -> Path:
    """The folder holding the entry's files: the local folder, or the cached hub snapshot."""
    key = f"bench.compare_drafts[{index}].model"
    try:
        folder = local_dir(entry["model"], entry.get("revision"))
    except FileNotFoundError as exc:
        raise FurtherDraftError(str(exc).replace("config key 'target.model'",
                                                 f"config key '{key}'")) from exc
    if not (folder / "config.json").is_file():
        raise FurtherDraftError(f"config key '{key}': {entry['model']} ({folder}) has no "
                                "config.json: not a draft checkpoint")
    return folder


def aux_layer_ids(draft_cfg: dict) -> list[int] | None:
    """The aux layer ids a draft config names (vLLM reads the top level, then eagle_config)."""
    ids = draft_cfg.get(LAYER_IDS_KEY) or (draft_cfg.get("eagle_config") or {}).get(LAYER_IDS_KEY)
    return list(ids) if ids else None


def in_vllm_convention(draft_cfg: dict, convention: str) -> dict:
    """``draft_cfg`` with its aux layer ids as vLLM reads them (SGLang's id k is vLLM's k + 1)."""
    if convention == "vllm" or aux_layer_ids(draft_cfg) is None:
        return draft_cfg
    out = json.loads(json.dumps(draft_cfg))
    if LAYER_IDS_KEY in out:
        out[LAYER_IDS_KEY] = [k + 1 for k in out[LAYER_IDS_KEY]]
    if LAYER_IDS_KEY in (out.get("eagle_config") or {}):
        out["eagle_config"][LAYER_IDS_KEY] = [k + 1 for k in out["eagle_config"][LAYER_IDS_KEY]]
    return out


def served_folder(entry: dict, index: int, work_dir: Path) -> Path:
    """What vLLM serves for the entry: its folder, or (SGLang's convention) a copy in
    ``work_dir/{name}`` with the ids shifted and every other file linked."""
    folder = draft_folder(entry, index)
    convention = entry.get("layer_ids", "vllm")
    draft_cfg = json.loads((folder / "config.json").read_text())
    served_cfg = in_vllm_convention(draft_cfg, convention)
    if served_cfg is draft_cfg:
        return folder
    copy = Path(work_dir) / entry["name"]
    copy.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        link = copy / item.name
        if item.name == "config.json" or link.exists():
            continue
        os.symlink(item.resolve(), link)
    write_json(copy / "config.json", served_cfg, indent=2)
    return copy


def configurations(compare_drafts: list[dict], num_speculative_tokens: list[int]) -> list[dict]:
    """One benchmark configuration per further draft and draft length."""
    return [{"name": f"{d['name']}-k{n}", "num_speculative_tokens": n, "draft": d["name"]}
            for d in compare_drafts for n in num_speculative_tokens]


def comparison(summary: list[dict], configs: list[dict]) -> list[dict]:
    """Per further draft and length: the trained draft's acceptance length and tok/s against
    it over the cells both were measured in (ratios trained / further, medians over cells)."""
    cells = {(s["config"], s["temperature"], s["concurrency"]): s for s in summary}
    rows = []
    for cfg in configs:
        if not cfg.get("draft"):
            continue
        trained = f"eagle3-k{cfg['num_speculative_tokens']}"
        pairs = [(cells[(trained, t, c)], other) for (name, t, c), other in cells.items()
                 if name == cfg["name"] and (trained, t, c) in cells]
        acceptance = [a["acceptance_length"] / b["acceptance_length"] for a, b in pairs
                      if a["acceptance_length"] and b["acceptance_length"]]
        throughput = [a["output_tok_s"]["median"] / b["output_tok_s"]["median"]
                      for a, b in pairs if b["output_tok_s"]["median"]]
        wins = sum(a["output_tok_s"]["median"] > b["output_tok_s"]["median"] for a, b in pairs)
        rows.append({
            "draft": cfg["draft"], "config": cfg["name"], "trained_config": trained,
            "cells": len(pairs), "trained_faster_cells": wins,
            "acceptance_ratio": round(statistics.median(acceptance), 4) if acceptance else None,
            "throughput_ratio": round(statistics.median(throughput), 4) if throughput else None})
    return rows


def comparison_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## The trained draft against further drafts", "",
             "Ratios trained / further over the cells (temperature, concurrency) both were "
             "measured in, medians; the cells are in the table above.", "",
             "| further draft | config | trained | acceptance length ratio | tok/s ratio | "
             "trained faster in |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['draft']} | {r['config']} | {r['trained_config']} | "
                     f"{r['acceptance_ratio'] or '-'} | {r['throughput_ratio'] or '-'} | "
                     f"{r['trained_faster_cells']} of {r['cells']} cells |")
    return lines

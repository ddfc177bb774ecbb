"""The facts the model card shows, read from the files already copied into the bundle."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftline.stages.bundle.archive import BundleError


def safetensors_parameters(path: Path) -> int:
    """Number of floating-point parameters in a safetensors file, from its header alone
    (integer and bool tensors such as d2t and t2d are lookup tables, not parameters)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    total = 0
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"].startswith(("F", "BF")):
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise BundleError(f"{path}, line {i}: not JSON ({exc})") from exc
    return records


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not JSON ({exc})") from exc


def recommended_speculative_tokens(bench_results: Any, config: Mapping[str, Any]) -> int:
    """The benchmark's recommendation when it states one, else the first benchmarked value."""
    if isinstance(bench_results, dict):
        for key in ("recommended_num_speculative_tokens", "best_num_speculative_tokens"):
            if isinstance(bench_results.get(key), int):
                return bench_results[key]
        best = bench_results.get("best")
        if isinstance(best, dict) and isinstance(best.get("num_speculative_tokens"), int):
            return best["num_speculative_tokens"]
    return config["bench"]["num_speculative_tokens"][0]


def stage_machines(generation: Any, eval_json: Any, bench: Any) -> list[tuple[str, dict]]:
    """What each stage ran on, as the stage recorded it in its own output (bundled files)."""
    machines: list[tuple[str, dict]] = []
    if isinstance(generation, dict):
        machines += [("generation", m) for m in generation.get("machines") or []]
    recorded = (eval_json or {}).get("machine") if isinstance(eval_json, dict) else None
    for key, stage in (("hidden_states", "hidden states"), ("training", "training")):
        if isinstance(recorded, dict) and isinstance(recorded.get(key), dict):
            machines.append((stage, recorded[key]))
    if isinstance(bench, dict) and isinstance(bench.get("machine"), dict):
        machines.append(("deployment benchmark", bench["machine"]))
    return machines


def collect_card_facts(root: Path, config: Mapping[str, Any], provenance: Mapping[str, Any],
                       draft_ref: str, files: list[dict]) -> dict[str, Any]:
    """What the model card shows, read from the files already copied into the bundle."""
    def optional(name: str) -> Any:
        return _read_json(root / name) if (root / name).exists() else None

    bench_results = optional("bench/results.json")
    summary = root / "bench" / "summary.md"
    eval_json = _read_json(root / "training" / "eval.json")
    return {
        "target": provenance["target"],
        "config": config,
        "provenance": provenance,
        "draft_config": _read_json(root / "config.json"),
        "draft_parameters": sum(safetensors_parameters(root / f["path"]) for f in files
                                if "/" not in f["path"] and f["path"].endswith(".safetensors")),
        "eval": eval_json,
        "metrics": _read_jsonl(root / "training" / "metrics.jsonl"),
        "coverage": _read_json(root / "vocab" / "coverage.json"),
        "prompts_summary": _read_json(root / "data" / "prompts_summary.json"),
        "prompt_sources": provenance["prompt_sources"],
        "profile": optional("profile/concurrency.json"),
        "profile_plot": "profile/concurrency.png" if (root / "profile/concurrency.png").exists()
        else None,
        "bench_results": bench_results,
        "bench_summary": summary.read_text() if summary.exists() else None,
        "bench_plots": sorted(f["path"] for f in files
                              if f["path"].startswith("bench/") and f["path"].endswith(".png")),
        "num_speculative_tokens": recommended_speculative_tokens(bench_results, config),
        "machines": stage_machines(optional("data/generation_summary.json"), eval_json,
                                   bench_results),
        "draft_ref": draft_ref,
        "variants": variant_facts(root, files),
        "files": files,
    }


def variant_facts(root: Path, files: list[dict]) -> list[dict]:
    """Each bundled draft variant (variants/{name}/): its config, parameters and evaluation."""
    names = sorted({f["path"].split("/")[1] for f in files
                    if f["path"].startswith("variants/") and f["path"].count("/") >= 2})
    return [{"name": name, "folder": f"variants/{name}",
             "config": _read_json(root / "variants" / name / "config.json"),
             "parameters": safetensors_parameters(root / "variants" / name / "model.safetensors"),
             "eval": _read_json(root / "variants" / name / "training" / "eval.json")}
            for name in names]


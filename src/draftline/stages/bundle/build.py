"""Building the bundle: copy the inputs (secrets scrubbed), write the resolved config, the model
card and ``manifest.json``, then the deterministic archive and the build record beside it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftline.core.atomic import atomic_dir, sha256_file, write_text
from draftline.stages import modelcard
from draftline.stages.bundle.archive import (
    BUNDLE_FORMAT,
    CHUNK,
    MANIFEST,
    README,
    BundleError,
    json_text,
    sort_key,
    walk_files,
    write_deterministic_tar,
)
from draftline.stages.bundle.card import collect_card_facts
from draftline.stages.bundle.inputs import BundleInputs
from draftline.stages.bundle.provenance import collect_provenance
from draftline.stages.bundle.record import (
    build_record_path,
    collect_build_record,
    write_build_record,
)
from draftline.stages.bundle.scrub import scrub_config, scrub_obj, scrub_text, secret_values

TEXT_SUFFIXES = {".json", ".jsonl", ".md", ".yaml", ".yml", ".txt", ".csv", ".tsv", ".html",
                 ".rst", ".log"}
CONTENT = {  # what each bundled file is (the model card's file table)
    "config.json": "draft config (the format vLLM serves)",
    "model.safetensors": "draft weights (with d2t and t2d when the draft vocab is reduced)",
    "vocab/vocab_map.safetensors": "draft vocab map (d2t, t2d)",
    "vocab/coverage.json": "draft vocab coverage",
    "training/metrics.jsonl": "training metrics",
    "training/eval.json": "held-out evaluation",
    "data/prompts_summary.json": "prompt selection summary",
    "data/generation_summary.json": "generation summary (throughput, what served the answers)",
    "profile/concurrency.json": "concurrency profile",
    "profile/concurrency.png": "concurrency profile plot",
    "bench/results.json": "deployment benchmark results",
    "bench/summary.md": "deployment benchmark summary",
    "resolved_config.yaml": "the pipeline config, defaults filled in, secrets removed",
    README: "this model card",
}


def _copy_scrubbed(src: Path, dst: Path, name: str, secrets: Mapping[str, str],
                   progress: tqdm) -> None:
    """Copy one input into the bundle: text files scrubbed, binary files refused if they
    contain a secret (a secret cannot be cut out of weights or a PNG safely)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.suffix in TEXT_SUFFIXES:
        data = src.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"bundle input {src}: not UTF-8 text ({exc})") from exc
        dst.write_bytes(scrub_text(text, secrets).encode("utf-8"))
        progress.update(len(data))
        return
    needles = [(n, v.encode()) for n, v in secrets.items()]
    overlap = max((len(v) for _, v in needles), default=1) - 1
    tail = b""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            window = tail + chunk
            for env_name, value in needles:
                if value in window:
                    fout.close()
                    dst.unlink()
                    raise BundleError(f"bundle input {src} (for {name}): contains the value of "
                                      f"environment variable {env_name}; refusing to bundle it")
            tail = window[-overlap:] if overlap else b""
            fout.write(chunk)
            progress.update(len(chunk))


def resolved_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as bundled: secrets removed, and without the publishing destination (where
    a bundle is copied to is not a property of the model, and must not change its bytes)."""
    cfg = scrub_config(json.loads(json.dumps(config)))
    cfg.get("bundle", {}).pop("publish_to", None)
    return cfg


def build_bundle(inputs: BundleInputs, out_dir: str | Path, tar_path: str | Path, *,
                 config: Mapping[str, Any], model: str, draft_ref: str | None = None,
                 card_html: str | Path | None = None, provenance: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None,
                 build_record: str | Path | None = None) -> dict[str, Any]:
    """Build ``out_dir`` (replaced as a whole), the deterministic ``tar_path`` and the build
    record beside it; return the manifest. ``config`` is the resolved pipeline config, ``model``
    the target path or hub id, ``draft_ref`` how the serving commands name this bundle (default:
    ``bundle.hf_repo`` or ``out_dir``), ``card_html`` an optional HTML rendering of the model
    card with the build record (for the report), ``build_record`` where that record goes
    (default: ``bundle.build.json`` beside ``bundle.tar``). ``provenance`` defaults to
    :func:`collect_provenance`; ``env`` to ``os.environ``."""
    out_dir, tar_path = Path(out_dir), Path(tar_path)
    secrets = secret_values(env, config)
    layout = inputs.layout()
    bundled_config = resolved_config(config)
    if provenance is None:
        provenance = collect_provenance(config, model)
    provenance = scrub_obj(json.loads(json.dumps(provenance)), secrets)
    bundled_config = scrub_obj(bundled_config, secrets)
    draft_ref = draft_ref or config.get("bundle", {}).get("hf_repo") or out_dir.as_posix()

    with atomic_dir(out_dir) as staging:
        manifest, card = _fill_staging(staging, layout, bundled_config, provenance, draft_ref,
                                       secrets)
    write_deterministic_tar(out_dir, tar_path)

    record = collect_build_record(tar_path, out_dir / MANIFEST, config)
    write_build_record(build_record or build_record_path(tar_path), record, secrets)
    if card_html is not None:  # the report's card may show this build; the bundle's may not
        modelcard.add_build_record(card, record)
        html_text = scrub_text(modelcard.render_html(card, out_dir), secrets)
        write_text(card_html, html_text)
    return manifest


def _fill_staging(staging: Path, layout: Mapping[str, Path], bundled_config: dict,
                  provenance: dict, draft_ref: str, secrets: Mapping[str, str],
                  ) -> tuple[dict[str, Any], modelcard.Card]:
    """Copy the inputs, write the resolved config, model card and manifest into ``staging``;
    return the manifest and the card."""
    import yaml

    total = sum(Path(src).stat().st_size for src in layout.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="bundle: copy", mininterval=1) as bar:
        for name, src in layout.items():
            _copy_scrubbed(Path(src), staging / name, name, secrets, bar)
    (staging / "resolved_config.yaml").write_text(scrub_text(
        yaml.safe_dump(bundled_config, sort_keys=True, allow_unicode=True), secrets))

    hashes: dict[str, tuple[str, int]] = {}  # each file is hashed once
    files = _file_entries(staging, layout, hashes)
    facts = collect_card_facts(staging, bundled_config, provenance, draft_ref, files)
    card = modelcard.build_card(facts)
    (staging / README).write_text(scrub_text(modelcard.render_markdown(card), secrets))

    manifest = {"format": BUNDLE_FORMAT, "files": _file_entries(staging, layout, hashes),
                "provenance": provenance}
    (staging / MANIFEST).write_text(scrub_text(json_text(manifest), secrets))
    for path in staging.rglob("*"):  # modes do not depend on the umask
        path.chmod(0o755 if path.is_dir() else 0o644)

    return manifest, card


def _file_entries(root: Path, layout: Mapping[str, Path],
                  hashes: dict[str, tuple[str, int]]) -> list[dict[str, Any]]:
    entries = []
    for path in sorted(walk_files(root), key=sort_key):
        if path == MANIFEST:
            continue
        if path not in hashes:
            hashes[path] = (sha256_file(root / path), (root / path).stat().st_size)
        entry = {"path": path, "sha256": hashes[path][0], "size": hashes[path][1]}
        if path in layout:
            entry["source"] = Path(layout[path]).as_posix()
        if path in CONTENT:
            entry["content"] = CONTENT[path]
        elif path.startswith("bench/") and path.endswith(".png"):
            entry["content"] = "deployment benchmark plot"
        elif path.endswith(".safetensors") and "/" not in path:
            entry["content"] = CONTENT["model.safetensors"]
        entries.append(entry)
    return entries


"""The artifacts a bundle is made of, and where each goes in the bundle folder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftline.core.layout import (
    CHECKPOINT,
    CHECKPOINT_CONFIG,
    CHECKPOINT_WEIGHTS,
    TRAIN_EVAL,
    TRAIN_METRICS,
    Layout,
)
from draftline.stages.bundle.archive import MANIFEST, README, BundleError


@dataclass
class BundleInputs:
    """The artifacts a bundle is made of (paths under the results root)."""

    checkpoint_dir: Path
    vocab_map: Path
    coverage: Path
    metrics: Path
    eval: Path
    prompts_summary: Path
    generation_summary: Path | None = None  # the stage summary: what served the answers
    profile_json: Path | None = None
    profile_png: Path | None = None
    bench_files: Sequence[Path] = field(default_factory=list)  # results, summary, plots
    variant_dirs: Mapping[str, Path] = field(default_factory=dict)  # train.variants' folders

    @classmethod
    def from_results(cls, root: str | Path) -> BundleInputs:
        """The standard layout under a results root; optional stages only where present."""
        lay = Layout(root)
        bench_files = [lay.bench_results, lay.bench_summary, *lay.bench_plots]
        return cls(
            checkpoint_dir=lay.checkpoint,
            vocab_map=lay.vocab_map,
            coverage=lay.vocab_coverage,
            metrics=lay.train_metrics,
            eval=lay.train_eval,
            prompts_summary=lay.prompts_summary,
            generation_summary=_existing(lay.generation_summary),
            profile_json=_existing(lay.profile_json),
            profile_png=_existing(lay.profile_png),
            bench_files=[p for p in bench_files if p.exists()],
            variant_dirs={p.name: p for p in sorted(lay.variants.glob("*"))
                          if (p / CHECKPOINT / CHECKPOINT_CONFIG).is_file()},
        )

    def layout(self) -> dict[str, Path]:
        """Bundle path -> source file, in bundle order."""
        files: dict[str, Path] = {}
        checkpoint = Path(self.checkpoint_dir)
        if not (checkpoint / "config.json").is_file():
            raise BundleError(f"draft checkpoint {checkpoint}: config.json not found")
        for src in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
            _put(files, src.relative_to(checkpoint).as_posix(), src)
        _put(files, "vocab/vocab_map.safetensors", self.vocab_map)
        _put(files, "vocab/coverage.json", self.coverage)
        _put(files, "training/metrics.jsonl", self.metrics)
        _put(files, "training/eval.json", self.eval)
        _put(files, "data/prompts_summary.json", self.prompts_summary)
        if self.generation_summary:
            _put(files, "data/generation_summary.json", self.generation_summary)
        if self.profile_json:
            _put(files, "profile/concurrency.json", self.profile_json)
        if self.profile_png:
            _put(files, "profile/concurrency.png", self.profile_png)
        for src in self.bench_files:
            _put(files, f"bench/{Path(src).name}", src)
        for name, folder in sorted(self.variant_dirs.items()):
            # each variant as the main draft: a checkpoint vLLM serves, and its training record
            _put(files, f"variants/{name}/{CHECKPOINT_CONFIG}",
                 folder / CHECKPOINT / CHECKPOINT_CONFIG)
            _put(files, f"variants/{name}/{CHECKPOINT_WEIGHTS}",
                 folder / CHECKPOINT / CHECKPOINT_WEIGHTS)
            _put(files, f"variants/{name}/training/{TRAIN_EVAL}", folder / TRAIN_EVAL)
            _put(files, f"variants/{name}/training/{TRAIN_METRICS}", folder / TRAIN_METRICS)
        for name, src in files.items():
            if not Path(src).is_file():
                raise BundleError(f"bundle input {src} (for {name}): file not found")
        return files


def _existing(path: Path) -> Path | None:
    return path if path.exists() else None


def _put(files: dict[str, Path], name: str, src: str | Path) -> None:
    if name in files or name in (MANIFEST, README, "resolved_config.yaml"):
        raise BundleError(f"bundle input {src}: bundle path {name} is already taken")
    files[name] = Path(src)


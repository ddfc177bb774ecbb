"""The results tree: where every artifact lives under the config's ``results`` root.

This is the one place the tree is named. The Snakemake rules (through ``rules/common.smk``),
the ``draftline`` CLI, the bundle and ``draftline plan`` all take their paths from here, so a
stage run by hand writes exactly where the workflow would.

Standard library only: ``rules/common.smk`` loads this file by its path while parsing the
workflow, where the draftline package and its dependencies need not be importable.

Sharded artifacts take the shard index ``i`` and a draft variant's its name; pass the string
``"{i}"`` (``"{variant}"``) to get the Snakemake wildcard pattern.
"""

from __future__ import annotations

from pathlib import Path

# Files a stage writes inside its own folder (the stage names them by these constants).
PROMPTS_REJECTED = "rejected.jsonl"
PROMPTS_SUMMARY = "summary.json"
BENCH_RESULTS = "results.json"
BENCH_SUMMARY = "summary.md"
BENCH_PLOTS = ("throughput.png", "acceptance.png")
DATASET_STATS = "stats.json"
VOCAB_MAP = "vocab_map.safetensors"
VOCAB_COVERAGE = "coverage.json"
HIDDEN_INDEX = "index.json"
HIDDEN_STATS = "extract_stats.json"
ONLINE_STATS = "hidden_stats.json"  # training's producer figures in online mode
# A training's folder (the main draft's and each variant's)
DRAFT_BEST = "best"
TRAIN_METRICS = "metrics.jsonl"
TRAIN_EVAL = "eval.json"
CHECKPOINT = "checkpoint"
CHECKPOINT_CONFIG = "config.json"
CHECKPOINT_WEIGHTS = "model.safetensors"


def shard_file(i: int | str) -> str:
    """The file name of shard ``i`` (prompt and response shards alike)."""
    return f"shard-{i}.jsonl"


class Layout:
    """Artifact paths under one results root."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def from_config(cls, config: dict) -> Layout:
        return cls(config["results"])

    def log(self, rule: str, name: str) -> Path:
        """A rule's log: under the results root, so that runs into two results folders keep
        their own logs."""
        return self.root / "logs" / rule / name

    # ----------------------------------------------------------------------------- the target
    @property
    def target(self) -> Path:
        """The built-in target's folder (only when ``target.model`` names one: ``toy``,
        ``smollm2-135m``; ``draftline.core.target_model``)."""
        return self.root / "target"

    # ----------------------------------------------------------------------------- prompts
    @property
    def prompts(self) -> Path:
        return self.root / "prompts"

    def prompt_shard(self, i: int | str) -> Path:
        return self.prompts / shard_file(i)

    def prompt_shards(self, num_shards: int) -> list[Path]:
        return [self.prompt_shard(i) for i in range(num_shards)]

    @property
    def prompts_rejected(self) -> Path:
        return self.prompts / PROMPTS_REJECTED

    @property
    def prompts_summary(self) -> Path:
        return self.prompts / PROMPTS_SUMMARY

    # -------------------------------------------------------------------------- concurrency profile
    @property
    def profile_json(self) -> Path:
        return self.root / "profile" / "concurrency.json"

    @property
    def profile_png(self) -> Path:
        return self.root / "profile" / "concurrency.png"

    # ----------------------------------------------------------------------------- generation
    @property
    def responses(self) -> Path:
        return self.root / "responses"

    def response_shard(self, i: int | str) -> Path:
        return self.responses / shard_file(i)

    def response_shards(self, num_shards: int) -> list[Path]:
        return [self.response_shard(i) for i in range(num_shards)]

    def response_errors(self, i: int | str) -> Path:
        return self.responses / f"shard-{i}.errors.jsonl"

    def response_summary(self, i: int | str) -> Path:
        return self.responses / f"shard-{i}.summary.json"

    @property
    def generation_summary(self) -> Path:
        return self.responses / "summary.json"

    @property
    def generation_plot(self) -> Path:
        return self.responses / "server_running.png"

    # ---------------------------------------------------------------------------- dataset and vocab
    @property
    def dataset(self) -> Path:
        return self.root / "dataset"

    @property
    def dataset_stats(self) -> Path:
        return self.dataset / DATASET_STATS

    @property
    def vocab(self) -> Path:
        return self.root / "vocab"

    @property
    def vocab_map(self) -> Path:
        return self.vocab / VOCAB_MAP

    @property
    def vocab_coverage(self) -> Path:
        return self.vocab / VOCAB_COVERAGE

    # ----------------------------------------------------------------------------- hidden states
    @property
    def hidden(self) -> Path:
        return self.root / "hidden"

    @property
    def hidden_index(self) -> Path:
        return self.hidden / HIDDEN_INDEX

    @property
    def hidden_stats(self) -> Path:
        return self.hidden / HIDDEN_STATS

    # ----------------------------------------------------------------------------- the draft
    @property
    def draft(self) -> Path:
        """Training's output folder (its resumable state lives below it too)."""
        return self.root / "draft"

    @property
    def draft_best(self) -> Path:
        return self.draft / DRAFT_BEST

    @property
    def train_metrics(self) -> Path:
        return self.draft / TRAIN_METRICS

    @property
    def train_eval(self) -> Path:
        return self.draft / TRAIN_EVAL

    @property
    def online_stats(self) -> Path:
        """The hidden-state producer's figures of an online training (hidden.mode online)."""
        return self.draft / ONLINE_STATS

    @property
    def checkpoint(self) -> Path:
        """The exported vLLM checkpoint."""
        return self.draft / CHECKPOINT

    @property
    def checkpoint_config(self) -> Path:
        return self.checkpoint / CHECKPOINT_CONFIG

    @property
    def checkpoint_weights(self) -> Path:
        return self.checkpoint / CHECKPOINT_WEIGHTS

    # ----------------------------------------------------------------------------- draft variants
    @property
    def variants(self) -> Path:
        return self.root / "variants"

    def variant(self, name: str) -> Path:
        """A draft variant's training folder (train.variants), laid out as ``draft``."""
        return self.variants / name

    def variant_best(self, name: str) -> Path:
        return self.variant(name) / DRAFT_BEST

    def variant_metrics(self, name: str) -> Path:
        return self.variant(name) / TRAIN_METRICS

    def variant_eval(self, name: str) -> Path:
        return self.variant(name) / TRAIN_EVAL

    def variant_checkpoint(self, name: str) -> Path:
        return self.variant(name) / CHECKPOINT

    def variant_checkpoint_config(self, name: str) -> Path:
        return self.variant_checkpoint(name) / CHECKPOINT_CONFIG

    def variant_checkpoint_weights(self, name: str) -> Path:
        return self.variant_checkpoint(name) / CHECKPOINT_WEIGHTS

    # ------------------------------------------------------------------------- deployment benchmark
    @property
    def bench(self) -> Path:
        return self.root / "bench"

    @property
    def bench_results(self) -> Path:
        return self.bench / BENCH_RESULTS

    @property
    def bench_summary(self) -> Path:
        return self.bench / BENCH_SUMMARY

    @property
    def bench_plots(self) -> list[Path]:
        return [self.bench / name for name in BENCH_PLOTS]

    # ----------------------------------------------------------------------------- the bundle
    @property
    def bundle(self) -> Path:
        return self.root / "bundle"

    @property
    def bundle_manifest(self) -> Path:
        return self.bundle / "manifest.json"

    @property
    def bundle_readme(self) -> Path:
        return self.bundle / "README.md"

    @property
    def bundle_tar(self) -> Path:
        return self.root / "bundle.tar"

    @property
    def bundle_build_record(self) -> Path:
        """Facts about one build (command line, host, time), outside the archive's hash."""
        return self.root / "bundle.build.json"

    @property
    def bundle_hub_record(self) -> Path:
        return self.root / "bundle.hub.json"

    @property
    def model_card_html(self) -> Path:
        return self.root / "report" / "model_card.html"

    # ----------------------------------------------------------------------------- run-time state
    @property
    def servers(self) -> Path:
        """State of the run's shared vLLM servers (draftline.serving.server)."""
        return self.root / ".servers"


def published_files(dest: str) -> dict[str, str]:
    """The files ``bundle.publish_to`` receives: the archive, its manifest and checksum."""
    dest = dest.rstrip("/")
    return {"tar": f"{dest}/bundle.tar", "manifest": f"{dest}/manifest.json",
            "sha256": f"{dest}/bundle.tar.sha256"}

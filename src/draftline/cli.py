"""``draftline``: every pipeline stage without Snakemake, plus planning and verification.

Each stage subcommand reads the validated config and writes where the Snakemake rules do: the
results tree of :mod:`draftline.core.layout` under ``config.results``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from draftline.core import variants
from draftline.core.config import ConfigError, load_config
from draftline.core.layout import (
    CHECKPOINT,
    DRAFT_BEST,
    TRAIN_EVAL,
    Layout,
    published_files,
)
from draftline.core.target_model import target_model


def _parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def cmd_toy(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.toy import build_toy_target

    build_toy_target(lay.target, cfg["target"]["toy"])


def cmd_prompts(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.prompts import build_prompt_shards

    p = cfg["prompts"]
    build_prompt_shards(p["sources"], lay.prompts, num_shards=p["num_shards"],
                        max_samples=p["max_samples"], seed=p["seed"],
                        max_line_bytes=p["max_line_bytes"])


def cmd_profile(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.profile import measure_concurrency_profile

    lay.profile_json.parent.mkdir(parents=True, exist_ok=True)
    measure_concurrency_profile(
        lay.prompt_shards(cfg["prompts"]["num_shards"]), lay.profile_json, lay.profile_png,
        profile_cfg=cfg["profile"], sampling=cfg["generate"], server_cfg=cfg["server"],
        model=target_model(cfg), state_dir=lay.servers,
        trust_remote_code=cfg["target"]["trust_remote_code"], revision=cfg["target"]["revision"])


def cmd_generate(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.generate import generate_responses

    shards = [args.shard] if args.shard is not None else range(cfg["prompts"]["num_shards"])
    lay.responses.mkdir(parents=True, exist_ok=True)
    generate_responses([lay.prompt_shard(i) for i in shards],
                       [lay.response_shard(i) for i in shards],
                       [lay.response_errors(i) for i in shards],
                       [lay.response_summary(i) for i in shards], gen_cfg=cfg["generate"],
                       server_cfg=cfg["server"], model=target_model(cfg),
                       state_dir=lay.servers, profile_json=lay.profile_json,
                       trust_remote_code=cfg["target"]["trust_remote_code"],
                       revision=cfg["target"]["revision"],
                       eval_fraction=cfg["dataset"]["eval_fraction"])


def cmd_dataset(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.dataset import build_dataset

    files = lay.response_shards(cfg["prompts"]["num_shards"])
    build_dataset(files, target_model(cfg), lay.dataset,
                  eval_fraction=cfg["dataset"]["eval_fraction"],
                  max_length=cfg["dataset"]["max_length"],
                  trust_remote_code=cfg["target"]["trust_remote_code"],
                  chat_template_kwargs=cfg["generate"]["chat_template_kwargs"],
                  revision=cfg["target"]["revision"])


def cmd_vocab(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.vocab import build_vocab_map, target_vocab_size

    build_vocab_map(lay.dataset, target_vocab_size(target_model(cfg)),
                    cfg["vocab"]["draft_vocab_size"], lay.vocab,
                    min_coverage=cfg["vocab"]["min_coverage"])


def answer_sampling(cfg: dict) -> dict:
    """How the dataset's answers were sampled: what the hidden-state gate checks against."""
    return {key: cfg["generate"][key] for key in ("temperature", "top_p")}


def cmd_hidden(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.hidden import extract_hidden_states

    hidden_cfg = {**cfg["hidden"], "trust_remote_code": cfg["target"]["trust_remote_code"]}
    extract_hidden_states(lay.dataset, target_model(cfg), lay.hidden, hidden_cfg,
                          server_cfg=cfg["server"], sampling=answer_sampling(cfg))


def cmd_train(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.train import train_draft

    online = None
    if cfg["hidden"]["mode"] == "online":  # states produced while training, from the dataset
        hidden = {**cfg["hidden"], "trust_remote_code": cfg["target"]["trust_remote_code"]}
        # the vllm producer: the run's shared server (stopped when idle or by server-stop-all)
        online = {"dataset_dir": lay.dataset, "hidden": hidden, "server": cfg["server"],
                  "server_state_dir": lay.servers}
    train_cfg, out_dir = _draft_to_build(cfg, lay, args.variant)
    train_draft(None if online else lay.hidden, lay.vocab_map, target_model(cfg), out_dir,
                train_cfg, online=online)


def _draft_to_build(cfg: dict, lay: Layout, variant: str | None) -> tuple[dict, Path]:
    """The training config and folder of the main draft, or of ``variant``."""
    if variant is None:
        return variants.main_train(cfg["train"]), lay.draft
    try:
        return variants.variant_train(cfg["train"], variant), lay.variant(variant)
    except KeyError as exc:
        raise SystemExit(f"draftline: --variant {variant}: {exc.args[0]}") from exc


def cmd_export(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.export import export_draft

    # the layers training read (from the stored index or produced online)
    _, folder = _draft_to_build(cfg, lay, args.variant)
    layer_ids = json.loads((folder / TRAIN_EVAL).read_text())["layer_ids"]
    export_draft(folder / DRAFT_BEST, target_model(cfg), lay.vocab_map, layer_ids,
                 folder / CHECKPOINT)


def cmd_bench(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.bench import measure_deployment_benchmark

    files = lay.response_shards(cfg["prompts"]["num_shards"])
    measure_deployment_benchmark(files, lay.checkpoint, lay.train_eval, lay.profile_json,
              lay.bench, bench_cfg=cfg["bench"], generate_cfg=cfg["generate"],
              eval_fraction=cfg["dataset"]["eval_fraction"], server_cfg=cfg["server"],
              model=target_model(cfg), state_dir=lay.servers,
              trust_remote_code=cfg["target"]["trust_remote_code"],
              revision=cfg["target"]["revision"],
              variant_dirs={name: lay.variant(name)
                            for name in variants.variant_names(cfg["train"])})


def cmd_plan(cfg: dict, lay: Layout, args) -> None:
    from draftline.plan import format_plan, measured_from_results, plan

    print(format_plan(plan(cfg, measured_from_results(cfg))))


def cmd_server_stop_all(cfg: dict, lay: Layout, args) -> None:
    from draftline.serving.server import stop_all

    print(f"stopped {stop_all(lay.servers)} shared server(s)")


def cmd_bundle(cfg: dict, lay: Layout, args) -> None:
    from draftline.stages.bundle import BundleInputs, build_bundle, publish_files

    bundle_dir, tar = lay.bundle, lay.bundle_tar
    build_bundle(BundleInputs.from_results(lay.root), bundle_dir, tar, config=cfg,
                 model=target_model(cfg), card_html=lay.model_card_html)
    print(f"bundle: {bundle_dir}/ and {tar}")
    dest = cfg["bundle"]["publish_to"]
    if dest and "://" not in dest:
        published = published_files(dest)
        publish_files(tar, lay.bundle_manifest, published["tar"], published["manifest"],
                      published["sha256"])
        print(f"published to {dest}")
    elif dest:
        print(f"bundle.publish_to {dest}: storage targets are published by the Snakemake "
              "workflow (storage plugins); run snakemake to upload")


COMMANDS = {
    "toy": (cmd_toy, "build the toy target"),
    "prompts": (cmd_prompts, "build the prompt shards"),
    "profile": (cmd_profile, "measure throughput against concurrency and choose one"),
    "generate": (cmd_generate, "generate synthetic responses"),
    "dataset": (cmd_dataset, "tokenize responses into the training dataset"),
    "vocab": (cmd_vocab, "build the draft vocab map"),
    "hidden": (cmd_hidden, "extract target hidden states"),
    "train": (cmd_train, "train the draft"),
    "export": (cmd_export, "export the draft checkpoint for vLLM"),
    "bench": (cmd_bench, "benchmark baseline vs the draft in vLLM"),
    "plan": (cmd_plan, "print expected disk and time per stage; runs nothing"),
    "server-stop-all": (cmd_server_stop_all, "stop the run's shared vLLM servers"),
    "bundle": (cmd_bundle, "build results/bundle/ and the deterministic results/bundle.tar"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", "-c", nargs="+", default=["config/config.yaml"],
                       metavar="FILE", help="YAML config files, read in order (as Snakemake's "
                                           "--configfile)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set generate.temperature=0")
        if name == "generate":
            p.add_argument("--shard", type=int, default=None, help="only this shard")
        if name in ("train", "export"):
            p.add_argument("--variant", default=None, metavar="NAME",
                           help="a draft variant of train.variants instead of the main draft")
    docs = sub.add_parser("config-docs", help="write config/README.md from the config schema")
    docs.add_argument("--check", action="store_true",
                      help="write nothing; fail when the file is not current")
    docs.add_argument("--out", default="config/README.md", help="the file to write or check")
    verify = sub.add_parser("verify", help="recompute every hash of a bundle folder or tar; "
                                           "with --rebuild, also rebuild it and compare bytes")
    verify.add_argument("bundle", help="bundle folder or .tar archive")
    verify.add_argument("--rebuild", metavar="RESULTS_DIR", default=None,
                        help="rebuild the bundle from this results folder (with the config the "
                             "bundle carries) into a temporary place and report whether the "
                             "bytes are equal, naming the first differing member if not")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "config-docs":  # documents the schema, reads no config
        from draftline.core.config_docs import write_or_check

        return write_or_check(Path(args.out), check=args.check)
    if args.command == "verify":  # needs no config: checks a bundle from anywhere
        from draftline.stages.bundle import main_rebuild, main_verify

        if args.rebuild is not None:
            return main_rebuild(args.rebuild, args.bundle)
        return main_verify(args.bundle)
    try:
        config = load_config(args.config, _parse_overrides(args.set))
    except (ConfigError, FileNotFoundError) as exc:
        print(f"draftline: {exc}", file=sys.stderr)
        return 2
    handler = COMMANDS[args.command][0]
    from draftline.stages.profile import AnswersCutShort
    from draftline.stages.responses import GenerationLocked, OutputNotWritable
    from draftline.stages.vocab import VocabTooSmall

    try:
        handler(config, Layout.from_config(config), args)
    except (GenerationLocked, OutputNotWritable, VocabTooSmall, AnswersCutShort) as exc:
        # refused, naming the file or config key, with nothing valid lost: one line
        print(f"draftline {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

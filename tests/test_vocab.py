"""Vocab map: hand-computed d2t/t2d, streaming counts, coverage.json."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from draftline.stages.vocab import (
    VocabTooSmall,
    build_vocab_map,
    count_tokens,
    coverage_table,
    load_vocab_map,
    vocab_map_from_counts,
)


def check_map(d2t, t2d, chosen: list[int], target_vocab: int) -> None:
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [t - i for i, t in enumerate(chosen)]
    assert t2d.shape == (target_vocab,)
    assert torch.nonzero(t2d).flatten().tolist() == chosen
    # docs/formats.md: target_id = i + d2t[i]
    assert (torch.arange(len(chosen)) + d2t).tolist() == chosen


def test_top_tokens_with_ties_to_lower_id():
    counts = np.array([5, 0, 3, 3, 7, 0, 3])
    d2t, t2d = vocab_map_from_counts(counts, 3)
    # 4 (7), 0 (5), then the tie 2/3/6 (3 each) goes to the lowest id, 2.
    assert d2t.tolist() == [0, 1, 2]  # draft ids 0,1,2 -> target 0,2,4
    check_map(d2t, t2d, [0, 2, 4], 7)


def test_padding_with_lowest_unused_ids():
    counts = np.array([0, 4, 0, 0, 1, 0])
    d2t, t2d = vocab_map_from_counts(counts, 4)
    # Seen: 1, 4. Two more needed: the lowest unseen ids 0 and 2.
    assert d2t.tolist() == [0, 0, 0, 1]
    check_map(d2t, t2d, [0, 1, 2, 4], 6)


def test_no_counts_gives_first_ids():
    d2t, t2d = vocab_map_from_counts(np.zeros(5, dtype=np.int64), 2)
    check_map(d2t, t2d, [0, 1], 5)


def test_draft_vocab_at_least_target_is_identity():
    d2t, t2d = vocab_map_from_counts(np.array([1, 0, 2]), 8)
    assert d2t.tolist() == [0, 0, 0] and t2d.tolist() == [True, True, True]


def save_dataset(path, train_rows, eval_rows):
    from datasets import Dataset, DatasetDict, Features, List, Value

    features = Features({"input_ids": List(Value("int64")), "loss_mask": List(Value("int8"))})

    def split(rows):
        return Dataset.from_dict(
            {"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]},
            features=features,
        )

    DatasetDict({"train": split(train_rows), "eval": split(eval_rows)}).save_to_disk(str(path))
    return path


TRAIN = [
    ([1, 2, 3, 3], [0, 1, 1, 1]),
    ([7, 3, 5], [1, 1, 0]),
    ([2, 2], [0, 0]),
    ([9, 3, 1], [0, 1, 1]),
    ([4, 4, 4, 4, 1], [1, 1, 1, 1, 0]),
]
EVAL = [([5, 3, 8], [1, 1, 1])]
# Supervised train tokens: 2, 3, 3 | 7, 3 | - | 3, 1 | 4, 4, 4, 4
TRAIN_COUNTS = [0, 1, 1, 4, 4, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("batch_size", [1, 2, 1024])
def test_count_tokens_only_where_supervised(tmp_path, batch_size):
    path = save_dataset(tmp_path / "ds", TRAIN, EVAL)
    counts = count_tokens(path, 10, split="train", batch_size=batch_size)
    assert counts.dtype == np.int64
    assert counts.tolist() == TRAIN_COUNTS
    assert count_tokens(path, 10, split="eval").tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 1, 0]


def test_count_tokens_large_vocab_matches_counter(tmp_path):
    rng = np.random.default_rng(0)
    vocab = 163_840
    rows = []
    for _ in range(50):
        n = int(rng.integers(1, 400))
        ids = rng.zipf(1.3, n) % vocab
        rows.append((ids.tolist(), rng.integers(0, 2, n).tolist()))
    path = save_dataset(tmp_path / "ds", rows, rows[:1])
    expected = Counter(t for ids, mask in rows for t, m in zip(ids, mask, strict=True) if m)
    counts = count_tokens(path, vocab, batch_size=7)
    assert counts.shape == (vocab,)
    assert {t: int(counts[t]) for t in np.flatnonzero(counts)} == dict(expected)


def test_count_tokens_rejects_ids_outside_vocab(tmp_path):
    path = save_dataset(tmp_path / "ds", TRAIN, EVAL)
    with pytest.raises(ValueError, match="token id 7 outside the vocabulary of size 6"):
        count_tokens(path, 6)


def test_coverage_table_is_capped_at_target_vocab():
    train = np.array([6, 3, 1, 0])
    eval_ = np.array([1, 1, 0, 2])
    rows = coverage_table(train, eval_, [1, 2, 8192])
    assert rows == [
        {"draft_vocab_size": 1, "train": 0.6, "eval": 0.25},
        {"draft_vocab_size": 2, "train": 0.9, "eval": 0.5},
        {"draft_vocab_size": 4, "train": 1.0, "eval": 1.0},
    ]


def test_build_vocab_map_files(tmp_path):
    path = save_dataset(tmp_path / "ds", TRAIN, EVAL)
    out = tmp_path / "vocab"
    record = build_vocab_map(path, target_vocab_size=10, draft_vocab_size=3, out_dir=out)

    d2t, t2d = load_vocab_map(out / "vocab_map.safetensors")
    # Train counts: 3 and 4 (4 each), then the tie 1/2/7 (1 each) -> 1.
    check_map(d2t, t2d, [1, 3, 4], 10)
    assert json.loads((out / "coverage.json").read_text()) == record
    assert record["map_needed"] is True and record["draft_vocab_size"] == 3
    assert record["coverage"] == {"train": 9 / 11, "eval": 1 / 3}
    assert record["counts"]["train"]["supervised_tokens"] == 11
    assert record["counts"]["train"]["distinct_tokens"] == 5
    assert record["counts"]["train"]["top_tokens"][:2] == [[3, 4], [4, 4]]
    sizes = [row["draft_vocab_size"] for row in record["coverage_by_size"]]
    assert sizes == [3, 10]  # 8k..64k capped at the target vocab of 10
    assert record["coverage_by_size"][-1]["train"] == 1.0


def test_build_vocab_map_without_map_needed(tmp_path):
    path = save_dataset(tmp_path / "ds", TRAIN, EVAL)
    record = build_vocab_map(path, target_vocab_size=10, draft_vocab_size=32,
                             out_dir=tmp_path / "v")
    assert record["map_needed"] is False and record["draft_vocab_size"] == 10
    assert "no map needed" in record["note"]
    d2t, t2d = load_vocab_map(tmp_path / "v" / "vocab_map.safetensors")
    assert d2t.tolist() == [0] * 10 and bool(t2d.all())


def test_a_draft_vocab_under_min_coverage_is_refused_naming_the_size_that_covers(tmp_path):
    """Eval tokens 5, 3, 8 against the train ranking 3, 4, 1, 2, 7, then the unseen 0, 5, 6,
    8, 9: three draft tokens hold one of three, and nine hold all three."""
    path = save_dataset(tmp_path / "ds", TRAIN, EVAL)
    with pytest.raises(VocabTooSmall) as refused:
        build_vocab_map(path, target_vocab_size=10, draft_vocab_size=3, out_dir=tmp_path / "v",
                        min_coverage=0.98)
    message = str(refused.value)
    assert "config key 'vocab.draft_vocab_size'" in message
    assert "3 draft tokens cover 33.33%" in message and "9 would cover it" in message
    assert not (tmp_path / "v" / "vocab_map.safetensors").exists()
    record = build_vocab_map(path, target_vocab_size=10, draft_vocab_size=9,
                             out_dir=tmp_path / "v", min_coverage=0.98)
    assert record["coverage"]["eval"] == 1.0
    # the size named is the smallest: eight tokens hold two of three
    with pytest.raises(VocabTooSmall, match="8 draft tokens cover 66.67%"):
        build_vocab_map(path, target_vocab_size=10, draft_vocab_size=8, out_dir=tmp_path / "w",
                        min_coverage=0.98)
    # 0 accepts any size
    assert build_vocab_map(path, target_vocab_size=10, draft_vocab_size=3,
                           out_dir=tmp_path / "x", min_coverage=0.0)["draft_vocab_size"] == 3

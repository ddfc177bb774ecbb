"""Prompt shards: every source format and record shape, ids, de-duplication, sharding, rejects."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftline.core.records import RecordError, read_shard
from draftline.stages.prompts import (
    PromptSourceError,
    build_prompt_shards,
    bundled_prompts_path,
)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def read_shards(out: Path, summary: dict) -> list[dict]:
    """All written records, shard by shard."""
    rows = []
    for i in range(summary["num_shards"]):
        rows += read_jsonl(out / f"shard-{i}.jsonl")
    return rows


def build(tmp_path: Path, sources: list[dict], num_shards=1, max_samples=1000, seed=0, name="out"):
    out = tmp_path / name
    summary = build_prompt_shards(sources, out, num_shards, max_samples, seed)
    return out, summary, read_shards(out, summary)


def by_id(rows: list[dict]) -> dict[str, list]:
    return {r["id"]: r["messages"] for r in rows}


def expected_hash_id(messages: list[dict]) -> str:
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def s(text):
    return {"role": "system", "content": text}


# --- record shapes ----------------------------------------------------------------------------


def test_openai_messages_trimmed_stripped_and_system_prompt_prepended(tmp_path):
    src = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"id": "multi", "messages": [u(" hi "), a("hello"), u("how are you?"), a("fine")]},
            {"id": "has-system", "messages": [s("be brief"), u("q"), a("x")]},
            {"id": "extra-keys", "messages": [{"role": "user", "content": "k", "name": "bob"}]},
            {"id": "developer", "messages": [{"role": "developer", "content": "d"}, u("z")]},
        ],
    )
    _, summary, rows = build(
        tmp_path, [{"path": str(src), "id_field": "id", "system_prompt": "SYS"}]
    )
    got = by_id(rows)
    assert summary["accepted"] == 4 and summary["rejected_total"] == 0
    # trailing assistant turn dropped, contents stripped, system prompt prepended
    assert got["multi"] == [s("SYS"), u("hi"), a("hello"), u("how are you?")]
    # the record's own system turn wins over system_prompt
    assert got["has-system"] == [s("be brief"), u("q")]
    assert got["extra-keys"] == [s("SYS"), u("k")]
    assert got["developer"] == [s("d"), u("z")]
    assert all(m[-1]["role"] == "user" for m in got.values())


def test_sharegpt_conversations(tmp_path):
    src = write_jsonl(
        tmp_path / "sharegpt.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "sys"},
                    {"from": "human", "value": "first"},
                    {"from": "gpt", "value": "answer"},
                    {"from": "user", "value": "second"},
                    {"from": "assistant", "value": "answer 2"},
                ]
            },
            {"conversations": [{"from": "human", "value": "solo"}]},
        ],
    )
    _, summary, rows = build(tmp_path, [{"path": str(src)}])
    messages = sorted((r["messages"] for r in rows), key=len)
    assert summary["accepted"] == 2
    assert messages == [[u("solo")], [s("sys"), u("first"), a("answer"), u("second")]]


def test_prompt_field_is_configurable(tmp_path):
    src = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 2+2?"}, {"question": "Why?"}])
    _, summary, rows = build(tmp_path, [{"path": str(src), "prompt_field": "question"}])
    assert sorted(r["messages"][0]["content"] for r in rows) == ["What is 2+2?", "Why?"]
    assert all(r["messages"] == [u(r["messages"][0]["content"])] for r in rows)
    # with the default field name the same records lack a prompt: the source gives none
    with pytest.raises(PromptSourceError, match=r"rejected: missing_prompt_field=2\)") as info:
        build(tmp_path, [{"path": str(src)}], name="default")
    assert info.value.reason == "no_prompts"


# --- source formats ---------------------------------------------------------------------------

RECORDS = [
    {"pid": "p1", "prompt": "alpha"},
    {"pid": "p2", "messages": [u("beta"), a("b")]},
    {"pid": "p3", "conversations": [{"from": "human", "value": "gamma"}]},
]
EXPECTED = {"p1": [u("alpha")], "p2": [u("beta")], "p3": [u("gamma")]}


def as_columns(records: list[dict]) -> dict[str, list]:
    """Column lists with None where a record lacks the field, as columnar formats store them.

    (Building from a list of rows would infer the schema from the first row only.)
    """
    keys = sorted({k for r in records for k in r})
    return {k: [r.get(k) for r in records] for k in keys}


@pytest.mark.parametrize("wrapped", [False, True])
def test_json_list_and_data_wrapper(tmp_path, wrapped):
    src = tmp_path / "data.json"
    src.write_text(json.dumps({"data": RECORDS} if wrapped else RECORDS))
    _, summary, rows = build(tmp_path, [{"path": str(src), "id_field": "pid"}])
    assert by_id(rows) == EXPECTED and summary["read"] == 3


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "data.parquet"
    pq.write_table(pa.table(as_columns(RECORDS)), src)
    _, summary, rows = build(tmp_path, [{"path": str(src), "id_field": "pid"}])
    assert by_id(rows) == EXPECTED and summary["rejected_total"] == 0


def test_saved_hf_dataset_dir_and_split(tmp_path):
    import datasets

    plain = tmp_path / "plain"
    datasets.Dataset.from_dict(as_columns(RECORDS)).save_to_disk(str(plain))
    _, _, rows = build(tmp_path, [{"path": str(plain), "id_field": "pid"}], name="o1")
    assert by_id(rows) == EXPECTED

    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "train prompt"}]),
            "test": datasets.Dataset.from_list([{"prompt": "test prompt"}]),
        }
    ).save_to_disk(str(splits))
    _, _, rows = build(tmp_path, [{"path": str(splits), "split": "test"}], name="o2")
    assert [r["messages"] for r in rows] == [[u("test prompt")]]
    with pytest.raises(PromptSourceError, match=r"no split 'valid'.*\['test', 'train'\]"):
        build(tmp_path, [{"path": str(splits), "split": "valid"}], name="o3")


def test_hf_prefix_goes_through_load_dataset(tmp_path, monkeypatch):
    """hf:<id> calls datasets.load_dataset, which also accepts a local data folder (no hub)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    folder = tmp_path / "hubish"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"prompt": "from load_dataset"}])
    _, summary, rows = build(tmp_path, [{"path": f"hf:{folder}", "split": "train"}])
    assert [r["messages"] for r in rows] == [[u("from load_dataset")]]
    assert summary["sources"][0]["path"] == f"hf:{folder}"


def _hub_reachable() -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _hub_reachable(), reason="the Hugging Face hub is not reachable")
def test_hf_hub_dataset(tmp_path):
    source = {"path": "hf:tatsu-lab/alpaca", "split": "train[:20]", "prompt_field": "instruction"}
    _, summary, rows = build(tmp_path, [source])
    assert summary["read"] == 20 and summary["accepted"] >= 19
    assert all(r["messages"][-1]["role"] == "user" for r in rows)


def test_missing_and_unreadable_sources_raise_naming_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        build(tmp_path, [{"path": str(missing)}])
    for name, content, pattern in [
        ("prompts.txt", "hello", "unsupported format '.txt'"),
        ("broken.json", "[{", "not valid JSON"),
        ("scalar.json", "42", "expected a list of records"),
        ("broken.parquet", "not parquet", "not a readable parquet file"),
    ]:
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(PromptSourceError, match=pattern) as info:
            build(tmp_path, [{"path": str(path)}])
        assert name in str(info.value)
    not_a_dataset = tmp_path / "emptydir"
    not_a_dataset.mkdir()
    with pytest.raises(PromptSourceError, match="emptydir"):
        build(tmp_path, [{"path": str(not_a_dataset)}])
    assert issubclass(PromptSourceError, ValueError)


# --- ids and de-duplication -------------------------------------------------------------------


def test_explicit_ids_are_kept_and_hash_ids_are_stable(tmp_path):
    src = write_jsonl(
        tmp_path / "ids.jsonl",
        [{"n": 7, "prompt": "seven"}, {"n": "  x-1 ", "prompt": "x"}],
    )
    _, _, rows = build(tmp_path, [{"path": str(src), "id_field": "n"}], name="explicit")
    assert set(by_id(rows)) == {"7", "x-1"}

    # hash ids depend only on the normalized messages, not on format or record order
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "one"}, {"messages": [u("two")]}])
    as_json = tmp_path / "b.json"
    as_json.write_text(json.dumps([{"conversations": [{"from": "human", "value": " two "}]}]))
    _, _, rows_a = build(tmp_path, [{"path": str(jsonl)}], name="ha")
    _, _, rows_b = build(tmp_path, [{"path": str(as_json)}], name="hb")
    ids_a = by_id(rows_a)
    assert ids_a == {
        expected_hash_id([u("one")]): [u("one")],
        expected_hash_id([u("two")]): [u("two")],
    }
    assert list(by_id(rows_b)) == [expected_hash_id([u("two")])]
    # a system prompt is part of the content, so it changes the id
    _, _, rows_c = build(tmp_path, [{"path": str(as_json), "system_prompt": "S"}], name="hc")
    assert list(by_id(rows_c)) == [expected_hash_id([s("S"), u("two")])]


def test_deduplication_by_content_and_duplicate_explicit_ids(tmp_path):
    first = write_jsonl(
        tmp_path / "first.jsonl",
        [
            {"id": "a", "prompt": "same"},
            {"id": "b", "messages": [u("  same "), a("dropped reply")]},  # same content as "a"
            {"id": "a", "prompt": "different"},  # id reused on other content
            {"id": "c", "prompt": "unique"},
        ],
    )
    second = write_jsonl(tmp_path / "second.jsonl", [{"id": "z", "prompt": "unique"}])
    _, summary, rows = build(
        tmp_path, [{"path": str(first), "id_field": "id"}, {"path": str(second), "id_field": "id"}]
    )
    assert by_id(rows) == {"a": [u("same")], "c": [u("unique")]}  # first occurrence wins
    assert summary["duplicates"] == 2
    assert summary["rejected"] == {"duplicate_id": 1}
    assert (
        summary["read"] == summary["accepted"] + summary["duplicates"] + summary["rejected_total"]
    )
    assert [src["duplicates"] for src in summary["sources"]] == [1, 1]


def test_max_samples_takes_first_unique_records_in_source_order(tmp_path):
    first = write_jsonl(tmp_path / "1.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    second = write_jsonl(tmp_path / "2.jsonl", [{"prompt": "p0"}] + [{"prompt": "q"}] * 2)
    sources = [{"path": str(first)}, {"path": str(second)}]
    _, summary, rows = build(tmp_path, sources, num_shards=2, max_samples=6)
    contents = sorted(r["messages"][0]["content"] for r in rows)
    assert contents == ["p0", "p1", "p2", "p3", "p4", "q"]
    # the sixth unique prompt ends the reading: the repeated "q" after it is never read
    assert (summary["read"], summary["accepted"], summary["duplicates"]) == (7, 6, 1)
    assert summary["written"] == 6 and summary["stopped_at_max_samples"] is True
    _, summary, rows = build(tmp_path, sources, num_shards=2, max_samples=3, name="capped")
    assert sorted(r["messages"][0]["content"] for r in rows) == ["p0", "p1", "p2"]
    assert summary["shard_sizes"] == [2, 1]
    assert [(src["read"], src.get("skipped")) for src in summary["sources"]] == [
        (3, None), (0, "max_samples reached"),
    ]
    _, summary, _ = build(tmp_path, sources, num_shards=2, max_samples=100, name="all")
    assert (summary["read"], summary["accepted"], summary["duplicates"]) == (8, 6, 2)
    assert summary["stopped_at_max_samples"] is False


# --- sharding ---------------------------------------------------------------------------------


def test_shards_are_deterministic_balanced_and_complete(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt number {i}"} for i in range(23)])
    out1, summary, rows = build(tmp_path, [{"path": str(src)}], num_shards=4, name="run1")
    out2, _, _ = build(tmp_path, [{"path": str(src)}], num_shards=4, name="run2")
    names = sorted(p.name for p in out1.iterdir())
    assert names == sorted(p.name for p in out2.iterdir())
    assert names == ["rejected.jsonl", *[f"shard-{i}.jsonl" for i in range(4)], "summary.json"]
    for name in names:  # same inputs => byte-identical files (and no temp files left behind)
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes()

    assert summary["shard_sizes"] == [6, 6, 6, 5]
    sizes = [len(read_jsonl(out1 / f"shard-{i}.jsonl")) for i in range(4)]
    assert sizes == summary["shard_sizes"]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 23

    # another seed deals the same records differently
    out3, _, rows3 = build(tmp_path, [{"path": str(src)}], num_shards=4, seed=1, name="run3")
    assert sorted(r["id"] for r in rows3) == sorted(ids)
    assert read_jsonl(out3 / "shard-0.jsonl") != read_jsonl(out1 / "shard-0.jsonl")


def test_rebuild_with_fewer_shards_removes_stale_shard_files(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"x{i}"} for i in range(10)])
    out, _, _ = build(tmp_path, [{"path": str(src)}], num_shards=5)
    _, summary, rows = build(tmp_path, [{"path": str(src)}], num_shards=3)
    assert sorted(p.name for p in out.glob("shard-*")) == [f"shard-{i}.jsonl" for i in range(3)]
    assert summary["shard_sizes"] == [4, 3, 3] and len(rows) == 10


# --- rejected records -------------------------------------------------------------------------

VALID = [
    '{"id": "ok-1", "prompt": "fine prompt"}',
    '{"id": "ok-2", "messages": [{"role": "user", "content": "fine too"}]}',
    '{"id": "ok-3", "conversations": [{"from": "human", "value": "also fine"}]}',
]
# (line, expected reason); the fixture interleaves them with the valid lines above
MALFORMED = [
    ('{"id": "m1", "prompt": "unterminated', "malformed_json"),
    ("   ", "empty_line"),
    ('["not", "an", "object"]', "not_an_object"),
    ("{}", "empty_record"),
    ('{"id": "m2", "messages": "just a string"}', "messages_not_list"),
    ('{"id": "m3", "messages": ["hello"]}', "message_not_object"),
    ('{"id": "m4", "messages": [{"role": "user", "content": ["a", "b"]}]}', "content_not_string"),
    ('{"id": "m5", "messages": [{"role": "wizard", "content": "x"}]}', "unknown_role"),
    ('{"id": "m6", "messages": [{"role": "user", "content": "   "}]}', "empty_content"),
    (
        '{"id": "m7", "messages": [{"role": "system", "content": "s"}, '
        '{"role": "assistant", "content": "a"}]}',
        "no_user_turn",
    ),
    ('{"id": "m8", "text": "wrong field"}', "missing_prompt_field"),
    ('{"id": "m9", "prompt": 42}', "prompt_not_string"),
    ('{"prompt": "no id here"}', "missing_id"),
    ('{"id": "", "prompt": "empty id"}', "empty_id"),
    ('{"id": 1.5, "prompt": "float id"}', "bad_id"),
    ('{"id": "ok-1", "prompt": "reused id"}', "duplicate_id"),
    ('{"id": "m10", "messages": []}', "empty_messages"),
    (
        '{"id": "m11", "messages": [{"role": "user", "content": "u"}, '
        '{"role": "system", "content": "late"}, {"role": "user", "content": "v"}]}',
        "system_not_first",
    ),
    ('{"id": "m12", "conversations": {"from": "human"}}', "conversations_not_list"),
    ("null", "not_an_object"),
    ('"just a string"', "not_an_object"),
    ('{"id": "m14", "messages": [{"content": "who said this?"}]}', "missing_role"),
    ('{"id": "m15", "conversations": [{"value": "no speaker"}]}', "missing_role"),
    ('{"id": "m16", "messages": [{"role": 1, "content": "x"}]}', "role_not_string"),
    ('{"id": "m17", "messages": [{"role": "user"}]}', "missing_content"),
    ('{"id": "m18", "messages": [{"role": "user", "content": null}]}', "missing_content"),
    (
        '{"id": "m19", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, '
        '{"type": "image_url", "image_url": {"url": "x.png"}}]}]}',
        "content_parts",
    ),
    (
        '{"id": "m20", "messages": "[{\\"role\\": \\"user\\", \\"content\\": \\"hi\\"}]"}',
        "messages_json_encoded",
    ),
    (
        '{"id": "m21", "conversations": "[{\\"from\\": \\"human\\", \\"value\\": \\"hi\\"}]"}',
        "conversations_json_encoded",
    ),
    ('{"id": "m22", "conversations": [{"from": "robot", "value": "beep"}]}', "unknown_role"),
    ('{"id": "   ", "prompt": "blank id"}', "empty_id"),
    ('{"id": {"n": 1}, "prompt": "object id"}', "bad_id"),
    ('{"id": true, "prompt": "boolean id"}', "bad_id"),
    (
        '{"id": "m23", "messages": [{"role": "user", "content": "nul \\u0000 here"}]}',
        "control_character",
    ),
    ('{"id": "m\\u001b[0m24", "prompt": "escape code in the id"}', "control_character"),
    ('{"id": "m25", "prompt": "lone \\ud83d surrogate"}', "unpaired_surrogate"),
    ('{"id": "m26", "prompt": "first", "prompt": "second"}', "duplicate_key"),
    (
        '{"id": "m27", "messages": [{"role": "user", "content": "a", "content": "b"}]}',
        "duplicate_key",
    ),
    ('{"id": "m28", "prompt": "  \\n\\t "}', "empty_content"),
]
# (reason, text its detail must contain): every detail names the field and position
DETAILS = [
    ("malformed_json", "invalid JSON: Unterminated string starting at"),
    ("empty_line", "blank line"),
    ("empty_record", "record has no fields"),
    ("messages_not_list", "'messages' must be a list, got string"),
    ("conversations_not_list", "'conversations' must be a list, got object"),
    ("empty_messages", "'messages' is an empty list"),
    ("missing_prompt_field", "no 'messages', 'conversations' or 'prompt' field"),
    ("prompt_not_string", "field 'prompt' must be a string, got number"),
    ("missing_id", "id field 'id' is missing"),
    ("not_an_object", "got array"),
    ("not_an_object", "got null"),
    ("not_an_object", "got string"),
    ("message_not_object", "messages[0] must be an object, got string"),
    ("content_not_string", "messages[0] content must be a string, got array"),
    ("unknown_role", "messages[0] has unknown role 'wizard'"),
    ("unknown_role", "conversations[0] has unknown role 'robot'"),
    ("empty_content", "messages[0] (user) has empty content"),
    ("system_not_first", "messages[1] is a system turn at position 1"),
    ("no_user_turn", "roles: system, assistant"),
    ("missing_role", "messages[0] has no 'role'"),
    ("missing_role", "conversations[0] has no 'from' or 'role'"),
    ("role_not_string", "messages[0] 'role' must be a string, got number"),
    ("missing_content", "messages[0] has no 'content'"),
    ("missing_content", "messages[0] has 'content' set to null"),
    ("content_parts", "messages[0] content is a list of 2 typed parts (text, image_url)"),
    ("messages_json_encoded", "'messages' is a string holding a JSON list"),
    ("conversations_json_encoded", "'conversations' is a string holding a JSON list"),
    ("empty_id", "id field 'id' is empty"),
    ("bad_id", "id field 'id' must be a string or integer, got number"),
    ("bad_id", "got object"),
    ("bad_id", "got boolean"),
    ("control_character", "messages[0] content has control character U+0000 at offset 4"),
    ("control_character", "id field 'id' has control character U+001B at offset 1"),
    ("unpaired_surrogate", "field 'prompt' content has unpaired surrogate U+D83D at offset 5"),
    ("duplicate_key", "key 'prompt' appears more than once in the record"),
    ("duplicate_key", "key 'content' appears more than once in messages[0]"),
    ("duplicate_id", "id 'ok-1' already used"),
    ("invalid_utf8", "line is not valid UTF-8"),
]


def test_malformed_records_are_rejected_with_reasons_and_the_run_continues(tmp_path, capsys):
    lines = [VALID[0], *(line for line, _ in MALFORMED[:9]), VALID[1]]
    lines += [line for line, _ in MALFORMED[9:]] + [VALID[2], VALID[0]]  # last: a duplicate
    src = tmp_path / "messy.jsonl"
    payload = "\n".join(lines).encode() + b"\n" + b'{"id": "m13", "prompt": "caf\xe9"}\n'
    src.write_bytes(payload)

    out, summary, rows = build(tmp_path, [{"path": str(src), "id_field": "id"}], num_shards=2)

    assert sorted(r["id"] for r in rows) == ["ok-1", "ok-2", "ok-3"]
    expected = Counter(reason for _, reason in MALFORMED) + Counter({"invalid_utf8": 1})
    assert len(expected) >= 20  # the requirement: at least 20 kinds of malformed records
    assert summary["rejected"] == dict(expected)
    assert summary["read"] == len(lines) + 1
    assert summary["accepted"] == 3 and summary["duplicates"] == 1
    assert summary["rejected_total"] == len(MALFORMED) + 1

    rejected = read_jsonl(out / "rejected.jsonl")
    assert len(rejected) == summary["rejected_total"]
    line_of = {line: n for n, line in enumerate(lines, start=1)}
    for entry, (line, reason) in zip(rejected, MALFORMED, strict=False):
        assert entry["source"] == str(src)
        assert entry["reason"] == reason
        assert entry["line"] == line_of[line] and entry["index"] == line_of[line] - 1
        assert entry["detail"]
        assert entry["excerpt"] == line[:200]
    utf8 = rejected[-1]
    assert utf8["reason"] == "invalid_utf8" and utf8["line"] == len(lines) + 1
    assert "caf" in utf8["excerpt"]
    details = [(e["reason"], e["detail"]) for e in rejected]
    for reason, text in DETAILS:
        assert any(r == reason and text in d for r, d in details), (reason, text, details)
    assert {reason for reason, _ in DETAILS} == set(expected)

    # the log line reports every reason with its count, and where the records went
    printed = capsys.readouterr().out
    report = re.search(r"rejected (\d+) \(([^)]*)\)", printed)
    assert report is not None, printed
    assert int(report.group(1)) == summary["rejected_total"]
    counts = dict(item.split("=") for item in report.group(2).split(", "))
    assert {reason: int(n) for reason, n in counts.items()} == dict(expected)
    assert f"{out / 'rejected.jsonl'}" in printed


def test_rejects_from_columnar_sources_carry_an_index(tmp_path):
    src = tmp_path / "rows.json"
    src.write_text(json.dumps([{"prompt": "good"}, {"prompt": ""}, 5, {"prompt": None}]))
    out, summary, _ = build(tmp_path, [{"path": str(src)}])
    rejected = read_jsonl(out / "rejected.jsonl")
    assert [(e["index"], e["line"], e["reason"]) for e in rejected] == [
        (1, None, "empty_content"),
        (2, None, "not_an_object"),
        (3, None, "empty_record"),
    ]
    assert rejected[1]["excerpt"] == "5"
    assert summary["accepted"] == 1


def test_unpaired_surrogates_in_json_sources_are_rejected_and_still_written(tmp_path):
    """A lone surrogate in a .json source must not stop the run, in the content or in a key."""
    src = tmp_path / "rows.json"
    src.write_text(
        '[{"prompt": "ok"}, {"prompt": "bad \\udc00 text"}, {"k\\ud800": {"x": 1, "x": 2}}]'
    )
    out, summary, rows = build(tmp_path, [{"path": str(src)}])
    assert [r["messages"] for r in rows] == [[u("ok")]]
    assert summary["rejected"] == {"duplicate_key": 1, "unpaired_surrogate": 1}
    rejected = read_jsonl(out / "rejected.jsonl")
    assert [(e["index"], e["reason"]) for e in rejected] == [
        (1, "unpaired_surrogate"),
        (2, "duplicate_key"),
    ]
    assert rejected[0]["excerpt"] == '{"prompt": "bad \\udc00 text"}'
    assert rejected[1]["detail"] == "key 'x' appears more than once in k\\ud800"


# --- bundled prompts --------------------------------------------------------------------------


def test_bundled_prompts_load_cleanly(tmp_path, capsys):
    out, summary, rows = build(tmp_path, [{"path": "bundled"}], num_shards=3, max_samples=10_000)
    assert summary["rejected_total"] == 0 and summary["duplicates"] == 0
    assert 300 <= summary["accepted"] <= 400 and summary["written"] == summary["accepted"]
    assert read_jsonl(out / "rejected.jsonl") == []
    assert "rejected 0" in capsys.readouterr().out

    file_ids = [r["id"] for r in read_jsonl(bundled_prompts_path())]
    assert file_ids == [f"bundled-{i:04d}" for i in range(1, len(file_ids) + 1)]
    assert sorted(r["id"] for r in rows) == file_ids
    conversations = [r["messages"] for r in rows]
    assert all(m[-1]["role"] == "user" for m in conversations)
    assert sum(m[0]["role"] == "system" for m in conversations) >= 20
    assert sum(sum(t["role"] == "user" for t in m) > 1 for m in conversations) >= 20
    # the toy target has a 1024-token context: keep every turn short
    assert max(len(t["content"].split()) for m in conversations for t in m) < 60


def test_read_shard_names_the_bad_line(tmp_path):
    path = tmp_path / "shard-0.jsonl"
    path.write_text('{"id": "a", "messages": []}\n{"id": "b"}\n')
    with pytest.raises(RecordError, match=r"shard-0.jsonl:2"):
        read_shard(path)


# --- encodings, line cap, nesting, streaming ---------------------------------------------------

GOOD_LINES = [b'{"prompt": "first"}', b'{"prompt": "second"}']


def write_lines(path: Path, lines: list[bytes], prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + b"".join(line + b"\n" for line in lines))
    return path


def test_deeply_nested_line_is_rejected_and_the_run_continues(tmp_path):
    deep = b'{"p": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    src = write_lines(tmp_path / "deep.jsonl", [GOOD_LINES[0], deep, GOOD_LINES[1]])
    out, summary, rows = build(tmp_path, [{"path": str(src)}])
    assert sorted(r["messages"][0]["content"] for r in rows) == ["first", "second"]
    assert summary["rejected"] == {"too_deeply_nested": 1}
    [entry] = read_jsonl(out / "rejected.jsonl")
    assert (entry["line"], entry["reason"]) == (2, "too_deeply_nested")
    assert "nested deeper than 100 levels" in entry["detail"]


def test_deep_but_parseable_nesting_in_a_json_source_is_rejected(tmp_path):
    src = tmp_path / "rows.json"
    src.write_text('[{"prompt": "ok"}, {"prompt": "x", "extra": ' + "[" * 500 + "]" * 500 + "}]")
    out, summary, rows = build(tmp_path, [{"path": str(src)}])
    assert [r["messages"] for r in rows] == [[u("ok")]]
    assert summary["rejected"] == {"too_deeply_nested": 1}
    assert read_jsonl(out / "rejected.jsonl")[0]["index"] == 1


def test_utf8_bom_is_accepted_in_jsonl_and_json(tmp_path):
    bom = b"\xef\xbb\xbf"
    jsonl = write_lines(tmp_path / "bom.jsonl", GOOD_LINES, prefix=bom)
    _, summary, rows = build(tmp_path, [{"path": str(jsonl)}])
    assert summary["rejected_total"] == 0
    assert sorted(r["messages"][0]["content"] for r in rows) == ["first", "second"]
    whole = tmp_path / "bom.json"
    whole.write_bytes(bom + b'[{"prompt": "first"}]')
    _, summary, rows = build(tmp_path, [{"path": str(whole)}], name="json")
    assert [r["messages"] for r in rows] == [[u("first")]]


@pytest.mark.parametrize("encoding, what", [
    ("utf-16", "UTF-16"), ("utf-16-le", "UTF-16 or UTF-32"), ("utf-16-be", "UTF-16 or UTF-32"),
    ("utf-32", "UTF-32"),
])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf16_and_utf32_files_are_refused_naming_the_file(tmp_path, encoding, what, suffix):
    text = '{"prompt": "first"}\n' if suffix == ".jsonl" else '[{"prompt": "first"}]'
    src = tmp_path / f"wide{suffix}"
    src.write_bytes(text.encode(encoding))
    with pytest.raises(PromptSourceError) as info:
        build(tmp_path, [{"path": str(src)}])
    assert isinstance(info.value, RecordError)
    assert info.value.reason == "unsupported_encoding"
    assert f"prompt source {src}: " in str(info.value)
    assert f"{what}" in str(info.value) and "UTF-8" in str(info.value)


def test_a_source_without_a_usable_prompt_fails_the_stage_naming_it(tmp_path):
    good = write_lines(tmp_path / "good.jsonl", GOOD_LINES)
    latin1 = write_lines(tmp_path / "latin1.jsonl", [b'{"prompt": "caf\xe9"}', b"", b"{"])
    with pytest.raises(PromptSourceError) as info:
        build(tmp_path, [{"path": str(good)}, {"path": str(latin1)}])
    message = str(info.value)
    assert info.value.reason == "no_prompts"
    assert f"prompt source {latin1}: no usable prompt in 3 records" in message
    assert "invalid_utf8=1" in message and "empty_line=1" in message
    assert "malformed_json=1" in message
    assert "line 1: invalid_utf8: line is not valid UTF-8" in message
    assert info.value.counts == {"path": str(latin1), "read": 3, "accepted": 0,
                                 "duplicates": 0, "rejected": 3}
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(PromptSourceError, match=r"empty.jsonl: no usable prompt in 0 records"):
        build(tmp_path, [{"path": str(empty)}])


def test_a_source_of_duplicates_only_is_not_an_error(tmp_path):
    first = write_lines(tmp_path / "1.jsonl", GOOD_LINES)
    again = write_lines(tmp_path / "2.jsonl", GOOD_LINES)
    _, summary, _ = build(tmp_path, [{"path": str(first)}, {"path": str(again)}])
    assert (summary["accepted"], summary["duplicates"]) == (2, 2)


def test_lines_over_the_cap_are_rejected_and_later_lines_still_read(tmp_path):
    long_line = b'{"prompt": "' + b"x" * 5000 + b'"}'
    src = write_lines(tmp_path / "long.jsonl", [GOOD_LINES[0], long_line, GOOD_LINES[1]])
    out = tmp_path / "out"
    summary = build_prompt_shards([{"path": str(src)}], out, 1, 100, max_line_bytes=1024)
    assert summary["accepted"] == 2 and summary["rejected"] == {"line_too_long": 1}
    [entry] = read_jsonl(out / "rejected.jsonl")
    assert (entry["line"], entry["index"]) == (2, 1)
    assert entry["detail"] == (
        f"line of {len(long_line) + 1} bytes is longer than prompts.max_line_bytes (1024)"
    )
    assert entry["excerpt"] == long_line[:200].decode()
    # the cap counts the line's bytes: the same line fits under a larger one
    summary = build_prompt_shards([{"path": str(src)}], out, 1, 100, max_line_bytes=8192)
    assert summary["accepted"] == 3 and summary["rejected_total"] == 0


def test_reading_stops_once_max_samples_prompts_are_found(tmp_path):
    """Records past the first max_samples unique prompts are never read (nor held), so a
    later source is not opened at all: not even its encoding is checked."""
    first = write_lines(tmp_path / "1.jsonl", [b"{", GOOD_LINES[0], GOOD_LINES[0],
                                                GOOD_LINES[1], b'{"prompt": "third"}'])
    wide = tmp_path / "2.jsonl"
    wide.write_bytes('{"prompt": "never read"}\n'.encode("utf-16"))
    out, summary, rows = build(tmp_path, [{"path": str(first)}, {"path": str(wide)}],
                               max_samples=2)
    assert sorted(r["messages"][0]["content"] for r in rows) == ["first", "second"]
    assert (summary["read"], summary["accepted"], summary["duplicates"]) == (4, 2, 1)
    assert summary["rejected_total"] == 1 and summary["stopped_at_max_samples"] is True
    assert [(s["path"], s["read"], s.get("skipped")) for s in summary["sources"]] == [
        (str(first), 4, None), (str(wide), 0, "max_samples reached"),
    ]


# --- any bytes in, only the reader's own errors out ---------------------------------------------

RECORD_LINES = st.sampled_from([
    *GOOD_LINES, b'{"prompt": "first"}', b'{"messages": [{"role": "user", "content": "m"}]}',
    b"", b"   ", b"{", b"[1, 2]", b"null", b'{"p": ' + b"[" * 1200 + b"]" * 1200 + b"}",
    b'{"prompt": "' + b"y" * 300 + b'"}', b'{"prompt": "caf\xe9"}', b'{"prompt": "a\x00b"}',
    b'{"prompt": "\\ud800"}', b'{"prompt": "x", "prompt": "y"}', b"\xef\xbb\xbf",
    b"\xff\xfe", b"\x00\x00\xfe\xff", b"\r", '{"prompt": "ünï"}'.encode(),
])
PROMPT_FILE_BYTES = st.one_of(
    st.binary(max_size=600),
    st.builds(lambda lines, sep: sep.join(lines), st.lists(RECORD_LINES, max_size=8),
              st.sampled_from([b"\n", b"\r\n"])),
    st.builds(lambda prefix, lines: prefix + b"\n".join(lines),
              st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\xff\xfe\x00\x00"]),
              st.lists(RECORD_LINES, max_size=4)),
)


@settings(max_examples=200, deadline=None)
@given(raw=PROMPT_FILE_BYTES, suffix=st.sampled_from([".jsonl", ".json"]))
def test_any_bytes_give_counted_records_or_the_readers_own_error(raw, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"fuzz{suffix}"
        src.write_bytes(raw)
        try:
            summary = build_prompt_shards([{"path": str(src)}], Path(tmp) / "out", 2, 1000,
                                          max_line_bytes=256)
        except RecordError as exc:  # PromptSourceError is one: a whole file refused
            assert str(src) in str(exc)
            counts = getattr(exc, "counts", None)
            if counts is not None:
                assert counts["accepted"] + counts["duplicates"] == 0
                assert counts["read"] == counts["rejected"]
            return
    [source] = summary["sources"]
    for counts in (summary, source):
        rejected = counts.get("rejected_total", counts["rejected"])
        assert counts["read"] == counts["accepted"] + counts["duplicates"] + rejected
    assert summary["accepted"] >= 1
    assert summary["rejected_total"] == sum(summary["rejected"].values())

"""Prompt shards: read prompt sources, normalize them to OpenAI chat messages, shard them.

Kept whole (about 880 lines): most of the length is one reader per source format with its
per-record checks, each naming the file and record it refuses.

Stage 1 of the pipeline. ``build_prompt_shards`` reads every configured source, turns each
record into ``{"id": str, "messages": [...]}`` whose last message is a user turn, drops
duplicates, keeps at most ``max_samples`` and splits the rest into ``num_shards`` balanced,
deterministic shards.

Rules (see docs/formats.md for the file formats):

* Sources: local ``.jsonl`` / ``.json`` (a list of records or ``{"data": [...]}``) / ``.parquet``
  files, a directory written by ``datasets.save_to_disk`` (``split`` picks from a DatasetDict),
  ``hf:<hub id>`` (``datasets.load_dataset(id, split=split)``; a local data folder works too) and
  ``bundled`` (the prompts shipped in ``draftline/data/prompts.jsonl``, ids taken from its
  ``id`` field).
* Record shapes, tried in this order: OpenAI ``messages`` (role/content), ShareGPT
  ``conversations`` (from/value), then a single string field named by ``prompt_field``.
  Only the roles system, user and assistant are kept (``developer`` counts as system; ShareGPT
  human/gpt map to user/assistant). Contents are stripped of surrounding whitespace and other
  message keys are dropped. Trailing turns after the last user turn are removed; a system turn
  may only come first. ``system_prompt`` is prepended when a record has no system turn.
* Ids: the ``id_field`` value (a non-empty string or integer) when configured, otherwise
  ``h-`` + the first 16 hex digits of the sha256 of the canonical JSON of the normalized
  messages. Records with the same normalized messages are duplicates (the first one wins); a
  repeated explicit id on different content is rejected.
* Selection: the first ``max_samples`` unique records in source order (sources in config order,
  records in file order). Reading stops there: later records and sources are not read, so
  memory holds the kept prompts and nothing that grows with the files.
* Files: UTF-8, a leading byte order mark allowed; a file that starts like UTF-16 or UTF-32 (a
  byte order mark or NUL bytes) is refused whole. A ``.jsonl`` line longer than
  ``max_line_bytes`` is rejected (``line_too_long``) and skipped without being held; JSON nested
  deeper than 100 levels is rejected (``too_deeply_nested``).
* Sharding: the selected records are sorted by ``sha256(f"{seed}:{id}")`` and dealt round-robin,
  so shard sizes differ by at most one and the same inputs give byte-identical files.
* Text checks: kept contents and ids must not hold control characters (tab, newline and
  carriage return are fine in contents) or unpaired UTF-16 surrogates (JSON ``"\\ud800"``), and no
  JSON object may repeat a key (which value wins would be up to the parser).
* A bad record never stops the run: it goes to ``rejected.jsonl`` with its source, index, line,
  reason code, a detail naming the field and position, and an excerpt; the summary and the log
  line count rejections per reason. A missing source raises FileNotFoundError; an unreadable
  one, or one that gives no usable prompt (all its records rejected), raises
  PromptSourceError, a RecordError whose reason is a code and whose message names the path.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any, BinaryIO

from tqdm import tqdm

from draftline.core.atomic import atomic_open, write_text
from draftline.core.layout import PROMPTS_REJECTED, PROMPTS_SUMMARY, shard_file
from draftline.core.records import Prompt, RecordError, write_shard

BUNDLED = "bundled"
HF_PREFIX = "hf:"
BUNDLED_ID_FIELD = "id"
HASH_ID_PREFIX = "h-"
HASH_ID_HEX_DIGITS = 16
EXCERPT_CHARS = 200
DEFAULT_MAX_LINE_BYTES = 1 << 20  # prompts.max_line_bytes in the config schema
# Deeper JSON is no prompt anyone wrote, and past about 1000 levels the parser (and every
# recursive walk of the value) would exhaust Python's stack.
MAX_NESTING = 100
UTF8_BOM = b"\xef\xbb\xbf"
# UTF-32 LE's mark begins with UTF-16 LE's, so it is tested first.
_WIDE_BOMS = (
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\xfe\xff", "UTF-16"),
    (b"\xff\xfe", "UTF-16"),
)
SNIFF_BYTES = 4096  # how much of a file's start is looked at to tell its encoding
SKIP_CHUNK = 1 << 16  # the part of an over-long line held at a time while skipping it

OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}

# C0 controls and DEL; contents may keep tab, newline and carriage return, ids may not.
_CONTENT_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_ID_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# json.loads turns "\ud800" into a lone surrogate, which cannot be written back out as UTF-8.
_SURROGATE = re.compile(r"[\ud800-\udfff]")

SELECTION_RULE = "first max_samples unique records in source order"
SHARDING_RULE = "sorted by sha256('{seed}:{id}'), dealt round-robin"
_SHARD_NAME = re.compile(r"shard-(\d+)\.jsonl")


class PromptSourceError(RecordError):
    """A prompt source that cannot be used as a whole (bad format or encoding, unreadable file,
    bad split, no usable prompt); the message names the source. ``counts`` holds what was read
    of it when the failure came after reading (no usable prompt)."""

    def __init__(
        self, source: object, reason: str, detail: str, counts: dict[str, Any] | None = None
    ):
        super().__init__(reason, f"prompt source {source}: {detail}")
        self.counts = counts


class _RepeatedKeyObject(dict):
    """A JSON object that named ``repeated_key`` more than once (the last value was kept)."""

    repeated_key: str


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that marks objects with a repeated key instead of hiding it."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    marked = _RepeatedKeyObject(obj)
    marked.repeated_key = next(k for k, _ in pairs if k in seen or seen.add(k))
    return marked


def _parse_json(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_object_from_pairs)


def _json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages about the data as the user wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


@dataclass(frozen=True)
class SourceSpec:
    """One ``prompts.sources`` item with its defaults filled in."""

    path: str
    split: str = "train"
    id_field: str | None = None
    prompt_field: str = "prompt"
    system_prompt: str | None = None

    @classmethod
    def from_config(cls, item: dict[str, Any]) -> SourceSpec:
        if "path" not in item:
            raise PromptSourceError(repr(item), "missing_path", "missing key 'path'")
        path = str(item["path"])
        id_field = item.get("id_field")
        if path == BUNDLED and id_field is None:
            id_field = BUNDLED_ID_FIELD  # bundled prompts carry stable ids "bundled-0001", ...
        return cls(
            path=path,
            split=item.get("split") or "train",
            id_field=id_field,
            prompt_field=item.get("prompt_field") or "prompt",
            system_prompt=item.get("system_prompt"),
        )


@dataclass(frozen=True)
class RawRecord:
    """A record as read from a source, before normalization.

    ``error`` is set when the record could not even be parsed (bad JSON, empty line).
    """

    index: int  # 0-based position in the source (for .jsonl: line number - 1)
    line: int | None  # 1-based line number, only for .jsonl sources
    value: Any = None
    raw_text: str | None = None
    error: RecordError | None = None


# ----------------------------------------------------------------------------- reading sources


def bundled_prompts_path() -> Path:
    """Path of the prompts shipped with draftline."""
    return Path(str(resources.files("draftline") / "data" / "prompts.jsonl"))


def iter_source(
    spec: SourceSpec, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> Iterator[RawRecord]:
    """Yield the raw records of one source, one at a time (a .json file is parsed whole);
    raise PromptSourceError for a source that cannot be read at all."""
    if spec.path.startswith(HF_PREFIX):
        yield from _iter_hub_dataset(spec.path[len(HF_PREFIX) :], spec.split)
        return
    path = bundled_prompts_path() if spec.path == BUNDLED else Path(spec.path)
    if not path.exists():
        raise FileNotFoundError(f"prompt source not found: {path}")
    if path.is_dir():
        yield from _iter_saved_dataset(path, spec.split)
    elif path.suffix == ".jsonl":
        yield from _iter_jsonl(path, max_line_bytes)
    elif path.suffix == ".json":
        yield from _iter_json(path)
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise PromptSourceError(
            path,
            "unsupported_format",
            f"unsupported format '{path.suffix}' "
            "(expected .jsonl, .json, .parquet, a saved HF dataset dir, hf:<id> or bundled)",
        )


def _check_encoding(head: bytes, path: Path) -> None:
    """Refuse a file whose first bytes show UTF-16 or UTF-32: read as UTF-8, every line of it
    would be rejected one by one and the real cause would be lost."""
    for bom, name in _WIDE_BOMS:
        if head.startswith(bom):
            raise PromptSourceError(
                path,
                "unsupported_encoding",
                f"starts with a {name} byte order mark; prompt files must be UTF-8 "
                f"(convert it, e.g. iconv -f {name} -t UTF-8)",
            )
    if b"\x00" in head:  # never in UTF-8 JSON text, always in UTF-16/32 text of ASCII
        raise PromptSourceError(
            path,
            "unsupported_encoding",
            "holds NUL bytes near its start, as UTF-16 or UTF-32 text does; "
            "prompt files must be UTF-8",
        )


def _open_text_source(path: Path) -> BinaryIO:
    """The file opened in binary mode past its UTF-8 byte order mark, its encoding checked."""
    f = path.open("rb")
    try:
        head = f.read(SNIFF_BYTES)
        _check_encoding(head, path)
    except BaseException:
        f.close()
        raise
    f.seek(len(UTF8_BOM) if head.startswith(UTF8_BOM) else 0)
    return f


def _capped_lines(f: BinaryIO, max_line_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(line, its length in bytes) for each line; a line longer than ``max_line_bytes`` comes
    cut to that many bytes, its rest skipped without being held."""
    while line := f.readline(max_line_bytes):
        length = len(line)
        if length == max_line_bytes and not line.endswith(b"\n"):
            length += _skip_rest_of_line(f)
        yield line, length


def _skip_rest_of_line(f: BinaryIO) -> int:
    """Read past the end of the current line a chunk at a time; return how many bytes."""
    skipped = 0
    while rest := f.readline(SKIP_CHUNK):
        skipped += len(rest)
        if rest.endswith(b"\n"):
            break
    return skipped


def _iter_jsonl(path: Path, max_line_bytes: int) -> Iterator[RawRecord]:
    # Binary mode: one badly encoded line is rejected instead of aborting the whole file.
    with _open_text_source(path) as f:
        for line_no, (raw, length) in enumerate(_capped_lines(f, max_line_bytes), start=1):
            yield _jsonl_record(line_no, raw, length, max_line_bytes)


def _jsonl_record(line_no: int, raw: bytes, length: int, max_line_bytes: int) -> RawRecord:
    index = line_no - 1
    if length > max_line_bytes:
        excerpt = raw[:EXCERPT_CHARS].decode("utf-8", errors="replace")
        error = RecordError(
            "line_too_long",
            f"line of {length} bytes is longer than prompts.max_line_bytes ({max_line_bytes})",
        )
        return RawRecord(index, line_no, raw_text=excerpt, error=error)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        excerpt = raw[:EXCERPT_CHARS].decode("utf-8", errors="replace")
        error = RecordError("invalid_utf8", f"line is not valid UTF-8: {exc.reason}")
        return RawRecord(index, line_no, raw_text=excerpt, error=error)
    text = text.rstrip("\r\n")
    if not text.strip():
        error = RecordError("empty_line", "blank line")
        return RawRecord(index, line_no, raw_text=text, error=error)
    try:
        value = _parse_json(text)
    except json.JSONDecodeError as exc:
        error = RecordError("malformed_json", f"invalid JSON: {exc.msg} at column {exc.colno}")
        return RawRecord(index, line_no, raw_text=text, error=error)
    except RecursionError:
        return RawRecord(index, line_no, raw_text=text, error=_too_deep_error())
    return RawRecord(index, line_no, value=value, raw_text=text)


def _too_deep_error() -> RecordError:
    return RecordError("too_deeply_nested", f"JSON nested deeper than {MAX_NESTING} levels")


def _iter_json(path: Path) -> Iterator[RawRecord]:
    with _open_text_source(path) as f:
        raw = f.read()
    try:
        data = _parse_json(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PromptSourceError(
            path, "unsupported_encoding", f"not valid UTF-8 ({exc}); prompt files must be UTF-8"
        ) from exc
    except json.JSONDecodeError as exc:
        raise PromptSourceError(path, "not_json", f"not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise PromptSourceError(
            path, "not_json", "not valid JSON: nested too deep to parse"
        ) from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise PromptSourceError(
            path,
            "not_a_record_list",
            f'expected a list of records or {{"data": [...]}}, got {type(data).__name__}',
        )
    for index, value in enumerate(data):
        yield RawRecord(index, None, value=value)


def _iter_parquet(path: Path) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise PromptSourceError(
            path, "unreadable_parquet", f"not a readable parquet file: {exc}"
        ) from exc
    index = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield RawRecord(index, None, value=row)
            index += 1


def _iter_saved_dataset(path: Path, split: str) -> Iterator[RawRecord]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise PromptSourceError(
            path, "not_a_saved_dataset", f"not a dataset saved with save_to_disk: {exc}"
        ) from exc
    yield from _iter_dataset_rows(loaded, split, str(path))


def _iter_hub_dataset(hub_id: str, split: str) -> Iterator[RawRecord]:
    import datasets

    try:
        loaded = datasets.load_dataset(hub_id, split=split)
    except Exception as exc:  # the hub client raises many unrelated types; name the source
        raise PromptSourceError(
            f"{HF_PREFIX}{hub_id} (split {split!r})", "cannot_load", f"cannot load: {exc}"
        ) from exc
    yield from _iter_dataset_rows(loaded, split, f"{HF_PREFIX}{hub_id}")


def _iter_dataset_rows(loaded: Any, split: str, name: str) -> Iterator[RawRecord]:
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise PromptSourceError(
                name, "no_such_split", f"no split {split!r} (available: {sorted(loaded)})"
            )
        loaded = loaded[split]
    if not isinstance(loaded, datasets.Dataset):
        raise PromptSourceError(name, "not_a_dataset", f"expected a Dataset, got {type(loaded)}")
    for index, row in enumerate(loaded):
        yield RawRecord(index, None, value=row)


# ----------------------------------------------------------------------------- normalizing records


def normalize_messages(record: Any, spec: SourceSpec) -> list[dict[str, str]]:
    """Turn one record into chat messages ending with a user turn; raise RecordError if unusable."""
    if not isinstance(record, dict):
        raise RecordError("not_an_object", f"expected a JSON object, got {_json_type(record)}")
    if _nested_deeper_than(record, MAX_NESTING):  # before any recursive walk of it
        raise _too_deep_error()
    _check_no_repeated_keys(record)
    # Rows of columnar sources (parquet, datasets) hold None for fields a record lacks.
    present = {key: value for key, value in record.items() if value is not None}
    if not present:
        raise RecordError("empty_record", "record has no fields")
    if "messages" in present:
        field = "messages"
        turns = _parse_turns(present[field], field, ("role",), ("content",), OPENAI_ROLES)
    elif "conversations" in present:
        field = "conversations"
        # ShareGPT exports sometimes use role/content inside "conversations"; accept both.
        turns = _parse_turns(
            present[field], field, ("from", "role"), ("value", "content"), SHAREGPT_ROLES
        )
    elif spec.prompt_field in present:
        prompt = present[spec.prompt_field]
        if not isinstance(prompt, str):
            raise RecordError(
                "prompt_not_string",
                f"field '{spec.prompt_field}' must be a string, got {_json_type(prompt)}",
            )
        turns = [{"role": "user", "content": prompt}]
        return _finish_conversation(turns, [f"field '{spec.prompt_field}'"], spec.system_prompt)
    else:
        raise RecordError(
            "missing_prompt_field",
            f"no 'messages', 'conversations' or '{spec.prompt_field}' field",
        )
    labels = [f"{field}[{i}]" for i in range(len(turns))]
    return _finish_conversation(turns, labels, spec.system_prompt)


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than ``limit`` levels (walked without recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
    return False


def _check_no_repeated_keys(record: dict[str, Any]) -> None:
    found = _find_repeated_key(record, "")
    if found is not None:
        where, key = found
        raise RecordError(
            "duplicate_key", f"key {key!r} appears more than once in {where or 'the record'}"
        )


def _find_repeated_key(value: Any, where: str) -> tuple[str, str] | None:
    """(path, key) of the first object that repeats a key, depth first; None when there is none."""
    if isinstance(value, _RepeatedKeyObject):
        return where, value.repeated_key
    if isinstance(value, dict):
        children = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        children = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for child_where, child in children:
        found = _find_repeated_key(child, child_where)
        if found is not None:
            return found
    return None


def _parse_turns(
    turns: Any,
    field: str,
    role_keys: tuple[str, ...],
    content_keys: tuple[str, ...],
    role_map: dict[str, str],
) -> list[dict[str, str]]:
    """Check types and map roles; content emptiness is checked later, on the kept turns only."""
    if isinstance(turns, str) and _holds_json_list(turns):
        raise RecordError(
            f"{field}_json_encoded",
            f"'{field}' is a string holding a JSON list; store the list itself, not its text",
        )
    if not isinstance(turns, list):
        raise RecordError(f"{field}_not_list", f"'{field}' must be a list, got {_json_type(turns)}")
    if not turns:
        raise RecordError("empty_messages", f"'{field}' is an empty list")
    parsed = []
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(
                "message_not_object", f"{where} must be an object, got {_json_type(turn)}"
            )
        role_key, role = _turn_value(turn, role_keys, where, "missing_role")
        if not isinstance(role, str):
            raise RecordError(
                "role_not_string",
                f"{where} '{role_key}' must be a string, got {_json_type(role)} ({role!r})",
            )
        if role.lower() not in role_map:
            raise RecordError(
                "unknown_role",
                f"{where} has unknown role {role!r} (expected one of {sorted(role_map)})",
            )
        _, content = _turn_value(turn, content_keys, where, "missing_content")
        _check_content_type(content, where)
        parsed.append({"role": role_map[role.lower()], "content": content.strip()})
    return parsed


def _holds_json_list(text: str) -> bool:
    if not text.lstrip().startswith("["):
        return False
    try:
        return isinstance(json.loads(text), list)
    except (json.JSONDecodeError, RecursionError):
        return False


def _turn_value(
    turn: dict[str, Any], keys: tuple[str, ...], where: str, reason: str
) -> tuple[str, Any]:
    """(key, value) of the first non-null value among ``keys``; a turn with none is rejected."""
    for key in keys:
        if turn.get(key) is not None:
            return key, turn[key]
    spelled = " or ".join(f"'{k}'" for k in keys)
    if any(key in turn for key in keys):
        raise RecordError(reason, f"{where} has {spelled} set to null")
    raise RecordError(reason, f"{where} has no {spelled} (keys: {sorted(map(str, turn))})")


def _check_content_type(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if (
        isinstance(content, list)
        and content
        and all(isinstance(part, dict) and "type" in part for part in content)
    ):
        kinds = ", ".join(dict.fromkeys(str(part["type"]) for part in content))
        raise RecordError(
            "content_parts",
            f"{where} content is a list of {len(content)} typed parts ({kinds}); "
            "only plain string content is supported",
        )
    raise RecordError(
        "content_not_string", f"{where} content must be a string, got {_json_type(content)}"
    )


def _finish_conversation(
    turns: list[dict[str, str]], labels: list[str], system_prompt: str | None
) -> list[dict[str, str]]:
    """Keep turns up to the last user turn and check them; ``labels[i]`` names turn i."""
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    if last_user is None:
        roles = ", ".join(t["role"] for t in turns)
        raise RecordError("no_user_turn", f"conversation has no user turn (roles: {roles})")
    kept = turns[: last_user + 1]  # generation answers the last user turn
    for i, turn in enumerate(kept):
        if turn["role"] == "system" and i != 0:
            raise RecordError(
                "system_not_first",
                f"{labels[i]} is a system turn at position {i}; only position 0 allowed",
            )
        if not turn["content"].strip():  # (a prompt field is kept unstripped: ids stay)
            raise RecordError("empty_content", f"{labels[i]} ({turn['role']}) has empty content")
        _check_text(turn["content"], f"{labels[i]} content", _CONTENT_CONTROL)
    if system_prompt and kept[0]["role"] != "system":
        kept.insert(0, {"role": "system", "content": system_prompt.strip()})
    return kept


def _check_text(text: str, what: str, control: re.Pattern[str]) -> None:
    """Reject text that would break tokenizers or could not be written back as UTF-8."""
    bad = control.search(text)
    if bad is not None:
        raise RecordError(
            "control_character",
            f"{what} has control character U+{ord(bad.group()):04X} at offset {bad.start()}",
        )
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise RecordError(
            "unpaired_surrogate",
            f"{what} has unpaired surrogate U+{ord(bad.group()):04X} at offset {bad.start()}",
        )


def content_hash(messages: list[dict[str, str]]) -> str:
    """sha256 hex digest of the canonical JSON of normalized messages (the de-duplication key)."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def explicit_id(record: dict[str, Any], id_field: str) -> str:
    value = record.get(id_field)
    if value is None:
        raise RecordError("missing_id", f"id field '{id_field}' is missing")
    # bool is an int subclass, but True is not an id anyone meant.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RecordError(
            "bad_id",
            f"id field '{id_field}' must be a string or integer, got {_json_type(value)}",
        )
    text = str(value).strip()
    if not text:
        raise RecordError("empty_id", f"id field '{id_field}' is empty")
    _check_text(text, f"id field '{id_field}'", _ID_CONTROL)
    return text


def to_prompt(record: Any, spec: SourceSpec) -> Prompt:
    """Normalize one parsed record into a Prompt with a stable id."""
    messages = normalize_messages(record, spec)
    digest = content_hash(messages)
    if spec.id_field is not None:
        prompt_id = explicit_id(record, spec.id_field)
    else:
        prompt_id = HASH_ID_PREFIX + digest[:HASH_ID_HEX_DIGITS]
    return Prompt(prompt_id, messages, digest)


# ------------------------------------------------------------------ collecting, selecting, sharding


def _excerpt(raw: RawRecord) -> str:
    if raw.raw_text is not None:
        text = raw.raw_text
    else:
        try:
            text = json.dumps(raw.value, ensure_ascii=False, default=str)
        except RecursionError:  # a record rejected for its nesting
            text = "(nested too deep to show)"
    return _writable(text[:EXCERPT_CHARS])


def _writable(text: str) -> str:
    """Spell unpaired surrogates as \\udXXX so a rejected record can still be written as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class _SourceTally:
    """What reading one source gave: the counts the summary reports, and for an error message
    the rejections by reason and the first of them."""

    path: str
    read: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    first_rejection: str | None = None
    skipped: str | None = None  # why the source was not read at all

    def counts(self) -> dict[str, Any]:
        counts = {"path": self.path, "read": self.read, "accepted": self.accepted,
                  "duplicates": self.duplicates, "rejected": self.rejected}
        if self.skipped is not None:
            counts["skipped"] = self.skipped
        return counts

    @property
    def usable(self) -> int:
        return self.accepted + self.duplicates


class _Collector:
    """Accepts records in order until ``max_samples`` prompts are kept, tracking duplicates and
    per-source counts; each rejection is written out as it comes, so memory holds only the
    kept prompts and their hashes and ids."""

    def __init__(self, max_samples: int, rejected_out: IO[str]) -> None:
        self.max_samples = max_samples
        self.accepted: list[Prompt] = []
        self.reasons: Counter[str] = Counter()
        self.sources: list[_SourceTally] = []
        self._rejected_out = rejected_out
        self._hashes: set[str] = set()
        self._ids: dict[str, str] = {}  # id -> source path where it was first seen

    @property
    def full(self) -> bool:
        return len(self.accepted) >= self.max_samples

    def total(self, count: str) -> int:
        return sum(getattr(tally, count) for tally in self.sources)

    def add_source(self, spec: SourceSpec, records: Iterable[RawRecord]) -> _SourceTally:
        """Read records until the source ends or max_samples prompts are kept: a record past
        that point is never pulled from ``records``."""
        tally = _SourceTally(spec.path)
        self.sources.append(tally)
        if self.full:
            tally.skipped = "max_samples reached"
            return tally
        for raw in records:
            tally.read += 1
            self._add(spec, raw, tally)
            if self.full:
                break
        return tally

    def _add(self, spec: SourceSpec, raw: RawRecord, tally: _SourceTally) -> None:
        try:
            if raw.error is not None:
                raise raw.error
            prompt = to_prompt(raw.value, spec)
            if prompt.content_hash in self._hashes:
                tally.duplicates += 1
                return
            if prompt.id in self._ids:
                raise RecordError(
                    "duplicate_id",
                    f"id {prompt.id!r} already used (first in {self._ids[prompt.id]})",
                )
        except RecordError as err:
            self._reject(spec, raw, err, tally)
            return
        self._hashes.add(prompt.content_hash)
        self._ids[prompt.id] = spec.path
        self.accepted.append(prompt)
        tally.accepted += 1

    def _reject(
        self, spec: SourceSpec, raw: RawRecord, err: RecordError, tally: _SourceTally
    ) -> None:
        self.reasons[err.reason] += 1
        tally.rejected += 1
        tally.reasons[err.reason] += 1
        if tally.first_rejection is None:
            tally.first_rejection = f"{_position(raw)}: {err.reason}: {_writable(err.detail)}"
        row = {
            "source": spec.path,
            "index": raw.index,
            "line": raw.line,
            "reason": err.reason,
            "detail": _writable(err.detail),
            "excerpt": _excerpt(raw),
        }
        self._rejected_out.write(json.dumps(row, ensure_ascii=False) + "\n")


def _position(raw: RawRecord) -> str:
    return f"line {raw.line}" if raw.line is not None else f"record {raw.index}"


def _check_usable(tally: _SourceTally) -> None:
    """A source that was read and gave no usable prompt is a mistake (a wrong file, encoding
    or field name) that must stop the stage here, not as an empty dataset stages later."""
    if tally.skipped is not None or tally.usable:
        return
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(tally.reasons.items())) or "none"
    detail = f"no usable prompt in {tally.read} records (rejected: {reasons})"
    if tally.first_rejection is not None:
        detail += f"; first: {tally.first_rejection}"
    raise PromptSourceError(tally.path, "no_prompts", detail, counts=tally.counts())


def shard_key(prompt_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).hexdigest()


def assign_shards(prompts: list[Prompt], num_shards: int, seed: int) -> list[list[Prompt]]:
    """Deal prompts round-robin in seeded-hash order: sizes differ by at most one."""
    ordered = sorted(prompts, key=lambda p: (shard_key(p.id, seed), p.id))
    return [ordered[i::num_shards] for i in range(num_shards)]


# ----------------------------------------------------------------------------- writing


def _remove_stale_shards(out_dir: Path, num_shards: int) -> None:
    """A previous run with more shards must not leave extra shard files behind."""
    for path in out_dir.glob(shard_file("*")):
        match = _SHARD_NAME.fullmatch(path.name)
        if match and int(match.group(1)) >= num_shards:
            path.unlink()


def _summary(
    collector: _Collector, shards: list[list[Prompt]], max_samples: int, seed: int
) -> dict[str, Any]:
    written = sum(len(s) for s in shards)
    return {
        "read": collector.total("read"),
        "accepted": collector.total("accepted"),
        "duplicates": collector.total("duplicates"),
        "rejected_total": collector.total("rejected"),
        "rejected": dict(sorted(collector.reasons.items())),
        # reading stopped there: later records and sources were not read
        "stopped_at_max_samples": collector.full,
        "written": written,
        "num_shards": len(shards),
        "shard_sizes": [len(s) for s in shards],
        "max_samples": max_samples,
        "seed": seed,
        "selection": SELECTION_RULE,
        "sharding": SHARDING_RULE,
        "sources": [tally.counts() for tally in collector.sources],
    }


def format_summary(summary: dict[str, Any]) -> str:
    """One log line with every count, rejections broken down as ``reason=count``."""
    reasons = ", ".join(f"{k}={v}" for k, v in summary["rejected"].items()) or "none"
    stopped = ", reading stopped at max_samples" if summary["stopped_at_max_samples"] else ""
    return (
        f"prompts: read {summary['read']}, accepted {summary['accepted']}, "
        f"duplicates {summary['duplicates']}, rejected {summary['rejected_total']} ({reasons})"
        f"{stopped}, "
        f"written {summary['written']} in {summary['num_shards']} shards {summary['shard_sizes']}"
    )


def build_prompt_shards(
    sources: list[dict[str, Any]],
    out_dir: Path,
    num_shards: int,
    max_samples: int,
    seed: int = 0,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> dict[str, Any]:
    """Read ``sources`` (``prompts.sources`` config items), write shards, rejects and a summary.

    Writes ``out_dir/shard-{i}.jsonl`` for i in 0..num_shards-1, ``out_dir/rejected.jsonl`` and
    ``out_dir/summary.json``; returns the summary dict. Raises FileNotFoundError for a missing
    source and PromptSourceError (a RecordError) for one that cannot be read at all or that
    gives no usable prompt.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    if not sources:
        raise ValueError("no prompt sources given")
    specs = [SourceSpec.from_config(item) for item in sources]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_open(out_dir / PROMPTS_REJECTED) as rejected_out:
        collector = _Collector(max_samples, rejected_out)
        for spec in specs:
            records = iter_source(spec, max_line_bytes)
            progress = tqdm(records, desc=f"prompts {spec.path}", unit="rec", mininterval=1)
            _check_usable(collector.add_source(spec, progress))

    shards = assign_shards(collector.accepted, num_shards, seed)
    for i, shard in enumerate(shards):
        write_shard(out_dir / shard_file(i), shard)
    _remove_stale_shards(out_dir, num_shards)
    summary = _summary(collector, shards, max_samples, seed)
    write_text(out_dir / PROMPTS_SUMMARY, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(format_summary(summary))
    if summary["rejected_total"]:
        print(f"prompts: rejected records with reason and detail: {out_dir / PROMPTS_REJECTED}")
    return summary

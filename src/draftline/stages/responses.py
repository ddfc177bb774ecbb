"""Generation's answers on disk: what makes a kept answer valid, and how a rerun resumes.

Results are appended and flushed to ``<out_dir>/.partial/shard-{i}.jsonl`` as they arrive
(``AppendLog``; Snakemake deletes declared outputs of failed jobs, the partial file survives).
Every kept record carries the ``fingerprint`` of what determined its answer (target, served
name, sampling settings, chat template kwargs, multi_turn, the prompt's messages). A rerun
(``resume_shard``) keeps only records with the current fingerprint (the others are discarded and
counted as ``discarded_stale``), takes valid answers for its ids from any shard's kept file (so
a changed shard assignment loses nothing), drops a torn last line and answers without token ids
(``discarded_incomplete``), and asks for every other prompt, those that ended in an error
before included. Errors are appended to ``<out_dir>/.partial/shard-{i}.errors.jsonl`` and kept
there: the history of every run's errors. ``draftline.stages.generate`` writes each
shard's final file once, from these, in prompt order. The stages after it read those final files
through ``iter_response_records``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from draftline.core.atomic import disk_full_names, write_jsonl
from draftline.core.records import RecordError

if TYPE_CHECKING:
    from draftline.core.records import Prompt
    from draftline.serving.server import Endpoint


class AnswerSettings(Protocol):
    """The sampling settings an answer depends on (``draftline.stages.generate.GenerateSettings``
    has them; this module reads only these, and imports nothing from generate)."""

    temperature: float
    top_p: float

    def temperature_for(self, prompt_id: str) -> float: ...

    max_tokens: int
    seed: int
    chat_template_kwargs: dict
    multi_turn: bool


# Small files that define the target: architecture, generation defaults, tokenizer, template.
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer_config.json",
                "tokenizer.json", "chat_template.jinja", "chat_template.json",
                "model.safetensors.index.json", "pytorch_model.bin.index.json")
# Weights up to this size are hashed whole (a retrained toy keeps its config); larger ones are
# identified by their index, names and sizes (hashing 595 GB would take an hour).
HASH_WEIGHTS_UP_TO = 256 << 20


def _sha256(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def fingerprinted_target(model: str, revision: str | None = None) -> dict:
    """The target as answer fingerprints see it: its path or hub id, the revision, and a hash
    of the files that define its answers (config, generation config, tokenizer, chat
    template, remote code; for a local directory also the weights index, small weights by
    content). A hub id is read from its snapshot in the local cache, whose commit is recorded
    too: a new snapshot, or a file edited in the cached one, changes every fingerprint.
    Not the bundle's ``provenance.target_identity``, a per-file record for the manifest:
    changing this one would invalidate every kept answer."""
    from draftline.core.hub import is_local

    identity = {"model": str(model), "revision": revision}
    if is_local(model):
        path = Path(model)
        if path.is_dir():
            identity["files_sha256"] = _sha256(*_definition_parts(path), *_weight_parts(path))
        return identity
    snapshot = _cached_snapshot(str(model), revision)
    if snapshot is not None:  # a hub id the servers fetch themselves: what is cached now
        identity["snapshot"] = snapshot.name  # the commit
        identity["files_sha256"] = _sha256(*_definition_parts(snapshot))
    return identity


def _definition_parts(path: Path) -> list[bytes]:
    """Name and content of each file that defines the target's answers: TARGET_FILES, the
    tokenizer's own files and the remote code a trust_remote_code target runs."""
    names = set(TARGET_FILES) | {p.name for p in path.glob("*.py")} | {
        p.name for pattern in ("tokenizer.model", "tiktoken.model", "*.tiktoken", "vocab.*",
                               "merges.txt", "special_tokens_map.json")
        for p in path.glob(pattern)}
    return [f"{name}\0".encode() + (path / name).read_bytes()
            for name in sorted(names) if (path / name).is_file()]


def _weight_parts(path: Path) -> list[bytes]:
    weights = sorted(p for p in path.iterdir()
                     if p.is_file() and p.suffix in (".safetensors", ".bin"))
    sizes = [p.stat().st_size for p in weights]
    whole = sum(sizes) <= HASH_WEIGHTS_UP_TO
    return [f"{weight.name}\0{size}\0".encode() + (weight.read_bytes() if whole else b"")
            for weight, size in zip(weights, sizes, strict=True)]


def _cached_snapshot(model: str, revision: str | None) -> Path | None:
    """The snapshot folder of a hub id (at ``revision``) in the local cache, None when absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


# Server settings that shape an answer: the weights' precision, the template and
# reasoning-parser options, whatever else vLLM is told (a --chat-template, a quantization).
ANSWER_SERVER_KEYS = ("dtype", "reasoning_parser", "extra_args", "max_model_len")


def answer_server_settings(server_cfg: dict) -> dict:
    """The managed server's settings that shape answers (an external server's are unknown)."""
    if server_cfg.get("mode", "managed") != "managed":
        return {}
    return {key: server_cfg.get(key) for key in ANSWER_SERVER_KEYS}


def settings_fingerprint(settings: AnswerSettings, served_model: str, target: dict,
                         temperature: float | None = None) -> str:
    """Everything but the prompt that determines an answer (not concurrency, retries, ...);
    ``temperature`` the prompt's own where it is not ``settings.temperature``."""
    answer_settings = {
        "target": target,
        "served_model": served_model,
        "temperature": settings.temperature if temperature is None else temperature,
        "top_p": settings.top_p,
        "max_tokens": settings.max_tokens,
        "seed": settings.seed,
        "chat_template_kwargs": settings.chat_template_kwargs,
        "multi_turn": settings.multi_turn,
    }
    return _sha256(json.dumps(answer_settings, sort_keys=True).encode())


def record_fingerprint(settings_fp: str, messages: list[dict]) -> str:
    """The fingerprint a kept answer to ``messages`` must carry to be reused."""
    return _sha256(settings_fp.encode(),
                   json.dumps(messages, sort_keys=True, ensure_ascii=False).encode())[:32]


def prompt_fingerprints(prompts: list[Prompt], settings: AnswerSettings,
                        endpoints: list[Endpoint], target: dict) -> dict[str, str]:
    """The fingerprint each prompt's kept answer must carry (with its own temperature: an eval
    prompt's answer is kept only while ``generate.eval_temperature`` is what it was)."""
    served = ",".join(sorted({ep.model for ep in endpoints}))
    by_temperature = {}
    fingerprints = {}
    for p in prompts:
        temperature = settings.temperature_for(p.split_id)
        if temperature not in by_temperature:
            by_temperature[temperature] = settings_fingerprint(settings, served, target,
                                                               temperature)
        fingerprints[p.id] = record_fingerprint(by_temperature[temperature], p.messages)
    return fingerprints


# ----------------------------------------------------------------------------- the kept files


def read_jsonl_ids(path: Path, cut_torn: bool = True) -> dict[str, dict]:
    """Records of a JSONL file by id; a torn last line (killed writer) is ignored and, with
    ``cut_torn``, cut off the file (never on a file another job may be appending to)."""
    records: dict[str, dict] = {}
    if not path.exists():
        return records
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data) and cut_torn:
        with open(path, "r+b") as fh:
            fh.truncate(keep)
    for line in data[:keep].splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["id"]] = rec
    return records


class AppendLog:
    """Append-and-flush JSONL writer: every finished record survives a kill.

    A write cut short (full disk, kill) leaves at most a torn last line, which the next
    ``read_jsonl_ids`` drops: a record counts only when its line is complete.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fh = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        with disk_full_names(self.path):
            self.fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.fh.flush()

    def close(self) -> None:
        # Every complete record was flushed by write(); what a failed write left buffered is
        # a torn line at most, so a close that cannot flush it loses nothing.
        with contextlib.suppress(OSError):
            os.fsync(self.fh.fileno())
        with contextlib.suppress(OSError):
            self.fh.close()


class GenerationLocked(RuntimeError):
    """Another generation run is writing the same responses folder."""


@contextlib.contextmanager
def generation_lock(partial_dir: Path) -> Iterator[Path]:
    """Hold the lock on one responses folder's kept files for the whole run: two runs on one
    folder would ask every prompt twice and rewrite each other's kept files on resume.

    An ``flock`` on ``<partial_dir>/generate.lock``, which holds the runner's pid: the kernel
    drops the lock when its process dies however it ends, so the lock of a dead run (its pid
    still in the file) is taken over. The file stays: removing it would let a run that opened
    it just before lock a file nobody else sees.
    """
    partial_dir.mkdir(parents=True, exist_ok=True)
    path = partial_dir / "generate.lock"
    fh = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise GenerationLocked(
            f"{partial_dir.parent}: another generation run (pid {holder}) is writing these "
            f"responses (lock {path}); wait for it to end or stop it, then rerun") from None
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        yield path
    finally:
        fh.close()  # releases the lock


class OutputNotWritable(OSError):
    """A folder generation writes to cannot be written."""


def check_writable(directory: Path) -> None:
    """Create (if need be) and write a probe file in ``directory``, so that an unwritable
    results folder stops the run before its first request rather than at its last write.
    A probe, not ``os.access``: root passes every access check, yet not a read-only mount."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputNotWritable(
            exc.errno, f"cannot write generation output in {directory}: "
                       f"{exc.strerror or exc}") from exc


def partial_paths(out_file: Path) -> tuple[Path, Path]:
    """The kept answers and kept errors of the shard whose final file is ``out_file``."""
    partial = out_file.parent / ".partial"
    stem = out_file.name.removesuffix(".jsonl")
    return partial / f"{stem}.jsonl", partial / f"{stem}.errors.jsonl"


def attempts_path(out_file: Path) -> Path:
    """The shard's run history: one JSON line per generation run that asked for its prompts,
    however the run ended (its summary, rewritten by every run, reports them all). Not
    ``.jsonl``: the kept-answer files are found by that suffix."""
    stem = out_file.name.removesuffix(".jsonl")
    return partial_paths(out_file)[0].parent / f"{stem}.attempts.log"


def append_attempt(out_file: Path, attempt: dict) -> None:
    log = AppendLog(attempts_path(out_file))
    try:
        log.write(attempt)
    finally:
        log.close()


def read_attempts(out_file: Path) -> list[dict]:
    """The shard's earlier runs, oldest first (a torn last line, a killed writer's, dropped)."""
    path = attempts_path(out_file)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line]


# ----------------------------------------------------------------------------- resume


@dataclass
class Resumed:
    records: dict[str, dict]  # valid answers for this shard's ids
    # earlier runs' errors for this shard's ids (the last per id): history, not a reason to
    # skip the prompt; answered since or not, every one without an answer is asked again
    errors: dict[str, dict]
    discarded_stale: int  # kept records for this shard's ids made under other settings
    adopted: int  # valid answers found in another shard's kept file
    discarded_incomplete: int = 0  # kept with missing or empty token ids: asked again


def has_token_ids(record: dict) -> bool:
    """Whether a kept answer has both token id lists, non-empty. Runs before answers were
    checked (``draftline.stages.generate.check_completion``) kept some without them, under a valid
    fingerprint; the dataset cannot use those, so a rerun asks for them again."""
    return all(isinstance(record.get(key), list) and record[key]
               for key in ("prompt_token_ids", "output_token_ids"))


def valid_records(records: dict[str, dict], fingerprints: dict[str, str]) -> dict[str, dict]:
    """The records that carry the fingerprint their id must carry now."""
    return {k: r for k, r in records.items() if r.get("fingerprint") == fingerprints.get(k)}


def resume_shard(partial: Path, partial_errors: Path,
                 fingerprints: dict[str, str]) -> Resumed:
    """What an earlier run left that is still valid, and rewrite the kept files to hold it.

    A record counts only under the current fingerprint. Answers for this shard's ids are also
    taken from the other shards' kept files (the shard assignment may have changed); records
    for ids this shard no longer owns stay in its file for the shard that does.
    """
    own = read_jsonl_ids(partial)
    fingerprinted = valid_records(own, fingerprints)
    records = {k: r for k, r in fingerprinted.items() if has_token_ids(r)}
    incomplete = len(fingerprinted) - len(records)
    discarded = sum(1 for k in own if k in fingerprints and k not in fingerprinted)
    adopted = 0
    for other in sorted(partial.parent.glob("*.jsonl")):
        if other == partial or other.name.endswith(".errors.jsonl"):
            continue
        found = valid_records(read_jsonl_ids(other, cut_torn=False), fingerprints)
        new = {k: r for k, r in found.items() if k not in records and has_token_ids(r)}
        records.update(new)
        adopted += len(new)
    foreign = {k: r for k, r in own.items() if k not in fingerprints}
    if discarded or adopted or incomplete:
        write_jsonl(partial, [*records.values(), *foreign.values()])
    # The errors file is the history of every run's errors, appended to and never rewritten:
    # a final error (a 400, a 404 from a proxy) is final within the run that got it, but the
    # next run asks again (the server or the way to it may have changed since).
    errors = valid_records(read_jsonl_ids(partial_errors), fingerprints)
    return Resumed(records, errors, discarded, adopted, incomplete)


# ----------------------------------------------------------------------------- the final files


def iter_response_records(paths: Iterable[str | Path]) -> Iterator[tuple[str, dict]]:
    """``("file:line", record)`` for every record of the final responses files, in order; a
    line that is not JSON raises RecordError naming its file and line."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise RecordError("invalid_json", f"{where}: invalid JSON: {e}") from e

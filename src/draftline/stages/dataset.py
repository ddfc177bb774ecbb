"""Tokenized training dataset: responses -> ``results/dataset/`` (HF DatasetDict on disk).

Kept whole (about 630 lines): the tokenization rules, the mismatch accounting and the split
all serve the one record format this stage writes, and read in that order.

Each sample is one conversation: the prompt messages the target saw plus the assistant turn it
generated. ``input_ids`` is the token stream the target processed; ``loss_mask`` is 1 on the
tokens the target generated (thinking tokens, reasoning, answer, end of turn) and 0 on
system/user/template tokens.

Where the token ids come from
    * A response with ``prompt_token_ids`` and ``output_token_ids`` (vLLM ``return_token_ids``)
      is ground truth: ``input_ids = prompt_token_ids + output_token_ids``. The chat-template
      rendering (below) is still computed and compared with these ids; each disagreement is
      counted as a mismatch in ``stats.json`` and the ids win.
    * Otherwise the sample is rendered: prompt part = chat template of the prompt messages with
      the generation prompt, tokenized; completion = the rest of the full rendering (prompt +
      assistant message), tokenized on its own. Tokenizing the completion separately mirrors
      what the target saw (a tokenized prompt followed by generated tokens), so a tokenizer
      merge across the prompt/answer boundary cannot shift the loss mask. Template text after
      the end-of-turn token (e.g. a trailing newline) was not generated and is cut.

End of turn
    ``output_token_ids`` may or may not end with the end-of-turn id. A finished turn (any
    ``finish_reason`` but ``length``/``abort``) that lacks it gets the template's end-of-turn id
    appended, so the draft learns to stop. An unfinished turn (``length``) gets nothing
    appended and is compared with the rendering only on the tokens the target produced. When
    such a turn has no ids, the rendering still holds whatever the template adds to close an
    open thinking block (e.g. ``</think>``) minus the end-of-turn token: a known small error
    of the no-ids fallback.

Truncation policy
    Samples longer than ``max_length`` keep their first ``max_length`` tokens (the prompt is
    never shortened, so the kept tokens are exactly the context the target had). A sample
    left with no supervised token (prompt of ``max_length`` tokens or more) is dropped and
    counted under ``dropped.no_supervised_tokens_after_truncation``.

Split
    A sample goes to ``eval`` iff ``sha256(id)`` (first 8 bytes, big endian) mod 10**6 is below
    ``eval_fraction * 10**6`` (``draftline.core.split``). The split depends on the id alone, so
    adding or removing samples never moves the others.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from draftline.core.atomic import atomic_dir
from draftline.core.hub import hub_revision, pretrained_kwargs
from draftline.core.layout import DATASET_STATS
from draftline.core.records import RecordError
from draftline.core.split import SPLITS, is_eval, split_of
from draftline.stages.responses import iter_response_records

log = logging.getLogger(__name__)

UNFINISHED_REASONS = frozenset({"length", "abort"})
TRUNCATION_POLICY = (
    "keep the first max_length tokens (prompt first, never shortened); drop the sample when "
    "no supervised token remains"
)
_MAX_LISTED_IDS = 20


class RenderError(ValueError):
    """The chat template could not render a record into prompt + completion."""


# ----------------------------------------------------------------------------- reading


@dataclass
class Response:
    """One validated response record, as read from a responses shard."""

    id: str
    prompt_messages: list[dict]
    assistant: dict
    finish_reason: str | None
    prompt_token_ids: list[int] | None
    output_token_ids: list[int] | None
    where: str  # "file:line", for messages
    prompt_id: str | None = None  # an answer after the first to that prompt: its split's

    @property
    def split_id(self) -> str:
        """The id its split is decided by (``draftline.core.split.split_key``)."""
        return self.prompt_id or self.id

    @property
    def finished(self) -> bool:
        return self.finish_reason not in UNFINISHED_REASONS

    @property
    def has_ids(self) -> bool:
        return self.prompt_token_ids is not None and self.output_token_ids is not None


def _normalise_assistant(message: dict) -> dict:
    """Copy of the assistant message in the shape chat templates expect.

    Newer vLLM names the reasoning ``reasoning``, older ``reasoning_content``; templates read
    ``reasoning_content``. A null content would render as the string "None" in Jinja.
    """
    out = dict(message)
    if out.get("reasoning_content") is None and out.get("reasoning") is not None:
        out["reasoning_content"] = out["reasoning"]
    out.pop("reasoning", None)
    if out.get("content") is None:
        out["content"] = ""
    return out


def _token_ids(value: Any, key: str, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise RecordError("bad_token_ids", f"{where}: '{key}' must be a list of integers")
    return value


def parse_response(raw: dict, where: str) -> Response:
    """Validate one JSON record from a responses shard."""
    sample_id = raw.get("id") if isinstance(raw, dict) else None
    if not isinstance(sample_id, str) or not sample_id:
        raise RecordError("missing_id", f"{where}: record has no string 'id'")
    where = f"{where} (id {sample_id!r})"
    messages = raw.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        raise RecordError("bad_messages",
                          f"{where}: 'messages' must hold the prompt and the assistant turn")
    if not all(isinstance(m, dict) and "role" in m for m in messages):
        raise RecordError("missing_role", f"{where}: every message needs a 'role'")
    if messages[-1]["role"] != "assistant":
        raise RecordError("no_assistant_turn",
                          f"{where}: the last message must be the generated assistant turn")
    prompt_id = raw.get("prompt_id")
    if prompt_id is not None and (not isinstance(prompt_id, str) or not prompt_id):
        raise RecordError("bad_prompt_id", f"{where}: 'prompt_id' must be a non-empty string "
                          f"(the prompt this answer is one more answer to)")
    return Response(
        id=sample_id,
        prompt_id=prompt_id,
        prompt_messages=messages[:-1],
        assistant=_normalise_assistant(messages[-1]),
        finish_reason=raw.get("finish_reason"),
        prompt_token_ids=_token_ids(raw.get("prompt_token_ids"), "prompt_token_ids", where),
        output_token_ids=_token_ids(raw.get("output_token_ids"), "output_token_ids", where),
        where=where,
    )


def iter_responses(paths: list[Path]) -> Iterator[Response]:
    for where, raw in iter_response_records(paths):
        yield parse_response(raw, where)


def _count_lines(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += sum(1 for line in f if line.strip())
    return total


def _batched(items: Iterator[Response], size: int) -> Iterator[list[Response]]:
    batch: list[Response] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------- rendering


def end_of_turn_ids(tokenizer, target_dir: Path) -> dict[int, None]:
    """Ids that end an assistant turn: the tokenizer's EOS, then generation_config's eos ids.

    An insertion-ordered dict used as a set, so the tokenizer's EOS comes first.
    """
    ids: dict[int, None] = {}
    if tokenizer.eos_token_id is not None:
        ids[int(tokenizer.eos_token_id)] = None
    gen_config = Path(target_dir) / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        for e in [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []:
            ids[int(e)] = None
    return ids


def render_texts(
    tokenizer, response: Response, template_kwargs: dict | None = None
) -> tuple[str, str]:
    """(prompt text with generation prompt, completion text) from the chat template."""
    kwargs = template_kwargs or {}
    try:
        prompt = tokenizer.apply_chat_template(
            response.prompt_messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        full = tokenizer.apply_chat_template(
            response.prompt_messages + [response.assistant], tokenize=False, **kwargs
        )
    except Exception as e:  # jinja errors have many types; the record is what matters
        raise RenderError(f"{response.where}: chat template failed: {e}") from e
    if not full.startswith(prompt):
        raise RenderError(
            f"{response.where}: the rendered conversation does not start with the rendered "
            "prompt (the template renders history differently from the generation prompt)"
        )
    return prompt, full[len(prompt) :]


def cut_after_end_of_turn(
    completion_ids: list[int], eot_ids: dict[int, None], finished: bool
) -> tuple[list[int], int | None]:
    """Drop template tokens after the turn's end; return (ids, end-of-turn id or None).

    The last end-of-turn id in the rendered completion closes the assistant turn; what follows
    (a newline, say) is template text the model never generated. An unfinished turn also loses
    the end-of-turn id itself.
    """
    for pos in range(len(completion_ids) - 1, -1, -1):
        if completion_ids[pos] in eot_ids:
            eot = completion_ids[pos]
            return completion_ids[: pos + 1] if finished else completion_ids[:pos], eot
    return completion_ids, None


# ----------------------------------------------------------------------------- samples


@dataclass
class Sample:
    id: str
    input_ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T] int8


@dataclass
class Stats:
    """Counters written to stats.json."""

    eval_fraction: float
    max_length: int
    samples_in: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    samples_out: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    supervised_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_ids: dict[str, list[str]] = field(default_factory=dict)
    with_token_ids: int = 0
    rendered_only: int = 0
    mismatch: int = 0
    mismatch_ids: list[str] = field(default_factory=list)
    render_errors: int = 0
    end_of_turn_appended: int = 0
    truncated: int = 0

    def drop(self, reason: str, sample_id: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        listed = self.dropped_ids.setdefault(reason, [])
        if len(listed) < _MAX_LISTED_IDS:
            listed.append(sample_id)

    def to_json(self) -> dict:
        return {
            "records_read": sum(self.samples_in.values()) + self.dropped.get("duplicate_id", 0),
            "samples_in": self.samples_in,
            "samples_out": self.samples_out,
            "dropped": self.dropped,
            "dropped_ids": self.dropped_ids,
            "tokens": self.tokens,
            "supervised_tokens": self.supervised_tokens,
            "with_token_ids": self.with_token_ids,
            "rendered_only": self.rendered_only,
            "mismatch": self.mismatch,
            "mismatch_ids": self.mismatch_ids,
            "mismatch_resolution": "the returned token ids are used when they disagree",
            "render_errors": self.render_errors,
            "end_of_turn_appended": self.end_of_turn_appended,
            "truncated": self.truncated,
            "eval_fraction": self.eval_fraction,
            "max_length": self.max_length,
            "truncation_policy": TRUNCATION_POLICY,
            "split_rule": "eval iff int(sha256(id)[:8]) mod 1e6 < eval_fraction * 1e6",
        }


def rendering_matches(
    prompt_ids: list[int],
    completion_ids: list[int],
    response: Response,
    output_ids: list[int],
) -> bool:
    """Does the rendering reproduce the ids the target saw and produced?

    An unfinished turn is compared on the produced tokens only: the template closes a turn the
    model never closed.
    """
    if prompt_ids != response.prompt_token_ids:
        return False
    if response.finished:
        return completion_ids == output_ids
    return completion_ids[: len(output_ids)] == output_ids


def assemble_sample(
    response: Response,
    rendered: tuple[list[int], list[int]] | None,
    eot_ids: dict[int, None],
    stats: Stats,
) -> tuple[list[int], int] | None:
    """(input ids, number of prompt tokens) of one response, or None to drop it.

    ``rendered`` is (prompt ids, raw completion ids) from the chat template, None when the
    template failed.
    """
    prompt_ids: list[int] = []
    completion_ids: list[int] = []
    eot = None
    if rendered is not None:
        prompt_ids = rendered[0]
        completion_ids, eot = cut_after_end_of_turn(rendered[1], eot_ids, response.finished)

    if not response.has_ids:
        stats.rendered_only += 1
        if rendered is None:
            return None
        return prompt_ids + completion_ids, len(prompt_ids)

    stats.with_token_ids += 1
    output_ids = list(response.output_token_ids)
    if response.finished and (not output_ids or output_ids[-1] not in eot_ids):
        # The template's own end-of-turn token, else the tokenizer's EOS (first in eot_ids).
        end_id = eot if eot is not None else next(iter(eot_ids), None)
        if end_id is not None:
            output_ids.append(end_id)
            stats.end_of_turn_appended += 1
    if rendered is None or not rendering_matches(prompt_ids, completion_ids, response, output_ids):
        stats.mismatch += 1
        if len(stats.mismatch_ids) < _MAX_LISTED_IDS:
            stats.mismatch_ids.append(response.id)
    return list(response.prompt_token_ids) + output_ids, len(response.prompt_token_ids)


def make_sample(sample_id: str, ids: list[int], n_prompt: int, max_length: int) -> Sample:
    input_ids = np.asarray(ids, dtype=np.int64)  # [T]
    loss_mask = np.zeros(len(ids), dtype=np.int8)  # [T]
    loss_mask[n_prompt:] = 1
    return Sample(sample_id, input_ids[:max_length], loss_mask[:max_length])


# ----------------------------------------------------------------------------- writing


def dataset_features():
    from datasets import Features, List, Value

    return Features(
        {"id": Value("string"), "input_ids": List(Value("int64")), "loss_mask": List(Value("int8"))}
    )


class SplitWriter:
    """Streams samples of one split into an Arrow file in bounded memory."""

    def __init__(self, path: Path, schema, flush_every: int = 512):
        import pyarrow as pa

        self._pa = pa
        self.path = path
        self.schema = schema
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, schema)
        self._pending: list[Sample] = []
        self._flush_every = flush_every

    def add(self, sample: Sample) -> None:
        self._pending.append(sample)
        if len(self._pending) >= self._flush_every:
            self.flush()

    def _list_array(self, arrays: list[np.ndarray], value_type):
        pa = self._pa
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int32)  # [n + 1]
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(arrays) if arrays else np.zeros(0)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))

    def flush(self) -> None:
        if not self._pending:
            return
        pa = self._pa
        batch = pa.record_batch(
            [
                pa.array([s.id for s in self._pending], type=pa.string()),
                self._list_array([s.input_ids for s in self._pending], pa.int64()),
                self._list_array([s.loss_mask for s in self._pending], pa.int8()),
            ],
            schema=self.schema,
        )
        self._writer.write_batch(batch)
        self._pending = []

    def close(self) -> None:
        self.flush()
        self._writer.close()
        self._sink.close()


# ----------------------------------------------------------------------------- build


def load_tokenizer(target_dir: Path | str, trust_remote_code: bool = False,
                   revision: str | None = None):
    """The target's tokenizer: a local directory, or a hub id at ``target.revision``."""
    from transformers import AutoTokenizer

    kwargs = pretrained_kwargs(target_dir, revision, trust_remote_code)
    return AutoTokenizer.from_pretrained(str(target_dir), **kwargs)


def _render_batch(
    tokenizer, batch: list[Response], template_kwargs: dict | None, stats: Stats
) -> list[tuple[list[int], list[int]] | None]:
    """Rendered (prompt ids, completion ids) per response; None where the template failed."""
    texts: list[tuple[str, str] | None] = []
    for response in batch:
        try:
            texts.append(render_texts(tokenizer, response, template_kwargs))
        except RenderError as e:
            stats.render_errors += 1
            log.warning("%s", e)
            texts.append(None)
    ok = [t for t in texts if t is not None]
    if not ok:
        return [None] * len(batch)
    # One batched call per side: the Rust tokenizer parallelises over the batch.
    prompt_ids = tokenizer([p for p, _ in ok], add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer([c for _, c in ok], add_special_tokens=False)["input_ids"]
    rendered = iter(zip(prompt_ids, completion_ids, strict=True))
    return [None if t is None else next(rendered) for t in texts]


def build_dataset(
    response_files: list[Path],
    target_dir: Path,
    out_dir: Path,
    eval_fraction: float,
    max_length: int,
    *,
    trust_remote_code: bool = False,
    chat_template_kwargs: dict | None = None,
    batch_size: int = 256,
    revision: str | None = None,
) -> dict:
    """Tokenize response shards into a train/eval DatasetDict at ``out_dir``; return stats.

    ``chat_template_kwargs`` must be the ones used at generation time (e.g. a thinking switch)
    so the rendering matches what the target saw. The output directory is replaced
    atomically; ``out_dir/stats.json`` holds the returned stats.
    """
    from datasets import Dataset, DatasetDict
    from tqdm import tqdm

    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    hub_revision(target_dir, revision)  # refused for a local directory, before any work
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    response_files = [Path(p) for p in response_files]
    for path in response_files:
        if not path.is_file():
            raise FileNotFoundError(f"response file not found: {path}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tokenizer = load_tokenizer(target_dir, trust_remote_code, revision)
    eot_ids = end_of_turn_ids(tokenizer, Path(target_dir))
    stats = Stats(eval_fraction=eval_fraction, max_length=max_length)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        features = dataset_features()
        writers = {s: SplitWriter(work / f"{s}.arrow", features.arrow_schema) for s in SPLITS}
        seen: set[str] = set()
        progress = tqdm(
            total=_count_lines(response_files), unit="sample", desc="dataset", dynamic_ncols=True
        )
        for batch in _batched(iter_responses(response_files), batch_size):
            rendered = _render_batch(tokenizer, batch, chat_template_kwargs, stats)
            for response, rendering in zip(batch, rendered, strict=True):
                sample = _process(response, rendering, eot_ids, seen, stats)
                if sample is not None:
                    writers[split_of(response.split_id, eval_fraction)].add(sample)
            progress.update(len(batch))
        progress.close()
        for writer in writers.values():
            writer.close()

        splits = DatasetDict({s: Dataset.from_file(str(writers[s].path)) for s in SPLITS})
        result = stats.to_json()
        with atomic_dir(out_dir) as final:
            # An empty split saved with the automatic shard count (0) cannot be loaded back.
            shards = {s: 1 for s in SPLITS if splits[s].num_rows == 0}
            splits.save_to_disk(str(final), num_shards=shards)
            del splits  # release the memory maps before the scratch files go
            (final / DATASET_STATS).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log_summary(result, out_dir)
    return result


def _process(
    response: Response,
    rendering: tuple[list[int], list[int]] | None,
    eot_ids: dict[int, None],
    seen: set[str],
    stats: Stats,
) -> Sample | None:
    """One response -> a sample for its split, or None (counted as dropped)."""
    if response.id in seen:
        stats.drop("duplicate_id", response.id)
        return None
    seen.add(response.id)
    split = split_of(response.split_id, stats.eval_fraction)
    stats.samples_in[split] += 1
    assembled = assemble_sample(response, rendering, eot_ids, stats)
    if assembled is None:
        stats.drop("render_error", response.id)
        return None
    ids, n_prompt = assembled
    if len(ids) <= n_prompt:
        stats.drop("no_supervised_tokens", response.id)
        return None
    if len(ids) > stats.max_length:
        if n_prompt >= stats.max_length:
            stats.drop("no_supervised_tokens_after_truncation", response.id)
            return None
        stats.truncated += 1  # kept, cut to max_length
    sample = make_sample(response.id, ids, n_prompt, stats.max_length)
    stats.samples_out[split] += 1
    stats.tokens[split] += len(sample.input_ids)
    stats.supervised_tokens[split] += int(sample.loss_mask.sum())
    return sample


def _log_summary(stats: dict, out_dir: Path) -> None:
    log.info(
        "dataset -> %s: train %d, eval %d samples; dropped %s; mismatches %d of %d with ids; "
        "truncated %d",
        out_dir,
        stats["samples_out"]["train"],
        stats["samples_out"]["eval"],
        stats["dropped"] or "none",
        stats["mismatch"],
        stats["with_token_ids"],
        stats["truncated"],
    )
    if stats["mismatch"]:
        log.warning(
            "%d samples: chat-template rendering differs from the returned token ids; the ids "
            "were used (first ids: %s)",
            stats["mismatch"],
            ", ".join(stats["mismatch_ids"][:5]),
        )


def load_split(dataset_dir: Path, split: str):
    """One split of a saved dataset (memory-mapped)."""
    from datasets import load_from_disk

    return load_from_disk(str(Path(dataset_dir) / split))


__all__ = [
    "build_dataset",
    "is_eval",
    "split_of",
    "load_split",
    "parse_response",
    "render_texts",
    "RenderError",
    "TRUNCATION_POLICY",
]


def count_render_mismatches(records: list[dict], target_dir: Path,
                            chat_template_kwargs: dict | None = None,
                            trust_remote_code: bool = False, revision: str | None = None) -> int:
    """How many response records the chat template does not render to their own token ids.

    The same check the dataset build applies; generation reports it per shard so drift between
    the stored text and the target's token stream is visible before training.
    """
    tokenizer = load_tokenizer(target_dir, trust_remote_code, revision)
    eot_ids = end_of_turn_ids(tokenizer, Path(target_dir))
    stats = Stats(eval_fraction=0.0, max_length=1)
    responses = [parse_response(r, f"record {i}") for i, r in enumerate(records)]
    for batch_start in range(0, len(responses), 256):
        batch = responses[batch_start: batch_start + 256]
        for response, rendering in zip(
            batch, _render_batch(tokenizer, batch, chat_template_kwargs, stats), strict=True
        ):
            if response.has_ids:
                assemble_sample(response, rendering, eot_ids, stats)
    return stats.mismatch + stats.render_errors

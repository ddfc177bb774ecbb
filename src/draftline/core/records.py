"""The prompt record and its shard file, read and written here only.

A prompt shard (``prompts/shard-{i}.jsonl``, docs/formats.md) holds one JSON object per line,
``{"id": str, "messages": [...]}``, whose last message is a user turn. The prompt stage writes
the shards (:func:`write_shard`); profiling, generation and the benchmark read prompts through
:class:`Prompt` (:func:`read_shard`). A record that cannot be used, in any of the pipeline's
record files, raises :class:`RecordError`.

Kept apart from ``draftline.stages.prompts`` (reading and cleaning the sources), so that the stages
that read shards do not depend on that code: editing it must not make generation stale.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from draftline.core.atomic import write_jsonl


class RecordError(ValueError):
    """One record of an input file that cannot be used (a prompt source, a prompt shard, a
    responses shard): ``reason`` is a short code, ``detail`` names the record and explains."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Prompt:
    """A chat prompt: the messages up to the user turn a response is asked for."""

    id: str
    messages: list[dict[str, str]]
    # full sha256 hex digest of the canonical messages; set when built from a source (it finds
    # duplicates), not kept in the shards
    content_hash: str | None = None
    # the prompt this is one more answer to (generate.answers_per_prompt), its split's and its
    # temperature's; None: the prompt itself
    prompt_id: str | None = None

    @property
    def split_id(self) -> str:
        """The id its split is decided by (``draftline.core.split``): its prompt's."""
        return self.prompt_id or self.id


def write_shard(path: str | Path, prompts: Iterable[Prompt]) -> None:
    write_jsonl(path, ({"id": p.id, "messages": p.messages} for p in prompts))


def read_shard(path: str | Path) -> list[Prompt]:
    """The prompts of one shard file, in file order; a bad record raises RecordError naming
    the file and line."""
    path = Path(path)
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                prompts.append(Prompt(id=str(rec["id"]), messages=list(rec["messages"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise RecordError("bad_shard_record", f"{path}:{lineno}: not a prompt record "
                                  f"with 'id' and 'messages' ({exc})") from exc
    return prompts

"""Which split a prompt's sample falls in: a hash of its id alone.

A sample goes to ``eval`` iff ``sha256(id)`` (first 8 bytes, big endian) mod 10**6 is below
``eval_fraction * 10**6``, so adding or removing samples never moves the others. Generation
asks for it too (the eval split's answers are sampled at ``generate.eval_temperature``), before
any dataset exists; the dataset stage, the benchmark and training read it from here.

A prompt answered more than once (``generate.answers_per_prompt``) gives samples of their own
ids, each record naming its prompt as ``prompt_id``: every answer to a prompt falls where the
prompt does (``split_key``), so that no prompt is trained on and evaluated on.
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "eval")
HASH_BUCKETS = 1_000_000


def is_eval(sample_id: str, eval_fraction: float) -> bool:
    """Deterministic split by id hash: adding samples never moves existing ones."""
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % HASH_BUCKETS
    return bucket < round(eval_fraction * HASH_BUCKETS)


def split_of(sample_id: str, eval_fraction: float) -> str:
    return "eval" if is_eval(sample_id, eval_fraction) else "train"


def split_key(record: dict) -> str:
    """The id a response record is split by: its prompt's (``prompt_id``, an answer after the
    first to that prompt), else its own."""
    return record.get("prompt_id") or record["id"]

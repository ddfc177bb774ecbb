"""The target is a local model directory or a hub id; ``target.revision`` pins a hub id.

A revision (branch, tag or commit) selects which files of a hub repository vLLM
(``--revision``, ``--tokenizer-revision``) and transformers (``from_pretrained(revision=)``)
download, so every stage that serves or loads the target gets it from here. A local directory has
no revisions: its files are what they are (the bundle records their hashes), so a revision given
with one is refused instead of being recorded as if it had pinned anything.
"""

from __future__ import annotations

from pathlib import Path


class RevisionError(ValueError):
    """``target.revision`` given for a target that is not a hub id."""


def is_local(model: str | Path) -> bool:
    """A directory (or file) on disk: what vLLM and transformers load as a path, not a hub id."""
    return Path(model).exists()


def hub_revision(model: str | Path, revision: str | None) -> str | None:
    """The revision to pass with ``model``: ``revision`` for a hub id, None when none is set."""
    if revision is None:
        return None
    if is_local(model):
        raise RevisionError(
            f"config key 'target.revision' is {revision!r}, but target.model ({model}) is a "
            "local directory, which has no revisions: set target.revision to null, or "
            "target.model to the hub id the revision belongs to")
    return revision


def pretrained_kwargs(model: str | Path, revision: str | None = None,
                      trust_remote_code: bool = False) -> dict:
    """Keyword arguments of ``from_pretrained(model, ...)``: the revision of a hub id, and
    ``trust_remote_code`` only when it is true."""
    kwargs: dict = {}
    pinned = hub_revision(model, revision)
    if pinned is not None:
        kwargs["revision"] = pinned
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    return kwargs


def local_dir(model: str | Path, revision: str | None = None) -> Path:
    """The directory holding the target's files, for the stages that read them (vocab, hidden
    states, training, export, bundle): ``model`` itself, or the snapshot of a hub id (at
    ``revision``) in the local Hugging Face cache.

    Nothing is downloaded here: a production target is hundreds of GB, fetched once on purpose
    (the servers read the same cache).
    """
    if is_local(model):
        return Path(model)
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    pinned = f" at revision {revision}" if revision else ""
    try:
        return Path(snapshot_download(str(model), revision=revision, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(
            f"config key 'target.model': {model}{pinned} is neither a local directory nor in "
            f"the Hugging Face cache ({HF_HUB_CACHE}); download it first, e.g. "
            f"`huggingface-cli download {model}" + (f" --revision {revision}" if revision
                                                     else "") + "`") from exc

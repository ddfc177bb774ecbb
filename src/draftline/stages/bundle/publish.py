"""Publishing a verified bundle: to a local folder or Snakemake storage, or to the HF hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from draftline.core.atomic import copy_file, sha256_file, write_text
from draftline.stages.bundle.archive import MANIFEST, BundleError, json_text
from draftline.stages.bundle.verify import verify_bundle


def publish_files(tar_path: str | Path, manifest_path: str | Path, tar_out: str | Path,
                  manifest_out: str | Path, sha256_out: str | Path) -> str:
    """Copy a verified bundle archive (and its manifest, and a sha256sum line) to the given
    paths: a local folder, or the local side of Snakemake storage outputs, which Snakemake
    then uploads (S3, GCS, ... through its storage plugins). Returns the archive's SHA-256."""
    verify_bundle(tar_path)  # never publish a damaged or tampered archive
    for out in (tar_out, manifest_out, sha256_out):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    copy_file(tar_path, tar_out)
    copy_file(manifest_path, manifest_out)
    digest = sha256_file(tar_out)
    write_text(sha256_out, f"{digest}  {Path(tar_out).name}\n")
    return digest


def push_to_hub(bundle_dir: str | Path, repo_id: str, token_env: str = "HF_TOKEN",
                private: bool = True) -> dict[str, Any]:
    """Upload a verified bundle folder to a Hugging Face model repo (created private when
    missing); the token comes from the environment variable ``token_env``, never the config.
    Returns what was pushed: repo, commit and the manifest's SHA-256."""
    token = os.environ.get(token_env)
    if not token:
        raise BundleError(f"bundle.hf_repo is set but environment variable {token_env} is empty")
    try:
        from huggingface_hub import HfApi
    except ImportError as exc:
        raise BundleError("bundle.hf_repo needs the huggingface_hub package") from exc
    bundle_dir = Path(bundle_dir)
    verify_bundle(bundle_dir)
    manifest_sha = sha256_file(bundle_dir / MANIFEST)
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(bundle_dir), repo_type="model",
                               commit_message=f"draftline bundle {manifest_sha[:12]}")
    return {"repo": repo_id, "commit": getattr(commit, "oid", None),
            "manifest_sha256": manifest_sha}


def write_push_record(path: str | Path, pushed: dict[str, Any]) -> None:
    """What ``push_to_hub`` returned, as the push rule's output (the bundle's JSON style)."""
    write_text(path, json_text(pushed))


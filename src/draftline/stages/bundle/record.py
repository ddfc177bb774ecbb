"""The build record: facts about one build of the bundle, kept beside the archive.

``bundle.build.json`` (next to ``bundle.tar``) says when, where, by whom and by which command
the archive was built, and what the local Docker knew of the configured images. None of it is
an input of the artifact, so none of it is in the archive or its manifest: two builds from the
same results give the same bytes on any host. The record points at the archive by its SHA-256;
nothing points back.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import platform
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from draftline.core.atomic import sha256_file, write_text
from draftline.stages.bundle.archive import json_text
from draftline.stages.bundle.provenance import image_refs, run_quiet
from draftline.stages.bundle.scrub import scrub_args, scrub_obj

RECORD_FORMAT = "draftline-bundle-build/1"


def build_record_path(tar_path: str | Path) -> Path:
    """``results/bundle.tar`` -> ``results/bundle.build.json``."""
    tar_path = Path(tar_path)
    return tar_path.with_name(f"{tar_path.name.removesuffix('.tar')}.build.json")


def command_line(argv: Sequence[str] | None = None) -> list[str]:
    """The invoking command: the Snakemake command line when set by the workflow
    (DRAFTLINE_COMMAND_LINE), else this process's; the program by name, not install path."""
    if argv is None:
        env = os.environ.get("DRAFTLINE_COMMAND_LINE")
        argv = shlex.split(env) if env else sys.argv
    argv = list(argv)
    if argv:
        argv[0] = Path(argv[0]).name
    return scrub_args(argv)


def host_summary() -> dict[str, Any]:
    """The building machine: name, user, CPU, memory and GPUs."""
    cpu_model = None
    mem_gib = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20)
    gpus = []
    out = run_quiet(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                     "--format=csv,noheader"]) if shutil.which("nvidia-smi") else None
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return {"hostname": socket.gethostname(), "user": _user(), "system": platform.system(),
            "machine": platform.machine(), "cpu_model": cpu_model,
            "logical_cpus": os.cpu_count(), "memory_gib": mem_gib, "gpus": gpus}


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (some containers)
        return None


def local_images(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The configured images as the local Docker knows them (id, repo digests), if at all."""
    images = []
    for role, ref in image_refs(config).items():
        entry: dict[str, Any] = {"role": role, "image": ref, "id": None, "repo_digests": []}
        if "@sha256:" in ref:
            entry["repo_digests"] = [ref]
        if shutil.which("docker") is None:
            entry["note"] = "docker not installed"
        else:
            out = run_quiet(["docker", "image", "inspect", "--format",
                             "{{.Id}} {{json .RepoDigests}}", ref])
            if out:
                image_id, _, digests = out.strip().partition(" ")
                entry["id"] = image_id
                entry["repo_digests"] = sorted(set(entry["repo_digests"]) | set(json.loads(
                    digests or "[]")))
            else:
                entry["note"] = "not inspectable (docker daemon down or image not present)"
        images.append(entry)
    return images


def collect_build_record(tar_path: str | Path, manifest_path: str | Path,
                         config: Mapping[str, Any],
                         argv: Sequence[str] | None = None) -> dict[str, Any]:
    return {
        "format": RECORD_FORMAT,
        "bundle": Path(tar_path).name,
        "bundle_sha256": sha256_file(tar_path),
        "manifest_sha256": sha256_file(manifest_path),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command_line": command_line(argv),
        "host": host_summary(),
        "local_images": local_images(config),
    }


def write_build_record(path: str | Path, record: Mapping[str, Any],
                       secrets: Mapping[str, str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json_text(scrub_obj(dict(record), secrets)))

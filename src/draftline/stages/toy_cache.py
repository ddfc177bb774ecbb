"""The toy target built once per content under a cache folder, shared by the test suite and
the benchmarks so that both measure the same target.

Apart from ``draftline.stages.toy`` on purpose: the cache key hashes that module's source,
which this code would otherwise be part of.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path

from draftline.stages import toy


def toy_build_key(toy_cfg: dict) -> str:
    """What a built toy depends on: the toy module's code, its sentences and ``toy_cfg``."""
    package = Path(toy.__file__).resolve().parents[1]
    source = (Path(toy.__file__).read_bytes()
              + (package / "data" / "toy" / "sentences.txt").read_bytes())
    blob = source + json.dumps(toy_cfg, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cached_toy_target(toy_cfg: dict, cache_dir: Path) -> Path:
    """The toy of ``toy_cfg`` under ``cache_dir``, built on first use and reused while its
    code and settings are unchanged (``toy_build_key``); concurrent callers build it once."""
    out = Path(cache_dir) / f"toy-{toy_build_key(toy_cfg)}"
    if (out / "config.json").exists():
        return out  # built (renamed into place whole): no need to queue behind another build
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "toy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            toy.build_toy_target(out, toy_cfg)
    return out

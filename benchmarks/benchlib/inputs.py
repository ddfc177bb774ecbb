"""The benchmarks' inputs: the default config, the target, prompts."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "config" / "config.yaml"
# where the test suite caches its toy target (tests/conftest.py), so that a benchmark and the
# tests measure the same target and build it once
TOY_CACHE = REPO / ".pytest_cache" / "draftline"


def default_config(path: str | Path = DEFAULT_CONFIG, overrides: dict | None = None) -> dict:
    """The config as the CLI resolves it (``draftline.core.config.load_config``)."""
    from draftline.core.config import load_config

    return load_config(path, overrides or {})


def target_or_cached_toy(model: str | Path | None, config: dict) -> str:
    """``model`` as given; without one, the toy of ``config`` as the tests build and cache it
    (built on first use)."""
    if model is not None:
        return str(model)
    from draftline.stages.toy_cache import cached_toy_target

    return str(cached_toy_target(config["target"]["toy"], TOY_CACHE))


def read_prompts(path: str | Path, limit: int | None = None) -> list:
    """The first ``limit`` prompts (all for None) of a jsonl of ``{id, messages}`` records
    (``draftline.core.records.read_shard``: a bad record names the file and line)."""
    from draftline.core.records import read_shard

    prompts = read_shard(path)
    return prompts if limit is None else prompts[:limit]


def bundled_prompts() -> list:
    """The prompts shipped with draftline, in file order."""
    from draftline.stages.prompts import bundled_prompts_path

    return read_prompts(bundled_prompts_path())


def question_prompts(n: int) -> list:
    """``n`` short synthetic questions of varied length (ids ``q0``, ``q1``, ...): the same
    requests for draftline's client and ``vllm bench serve`` in the agreement checks."""
    from draftline.core.records import Prompt

    subjects = ["rivers", "prime numbers", "bread", "comets", "chess openings", "tides",
                "glass", "owls", "bridges", "volcanoes", "maps", "clocks"]
    prompts = []
    for i in range(n):
        words = ", ".join(subjects[(i * 7 + k) % len(subjects)] for k in range(1 + i % 5))
        text = f"Question {i}: explain {words} to a curious student."
        prompts.append(Prompt(f"q{i}", [{"role": "user", "content": text}]))
    return prompts


def folder_bytes(path: str | Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())

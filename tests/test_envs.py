"""Conda environments and image locks agree with the project's pins.

Every pip entry of envs/*.yaml is an exact pin; it satisfies pyproject.toml's requirement for
that package, repeats pyproject's own exact pins, and equals the version in the image locks
(containers/requirements/*.txt: the versions the test suite runs with), so the conda, CPU image
and pipeline image deployments install the same thing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
ENV_FILES = sorted((REPO / "envs").glob("*.yaml"))
LOCKS = sorted((REPO / "containers" / "requirements").glob("*.txt"))
# Pinned in the conda env only: the CPU image leaves them out (they break `import transformers`
# when built for another torch); the env pins the builds that go with torch 2.13.
ENV_ONLY = {"torchvision", "torchaudio"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def env_pins(path: Path) -> dict[str, str]:
    deps = yaml.safe_load(path.read_text())["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    pins = {}
    for line in pip:
        if line.startswith("-"):  # pip options (--extra-index-url)
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and "*" not in spec.version, f"{path.name}: {line} not exact"
        pins[canonical(req.name)] = spec.version
    return pins


def lock_pins() -> dict[str, set[str]]:
    """Package -> its versions across the image locks (one, unless an image's own resolution
    picked another version of a build tool such as setuptools)."""
    pins: dict[str, set[str]] = {}
    for path in LOCKS:
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                name, _, version = line.partition("==")
                pins.setdefault(canonical(name), set()).add(version)
    return pins


def project_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in ("cpu",):  # the CPU env's extra; gpu is the images' business
        lines += project["optional-dependencies"][extra]
    return {canonical(Requirement(line).name): Requirement(line) for line in lines}


def test_env_files_exist_and_python_is_pinned():
    assert ENV_FILES, "no conda environment files in envs/"
    for path in ENV_FILES:
        deps = yaml.safe_load(path.read_text())["dependencies"]
        assert "python=3.11" in deps, f"{path.name}: python must be pinned to 3.11"


@pytest.mark.parametrize("path", ENV_FILES, ids=lambda p: p.name)
def test_env_pins_match_pyproject(path):
    pins = env_pins(path)
    for name, req in project_requirements().items():
        assert name in pins, f"{path.name}: {name} (a draftline requirement) is not pinned"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (
            f"{path.name}: {name}=={pins[name]} does not satisfy pyproject's {req}")
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:  # pyproject's own exact pins, repeated exactly (a local build label allowed)
            assert Version(pins[name]).public == Version(exact[0]).public, (name, pins[name])


@pytest.mark.parametrize("path", ENV_FILES, ids=lambda p: p.name)
def test_env_pins_match_the_image_locks(path):
    locked = lock_pins()
    for name, version in env_pins(path).items():
        if name in ENV_ONLY:
            assert version.endswith("+cpu"), f"{path.name}: {name} must be the +cpu build"
            continue
        assert name in locked, f"{path.name}: {name} is in no image lock"
        assert locked[name] == {version}, f"{path.name}: {name}=={version}, locked {locked[name]}"


def test_locks_satisfy_pyproject_and_keep_broken_packages_out():
    locked = lock_pins()
    requirements = project_requirements()
    for name, req in requirements.items():
        assert name in locked, f"{name} is in no image lock"
        for version in locked[name]:
            assert req.specifier.contains(Version(version), prereleases=True), (name, req)
    serving = (REPO / "containers" / "requirements" / "serving-cpu.txt").read_text()
    assert not re.search(r"^(torchvision|torchaudio|torchcodec)==", serving, re.M)
    assert "torch==2.13.0+cpu" in serving.splitlines()
    pipeline = (REPO / "containers" / "requirements" / "pipeline.txt").read_text()
    assert not re.search(r"^(torch|triton|nvidia-.*)==", pipeline, re.M)  # the CUDA base has them
    pipeline_names = {canonical(line.partition("==")[0]) for line in pipeline.splitlines()}
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for line in core:  # the pipeline image installs draftline with --no-deps: all must be locked
        assert canonical(Requirement(line).name) in pipeline_names, f"pipeline.txt lacks {line}"

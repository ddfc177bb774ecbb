"""Conda environments and image locks agree with the project's pins.

Every pip entry of envs/*.yaml is an exact pin; it satisfies pyproject.toml's requirement for
that package, repeats pyproject's own exact pins, and equals the version in the image locks
(containers/requirements/*.txt: the versions the test suite runs with), so the conda, CPU image
and pipeline image deployments install the same thing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
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


# ----------------------------------------------------- what a remote-code tokenizer needs in images

TIKTOKEN_TOKENIZER = '''
import tiktoken
from transformers import PreTrainedTokenizer


class TikTokenizer(PreTrainedTokenizer):
    """Byte-level tiktoken encoding, the way Kimi-K2.5's tokenization_kimi.py builds its own."""

    vocab_files_names: dict = {}

    def __init__(self, **kwargs):
        self.model = tiktoken.Encoding(name="tiny", pat_str=r"\\S+|\\s+", special_tokens={},
                                       mergeable_ranks={bytes([i]): i for i in range(256)})
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return 256

    def get_vocab(self):
        return {str(i): i for i in range(256)}

    def _tokenize(self, text):
        return [str(t) for t in self.model.encode(text)]

    def _convert_token_to_id(self, token):
        return int(token)

    def _convert_id_to_token(self, index):
        return str(index)

    def convert_tokens_to_string(self, tokens):
        return self.model.decode([int(t) for t in tokens])
'''

# Prints the distributions behind every module imported once draftline's dataset stage has
# loaded the tokenizer in argv[1] (and encoded a text with it).
IMPORTED_DISTRIBUTIONS = '''
import importlib.metadata, json, sys
from draftline.stages.dataset import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1], trust_remote_code=True)
assert tokenizer("hi there")["input_ids"]
owners = importlib.metadata.packages_distributions()
top = {name.partition(".")[0] for name in sys.modules}
print(json.dumps(sorted({canonical for n in top for canonical in owners.get(n, [])})))
'''


def imported_distributions(tokenizer_dir: Path) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", IMPORTED_DISTRIBUTIONS, str(tokenizer_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {canonical(name) for name in json.loads(proc.stdout.splitlines()[-1])}


def test_images_that_load_the_tokenizer_have_what_remote_tokenizer_code_imports(tmp_path):
    """Kimi-K2.5's tokenizer is remote code that imports tiktoken; the dataset stage (pipeline
    image) and vLLM (serving image) load it. What such code imports beyond a plain tokenizer's
    load must be locked in both images."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = tmp_path / "plain"
    vocab = {"[UNK]": 0, "hi": 1, "there": 2}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "[UNK]")),
                            unk_token="[UNK]").save_pretrained(plain)
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "tokenization_tiny.py").write_text(TIKTOKEN_TOKENIZER)
    (remote / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_tiny.TikTokenizer", None]}}))

    needed = imported_distributions(remote) - imported_distributions(plain)
    assert "tiktoken" in needed  # the check sees what remote code imports
    locked = {path.stem: {canonical(line.partition("==")[0])
                          for line in path.read_text().splitlines() if "==" in line}
              for path in LOCKS}
    for image in ("pipeline", "serving-cpu"):
        missing = needed - locked[image]
        assert not missing, f"containers/requirements/{image}.txt lacks {sorted(missing)}"

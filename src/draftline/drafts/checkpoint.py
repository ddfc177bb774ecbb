"""What every family's exported checkpoint shares: its file names, the refusal of tensors
that do not fit the shapes a config implies, the dtype it is written in and the atomic write.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline.core.atomic import atomic_dir
from draftline.core.target import text_config

WEIGHTS_FILE, DRAFT_CONFIG_FILE = "model.safetensors", "draft_config.json"
SHARED_WITH_TARGET = ("embed_tokens.weight",)  # may be present in the weights; never exported
DTYPES = {"bfloat16", "float16", "float32"}


class ExportError(ValueError):
    """The draft weights do not form a valid checkpoint; the message names the tensor."""


def check_tensors(tensors: dict, expected: dict[str, tuple[int, ...]], source: Path) -> None:
    """Refuse missing, unexpected, mis-shaped or non-finite tensors (all problems listed)."""
    import torch

    problems = [f"missing tensor '{n}' (expected shape {list(s)})"
                for n, s in expected.items() if n not in tensors]
    problems += [f"unexpected tensor '{n}'" for n in tensors
                 if n not in expected and n not in SHARED_WITH_TARGET]
    for name, shape in expected.items():
        if name in tensors:
            got = tuple(tensors[name].shape)
            if got != shape:
                problems.append(f"tensor '{name}' has shape {list(got)}, expected {list(shape)}")
            elif not torch.isfinite(tensors[name].float()).all():
                problems.append(f"tensor '{name}' has non-finite values")
    if problems:
        raise ExportError(f"{source}: refusing to export: " + "; ".join(problems))


def target_dtype(target_cfg: dict) -> str:
    dtype = target_cfg.get("torch_dtype") or target_cfg.get("dtype") or \
        text_config(target_cfg).get("torch_dtype") or "bfloat16"
    return dtype if dtype in DTYPES else "bfloat16"


def write_checkpoint(out_dir: Path, tensors: dict, config: dict) -> Path:
    """``out_dir/model.safetensors`` and ``out_dir/config.json``, assembled next to
    ``out_dir`` and renamed into place: a refused or interrupted export leaves no partial
    directory."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir

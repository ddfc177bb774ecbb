"""Export trained draft weights as an EAGLE-3 checkpoint that vLLM (and SGLang) load.

Format (docs/formats.md, matching vLLM's ``Eagle3LlamaForCausalLM`` loader): ``config.json`` with
``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, one hidden layer, the
target's ``vocab_size``, ``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``
(vLLM captures exactly these target layers), the norm flags ``norm_before_fc``, ``fc_norm``,
``norm_before_residual`` and ``norm_output`` (EAGLE-3.1 sets ``fc_norm`` and ``norm_output``),
and ``model.safetensors`` with ``fc`` (and ``input_norm``, ``fc_norm.{i}``), ``midlayer.*``,
``norm``, ``lm_head``, ``d2t`` (vLLM's ``draft_id_to_target_id``) and ``t2d`` (skipped by
vLLM, used by SGLang). No ``embed_tokens``: vLLM shares the target's.

A draft vocab equal to the target's (the vocab stage's identity map, whenever
``vocab.draft_vocab_size`` >= the target vocab) ships neither ``d2t`` nor ``t2d``: vLLM then
builds the draft without a ``draft_id_to_target_id`` parameter, and its loader fails on a
checkpoint that has ``d2t`` ("There is no module or parameter named 'draft_id_to_target_id'").
SGLang, too, treats a checkpoint without ``d2t`` as predicting the full vocab.

Every tensor is checked against the shapes the config implies before anything is written;
a missing, mis-shaped, unexpected or non-finite tensor refuses the export.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline.core.atomic import atomic_dir
from draftline.core.target import read_teacher_config, text_config
from draftline.stages.hidden.layers import LayerIdError, check_layer_ids

WEIGHTS_FILE, DRAFT_CONFIG_FILE = "model.safetensors", "draft_config.json"
SHARED_WITH_TARGET = ("embed_tokens.weight",)  # may be present in the weights; never exported
DTYPES = {"bfloat16", "float16", "float32"}


class ExportError(ValueError):
    """The draft weights do not form a valid checkpoint; the message names the tensor."""


def _weights_file(best_weights: Path) -> Path:
    path = Path(best_weights)
    path = path / WEIGHTS_FILE if path.is_dir() else path
    if not path.exists():
        raise ExportError(f"draft weights not found: {path}")
    return path


def _draft_config(weights_file: Path, target_cfg: dict, draft_vocab: int):
    """The draft architecture: ``draft_config.json`` next to the weights, else from the target."""
    from draftline.model import DraftConfig

    saved = weights_file.parent / DRAFT_CONFIG_FILE
    if saved.exists():
        cfg = DraftConfig.from_dict(json.loads(saved.read_text()))
    else:
        cfg = DraftConfig.from_target(target_cfg, draft_vocab)
    reference = DraftConfig.from_target(target_cfg, draft_vocab)
    for key in ("vocab_size", "target_hidden_size", "draft_vocab_size"):
        if getattr(cfg, key) != getattr(reference, key):
            raise ExportError(f"{saved}: {key} {getattr(cfg, key)} does not match the target/"
                              f"vocab map ({getattr(reference, key)})")
    return cfg


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


def check_vocab_map(d2t, t2d, draft_cfg, source: Path) -> None:
    import torch

    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_cfg.draft_vocab_size,):
        raise ExportError(f"{source}: d2t must be int64 [{draft_cfg.draft_vocab_size}], got "
                          f"{d2t.dtype} {list(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (draft_cfg.vocab_size,):
        raise ExportError(f"{source}: t2d must be bool [{draft_cfg.vocab_size}], got "
                          f"{t2d.dtype} {list(t2d.shape)}")
    target_ids = torch.arange(d2t.shape[0]) + d2t  # [D]
    if (target_ids < 0).any() or (target_ids >= t2d.shape[0]).any():
        raise ExportError(f"{source}: d2t maps draft ids outside the target vocab")
    # Ascending ids make a full-size map the identity, which is what vLLM assumes when it
    # loads a draft without d2t (a permuted full map would silently scramble lm_head rows).
    if (target_ids[1:] <= target_ids[:-1]).any():
        raise ExportError(f"{source}: d2t target ids must be strictly ascending")
    if not t2d[target_ids].all() or int(t2d.sum()) != d2t.shape[0]:
        raise ExportError(f"{source}: d2t and t2d disagree on the draft vocab")


def vocab_map_needed(draft_cfg) -> bool:
    """Whether the checkpoint carries ``d2t``/``t2d``: only for a reduced draft vocab."""
    return draft_cfg.draft_vocab_size != draft_cfg.vocab_size


def draft_layer_ids(layer_ids, target_cfg: dict) -> list[int]:
    """The aux ids vLLM will capture for this draft, checked as extraction checked them."""
    num_layers = int(text_config(target_cfg)["num_hidden_layers"])
    try:
        return check_layer_ids(layer_ids, num_layers, target_cfg, source="layer_ids")
    except LayerIdError as exc:
        raise ExportError(str(exc)) from exc


def draft_config_json(draft_cfg, target_cfg: dict, layer_ids: list[int], dtype: str) -> dict:
    text = text_config(target_cfg)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": draft_cfg.hidden_size,
        "intermediate_size": draft_cfg.intermediate_size,
        "num_attention_heads": draft_cfg.num_attention_heads,
        "num_key_value_heads": draft_cfg.num_key_value_heads,
        "head_dim": draft_cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": draft_cfg.rms_norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta
        # and rope_scaling.
        "rope_theta": draft_cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", **(draft_cfg.rope_scaling or {}),
                            "rope_theta": draft_cfg.rope_theta},
        "rope_scaling": draft_cfg.rope_scaling,
        "max_position_embeddings": draft_cfg.max_position_embeddings,
        "vocab_size": draft_cfg.vocab_size,
        "draft_vocab_size": draft_cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "pad_token_id": text.get("pad_token_id"),
        # Both places: vLLM's model runner reads eagle_config, its newer GPU runner
        # (v1/worker/gpu/spec_decode) only the top level.
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        # Norm placements (vLLM reads each from the top level; absent means false).
        **{flag: getattr(draft_cfg, flag) for flag in draft_cfg.NORM_FLAGS},
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": layer_ids,
            "use_aux_hidden_state": True,
        },
    }
    if draft_cfg.target_hidden_size != draft_cfg.hidden_size:
        config["target_hidden_size"] = draft_cfg.target_hidden_size
    if draft_cfg.arch == "deepseek_mla":
        config.update(mla_config_keys(draft_cfg))
        for key in ("head_dim", "num_key_value_heads", "norm_before_fc"):  # not the MLA class's
            config.pop(key)
    if draft_cfg.parallel_drafting:
        # P-EAGLE: vLLM reads the mask slots' token here (its proposer's first choice) and the
        # state from the weights' mask_hidden; parallel_drafting itself is a speculative-config
        # setting, recorded here for the servers draftline starts and the model card
        config["mask_token_id"] = draft_cfg.mask_token_id
        config["parallel_drafting"] = True
    return config


def mla_config_keys(draft_cfg) -> dict:
    """What vLLM's ``Eagle3DeepseekV3ForCausalLM`` reads besides the Llama draft's keys.

    ``model_type`` must be deepseek_v2: vLLM rewrites a deepseek_v3 draft config into its MTP
    model (``SpeculativeConfig.hf_config_override``), which has no EAGLE-3 class. The loader
    always stacks ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``, which exists only with a
    ``q_lora_rank``: the draft always has one (``draftline.model.mla_sizes``)."""
    return {"architectures": ["Eagle3DeepseekV3ForCausalLM"], "model_type": "deepseek_v2",
            **{key: getattr(draft_cfg, key) for key in draft_cfg.MLA_KEYS}}


def _target_dtype(target_cfg: dict) -> str:
    dtype = target_cfg.get("torch_dtype") or target_cfg.get("dtype") or \
        text_config(target_cfg).get("torch_dtype") or "bfloat16"
    return dtype if dtype in DTYPES else "bfloat16"


def export_draft(best_weights, target_dir, vocab_map, layer_ids, out_dir) -> Path:
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors``; return ``out_dir``.

    ``best_weights`` is the training's ``best/`` dir (or its model.safetensors); ``layer_ids``
    the aux layer ids used in extraction. The checkpoint is assembled next to ``out_dir`` and
    renamed into place, so a refused or interrupted export leaves no partial directory.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from draftline.model import expected_shapes

    weights_file = _weights_file(Path(best_weights))
    target_cfg = read_teacher_config(Path(target_dir))
    saved = weights_file.parent / DRAFT_CONFIG_FILE
    if saved.exists() and json.loads(saved.read_text()).get("drafting") == "dflash":
        return export_dflash(weights_file, target_cfg, layer_ids, Path(out_dir))
    vocab = load_file(str(vocab_map))
    if "d2t" not in vocab or "t2d" not in vocab:
        raise ExportError(f"{vocab_map}: needs tensors 'd2t' and 't2d'")
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    draft_cfg = _draft_config(weights_file, target_cfg, d2t.shape[0])
    tensors = load_file(str(weights_file))
    check_tensors(tensors, expected_shapes(draft_cfg), weights_file)
    check_vocab_map(d2t, t2d, draft_cfg, Path(vocab_map))
    ids = draft_layer_ids(layer_ids, target_cfg)

    dtype = _target_dtype(target_cfg)
    out = {name: tensors[name].to(getattr(torch, dtype)).contiguous()
           for name in expected_shapes(draft_cfg)}
    if vocab_map_needed(draft_cfg):
        out["d2t"] = d2t.contiguous()
        out["t2d"] = t2d.contiguous()
    config = draft_config_json(draft_cfg, target_cfg, ids, dtype)

    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_file(out, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def dflash_config_json(cfg, target_cfg: dict, layer_ids: list[int], dtype: str) -> dict:
    """config.json of a DFlash draft as vLLM's ``DFlashQwen3ForCausalLM`` reads it.

    ``dflash_config.target_layer_ids`` names a layer by its output, vLLM's aux id by its
    input: DFlash's t is vLLM's t + 1, so the stored states' ids k are listed as k - 1 (vLLM
    adds the 1 back, eagle3_utils). No ``eagle_config`` or ``eagle_aux_hidden_state_layer_ids``:
    either would override the list without the shift. ``head_dim`` and the rotary base are
    written out: transformers' Qwen3Config would otherwise fill its own defaults. vLLM sizes
    the draft's rotary cache and its longest context by ``max_position_embeddings``: the
    target's, plus one block. It never reads ``block_size`` (kept for other readers)."""
    text = text_config(target_cfg)
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings + cfg.block_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "block_size": cfg.block_size,
        "num_target_layers": int(text["num_hidden_layers"]),
        "dflash_config": {"target_layer_ids": [k - 1 for k in layer_ids],
                          "mask_token_id": cfg.mask_token_id},
    }


def export_dflash(weights_file: Path, target_cfg: dict, layer_ids, out_dir: Path) -> Path:
    """A DFlash draft's checkpoint: its layers' weights (vLLM's names, no ``model.`` prefix),
    no embedding and no lm_head (vLLM shares the target's: the draft's hidden size is the
    target's), and ``dflash_config_json``."""
    import torch
    from safetensors.torch import load_file, save_file

    from draftline.dflash import DFlashConfig, expected_shapes

    cfg = DFlashConfig.from_dict(json.loads((weights_file.parent / DRAFT_CONFIG_FILE)
                                            .read_text()))
    if cfg.hidden_size != int(text_config(target_cfg)["hidden_size"]):
        raise ExportError(f"{weights_file}: a DFlash draft's hidden size ({cfg.hidden_size}) "
                          "must be the target's: vLLM shares the target's embedding and lm_head")
    tensors = load_file(str(weights_file))
    check_tensors(tensors, expected_shapes(cfg), weights_file)
    ids = draft_layer_ids(layer_ids, target_cfg)
    if 0 in ids:
        raise ExportError(f"layer_ids {ids}: id 0 (the embeddings) has no DFlash name")
    dtype = _target_dtype(target_cfg)
    out = {name: tensors[name].to(getattr(torch, dtype)).contiguous()
           for name in expected_shapes(cfg)}
    with atomic_dir(Path(out_dir)) as tmp:
        save_file(out, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(
            json.dumps(dflash_config_json(cfg, target_cfg, ids, dtype), indent=2) + "\n")
    return Path(out_dir)

"""A DFlash draft exported as the checkpoint vLLM's ``DFlashQwen3ForCausalLM`` loads: its layers'
weights (vLLM's names, no ``model.`` prefix), no embedding and no lm_head (vLLM shares the
target's: the draft's hidden size is the target's), and ``dflash_config_json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline.core.target import text_config
from draftline.drafts.checkpoint import (
    DRAFT_CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    check_tensors,
    target_dtype,
    write_checkpoint,
)


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


def export(weights_file: Path, target_cfg: dict, vocab_map, layer_ids: list[int],
           out_dir) -> Path:
    """The checkpoint of the draft in ``weights_file`` (its ``draft_config.json`` beside it)
    for the aux ``layer_ids`` (checked) in ``out_dir``; no vocab map (the target's vocab)."""
    import torch
    from safetensors.torch import load_file

    from draftline.drafts.dflash.config import DFlashConfig
    from draftline.drafts.dflash.model import expected_shapes

    cfg = DFlashConfig.from_dict(json.loads((weights_file.parent / DRAFT_CONFIG_FILE)
                                            .read_text()))
    if cfg.hidden_size != int(text_config(target_cfg)["hidden_size"]):
        raise ExportError(f"{weights_file}: a DFlash draft's hidden size ({cfg.hidden_size}) "
                          "must be the target's: vLLM shares the target's embedding and lm_head")
    tensors = load_file(str(weights_file))
    check_tensors(tensors, expected_shapes(cfg), weights_file)
    if 0 in layer_ids:
        raise ExportError(f"layer_ids {layer_ids}: id 0 (the embeddings) has no DFlash name")
    dtype = target_dtype(target_cfg)
    out = {name: tensors[name].to(getattr(torch, dtype)).contiguous()
           for name in expected_shapes(cfg)}
    return write_checkpoint(out_dir, out, dflash_config_json(cfg, target_cfg, layer_ids, dtype))


def serving_problem(draft_dir) -> str | None:
    """Why vLLM's CPU build cannot serve this DFlash checkpoint faithfully, or None: its
    layers have k_norm weights that differ, and the CPU build norms every layer's context keys
    with the first layer's (tests/test_dflash.py), so it would serve another model than the one
    trained (draftline's DFlash drafts share one k_norm)."""
    from safetensors import safe_open

    path = Path(draft_dir) / WEIGHTS_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        norms = [f.get_tensor(k) for k in sorted(f.keys()) if k.endswith("self_attn.k_norm.weight")]
    if any(not bool((n == norms[0]).all()) for n in norms[1:]):
        return (f"the DFlash draft {draft_dir} has a k_norm per layer, and vLLM's CPU build "
                "norms every layer's context keys with the first layer's (tests/test_dflash.py), "
                "so it would serve another model than the one trained (draftline's DFlash "
                "drafts share one k_norm)")
    return None

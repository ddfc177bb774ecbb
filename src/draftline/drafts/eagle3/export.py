"""An EAGLE-3 draft exported as the checkpoint vLLM (and SGLang) load.

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

from draftline.core.target import text_config
from draftline.drafts.checkpoint import (
    DRAFT_CONFIG_FILE,
    ExportError,
    check_tensors,
    target_dtype,
    write_checkpoint,
)


def _draft_config(weights_file: Path, target_cfg: dict, draft_vocab: int):
    """The draft architecture: ``draft_config.json`` next to the weights, else from the target."""
    from draftline.drafts.eagle3.config import DraftConfig

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
    ``q_lora_rank``: the draft always has one (``draftline.drafts.eagle3.config.mla_sizes``)."""
    return {"architectures": ["Eagle3DeepseekV3ForCausalLM"], "model_type": "deepseek_v2",
            **{key: getattr(draft_cfg, key) for key in draft_cfg.MLA_KEYS}}


def export(weights_file: Path, target_cfg: dict, vocab_map, layer_ids: list[int],
           out_dir) -> Path:
    """The checkpoint of the draft in ``weights_file`` (its ``draft_config.json`` beside it)
    for the aux ``layer_ids`` (checked) in ``out_dir``."""
    import torch
    from safetensors.torch import load_file

    from draftline.drafts.eagle3.model import expected_shapes

    vocab = load_file(str(vocab_map))
    if "d2t" not in vocab or "t2d" not in vocab:
        raise ExportError(f"{vocab_map}: needs tensors 'd2t' and 't2d'")
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    draft_cfg = _draft_config(weights_file, target_cfg, d2t.shape[0])
    tensors = load_file(str(weights_file))
    check_tensors(tensors, expected_shapes(draft_cfg), weights_file)
    check_vocab_map(d2t, t2d, draft_cfg, Path(vocab_map))

    dtype = target_dtype(target_cfg)
    out = {name: tensors[name].to(getattr(torch, dtype)).contiguous()
           for name in expected_shapes(draft_cfg)}
    if vocab_map_needed(draft_cfg):
        out["d2t"] = d2t.contiguous()
        out["t2d"] = t2d.contiguous()
    return write_checkpoint(out_dir, out, draft_config_json(draft_cfg, target_cfg, layer_ids,
                                                            dtype))

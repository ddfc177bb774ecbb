"""Export a DSpark draft as the checkpoint vLLM 0.32 serves with ``"method": "dspark"``.

``config.json`` is DFlash's (``draftline.drafts.dflash.export.dflash_config_json``: the same
backbone, its ``dflash_config.target_layer_ids`` and ``mask_token_id``) with vLLM's DSpark
keys:

- ``architectures: ["Qwen3DSparkModel"]``: the registry's ``qwen3_dspark.Qwen3DSparkForCausalLM``;
  ``SpeculativeConfig`` also infers ``method: dspark`` from it.
- ``markov_rank`` (required: ``Qwen3DSparkModel`` sizes the Markov head by it),
  ``markov_head_type: "vanilla"`` (the low-rank head; other types are not this class's).
- ``enable_confidence_head``, ``confidence_head_with_markov``: without the first, vLLM builds
  no confidence head and drops the weights.
- ``sample_from_anchor: false`` (``DSparkSpeculator`` defaults to true, the anchor-predicts
  layout): the block is DFlash's fill-in layout, the one training uses, so vLLM drafts
  ``num_speculative_tokens`` = ``block_size`` - 1 tokens a round after the bonus token.
  ``dspark_bonus_anchor: true`` says the same to readers of the speculators format.
- ``draft_vocab_size`` = ``vocab_size``: the draft drafts over the target's vocabulary
  through the target's lm_head (no ``lm_head``, ``d2t`` or ``t2d`` shipped; vLLM shares the
  target's head and embedding).

vLLM reads ``block_size`` as the default ``num_speculative_tokens`` of a DSpark draft
(``SpeculativeConfig``), which under the fill-in layout is one more than the draft was trained
for: servers started by draftline always set ``num_speculative_tokens`` (B - 1).

Weights keep their training names (``model.safetensors``; vLLM prefixes ``model.``):
DFlash's plus ``markov_head.markov_w1.weight`` ``[V, r]``, ``markov_head.markov_w2.weight``
``[V, r]`` and ``confidence_head.proj.{weight,bias}`` ``[1, H (+ r)]``, ``[1]``.
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
from draftline.drafts.dflash.export import dflash_config_json
from draftline.drafts.dspark.family import ARCHITECTURE


def dspark_config_json(cfg, target_cfg: dict, layer_ids: list[int], dtype: str) -> dict:
    """config.json of a DSpark draft as vLLM's ``Qwen3DSparkForCausalLM`` reads it (see the
    module docstring); ``layer_ids`` are vLLM's aux ids, as for DFlash."""
    config = dflash_config_json(cfg, target_cfg, layer_ids, dtype)
    config.update({
        "architectures": [ARCHITECTURE],
        "draft_vocab_size": cfg.vocab_size,
        "mask_token_id": cfg.mask_token_id,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "sample_from_anchor": False,
        "dspark_bonus_anchor": True,
    })
    return config


def export(weights_file: Path, target_cfg: dict, vocab_map, layer_ids: list[int],
           out_dir) -> Path:
    """A DSpark draft's checkpoint from the training's ``best/model.safetensors`` and its
    ``draft_config.json`` for the aux ``layer_ids`` (checked) in ``out_dir``: the tensors of
    ``expected_shapes`` (checked first, all problems listed), cast to the target's dtype (the
    confidence projection kept in float32, as vLLM keeps it), and ``dspark_config_json``. No
    vocab map: the target's vocabulary."""
    import torch
    from safetensors.torch import load_file

    from draftline.drafts.dspark.config import DSparkConfig
    from draftline.drafts.dspark.model import expected_shapes

    weights_file = Path(weights_file)
    saved = json.loads((weights_file.parent / DRAFT_CONFIG_FILE).read_text())
    if saved.get("drafting") != "dspark":
        raise ExportError(f"{weights_file.parent / DRAFT_CONFIG_FILE}: drafting is "
                          f"{saved.get('drafting')!r}, not 'dspark'")
    cfg = DSparkConfig.from_dict(saved)
    if cfg.hidden_size != int(text_config(target_cfg)["hidden_size"]):
        raise ExportError(f"{weights_file}: a DSpark draft's hidden size ({cfg.hidden_size}) "
                          "must be the target's: vLLM shares the target's embedding and lm_head")
    tensors = load_file(str(weights_file))
    check_tensors(tensors, expected_shapes(cfg), weights_file)
    if 0 in layer_ids:
        raise ExportError(f"layer_ids {layer_ids}: id 0 (the embeddings) has no DSpark name")
    dtype = target_dtype(target_cfg)
    out = {}
    for name in expected_shapes(cfg):
        # vLLM keeps the confidence projection in float32 (DSparkConfidenceHead)
        keep = torch.float32 if name.startswith("confidence_head.") else getattr(torch, dtype)
        out[name] = tensors[name].to(keep).contiguous()
    return write_checkpoint(out_dir, out, dspark_config_json(cfg, target_cfg, layer_ids, dtype))

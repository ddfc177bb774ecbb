"""The draft and its teacher, built from the target's tensors and the vocab map.

Only three target tensors are read (embedding, final norm, lm_head), through safetensors'
memory map one at a time; the rest of the checkpoint (for Kimi-K2.5, about 600 GB of experts)
is never touched. ``check_inputs`` refuses hidden states, vocab map and target that do not
fit together before anything large is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftline.core.target import (
    load_target_tensors,
    read_teacher_config,
    text_config,
)
from draftline.drafts import registry
from draftline.drafts.eagle3.config import DraftConfig
from draftline.stages.hidden.layers import check_layer_ids
from draftline.stages.hidden.store import HiddenStates
from draftline.stages.train.checkpoint import DRAFT_CONFIG_FILE, save_weights


def build_draft(target_dir: Path, vocab_map: Path, seed: int, device=None,
                architecture: dict | None = None):
    """(untrained draft, target head, DraftConfig) from the target, the vocab map and the
    ``train.draft`` sizes (``architecture``; null entries keep the target's).

    The draft's lm_head starts from the target's lm_head rows of the draft tokens; the
    embedding is the target's, frozen. Tensors stay in bf16 on GPU, fp32 on CPU. The draft's
    family (``draftline.drafts.registry``, by ``drafting``) builds it: a DFlash draft drafts
    over the target's whole vocabulary through the target's own lm_head (the head's).
    """
    device = device or torch.device("cpu")
    vocab = load_file(str(vocab_map))
    d2t, t2d = vocab["d2t"], vocab["t2d"]  # [D] int64, [V] bool
    target = load_target_tensors(target_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    build = registry.hook(registry.for_draft(architecture), "build")
    model, head, draft_cfg = build(target_dir, target, d2t, t2d, seed, dtype, architecture)
    return model.to(device), head.to(device), draft_cfg


def save_untrained(target_dir: Path, vocab_map: Path, out_dir: Path, seed: int = 0,
                   architecture: dict | None = None) -> Path:
    """Write the untrained draft in the ``best/`` layout (a baseline for export and serving)."""
    model, _, draft_cfg = build_draft(target_dir, vocab_map, seed, architecture=architecture)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_weights(model.trainable_state_dict(), out_dir)
    (out_dir / DRAFT_CONFIG_FILE).write_text(json.dumps(draft_cfg.to_dict(), indent=1) + "\n")
    return out_dir


def check_inputs(store: HiddenStates, vocab_map: Path, target_dir: Path,
                 architecture: dict | None = None) -> None:
    """Hidden states, vocab map and target agree on widths, layer count and vocab size."""
    with safe_open(str(vocab_map), framework="pt") as f:
        missing = {"d2t", "t2d"} - set(f.keys())
        if missing:
            raise ValueError(f"{vocab_map}: missing tensor(s) {sorted(missing)}")
        draft_vocab = f.get_slice("d2t").get_shape()[0]
        t2d_size = f.get_slice("t2d").get_shape()[0]
    target_cfg = read_teacher_config(target_dir)
    draft_cfg = DraftConfig.from_target(target_cfg, draft_vocab, architecture)
    if store.hidden_size != draft_cfg.target_hidden_size:
        raise ValueError(f"{store.origin}: hidden_size {store.hidden_size} != "
                         f"target hidden_size {draft_cfg.target_hidden_size}")
    if len(store.layer_ids) != draft_cfg.num_aux_hidden_states:
        raise ValueError(f"{store.origin}: {len(store.layer_ids)} layer_ids, the "
                         f"draft takes {draft_cfg.num_aux_hidden_states}")
    # States concatenated in another order than vLLM's would train fc on a permutation.
    check_layer_ids(store.layer_ids, int(text_config(target_cfg)["num_hidden_layers"]), target_cfg,
                    source=f"{store.origin}: layer_ids")
    registry.hook(registry.for_draft(architecture), "check_inputs")(store, architecture)
    if t2d_size != draft_cfg.vocab_size:
        raise ValueError(f"{vocab_map}: t2d has {t2d_size} entries, target vocab_size is "
                         f"{draft_cfg.vocab_size}")

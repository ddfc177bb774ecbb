"""An exported EAGLE-3 checkpoint, draftline's or the peer's, walked over the run's stored eval
answers the way a temperature-0 server drafts them: one fixed text for every draft, so that
two trainers compare without the served text moving with the draft (at T = 0 in bf16 the
target's greedy answers change with the verification batches, and with them served
acceptance).

Both checkpoints are the format vLLM loads (``LlamaForCausalLMEagle3``): draftline's names its
decoder layer ``midlayer.``, the peer (speculators) ``layers.0.``, which vLLM's loader treats as
the same; the norm flags (``norm_before_fc``, ``fc_norm``, ``norm_before_residual``,
``norm_output``) are top-level config keys in both. The weights go into draftline's own
EAGLE-3 module (``draftline.drafts.eagle3``), which is tested equal to vLLM's class on every
flag, and the walk is draftline's evaluation (``walked_acceptance_length``), in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

# tensors a checkpoint may carry that the walk does not read: the target's (shared or frozen)
# and the vocab map, which must equal the run's (checked)
NOT_DRAFT_WEIGHTS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
VOCAB_TENSORS = ("d2t", "t2d")
PEER_LAYER, OWN_LAYER = "layers.0.", "midlayer."
NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
# sizes vLLM reads from the checkpoint's config that draftline's module takes from the target:
# a checkpoint that states others is not walked (its layer would not be the served one)
TARGET_SIZES = ("hidden_size", "rms_norm_eps")


class WalkError(ValueError):
    """The checkpoint cannot be walked as an EAGLE-3 draft of this run; the message says why."""


def layer_architecture(layer: dict) -> dict:
    """The ``train.draft`` sizes of a checkpoint's decoder layer config (draftline's exported
    config, or the peer's ``transformer_layer_config``); rotary from either spelling."""
    from draftline.drafts.eagle3.config import DraftConfig

    sizes = {key: layer[key] for key in DraftConfig.ARCHITECTURE_KEYS
             if layer.get(key) is not None}
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" not in sizes and rope.get("rope_theta") is not None:
        sizes["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" not in sizes and rope.get("rope_type", "default") != "default":
        sizes["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return sizes


def read_eagle3_checkpoint(checkpoint: Path) -> tuple[dict, dict, dict]:
    """(the ``train.draft`` settings its config states: norm flags and the layer's sizes, the
    sizes taken from the target, the draft's tensors under draftline's names) of an exported
    EAGLE-3 checkpoint, ``d2t``/``t2d`` under their own names."""
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    if "LlamaForCausalLMEagle3" not in config.get("architectures", []) and \
            config.get("speculators_model_type") != "eagle3":
        raise WalkError(f"{checkpoint}: not an EAGLE-3 checkpoint "
                        f"(architectures {config.get('architectures')})")
    if config.get("parallel_drafting"):
        raise WalkError(f"{checkpoint}: a parallel (P-EAGLE) draft; the walk drafts "
                        f"autoregressively")
    layer = config.get("transformer_layer_config") or config  # the peer's, or draftline's
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise WalkError(f"{checkpoint}: {layers} decoder layers; draftline's EAGLE-3 has one")
    architecture = {**layer_architecture(layer),
                    **{flag: bool(config.get(flag, False)) for flag in NORM_FLAGS}}
    target_sizes = {key: layer[key] for key in TARGET_SIZES if layer.get(key) is not None}
    tensors = {}
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        if name in NOT_DRAFT_WEIGHTS:
            continue
        if name.startswith(PEER_LAYER):
            name = OWN_LAYER + name[len(PEER_LAYER):]
        tensors[name] = tensor
    return architecture, target_sizes, tensors


def load_walkable(checkpoint: Path, target_dir: Path, vocab_map: Path):
    """(draftline's EAGLE-3 draft holding the checkpoint's weights in fp32, the target head,
    its ``train.draft`` settings); refuses a checkpoint whose vocabulary map is not the run's
    or whose tensors do not fit."""
    import torch
    from safetensors.torch import load_file

    from draftline.stages.train.draft import build_draft

    architecture, target_sizes, tensors = read_eagle3_checkpoint(checkpoint)
    model, head, draft_cfg = build_draft(target_dir, vocab_map, 0, torch.device("cpu"),
                                         architecture)
    differ = [f"{k} {v} (the target's: {getattr(draft_cfg, k)})"
              for k, v in target_sizes.items() if float(v) != float(getattr(draft_cfg, k))]
    if differ:
        raise WalkError(f"{checkpoint}: a layer of other sizes: {', '.join(differ)}")
    run_map = load_file(str(vocab_map))
    for name in VOCAB_TENSORS:
        if name in tensors and not torch.equal(tensors.pop(name).to(run_map[name].dtype),
                                               run_map[name]):
            raise WalkError(f"{checkpoint}: its {name} is not the vocab map {vocab_map}")
    expected = model.trainable_state_dict()
    problems = sorted(set(expected) ^ set(tensors))
    problems += [f"{n} {list(t.shape)} != {list(expected[n].shape)}"
                 for n, t in tensors.items() if n in expected and t.shape != expected[n].shape]
    if problems:
        raise WalkError(f"{checkpoint}: tensors do not fit draftline's EAGLE-3 draft with "
                        f"{architecture}: {', '.join(problems)}")
    model.load_state_dict({n: t.float() for n, t in tensors.items()}, strict=False)
    return model, head, architecture


def walk_checkpoint(checkpoint: Path, hidden_dir: Path, target_dir: Path, vocab_map: Path,
                    train_cfg: dict, parts: dict[str, set[str]] | None = None) -> dict:
    """The checkpoint's evaluation on the store's eval split, as draftline's training scores its
    own draft (``walked_acceptance_length`` after ``train.ttt_steps`` drafts, and the
    per-position figures); ``train_cfg`` is a resolved ``train`` section. ``parts`` names
    subsets of the eval answers by sample id (the answers that end, those cut at the cap):
    each is walked on its own too, under ``parts`` (None where the split holds none of it)."""
    from draftline.drafts.eagle3.train import evaluate
    from draftline.stages.hidden.store import HiddenStates
    from draftline.stages.train.data import StoredBatches
    from draftline.stages.train.distributed import init_runtime

    model, head, _ = load_walkable(Path(checkpoint), Path(target_dir), Path(vocab_map))
    store = HiddenStates(Path(hidden_dir))
    rt = init_runtime()
    try:
        data = StoredBatches(store, train_cfg, 0, 1, 0)
        metrics = evaluate(model, head, data, train_cfg, rt, lambda t: t)
        every_answer = data.eval_refs
        metrics["parts"] = {}
        for name, ids in (parts or {}).items():
            data.eval_refs = [ref for ref in every_answer if ref.sample_id in ids]
            metrics["parts"][name] = walk_part(model, head, data, train_cfg, rt)
        return metrics
    finally:
        store.close()


def walk_part(model, head, data, train_cfg: dict, rt) -> dict | None:
    """The walk over the eval answers ``data`` holds now: how many, and their walked
    acceptance after 1..K drafts (None for no answers)."""
    from draftline.drafts.eagle3.train import evaluate

    if not data.eval_refs:
        return None
    metrics = evaluate(model, head, data, train_cfg, rt, lambda t: t)
    return {"answers": len(data.eval_refs), "walked_acceptance_length_by_num_drafts":
            metrics["walked_acceptance_length_by_num_drafts"]}

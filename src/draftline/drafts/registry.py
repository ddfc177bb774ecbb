"""Which draft family a draft is, and everything the rest of draftline asks of a family.

A family is one folder of ``draftline.drafts`` (``eagle3/``, ``dflash/``, ``dspark/``) whose
``family`` module holds its facts. The registry finds a family by ``train.draft`` (its
``drafting`` key, ``for_draft``) or by a saved ``draft_config.json`` or an exported
``config.json`` (``of_config``); every other module asks it, never tests a family itself.

A ``family`` module has (standard library only):

    NAME, DRAFTINGS       its name (also the model card's tag), the train.draft.drafting
                          values it trains
    recognises(config)    whether a saved or exported config is one of its drafts
    label(draft)          its name as the plan and the benchmark print it (of train.draft)
    served_label(config)  the same of an exported config.json (the model card's heading)
    card_summary(config)  the model card's description of the draft of an exported config.json
    aux_layer_ids(config) vLLM's ids of the target layers whose states the draft of an exported
                          config.json reads (None where it does not say)
    trainable_params(dims, sizes, draft_vocab, draft)   the one count of its parameters
    train_passes(train, draft, sample_tokens)           one-layer passes a step costs, and why
    speculative(config)   vLLM's speculative-config keys: method, parallel_drafting
    sglang_refusal(config)  why SGLang cannot serve it, or None
    SGLANG_ALGORITHM      SGLang's --speculative-algorithm for the drafts it serves (None:
                          it serves none, sglang_refusal always answers)
    config_problem(config, key, draft, target_mla)  what vLLM cannot serve in a config, or
                          None; ``target_mla`` whether the target has MLA attention
                          (``draftline.core.target.uses_mla``), None where not known yet
    serving_problem_beside(exported, target_mla, on_gpu)  why vLLM cannot start the draft of
                          an exported config.json beside the target on this host, or None
    FSDP_UNITS            submodules FSDP shards as units before the whole draft
    OWN_LM_HEAD           whether the draft has its own lm_head (else the target's)
    HOOKS                 hook name -> the module (torch side, imported when asked) defining it

and its torch-side hooks (``hook``):

    build(target_dir, target, d2t, t2d, seed, dtype, draft) -> (model, head, draft config)
        ``target`` the target's embed, norm and lm_head tensors, d2t/t2d the vocab map
    init(model, seed)                 deterministic initial weights (``build`` calls it)
    check_inputs(store, draft)        refuses hidden states it cannot train on
    micro_batch(model, head, batch, cfg, rt, walk=False) -> (loss, counts, walk counts)
        counts ``[len(COUNT_KEYS), K]`` (``draftline.drafts.acceptance``); with ``walk`` (the
        evaluation) the walk counts (``draftline.drafts.acceptance.empty_walk``'s), else None
    evaluate(model, head, data, cfg, rt, reduce) -> metrics   the whole eval split, ``reduce``
        summing a tensor over the processes
    export(weights_file, target_cfg, vocab_map, layer_ids, out_dir) -> out_dir   the layer
        ids checked
    serving_problem(draft_dir) -> str | None   (optional) why vLLM's CPU build cannot serve it

Adding a family: its folder with these modules, its entry in ``FAMILIES`` and its drafting in
the schema's ``train.draft.drafting`` enum.

Standard library only, and so is every ``family`` module: ``draftline.core.config_check``
loads this file by its path at the workflow's parse time (``rules/common.smk``), and this file
then loads the families' by theirs.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

# family name -> its facts module (named in full: draftline.core.codehash follows the names)
FAMILIES = {
    "eagle3": "draftline.drafts.eagle3.family",
    "dflash": "draftline.drafts.dflash.family",
    "dspark": "draftline.drafts.dspark.family",
}
DEFAULT = "eagle3"  # a draft that says no drafting, a saved config no family recognises
# A speculators-format checkpoint (the peer trainer's, benchmarks/draft_quality.py) names its
# type: its family, and vLLM's method and parallel drafting for it (as vLLM's
# SpeculatorsConfig.build_vllm_speculative_config maps the type).
SPECULATORS_TYPES = {"eagle3": ("eagle3", "eagle3", False), "peagle": ("eagle3", "eagle3", True),
                     "dflash": ("dflash", "dflash", False), "dflash2": ("dflash", "dflash", False),
                     "dspark": ("dspark", "dspark", False)}
_LOADED: dict[str, ModuleType] = {}


def family(name: str) -> ModuleType:
    """The facts module of family ``name``."""
    if name not in FAMILIES:
        raise ValueError(f"unknown draft family {name!r} (known: {', '.join(FAMILIES)})")
    if name not in _LOADED:
        _LOADED[name] = _load(FAMILIES[name])
    return _LOADED[name]


def _load(module: str) -> ModuleType:
    if __package__ == "draftline.drafts":
        return importlib.import_module(module)
    # loaded by its path: the family's file by its own (no draftline package needed)
    path = Path(__file__).parent.joinpath(*module.split(".")[2:]).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(f"_draftline_{module.replace('.', '_')}",
                                                  path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def families() -> list[ModuleType]:
    return [family(name) for name in FAMILIES]


def for_draft(draft: dict | None) -> ModuleType:
    """The family of ``train.draft`` (a variant's included), by its ``drafting``."""
    drafting = (draft or {}).get("drafting")
    if drafting is None:
        return family(DEFAULT)
    for fam in families():
        if drafting in fam.DRAFTINGS:
            return fam
    known = [d for fam in families() for d in fam.DRAFTINGS]
    raise ValueError(f"config key 'train.draft.drafting': {drafting!r} is no draft family's "
                     f"(known: {', '.join(known)})")


def of_config(config: dict | None) -> ModuleType:
    """The family of a saved ``draft_config.json`` or an exported ``config.json`` (an empty
    or unrecognised one: the default family's)."""
    config = config or {}
    peer = SPECULATORS_TYPES.get(config.get("speculators_model_type"))
    if peer is not None:
        return family(peer[0])
    for fam in families():
        if fam.NAME != DEFAULT and fam.recognises(config):
            return fam
    return family(DEFAULT)


def hook(fam: ModuleType, name: str):
    """The family's torch-side hook ``name`` (imported now); None for an optional hook it
    does not have."""
    module = fam.HOOKS.get(name)
    if module is None:
        return None
    return getattr(importlib.import_module(module), name)


# ----------------------------------------------------------------------------- facts


def layer_sizes(dims: dict, draft: dict) -> dict:
    """A draft layer's sizes from the target's dims (``draftline.plan.target_dims``) and
    train.draft's non-null entries: hidden h, heads, head_dim, kv heads and the MLP's
    parameters."""
    h = dims["hidden_size"]
    heads = draft.get("num_attention_heads", dims.get("num_heads", 1))
    return {"h": h, "heads": heads,
            "head_dim": draft.get("head_dim", h // dims.get("num_heads", 1)),
            "kv": draft.get("num_key_value_heads", dims.get("num_kv_heads", heads)),
            "mlp": 3 * h * draft.get("intermediate_size", dims.get("intermediate_size", 4 * h))}


def trainable_params(dims: dict, draft_vocab: int, draft: dict | None = None) -> int:
    """Trainable parameters of the draft ``train.draft`` describes (embedding shared, not
    counted; null entries keep the target's sizes)."""
    draft = {k: v for k, v in (draft or {}).items() if v is not None}
    return for_draft(draft).trainable_params(dims, layer_sizes(dims, draft), draft_vocab, draft)


def label(draft: dict | None) -> str:
    """The draft's family as the plan and the benchmark label it."""
    draft = draft or {}
    return for_draft(draft).label(draft)


def served_label(exported: dict) -> str:
    """``label`` of an exported config.json."""
    return of_config(exported).served_label(exported)


def card_summary(exported: dict) -> str:
    """What the draft of an exported config.json is, in the model card's words."""
    return of_config(exported).card_summary(exported)


def aux_layer_ids(exported: dict) -> list[int] | None:
    """vLLM's ids of the target layers the draft of an exported config.json reads."""
    return of_config(exported).aux_layer_ids(exported)


def card_tag(exported: dict) -> str:
    """The model card's tag of the draft's family (its name)."""
    return of_config(exported).NAME


def speculative(exported: dict) -> dict:
    """How vLLM is asked to serve a draft, from its exported config.json: ``method`` and
    ``parallel_drafting`` (a speculators-format checkpoint's by its type)."""
    peer = SPECULATORS_TYPES.get(exported.get("speculators_model_type"))
    if peer is not None:
        return {"method": peer[1], "parallel_drafting": peer[2]}
    return of_config(exported).speculative(exported)


def sglang_refusal(exported: dict) -> str | None:
    return of_config(exported).sglang_refusal(exported)


def sglang_algorithm(exported: dict) -> str | None:
    """SGLang's ``--speculative-algorithm`` for the draft of an exported config.json (None
    where SGLang serves none of its family)."""
    return of_config(exported).SGLANG_ALGORITHM


def config_problems(config: dict, drafts, target_mla: bool | None = None) -> str | None:
    """The first problem of the drafts ``[(key, train.draft), ...]`` a config trains, or None.
    ``target_mla``: whether the target has MLA attention (None: not known before the stages
    read it, a hub id)."""
    for key, draft in drafts:
        problem = for_draft(draft).config_problem(config, key, draft, target_mla)
        if problem:
            return problem
    return None


def serving_problem_beside(exported: dict, target_mla: bool | None, on_gpu: bool) -> str | None:
    """Why vLLM cannot start the draft of this exported config.json beside the target (MLA
    attention or not, None: not known) on this host (a GPU or vLLM's CPU build), or None."""
    return of_config(exported).serving_problem_beside(exported, target_mla, on_gpu)

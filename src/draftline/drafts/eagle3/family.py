"""The EAGLE-3 family's facts, as ``draftline.drafts.registry`` asks them: its name and labels,
its trainable parameters, its cost, how vLLM and SGLang serve it, its config checks and where
its torch code is.

Standard library only: ``draftline.core.config_check`` loads the registry, and the registry
this file, by path at the workflow's parse time.
"""

from __future__ import annotations

NAME = "eagle3"
DRAFTINGS = ("autoregressive", "parallel")  # train.draft.drafting: EAGLE-3's unroll, P-EAGLE
# The torch side, imported when asked (``registry.hook``): each hook by its module.
HOOKS = {
    "build": "draftline.drafts.eagle3.train",
    "init": "draftline.drafts.eagle3.model",
    "check_inputs": "draftline.drafts.eagle3.train",
    "micro_batch": "draftline.drafts.eagle3.train",
    "evaluate": "draftline.drafts.eagle3.train",
    "export": "draftline.drafts.eagle3.export",
}
FSDP_UNITS = ("midlayer",)  # sharded as one unit each before the whole draft
OWN_LM_HEAD = True  # the draft's own lm_head over the draft vocab (train.lm_head: trained)
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV3ForCausalLM")  # exported
MLA_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# SGLang's --speculative-algorithm for the drafts of this family it serves (sglang_refusal None)
SGLANG_ALGORITHM = "EAGLE3"
# Norm placements and P-EAGLE's setting that vLLM's Eagle3LlamaForCausalLM serves and SGLang's
# LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py) does not read: it builds no
# input_norm or fc_norm, skips their weights without a word, and always takes the raw state as
# the residual and the prenorm state onward, so it would serve another model than the one
# trained.
SGLANG_UNREAD = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output",
                 "parallel_drafting")


def recognises(config: dict) -> bool:
    """A saved ``draft_config.json`` or an exported ``config.json`` of this family."""
    return (config.get("drafting") in DRAFTINGS
            or bool(set(config.get("architectures") or []) & set(ARCHITECTURES)))


def label(draft: dict) -> str:
    """P-EAGLE (train.draft.drafting parallel), EAGLE-3.1 (fc_norm or norm_output) or EAGLE-3,
    with MLA attention or not (train.draft.arch). The same unroll trains each, at one cost."""
    name = ("P-EAGLE" if draft.get("drafting") == "parallel" else
            "EAGLE-3.1" if draft.get("fc_norm") or draft.get("norm_output") else
            "EAGLE-3")
    return name + (" MLA" if draft.get("arch") == "deepseek_mla" else "")


def served_label(exported: dict) -> str:
    """``label`` as an exported config.json says it."""
    name = "P-EAGLE" if exported.get("parallel_drafting") else (
        "EAGLE-3.1" if exported.get("fc_norm") or exported.get("norm_output") else "EAGLE-3")
    mla = MLA_ARCHITECTURE in (exported.get("architectures") or [])
    return name + (" MLA" if mla else "")


def aux_layer_ids(exported: dict) -> list[int] | None:
    """vLLM's aux layer ids, as the exported config gives them (``eagle_config``)."""
    return (exported.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def card_summary(exported: dict) -> str:
    """The model card's description of the draft of this config.json: the layer (Llama's
    attention or DeepSeek's MLA), the three target states it reads, and for P-EAGLE the one
    pass that drafts a round."""
    name = served_label(exported)
    article = "A" if name.startswith("P-") else "An"
    layer = ("one DeepSeek-V3-style decoder layer (multi-head latent attention, MLA)"
             if MLA_ARCHITECTURE in (exported.get("architectures") or [])
             else "one Llama-style decoder layer")
    proposes = ("a round's tokens in one forward pass (parallel drafting: the slots after the "
                "first read a trained mask state), which" if exported.get("parallel_drafting")
                else "tokens which")
    return (f"{article} {name} speculative-decoding draft: {layer} that reads three hidden "
            f"states of the target and proposes {proposes} the target then verifies, so "
            "outputs are those of the target alone, produced faster.")


def trainable_params(dims: dict, sizes: dict, draft_vocab: int, draft: dict) -> int:
    """Trainable parameters of the one-layer draft (embedding shared, not counted): fc,
    attention, MLP, lm_head, norms and P-EAGLE's mask state. ``sizes`` are the layer's
    (``registry.layer_sizes``), ``draft`` is train.draft without its null entries."""
    h, heads, head_dim, kv = sizes["h"], sizes["heads"], sizes["head_dim"], sizes["kv"]
    attention = 2 * h * heads * head_dim + 2 * (2 * h * kv * head_dim) + heads * head_dim * h
    if draft.get("arch") == "deepseek_mla":  # low-rank q, one k/v latent, per-head expansion
        mla = {key: draft.get(key, dims.get(key)) for key in MLA_KEYS}
        if all(mla.values()):
            qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
            attention = (2 * h * (mla["q_lora_rank"] + mla["kv_lora_rank"]
                                  + mla["qk_rope_head_dim"])
                         + mla["q_lora_rank"] * heads * qk
                         + mla["kv_lora_rank"] * heads * (mla["qk_nope_head_dim"]
                                                          + mla["v_head_dim"])
                         + heads * mla["v_head_dim"] * h)
    mask_hidden = 3 * h if draft.get("drafting") == "parallel" else 0  # P-EAGLE's mask state
    return 3 * h * h + attention + sizes["mlp"] + draft_vocab * h + 4 * h + mask_hidden


def train_passes(train: dict, draft: dict, sample_tokens: float) -> tuple[float, str]:
    """One-layer passes over a sample's tokens a training step costs: the unroll steps."""
    return float(train["ttt_steps"]), f"ttt_steps {train['ttt_steps']}"


def speculative(exported: dict) -> dict:
    """vLLM's speculative-config keys for the draft of this config.json: method eagle3, and
    parallel drafting for P-EAGLE (a speculative-config setting vLLM does not read from the
    checkpoint; the export records it there for the servers draftline starts)."""
    return {"method": "eagle3", "parallel_drafting": bool(exported.get("parallel_drafting"))}


def sglang_refusal(exported: dict) -> str | None:
    """Why SGLang cannot serve the draft of this config.json, or None."""
    unread = [flag for flag in SGLANG_UNREAD if exported.get(flag)]
    if not unread:
        return None
    return (f"Not with SGLang: this draft sets {', '.join(unread)} (config.json), which "
            "SGLang's LlamaForCausalLMEagle3 does not read; it would load the draft without "
            "them and serve another model than the one trained. Serve it with vLLM.")


def config_problem(config: dict, key: str, draft: dict,
                   target_mla: bool | None = None) -> str | None:
    """What a config says of this draft (at ``key``: train.draft or a variant's) that vLLM
    cannot serve, or None. ``target_mla``: whether the target has MLA attention (None: not
    known yet, a hub id the stages read later).

    An MLA draft beside a target without MLA does not serve: vLLM 0.32 builds the draft's MLA
    attention metadata with the target's head size, which no MLA kernel takes (measured on its
    CPU build: "Head dimension 32 is not supported by MLA" beside the toy). vLLM 0.32 drafts in
    parallel from the draft's mask_hidden state, which only its Llama EAGLE-3 class
    (llama_eagle3.py) has: the proposer reads ``model.mask_hidden``, and
    Eagle3DeepseekV3ForCausalLM (deepseek_eagle3.py) defines none. vLLM's EAGLE-3 drafts have
    one layer."""
    if draft["arch"] == "deepseek_mla" and target_mla is False:
        return (f"config key '{key}.arch': deepseek_mla needs a target with MLA attention "
                f"(target.model {config['target']['model']} has none); vLLM serves an MLA "
                "draft only beside one (it sizes the draft's MLA attention by the target's "
                "heads): use arch llama")
    if draft["drafting"] == "parallel" and draft["arch"] == "deepseek_mla":
        return (f"config key '{key}.drafting': vLLM serves parallel drafting (P-EAGLE) only "
                "with the Llama draft (Eagle3LlamaForCausalLM holds its mask_hidden state; the "
                "MLA draft's class has none): use arch llama, or drafting autoregressive")
    if draft["num_layers"] not in (None, 1):
        return (f"config key '{key}.num_layers': vLLM's EAGLE-3 drafts have one layer; more "
                "are for drafting dflash")
    return None


def serving_problem_beside(exported: dict, target_mla: bool | None, on_gpu: bool) -> str | None:
    """Why vLLM cannot start the draft of this config.json beside the target on this host, or
    None: its CPU build starts no EAGLE-3 draft beside an MLA target (no common KV-cache block
    size: CPU MLA needs 16, the draft's CPU attention multiples of 32; docs/internals.md).
    GPUs serve it."""
    if on_gpu or not target_mla:
        return None
    return (f"the target uses MLA attention, and {served_label(exported)} beside an MLA target "
            "does not start on vLLM's CPU build (no common KV-cache block size: CPU MLA needs "
            "16, the draft's CPU attention multiples of 32; see docs/internals.md); beside a "
            "Llama-architecture target it starts")

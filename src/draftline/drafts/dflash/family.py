"""The DFlash family's facts, as ``draftline.drafts.registry`` asks them: its name and labels,
its trainable parameters, its cost, how vLLM serves it (SGLang does not), its config checks and
where its torch code is.

Standard library only: ``draftline.core.config_check`` loads the registry, and the registry
this file, by path at the workflow's parse time.
"""

from __future__ import annotations

NAME = "dflash"
DRAFTINGS = ("dflash",)  # train.draft.drafting
HOOKS = {
    "build": "draftline.drafts.dflash.train",
    "init": "draftline.drafts.dflash.model",
    "check_inputs": "draftline.drafts.dflash.train",
    "micro_batch": "draftline.drafts.dflash.train",
    "evaluate": "draftline.drafts.dflash.train",
    "export": "draftline.drafts.dflash.export",
    "serving_problem": "draftline.drafts.dflash.export",
}
# One unit: its layers share one k_norm (the package docstring), which FSDP cannot split.
FSDP_UNITS = ()
OWN_LM_HEAD = False  # it drafts through the target's own lm_head (the teacher's)
ARCHITECTURE = "DFlashDraftModel"  # exported: vLLM's DFlashQwen3ForCausalLM reads it
# train.draft.num_layers null: the toy's simulated acceptance with 1, 2 and 3 layers was 1.23,
# 2.48 and 2.65 (one layer cannot carry the anchor token to the mask slots and attend to the
# context too)
DEFAULT_LAYERS = 3
SGLANG_ALGORITHM = None  # the card gives no SGLang command (sglang_refusal)


def recognises(config: dict) -> bool:
    """A saved ``draft_config.json`` (``drafting``) or an exported ``config.json``
    (``architectures``) of a DFlash draft."""
    return (config.get("drafting") in DRAFTINGS
            or ARCHITECTURE in (config.get("architectures") or []))


def layers(draft: dict) -> int:
    """The draft's layers: train.draft.num_layers, else DEFAULT_LAYERS."""
    return draft.get("num_layers") or DEFAULT_LAYERS


def label(draft: dict) -> str:
    return f"DFlash ({layers(draft)} layer(s), block {draft.get('block_size', 16)})"


def served_label(exported: dict) -> str:
    return "DFlash"


def drafter(exported: dict) -> str:
    """What the draft of this config.json is, in words (the card's; DSpark's backbone too):
    its layers, the target states they read and the block one pass fills (block_size - 1
    drafts after the last accepted token)."""
    n = exported.get("num_hidden_layers") or DEFAULT_LAYERS
    layers_read = f"{n} Qwen3-style decoder layer{'s that read' if n > 1 else ' that reads'}"
    ids = (exported.get("dflash_config") or {}).get("target_layer_ids")
    at = f" at {len(ids)} of its layers" if ids else ""
    block = exported.get("block_size")
    fills = f"a block of {block - 1} masked tokens" if block else "a block of masked tokens"
    return (f"{layers_read} the target's hidden states{at} for every accepted position and "
            f"fill{'' if n > 1 else 's'} {fills} in one forward pass")


def aux_layer_ids(exported: dict) -> list[int] | None:
    """vLLM's aux layer ids: DFlash names a layer by its output (``dflash_config.
    target_layer_ids``), vLLM by its input, one more."""
    ids = (exported.get("dflash_config") or {}).get("target_layer_ids")
    return None if ids is None else [i + 1 for i in ids]


def card_summary(exported: dict) -> str:
    """The model card's description of the draft of this config.json (vLLM's DFlash)."""
    return (f"A DFlash speculative-decoding draft (vLLM's DFlash): {drafter(exported)}, which "
            "the target then verifies, so outputs are those of the target alone, produced "
            "faster. It drafts through the target's own embedding and lm_head.")


def trainable_params(dims: dict, sizes: dict, draft_vocab: int, draft: dict) -> int:
    """fc, its norm and the final one, and each layer (q, o; k, v from one input each; its
    norms); the shared k_norm once. No lm_head: the target's."""
    h, heads, head_dim, kv = sizes["h"], sizes["heads"], sizes["head_dim"], sizes["kv"]
    gqa = h * heads * head_dim * 2 + 2 * h * kv * head_dim  # q, o; k, v (one input each)
    return 3 * h * h + 2 * h + layers(draft) * (gqa + head_dim + sizes["mlp"] + 2 * h) + head_dim


def train_passes(train: dict, draft: dict, sample_tokens: float) -> tuple[float, str]:
    """Each layer over the context and the blocks (anchors x block_size tokens a sample)."""
    block_tokens = min(train["anchors"], sample_tokens) * draft["block_size"]
    # each layer projects the whole context (keys, values) and runs the blocks through
    passes = layers(draft) * (1.0 + block_tokens / max(sample_tokens, 1.0))
    return passes, (f"{layers(draft)} layer(s) over the context and {train['anchors']} "
                    f"anchors x block {draft['block_size']} a sample: {passes:.1f} passes")


def speculative(exported: dict) -> dict:
    """vLLM's method ``dflash`` (it then drafts the block in parallel by itself)."""
    return {"method": "dflash", "parallel_drafting": bool(exported.get("parallel_drafting"))}


def sglang_refusal(exported: dict) -> str | None:
    return ("Not with SGLang from this card: this is a DFlash draft, checked against vLLM's "
            "DFlashQwen3ForCausalLM only. Serve it with vLLM.")


def config_problem(config: dict, key: str, draft: dict, target_mla: bool | None = None,
                   name: str = "DFlash",
                   served_by: str = "DFlashQwen3ForCausalLM") -> str | None:
    """A DFlash draft is vLLM's Qwen3-layer DFlashQwen3ForCausalLM: no MLA; it names a layer by
    its output (so no aux id 0, the embeddings); it was trained on blocks of block_size, so
    it serves at most block_size - 1 drafts. Any target's attention (``target_mla``) trains
    one. ``name`` and ``served_by``: a family on DFlash's backbone (DSpark) asking the same."""
    layer_ids = config["hidden"]["layer_ids"] or []
    if draft["arch"] != "llama":
        return (f"config key '{key}.arch': a {name} draft has vLLM's Qwen3 attention "
                f"({served_by}): use arch llama")
    if 0 in layer_ids:
        return (f"config key 'hidden.layer_ids': {layer_ids} include 0 (the embeddings), which "
                f"the {name} draft of {key} cannot read")
    longest = max(config["bench"]["num_speculative_tokens"])
    if longest > draft["block_size"] - 1:
        return (f"config key 'bench.num_speculative_tokens': {longest} drafts, but the {name} "
                f"draft of {key} is trained on blocks of {draft['block_size']} (block_size), "
                f"which fill at most {draft['block_size'] - 1}")
    return None


def serving_problem_beside(exported: dict, target_mla: bool | None, on_gpu: bool,
                           name: str = "DFlash") -> str | None:
    """Why vLLM cannot start the draft beside the target on this host, or None. Its layers
    take vLLM's CPU attention as an EAGLE-3 draft's do, so beside an MLA target its CPU build
    finds no common KV-cache block size either (measured with EAGLE-3, docs/internals.md).
    ``name``: a family on DFlash's backbone (DSpark)."""
    if on_gpu or not target_mla:
        return None
    return (f"the target uses MLA attention, and {name} beside an MLA target does not start on "
            "vLLM's CPU build (no common KV-cache block size: CPU MLA needs 16, the draft's "
            "CPU attention multiples of 32; see docs/internals.md); beside a Llama-architecture "
            "target it starts")

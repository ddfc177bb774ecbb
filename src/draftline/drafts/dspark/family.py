"""The DSpark family's facts, as ``draftline.drafts.registry`` asks them: its name and labels,
its trainable parameters, its cost, how vLLM serves it (SGLang does not), its config checks and
where its torch code is. Its backbone is DFlash's: the facts it shares are DFlash's
(``draftline.drafts.dflash.family``), plus its heads.

Standard library only: ``draftline.core.config_check`` loads the registry, and the registry
this file, by path at the workflow's parse time (and this file DFlash's by its path then).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

NAME = "dspark"
DRAFTINGS = ("dspark",)  # train.draft.drafting
HOOKS = {
    "build": "draftline.drafts.dspark.train",
    "init": "draftline.drafts.dspark.model",
    "check_inputs": "draftline.drafts.dspark.train",
    "micro_batch": "draftline.drafts.dspark.train",
    "evaluate": "draftline.drafts.dspark.train",
    "export": "draftline.drafts.dspark.export",
    "serving_problem": "draftline.drafts.dspark.serving",
}
FSDP_UNITS = ()  # one unit, as DFlash's: its layers share one k_norm
OWN_LM_HEAD = False  # it drafts through the target's lm_head, biased by its Markov head
ARCHITECTURE = "Qwen3DSparkModel"  # exported: vLLM's Qwen3DSparkForCausalLM reads it
# train.draft.markov_rank null: DSpark's published Qwen3 drafts use a small rank (the head runs
# once per slot, one slot after the other)
DEFAULT_MARKOV_RANK = 64
SGLANG_ALGORITHM = None  # the card gives no SGLang command (sglang_refusal)
DFLASH = "draftline.drafts.dflash.family"  # the backbone's facts
_BACKBONE = []


def backbone():
    """DFlash's facts module (by its path when this file was loaded by its own)."""
    if not _BACKBONE:
        if __package__:
            _BACKBONE.append(importlib.import_module(DFLASH))
        else:
            path = Path(__file__).parents[1] / "dflash" / "family.py"
            spec = importlib.util.spec_from_file_location("_draftline_dspark_backbone", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _BACKBONE.append(module)
    return _BACKBONE[0]


def recognises(config: dict) -> bool:
    """A saved ``draft_config.json`` (``drafting``) or an exported ``config.json``
    (``architectures``) of a DSpark draft."""
    return (config.get("drafting") in DRAFTINGS
            or ARCHITECTURE in (config.get("architectures") or []))


def markov_rank(draft: dict) -> int:
    return draft.get("markov_rank") or DEFAULT_MARKOV_RANK


def label(draft: dict) -> str:
    return (f"DSpark ({backbone().layers(draft)} layer(s), block {draft.get('block_size', 16)}, "
            f"Markov rank {markov_rank(draft)})")


def served_label(exported: dict) -> str:
    return "DSpark"


def aux_layer_ids(exported: dict) -> list[int] | None:
    """DFlash's (``backbone().aux_layer_ids``): the same ``dflash_config``."""
    return backbone().aux_layer_ids(exported)


def card_summary(exported: dict) -> str:
    """The model card's description of the draft of this config.json: DFlash's drafter
    (``backbone().drafter``), then its Markov head and, where it has one
    (``enable_confidence_head``), its confidence head."""
    rank = exported.get("markov_rank")
    heads = (f"a Markov head{f' (rank {rank})' if rank else ''} that biases each draft "
             "token's logits by the token drafted just before it")
    if exported.get("enable_confidence_head"):  # vLLM builds none without it
        heads += (" and a confidence head that predicts each draft token's chance of "
                  "acceptance given those before it")
    return (f"A DSpark speculative-decoding draft (vLLM's DSpark): DFlash's drafter, "
            f"{backbone().drafter(exported)}, plus {heads}. The target then verifies the "
            "drafts, so outputs are those of the target alone, produced faster. It drafts "
            "through the target's own embedding and lm_head.")


def trainable_params(dims: dict, sizes: dict, draft_vocab: int, draft: dict) -> int:
    """DFlash's backbone, the Markov head (two [V, r] matrices over the target's vocabulary)
    and the confidence head (one logit from the slot's state, and its Markov embedding)."""
    rank, vocab = markov_rank(draft), dims.get("vocab_size", draft_vocab)
    params = backbone().trainable_params(dims, sizes, draft_vocab, draft) + 2 * vocab * rank
    if draft.get("confidence_head", True):
        with_markov = draft.get("confidence_head_with_markov", True)
        params += sizes["h"] + (rank if with_markov else 0) + 1
    return params


def train_passes(train: dict, draft: dict, sample_tokens: float) -> tuple[float, str]:
    """DFlash's (the heads are one matrix product a slot, next to the layers)."""
    return backbone().train_passes(train, draft, sample_tokens)


def speculative(exported: dict) -> dict:
    """vLLM's method ``dspark``; vLLM drafts the block in parallel by itself."""
    return {"method": "dspark", "parallel_drafting": False}


def sglang_refusal(exported: dict) -> str | None:
    return ("Not with SGLang from this card: this is a DSpark draft, checked against vLLM's "
            "Qwen3DSparkForCausalLM only. Serve it with vLLM (its GPU build).")


def config_problem(config: dict, key: str, draft: dict,
                   target_mla: bool | None = None) -> str | None:
    """DFlash's checks (the same backbone and block), named DSpark's."""
    return backbone().config_problem(config, key, draft, target_mla, name="DSpark",
                                     served_by="Qwen3DSparkForCausalLM")


def serving_problem_beside(exported: dict, target_mla: bool | None, on_gpu: bool) -> str | None:
    """DFlash's (the same layers), named DSpark's."""
    return backbone().serving_problem_beside(exported, target_mla, on_gpu, name="DSpark")

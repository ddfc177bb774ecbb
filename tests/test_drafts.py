"""The draft families' registry: one family per drafting, found again from saved and exported
configs, every family with the whole contract, loadable by path with the standard library."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from draftline.drafts import registry

FACTS = ("NAME", "DRAFTINGS", "HOOKS", "FSDP_UNITS", "OWN_LM_HEAD", "recognises", "label",
         "served_label", "card_summary", "aux_layer_ids", "trainable_params", "train_passes",
         "speculative", "sglang_refusal", "SGLANG_ALGORITHM", "config_problem",
         "serving_problem_beside")
REQUIRED_HOOKS = ("build", "init", "check_inputs", "micro_batch", "evaluate", "export")


@pytest.mark.parametrize("family", registry.families(), ids=lambda f: f.NAME)
def test_every_family_has_the_whole_contract(family):
    assert [name for name in FACTS if not hasattr(family, name)] == []
    for hook in REQUIRED_HOOKS:
        assert callable(registry.hook(family, hook)), f"{family.NAME}: no hook {hook}"
    # a family SGLang serves names its algorithm; one it does not refuses every draft
    assert bool(family.SGLANG_ALGORITHM) != bool(family.sglang_refusal({}))


def test_each_drafting_is_one_familys_and_the_schema_lists_them_all():
    import yaml

    schema = yaml.safe_load((REPO / "src/draftline/schemas/config.schema.yaml").read_text())
    draft = schema["properties"]["train"]["properties"]["draft"]["properties"]
    draftings = [d for f in registry.families() for d in f.DRAFTINGS]
    assert sorted(draftings) == sorted(draft["drafting"]["enum"])
    assert len(set(draftings)) == len(draftings)
    assert registry.for_draft({"drafting": "parallel"}).NAME == "eagle3"
    assert registry.for_draft({"drafting": "dflash"}).NAME == "dflash"
    assert registry.for_draft({"drafting": "dspark"}).NAME == "dspark"
    assert registry.for_draft(None).NAME == registry.DEFAULT
    with pytest.raises(ValueError, match="train.draft.drafting"):
        registry.for_draft({"drafting": "medusa"})


def test_saved_and_exported_configs_name_their_family():
    assert registry.of_config({"drafting": "dflash", "block_size": 16}).NAME == "dflash"
    assert registry.of_config({"architectures": ["DFlashDraftModel"]}).NAME == "dflash"
    assert registry.of_config({"architectures": ["LlamaForCausalLMEagle3"],
                               "parallel_drafting": True}).NAME == "eagle3"
    assert registry.of_config({}).NAME == "eagle3"  # no config: the main EAGLE-3 draft
    assert registry.of_config({"drafting": "dspark", "markov_rank": 64}).NAME == "dspark"
    assert registry.of_config({"architectures": ["Qwen3DSparkModel"]}).NAME == "dspark"
    assert registry.speculative({"architectures": ["Qwen3DSparkModel"]}) == {
        "method": "dspark", "parallel_drafting": False}
    assert registry.served_label({"architectures": ["Qwen3DSparkModel"]}) == "DSpark"
    assert registry.speculative({"architectures": ["DFlashDraftModel"]}) == {
        "method": "dflash", "parallel_drafting": False}
    assert registry.speculative({"parallel_drafting": True}) == {
        "method": "eagle3", "parallel_drafting": True}
    assert registry.served_label({"architectures": ["Eagle3DeepseekV3ForCausalLM"],
                                  "fc_norm": True}) == "EAGLE-3.1 MLA"


def test_each_family_describes_its_own_draft_on_the_model_card():
    """The card's paragraph is the family's, from the exported config.json: P-EAGLE and the
    MLA draft are EAGLE-3 options; DFlash's layers and block; DSpark's heads."""
    eagle3 = registry.card_summary({"architectures": ["LlamaForCausalLMEagle3"]})
    assert eagle3.startswith("An EAGLE-3 speculative-decoding draft: one Llama-style decoder "
                             "layer that reads three hidden states of the target and proposes "
                             "tokens which the target then verifies")
    peagle = registry.card_summary({"architectures": ["LlamaForCausalLMEagle3"],
                                    "parallel_drafting": True})
    assert peagle.startswith("A P-EAGLE speculative-decoding draft: one Llama-style")
    assert "proposes a round's tokens in one forward pass (parallel drafting" in peagle
    mla = registry.card_summary({"architectures": ["Eagle3DeepseekV3ForCausalLM"]})
    assert mla.startswith("An EAGLE-3 MLA speculative-decoding draft: one DeepSeek-V3-style "
                          "decoder layer (multi-head latent attention, MLA)")
    dflash = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 1, "block_size": 16,
              "dflash_config": {"target_layer_ids": [1, 3, 4]}}
    assert registry.card_summary(dflash).startswith(
        "A DFlash speculative-decoding draft (vLLM's DFlash): 1 Qwen3-style decoder layer that "
        "reads the target's hidden states at 3 of its layers for every accepted position and "
        "fills a block of 15 masked tokens in one forward pass")
    dspark = {**dflash, "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": 2,
              "markov_rank": 64, "enable_confidence_head": True}
    text = registry.card_summary(dspark)
    assert text.startswith("A DSpark speculative-decoding draft (vLLM's DSpark): DFlash's "
                           "drafter, 2 Qwen3-style decoder layers that read")
    assert "plus a Markov head (rank 64) that biases each draft token's logits" in text
    assert "a confidence head" in text
    assert "confidence head" not in registry.card_summary(
        {**dspark, "enable_confidence_head": False})
    assert [registry.card_tag(c) for c in ({}, dflash, dspark)] == ["eagle3", "dflash",
                                                                     "dspark"]
    assert not any("EAGLE" in registry.card_summary(c) for c in (dflash, dspark))


def test_the_registry_loads_by_path_without_the_library_or_torch():
    """As config_check loads it at the workflow's parse time: no draftline package, no torch."""
    code = (
        "import importlib.util, sys\n"
        f"path = {str(REPO / 'src/draftline/drafts/registry.py')!r}\n"
        "spec = importlib.util.spec_from_file_location('_reg', path)\n"
        "reg = importlib.util.module_from_spec(spec); spec.loader.exec_module(reg)\n"
        "print(reg.for_draft({'drafting': 'dflash'}).NAME, reg.label({'drafting': 'parallel'}),\n"
        "      reg.label({'drafting': 'dspark', 'num_layers': 2, 'block_size': 8}))\n"
        "assert 'torch' not in sys.modules and 'draftline' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.split(maxsplit=2) == ["dflash", "P-EAGLE",
                                            "DSpark (2 layer(s), block 8, Markov rank 64)\n"]


def test_a_dspark_draft_counts_and_checks_as_its_dflash_backbone_plus_its_heads():
    """DSpark's parameters are DFlash's plus two [V, r] Markov matrices and the confidence
    projection; its config checks are DFlash's, named DSpark's."""
    dims = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
            "vocab_size": 1000}
    draft = {"drafting": "dflash", "block_size": 8, "num_layers": 2}
    dflash = registry.trainable_params(dims, 1000, draft)
    rank = 16
    spark = registry.trainable_params(dims, 1000, {**draft, "drafting": "dspark",
                                                   "markov_rank": rank})
    assert spark - dflash == 2 * 1000 * rank + (64 + rank + 1)
    no_conf = registry.trainable_params(dims, 1000, {**draft, "drafting": "dspark",
                                                     "markov_rank": rank,
                                                     "confidence_head": False})
    assert no_conf - dflash == 2 * 1000 * rank
    config = {"hidden": {"layer_ids": [2, 4]}, "bench": {"num_speculative_tokens": [8]}}
    problem = registry.config_problems(config, [("train.draft", {
        "drafting": "dspark", "arch": "llama", "block_size": 8})])
    assert problem.startswith("config key 'bench.num_speculative_tokens': 8 drafts, but the "
                              "DSpark draft of train.draft is trained on blocks of 8")


def test_the_families_answer_whether_their_draft_serves_beside_an_mla_target():
    """The MLA questions are the families' (asked through the registry): an MLA draft needs an
    MLA target (unknown, None: no answer yet); vLLM's CPU build starts no draft beside an MLA
    target, a GPU does."""
    config = {"target": {"model": "toy"}, "hidden": {"layer_ids": [2, 4]},
              "bench": {"num_speculative_tokens": [3]}}
    mla = {"drafting": "autoregressive", "arch": "deepseek_mla", "num_layers": None}
    drafts = [("train.draft", {**mla, "arch": "llama"}), ("train.variants[0].draft", mla)]
    assert registry.config_problems(config, drafts, target_mla=False) == (
        "config key 'train.variants[0].draft.arch': deepseek_mla needs a target with MLA "
        "attention (target.model toy has none); vLLM serves an MLA draft only beside one (it "
        "sizes the draft's MLA attention by the target's heads): use arch llama")
    assert registry.config_problems(config, drafts, target_mla=True) is None
    assert registry.config_problems(config, drafts, target_mla=None) is None
    for exported, label in [({}, "EAGLE-3"), ({"parallel_drafting": True}, "P-EAGLE"),
                            ({"architectures": ["DFlashDraftModel"]}, "DFlash"),
                            ({"architectures": ["Qwen3DSparkModel"]}, "DSpark")]:
        problem = registry.serving_problem_beside(exported, target_mla=True, on_gpu=False)
        assert f"{label} beside an MLA target does not start on vLLM's CPU build" in problem
        assert registry.serving_problem_beside(exported, target_mla=True, on_gpu=True) is None
        assert registry.serving_problem_beside(exported, target_mla=False, on_gpu=False) is None
        assert registry.serving_problem_beside(exported, target_mla=None, on_gpu=False) is None

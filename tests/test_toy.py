"""The toy reasoning target: chat template, determinism, file layout, and trained behaviour."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from draftline.stages import toy
from draftline.stages.hidden import default_layer_ids

QUICK_STEPS = 20  # enough to exercise training; the default build is covered by `toy_target`


def sha256_of_files(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def quick_builds(tmp_path_factory) -> tuple[Path, Path]:
    """Two independent builds with the default dims and a short training run."""
    root = tmp_path_factory.mktemp("toy")
    first = toy.build_toy_target(root / "first", {"train_steps": QUICK_STEPS})
    second = toy.build_toy_target(root / "second", {"train_steps": QUICK_STEPS})
    return first, second


def test_chat_template_matches_contract():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "2 plus 2 is 4."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    assert toy.render_chat(messages, add_generation_prompt=True) == (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nWhat is 2 + 2?<|end|>\n"
        "<|assistant|>\n<think>\n2 plus 2 is 4.\n</think>\n\n4<|end|>\n"
        "<|user|>\nAnd 3 + 3?<|end|>\n"
        "<|assistant|>\n<think>\n"
    )


def test_parser_split_message_renders_back_to_model_text():
    # vLLM's deepseek_r1 parser splits "r\n</think>\n\na" into reasoning "r\n", content "\n\na".
    prompt = [{"role": "user", "content": "hi"}]
    model_output = "Greet back.\n</think>\n\nHello!<|end|>"
    parsed = {"role": "assistant", "reasoning": "Greet back.\n", "content": "\n\nHello!"}
    rendered = toy.render_chat(prompt + [parsed])
    assert rendered == toy.render_chat(prompt, add_generation_prompt=True) + model_output + "\n"


def test_template_rejects_unknown_role():
    with pytest.raises(Exception, match="unsupported role: tool"):
        toy.render_chat([{"role": "tool", "content": "x"}])


def test_default_aux_layer_ids_are_distinct(config):
    num_layers = config["target"]["toy"]["num_layers"]
    ids = default_layer_ids(num_layers)
    assert ids == (2, 4, 5)
    assert len(set(ids)) == 3 and max(ids) < num_layers


def test_corpus_is_seeded_and_varied():
    first = toy.synthetic_conversations(400, seed=0)
    assert first == toy.synthetic_conversations(400, seed=0)
    assert first != toy.synthetic_conversations(400, seed=1)
    assert all(c[-1]["role"] == "assistant" and c[-1]["reasoning_content"] for c in first)
    distinct_prompts = {c[-2]["content"] for c in first}
    assert len(distinct_prompts) > 300
    assert {m["role"] for c in first for m in c} == {"system", "user", "assistant"}


def test_same_config_gives_identical_files(quick_builds):
    first, second = quick_builds
    hashes = sha256_of_files(first)
    assert set(hashes) >= {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json",
    }
    assert hashes == sha256_of_files(second)
    leftovers = [p.name for p in first.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_model_files_follow_contract(quick_builds):
    from safetensors import safe_open

    target = quick_builds[0]
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    assert config["num_hidden_layers"] == 8 and config["hidden_size"] == 128
    assert config["head_dim"] == 32 and config["max_position_embeddings"] >= 2048
    with safe_open(str(target / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("lm_head.weight").shape == (2048, 128)
        assert {str(weights.get_tensor(n).dtype) for n in names} == {"torch.bfloat16"}
    assert "model.embed_tokens.weight" in names and len(names) == 3 + 8 * 9  # 9 per layer


def test_tokenizer_special_tokens(quick_builds):
    from transformers import AutoTokenizer

    target = quick_builds[0]
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in toy.SPECIAL_TOKENS}
    assert sorted(ids.values()) == list(range(len(toy.SPECIAL_TOKENS)))
    for tok, tok_id in ids.items():
        assert tokenizer.encode(f"a{tok}b", add_special_tokens=False).count(tok_id) == 1, tok
    generation = json.loads((target / "generation_config.json").read_text())
    assert tokenizer.eos_token == "<|end|>" and generation["eos_token_id"] == ids["<|end|>"]
    # The reasoning parser reads <think>/</think> from the text: they must survive decoding.
    reply = tokenizer.encode("why\n</think>\n\nok<|end|>", add_special_tokens=False)
    assert tokenizer.decode(reply, skip_special_tokens=True) == "why\n</think>\n\nok"
    text = "Unseen words, ZEBRAS and emoji 😀 ü encode too."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == toy.render_chat(messages, add_generation_prompt=True)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(toy, "train_model", crash)
    with pytest.raises(RuntimeError, match="killed"):
        toy.build_toy_target(tmp_path / "target", {"train_steps": 0})
    assert list(tmp_path.iterdir()) == []


def test_rebuild_replaces_old_directory(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    toy.build_toy_target(target, {"train_steps": 0, "num_layers": 8, "hidden_size": 64})
    assert not (target / "stale.txt").exists()
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 64
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_unknown_toy_key_is_named(tmp_path):
    with pytest.raises(ValueError, match="config key 'target.toy.layers'"):
        toy.build_toy_target(tmp_path / "t", {"layers": 3})


def sample_replies(target: Path, prompts: list[list[dict]], max_new_tokens: int) -> list[list[int]]:
    """Sampled reply token ids (temperature 0.7), each cut after the first <|end|>."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for m in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=0.7,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    end_id = tokenizer.eos_token_id
    replies = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        replies.append(row[: row.index(end_id) + 1] if end_id in row else row)
    return replies


@pytest.mark.slow
def test_trained_toy_closes_thinking_and_ends_turn(toy_target):
    held_out = [c[:-1] for c in toy.synthetic_conversations(24, seed=987)]
    unlike_training = [[{"role": "user", "content": text}] for text in (
        "Explain how photosynthesis works.", "Write a haiku about autumn.",
        "Give me a Python function that reverses a list.", "Why is the sky blue?",
    )]
    replies = sample_replies(toy_target, held_out + unlike_training, max_new_tokens=160)

    def well_formed(reply: list[int]) -> bool:
        close_id, end_id = 6, 1  # </think>, <|end|>
        if close_id not in reply or reply[-1] != end_id or len(reply) >= 128:
            return False
        # some reasoning before </think>; after it "\n\n", at least one answer token, <|end|>
        return reply.index(close_id) >= 3 and len(reply) - reply.index(close_id) >= 5

    # Measured: 28/28 for the default build, 11/28 after 20 training steps.
    assert sum(map(well_formed, replies)) / len(replies) >= 0.9

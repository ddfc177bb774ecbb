"""Dataset stage: rendering, loss masks, ids as ground truth, truncation, split stability.

The tokenizers here are small WordLevel tokenizers built in the test (real `tokenizers` +
transformers objects, saved and loaded with AutoTokenizer), one per chat-template style:
"a" opens the thinking block in the generation prompt (the toy target's style), "b" leaves
it to the model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from draftline.core.records import RecordError
from draftline.stages import toy
from draftline.stages.dataset import build_dataset, is_eval, split_of

SPECIALS = ["<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]
WORDS = ["\n", "\n\n", " ", "be", "brief", ".", "what", "is", "2", "+", "?", "4", "ok", "so"]

ASSISTANT_TURN = (
    "{{ '<|assistant|>\\n<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n'"
    " + m.content + '<|end|>\\n' }}"
)
GENERATION_PROMPT = {"a": "<|assistant|>\\n<think>\\n", "b": "<|assistant|>\\n"}


def chat_template(style: str) -> str:
    return (
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}" + ASSISTANT_TURN + "{%- else -%}"
        "{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '" + GENERATION_PROMPT[style] + "' }}{%- endif -%}"
    )


def make_target(root: Path, style: str) -> Path:
    """A tokenizer-only target dir with a chat template of the given style."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, "[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\s+"), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>", unk_token="[UNK]"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    fast.chat_template = chat_template(style)
    out = root / f"target-{style}"
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {style: make_target(root, style) for style in ("a", "b")}


@pytest.fixture(scope="module")
def token_id(targets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(targets["a"]))
    return lambda tokens: tokenizer.convert_tokens_to_ids(tokens)


PROMPT = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "what is 2+2?"},
]
ANSWER = {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4."}

PROMPT_TOKENS = ["<|system|>", "\n", "be", " ", "brief", ".", "<|end|>", "\n"] + [
    "<|user|>", "\n", "what", " ", "is", " ", "2", "+", "2", "?", "<|end|>", "\n",
    "<|assistant|>", "\n",
]  # fmt: skip
REASONING_AND_ANSWER = [
    "2", "+", "2", " ", "is", " ", "4", ".", "\n", "</think>", "\n\n", "4", "<|end|>",
]  # fmt: skip
# Style a: the generation prompt already opened the thinking block.
PROMPT_A, OUTPUT_A = PROMPT_TOKENS + ["<think>", "\n"], REASONING_AND_ANSWER
# Style b: the model emits "<think>\n" itself, so those tokens are supervised.
PROMPT_B, OUTPUT_B = PROMPT_TOKENS, ["<think>", "\n"] + REASONING_AND_ANSWER


def record(sample_id: str, prompt=PROMPT, answer=ANSWER, **extra) -> dict:
    return {"id": sample_id, "messages": [*prompt, answer], "finish_reason": "stop", **extra}


def build(tmp_path: Path, target: Path, records: list[dict], **kwargs):
    """Write records to a shard, build the dataset, return (stats, DatasetDict)."""
    from datasets import load_from_disk

    tmp_path.mkdir(parents=True, exist_ok=True)
    shard = tmp_path / "shard-0.jsonl"
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "dataset"
    params = {"eval_fraction": 0.0, "max_length": 4096} | kwargs
    stats = build_dataset([shard], target, out, **params)
    return stats, load_from_disk(str(out))


def only_sample(ds) -> dict:
    assert ds["train"].num_rows == 1
    return ds["train"][0]


@pytest.mark.parametrize(
    "style, prompt_tokens, output_tokens",
    [("a", PROMPT_A, OUTPUT_A), ("b", PROMPT_B, OUTPUT_B)],
)
def test_rendered_loss_mask_marks_generated_tokens(
    tmp_path, targets, token_id, style, prompt_tokens, output_tokens
):
    stats, ds = build(tmp_path, targets[style], [record("s0")])
    sample = only_sample(ds)
    assert sample["input_ids"] == token_id(prompt_tokens + output_tokens)
    assert sample["loss_mask"] == [0] * len(prompt_tokens) + [1] * len(output_tokens)
    assert stats["rendered_only"] == 1 and stats["mismatch"] == 0
    assert stats["supervised_tokens"] == {"train": len(output_tokens), "eval": 0}
    assert json.loads((tmp_path / "dataset" / "stats.json").read_text()) == stats


@pytest.mark.parametrize(
    "style, prompt_tokens, output_tokens",
    [("a", PROMPT_A, OUTPUT_A), ("b", PROMPT_B, OUTPUT_B)],
)
def test_matching_ids_are_used_and_end_of_turn_appended(
    tmp_path, targets, token_id, style, prompt_tokens, output_tokens
):
    prompt_ids, output_ids = token_id(prompt_tokens), token_id(output_tokens)
    records = [
        record("with-eos", prompt_token_ids=prompt_ids, output_token_ids=output_ids),
        # vLLM clients may strip the final EOS: a finished turn gets it back.
        record("without-eos", prompt_token_ids=prompt_ids, output_token_ids=output_ids[:-1]),
    ]
    stats, ds = build(tmp_path, targets[style], records)
    assert stats["with_token_ids"] == 2 and stats["mismatch"] == 0
    assert stats["end_of_turn_appended"] == 1
    for sample in ds["train"]:
        assert sample["input_ids"] == prompt_ids + output_ids
        assert sample["loss_mask"] == [0] * len(prompt_ids) + [1] * len(output_ids)


def test_mismatch_between_rendering_and_ids_is_counted_and_ids_win(tmp_path, targets, token_id):
    prompt_ids = token_id(PROMPT_A)
    produced = token_id(OUTPUT_A[:-2] + ["ok", "<|end|>"])  # the text says "4", the ids "ok"
    records = [
        record("differs", prompt_token_ids=prompt_ids, output_token_ids=produced),
        record("agrees", prompt_token_ids=prompt_ids, output_token_ids=token_id(OUTPUT_A)),
    ]
    stats, ds = build(tmp_path, targets["a"], records)
    assert stats["mismatch"] == 1 and stats["mismatch_ids"] == ["differs"]
    by_id = {s["id"]: s for s in ds["train"]}
    assert by_id["differs"]["input_ids"] == prompt_ids + produced


def test_prompt_mismatch_is_detected(tmp_path, targets, token_id):
    other_prompt = token_id(PROMPT_A[:-2] + ["\n", "<think>", "\n"])  # an extra newline
    rec = record("p", prompt_token_ids=other_prompt, output_token_ids=token_id(OUTPUT_A))
    stats, ds = build(tmp_path, targets["a"], [rec])
    assert stats["mismatch"] == 1
    assert only_sample(ds)["loss_mask"].index(1) == len(other_prompt)


def test_unfinished_turn_gets_no_end_of_turn(tmp_path, targets, token_id):
    partial = OUTPUT_A[:5]  # cut by max_tokens inside the reasoning
    answer = {"role": "assistant", "content": None, "reasoning_content": "2+2 is"}
    with_ids = record(
        "ids",
        answer=answer,
        finish_reason="length",
        prompt_token_ids=token_id(PROMPT_A),
        output_token_ids=token_id(partial),
    )
    stats, ds = build(tmp_path, targets["a"], [with_ids])
    sample = only_sample(ds)
    assert sample["input_ids"] == token_id(PROMPT_A + partial)
    assert stats["mismatch"] == 0 and stats["end_of_turn_appended"] == 0

    rendered = record("text", answer=answer, finish_reason="length")
    _, ds = build(tmp_path, targets["a"], [rendered])
    ids = only_sample(ds)["input_ids"]
    assert token_id("<|end|>") != ids[-1]  # the template's end of turn is not supervised


def test_boundary_merge_does_not_shift_the_mask(tmp_path, targets, token_id):
    # Tokenized jointly, "<think>\n" + " so" would merge "\n " into one (unknown) token.
    answer = {"role": "assistant", "content": "4", "reasoning_content": " so 4"}
    _, ds = build(tmp_path, targets["a"], [record("m", answer=answer)])
    sample = only_sample(ds)
    expected_output = [" ", "so", " ", "4", "\n", "</think>", "\n\n", "4", "<|end|>"]
    assert sample["input_ids"] == token_id(PROMPT_A + expected_output)
    assert sample["loss_mask"].index(1) == len(PROMPT_A)


def test_truncation_and_samples_without_supervised_tokens(tmp_path, targets, token_id):
    ids = {"prompt_token_ids": token_id(PROMPT_A)}
    records = [
        record("long", output_token_ids=token_id(OUTPUT_A), **ids),
        record("empty", finish_reason="length", output_token_ids=[], **ids),
    ]
    keep = len(PROMPT_A) + 3
    stats, ds = build(tmp_path, targets["a"], records, max_length=keep)
    sample = only_sample(ds)
    assert sample["input_ids"] == token_id(PROMPT_A + OUTPUT_A[:3])
    assert sum(sample["loss_mask"]) == 3
    assert stats["truncated"] == 1
    assert stats["dropped"] == {"no_supervised_tokens": 1}

    stats, ds = build(tmp_path, targets["a"], records[:1], max_length=len(PROMPT_A))
    assert ds["train"].num_rows == 0
    assert stats["dropped"] == {"no_supervised_tokens_after_truncation": 1}


def test_duplicates_dropped_and_bad_records_named(tmp_path, targets):
    stats, ds = build(tmp_path, targets["a"], [record("x"), record("x")])
    assert ds["train"].num_rows == 1 and stats["dropped"] == {"duplicate_id": 1}

    bad = record("no-answer")
    bad["messages"] = bad["messages"][:-1]
    with pytest.raises(RecordError, match=r"shard-0\.jsonl:2 \(id 'no-answer'\)"):
        build(tmp_path, targets["a"], [record("ok"), bad])
    # The failed build left the previous dataset in place.
    assert (tmp_path / "dataset" / "stats.json").exists()


def hashed_bucket(sample_id: str) -> int:
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") % 1_000_000


def test_split_is_stable_when_samples_are_added(tmp_path, targets):
    ids = [f"sample-{i}" for i in range(4000)]
    share = sum(is_eval(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert not any(is_eval(i, 0.0) for i in ids)

    first = [record(f"s{i}") for i in range(30)]
    more = first[:15] + [record(f"t{i}") for i in range(30)] + first[15:]
    stats1, ds1 = build(tmp_path / "1", targets["a"], first, eval_fraction=0.3)
    stats2, ds2 = build(tmp_path / "2", targets["a"], more, eval_fraction=0.3)
    for split in ("train", "eval"):
        assert set(ds1[split]["id"]) <= set(ds2[split]["id"])
        assert all(split_of(i, 0.3) == split for i in ds2[split]["id"])
    # the exact sets, by the contract's rule computed here: eval when the first 8 bytes of the
    # id's SHA-256, big-endian, mod 10**6 fall below eval_fraction * 10**6
    assert set(ds1["eval"]["id"]) == {"s6", "s9", "s11", "s15", "s16", "s17", "s20", "s21",
                                      "s27"}
    all_ids = {r["id"] for r in more}
    eval_ids = {i for i in all_ids if hashed_bucket(i) < 300_000}
    assert set(ds2["eval"]["id"]) == eval_ids
    assert set(ds2["train"]["id"]) == all_ids - eval_ids
    assert stats1["samples_out"] == {"train": 21, "eval": 9}
    assert sum(stats2["samples_in"].values()) == 60


def test_real_toy_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    target = toy.build_toy_target(tmp_path / "target", {"train_steps": 0})
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    stats, ds = build(tmp_path, target, [record("toy")])
    sample = only_sample(ds)
    supervised = [t for t, m in zip(sample["input_ids"], sample["loss_mask"], strict=True) if m]
    text = tokenizer.decode(supervised)
    # The generation prompt opened the thinking block; the model's part closes it and the turn.
    assert text.startswith("2+2 is 4.") and "</think>" in text and text.endswith("<|end|>")
    assert stats["mismatch"] == 0


def test_an_answer_after_the_first_falls_in_its_prompts_split(tmp_path, targets):
    """Records naming their prompt (``prompt_id``, generate.answers_per_prompt) are split by
    that prompt's id, not their own: no prompt is both trained on and evaluated on."""
    prompts = [f"s{i}" for i in range(30)]
    answers = [record(f"{p}#1", prompt_id=p) for p in prompts]
    # the check can fail: some answers' own ids hash into the other split than their prompt's
    assert any(split_of(r["id"], 0.3) != split_of(r["prompt_id"], 0.3) for r in answers)
    stats, ds = build(tmp_path, targets["a"], [record(p) for p in prompts] + answers,
                      eval_fraction=0.3)
    for split in ("train", "eval"):
        assert {i.split("#")[0] for i in ds[split]["id"]} == \
            {p for p in prompts if split_of(p, 0.3) == split}
    assert sum(stats["samples_out"].values()) == 60
    with pytest.raises(RecordError, match="prompt_id"):
        build(tmp_path / "bad", targets["a"], [record("s0#1", prompt_id=3)])

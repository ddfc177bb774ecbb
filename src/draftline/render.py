"""Chat-template rendering shared by generation (mismatch check) and the dataset stage."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4)
def load_tokenizer(tokenizer_dir: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_matches_ids(tokenizer, record: dict) -> bool:
    """True when rendering the conversation reproduces prompt_token_ids + output_token_ids.

    The target's stream must be a prefix of the rendering: the template may add a newline
    after the end-of-turn token, and an unfinished turn (finish_reason length) stops early.
    """
    prompt_ids, output_ids = record.get("prompt_token_ids"), record.get("output_token_ids")
    if prompt_ids is None or output_ids is None:
        return False
    stream = list(prompt_ids) + list(output_ids)
    rendered = render_ids(tokenizer, record["messages"])
    if record.get("finish_reason") == "length":
        return rendered[: len(stream)] == stream
    return rendered[: len(stream)] == stream and len(rendered) - len(stream) <= 2

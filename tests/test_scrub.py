"""Secret scrubbing (draftline.stages.bundle.scrub): secrets go by explicit option names, URL
credentials and the environment variables the config names; every other argument is kept."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from draftline.stages.bundle.scrub import (
    REDACTED,
    scrub_args,
    scrub_config,
    scrub_text,
    secret_values,
)

# ordinary vLLM-like arguments, the substring traps among them
FLAGS = ["--enforce-eager", "--skip-tokenizer-init", "--trust-remote-code",
         "--disable-log-requests", "--no-enable-chunked-prefill"]
VALUED = ["--max-num-batched-tokens", "--tokenizer", "--tokenizer-revision", "--port",
          "--api-key-env", "--served-model-name", "--max-model-len", "--key-value-dtype"]
PLAIN = ["OMP_NUM_THREADS=2", "TOKENIZERS_PARALLELISM=false", "serve", "target",
         "server.max_num_batched_tokens=8192", "http://127.0.0.1:8000/v1"]
ordinary_values = st.text("abcdefghijklmnopqrstuvwxyz0123456789/.-", min_size=1, max_size=12)
# secrets come from an alphabet no ordinary argument uses, so "survives" is a plain search
secret_values_ = st.text("ABCDEFGHJKLMNPQRSTUVWXYZ", min_size=8, max_size=24)


@st.composite
def argv_parts(draw):
    """Pieces of an argv, each with what the scrubbed piece must be and its secret (or None)."""
    kind = draw(st.sampled_from(["flag", "valued", "plain", "secret", "secret_eq", "url"]))
    if kind == "flag":
        arg = draw(st.sampled_from(FLAGS))
        return [arg], [arg], None
    if kind == "valued":
        parts = [draw(st.sampled_from(VALUED)), draw(ordinary_values)]
        return parts, parts, None
    if kind == "plain":
        arg = draw(st.sampled_from(PLAIN))
        return [arg], [arg], None
    option = draw(st.sampled_from(["--api-key", "--hf-token", "--token"]))
    secret = draw(secret_values_)
    if kind == "secret":
        return [option, secret], [option, REDACTED], secret
    if kind == "secret_eq":
        return [f"{option}={secret}"], [f"{option}={REDACTED}"], secret
    user = draw(st.text("abcxyz019_.", max_size=8))
    host = draw(st.sampled_from(["host", "10.0.0.1:8000"]))
    arg = f"--base-url=https://{user}:{secret}@{host}/v1"
    return [arg], [f"--base-url=https://{user}:{REDACTED}@{host}/v1"], secret


@settings(max_examples=300, deadline=None)
@given(st.lists(argv_parts(), max_size=12))
def test_no_secret_survives_and_nothing_else_changes(parts):
    argv = [a for given_, _, _ in parts for a in given_]
    expected = [a for _, want, _ in parts for a in want]
    secrets = [s for _, _, s in parts if s]
    scrubbed = scrub_args(argv)
    assert scrubbed == expected
    assert not any(s in " ".join(scrubbed) for s in secrets)


def test_substring_traps_are_kept():
    argv = ["--skip-tokenizer-init", "--enforce-eager", "--max-num-batched-tokens", "8192",
            "--tokenizer", "org/tok", "--api-key-env", "MY_KEY"]
    assert scrub_args(argv) == argv


def test_secret_variable_assignments_are_redacted_by_whole_word():
    assert scrub_args(["server.env.HF_TOKEN=hf_abc", "A_TOKEN=1", "TOKENIZERS_PARALLELISM=false"]
                      ) == ["server.env.HF_TOKEN=[REDACTED]", "A_TOKEN=[REDACTED]",
                            "TOKENIZERS_PARALLELISM=false"]


def test_config_keeps_ordinary_keys_and_removes_url_credentials():
    config = {"server": {
        "extra_args": ["--max-num-batched-tokens", "8192", "--tokenizer", "org/tok",
                       "--api-key", "sk-literal-0123456789"],
        "external": {"base_urls": ["https://user:pw-0123456789@host/v1", "http://h:8000"],
                     "api_key_env": "MY_KEY"},
        "max_num_batched_tokens": 8192, "tokenizer": "org/tok"}}
    scrubbed = scrub_config(config)
    assert scrubbed["server"]["extra_args"] == ["--max-num-batched-tokens", "8192", "--tokenizer",
                                                "org/tok", "--api-key", REDACTED]
    assert scrubbed["server"]["external"] == {
        "base_urls": [f"https://user:{REDACTED}@host/v1", "http://h:8000"],
        "api_key_env": "MY_KEY"}
    assert scrubbed["server"]["tokenizer"] == "org/tok"
    assert scrubbed["server"]["max_num_batched_tokens"] == 8192


def test_values_of_variables_the_config_names_are_scrubbed_whatever_their_name():
    config = {"server": {"external": {"api_key_env": "MY_ENDPOINT"},
                         "pass_env": ["GATED_ACCESS"]}}
    env = {"MY_ENDPOINT": "ep-value-0123456789", "GATED_ACCESS": "gated-0123456789",
           "HF_TOKEN": "hf_tokenvalue0123", "HOME": "/home/someone/longpath"}
    found = secret_values(env, config)
    assert found == {"MY_ENDPOINT": "ep-value-0123456789", "GATED_ACCESS": "gated-0123456789",
                     "HF_TOKEN": "hf_tokenvalue0123"}
    text = "key ep-value-0123456789 and gated-0123456789 at /home/someone/longpath"
    assert scrub_text(text, found) == ("key [REDACTED:MY_ENDPOINT] and [REDACTED:GATED_ACCESS] "
                                       "at /home/someone/longpath")


def test_url_credentials_are_removed_from_text():
    assert scrub_text("GET https://alice:s3cret-pw@example.org/x", {}) == (
        f"GET https://alice:{REDACTED}@example.org/x")


def test_secret_named_variables_of_an_env_mapping_are_redacted():
    config = {"server": {"env": {"HF_TOKEN": "hf_literal0123456789", "OMP_NUM_THREADS": "2",
                                 "TOKENIZERS_PARALLELISM": "false"}}}
    assert scrub_config(config)["server"]["env"] == {
        "HF_TOKEN": REDACTED, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}

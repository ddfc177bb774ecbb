"""Which names hold secrets: options, environment variables and URLs (standard library only).

Shared by the config check (which refuses secrets written into a config), the servers (which
take their keys from the environment) and the bundle's scrubbing. Every rule is an explicit
name or a whole word of a name, never a substring: ``--max-num-batched-tokens``,
``--skip-tokenizer-init`` and ``TOKENIZERS_PARALLELISM`` hold no secret.
"""

from __future__ import annotations

import re

# Options whose value is a secret. vLLM's CLI has two (``--api-key``: the key its OpenAI server
# requires; ``--hf-token``: the bearer token for the hub); ``--token`` is the Hugging Face CLI's.
SECRET_OPTIONS = frozenset({"--api-key", "--hf-token", "--token"})

# Words that make an environment variable's name secret-bearing (HF_TOKEN, OPENAI_API_KEY,
# AWS_SECRET_ACCESS_KEY, PGPASSWORD's kin DB_PASSWORD), matched against whole ``_`` words.
SECRET_WORDS = frozenset({"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD",
                          "CREDENTIAL", "CREDENTIALS", "PAT"})

MIN_SECRET_LEN = 8  # shorter values ("1", "true") would scrub ordinary text

# user:password@ in a URL's authority (scheme://user:password@host)
URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s:@]*):"
                             r"(?P<password>[^/\s]+)@")  # to the last @: a password may hold one


def secret_variable_name(name: str) -> bool:
    """True for an environment variable whose name says it holds a secret (HF_TOKEN)."""
    return any(word in SECRET_WORDS for word in name.upper().split("_"))


def looks_like_secret(value: str) -> bool:
    """True for a literal that could be a key or token: long enough, one word, not a number."""
    text = value.strip()
    return (len(text) >= MIN_SECRET_LEN and not any(c.isspace() for c in text)
            and not re.fullmatch(r"[0-9.eE+-]+", text))


def secret_option(arg: str) -> str | None:
    """The secret option ``arg`` is (``--api-key`` or ``--api-key=...``), else None."""
    name = arg.partition("=")[0]
    return name if name in SECRET_OPTIONS else None

"""Secrets never enter a bundle. What counts as one is explicit (``draftline.core.secret_names``):

* the values of the secret options (``--api-key``, ``--hf-token``, ``--token``) and of
  ``NAME=value`` assignments to a secret-named variable (``server.env.HF_TOKEN=...``);
* the password of a URL (``https://user:password@host``), anywhere;
* the values of the environment variables the config names through its ``*_env`` keys
  (``api_key_env: MY_KEY`` -> the value of ``$MY_KEY``), and of those whose name has a secret
  word (``HF_TOKEN``), wherever they appear.

Never a substring of a name: ``--max-num-batched-tokens 8192`` and ``--tokenizer org/tok`` are
kept, so the bundled ``resolved_config.yaml`` still reproduces the run (``verify --rebuild``).
The config schema defines no key that holds a secret itself: secrets reach draftline only by
the name of an environment variable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from draftline.core.secret_names import (
    MIN_SECRET_LEN,
    URL_CREDENTIALS,
    secret_option,
    secret_variable_name,
)

REDACTED = "[REDACTED]"


def config_env_names(node: Any) -> Iterator[str]:
    """Names of the environment variables a config names through its ``*_env`` keys."""
    if isinstance(node, dict):
        for key, value in node.items():
            if str(key).endswith("_env"):
                values = value if isinstance(value, list) else [value]
                yield from (v for v in values if isinstance(v, str) and v)
            else:
                yield from config_env_names(value)
    elif isinstance(node, list):
        for item in node:
            yield from config_env_names(item)


def secret_values(env: Mapping[str, str] | None = None,
                  config: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Values to cut from text: of the variables ``config`` names by ``*_env`` keys, and of those
    with a secret word in their name; longest first (a secret containing another goes whole)."""
    env = os.environ if env is None else env
    named = set(config_env_names(dict(config or {})))
    found = {name: value for name, value in env.items()
             if (name in named or secret_variable_name(name)) and len(value) >= MIN_SECRET_LEN}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[1])))


def scrub_urls(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:[REDACTED]@host``."""
    return URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)


def scrub_text(text: str, secrets: Mapping[str, str]) -> str:
    """Replace each secret value, raw and as escaped inside a JSON string, and URL passwords."""
    for name, value in secrets.items():
        for form in {value, json.dumps(value)[1:-1]}:
            text = text.replace(form, f"[REDACTED:{name}]")
    return scrub_urls(text)


def scrub_obj(node: Any, secrets: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return scrub_text(node, secrets)
    if isinstance(node, dict):
        return {scrub_obj(k, secrets): scrub_obj(v, secrets) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [scrub_obj(x, secrets) for x in node]
    return node


def _secret_assignment(arg: str) -> bool:
    """``HF_TOKEN=x`` or ``server.env.HF_TOKEN=x`` (a Snakemake ``--config`` item)."""
    name, sep, _ = arg.partition("=")
    return bool(sep) and not name.startswith("-") and secret_variable_name(name.split(".")[-1])


def scrub_args(args: Sequence[str]) -> list[str]:
    """The arguments with the values of secret options and assignments redacted, and URL
    passwords; every other argument as it was."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        option = secret_option(arg)
        if option and "=" in arg or _secret_assignment(arg):
            arg = f"{arg.partition('=')[0]}={REDACTED}"
        elif option:
            hide_next = True
        out.append(scrub_urls(arg))
    return out


def scrub_environment(env: Mapping[str, Any]) -> dict[str, Any]:
    """An ``env`` mapping (``server.env``) with the values of secret-named variables redacted
    (the config check refuses them; a config that skipped it still bundles none)."""
    return {name: REDACTED if secret_variable_name(name) and isinstance(value, str)
            else scrub_config(value) for name, value in env.items()}


def scrub_config(node: Any) -> Any:
    """A copy of the config with secrets removed from its option lists, URLs and ``env``."""
    if isinstance(node, dict):
        return {k: scrub_environment(v) if k == "env" and isinstance(v, dict)
                else scrub_config(v) for k, v in node.items()}
    if isinstance(node, list):
        if all(isinstance(x, str) for x in node):
            return scrub_args(node)
        return [scrub_config(x) for x in node]
    if isinstance(node, str):
        return scrub_urls(node)
    return node

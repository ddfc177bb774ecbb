"""Secrets never enter a bundle: values of environment variables named like keys, tokens or
secrets are removed from text, and secret-looking config values and options are redacted."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
MIN_SECRET_LEN = 8  # shorter values ("1", "true") would scrub ordinary text
REDACTED = "[REDACTED]"


def secret_values(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Values of environment variables whose names look like keys, tokens or secrets."""
    env = os.environ if env is None else env
    found = {name: value for name, value in env.items()
             if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_LEN}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[1])))  # longest first


def scrub_text(text: str, secrets: Mapping[str, str]) -> str:
    """Replace each secret value, raw and as escaped inside a JSON string."""
    for name, value in secrets.items():
        for form in {value, json.dumps(value)[1:-1]}:
            text = text.replace(form, f"[REDACTED:{name}]")
    return text


def scrub_obj(node: Any, secrets: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return scrub_text(node, secrets)
    if isinstance(node, dict):
        return {scrub_obj(k, secrets): scrub_obj(v, secrets) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [scrub_obj(x, secrets) for x in node]
    return node


def _secret_key(key: str) -> bool:
    """Config keys that hold a secret. ``*_env`` keys hold only a variable NAME."""
    return bool(SECRET_NAME.search(key)) and not key.lower().replace("-", "_").endswith("_env")


def scrub_args(args: Sequence[str]) -> list[str]:
    """Remove values of secret-looking options: ``--api-key X``, ``--hf-token=X``, ``K_TOKEN=X``."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, sep, _ = arg.partition("=")
        if _secret_key(name.lstrip("-")):
            if sep:
                arg = f"{name}={REDACTED}"
            elif arg.startswith("-"):
                hide_next = True
        out.append(arg)
    return out


def scrub_config(node: Any) -> Any:
    """A copy of the config with secret-looking values removed (keys and option lists)."""
    if isinstance(node, dict):
        return {k: (REDACTED if _secret_key(str(k)) and isinstance(v, str) else scrub_config(v))
                for k, v in node.items()}
    if isinstance(node, list):
        if all(isinstance(x, str) for x in node):
            return scrub_args(node)
        return [scrub_config(x) for x in node]
    return node


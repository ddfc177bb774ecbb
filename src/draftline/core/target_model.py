"""The target the stages load: a built-in target's folder, or ``target.model`` as given.

Its own module: ``builtin_targets`` (which the config check, and so the toy's build, imports)
stays clear of ``layout``, so that a new artifact path does not make the toy target stale.
"""

from __future__ import annotations

from draftline.core.builtin_targets import is_builtin
from draftline.core.layout import Layout


def target_model(config: dict) -> str:
    """``<results>/target`` for a built-in target (``toy``, ``smollm2-135m``), else
    ``target.model`` (a local model folder or a hub id)."""
    model = config["target"]["model"]
    return str(Layout.from_config(config).target) if is_builtin(model) else model

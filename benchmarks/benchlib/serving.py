"""A vLLM server of a target, with or without a draft, and its spec-decode counters.

Every benchmark starts its servers from the same definition as the pipeline:
``draftline.serving.server.spec_from_config`` (the config's server flags),
``draftline.stages.bench.speculative_config`` (the draft's method, from its own config) and
``draftline.serving.server.make_server`` (a process, or a container for ``launcher: docker``).
"""

from __future__ import annotations

from pathlib import Path

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def server_spec(server_cfg: dict, model: str | Path, draft: str | Path | None = None, *,
                num_speculative_tokens: int = 3, draft_sample_method: str = "greedy",
                target_cfg: dict | None = None):
    """The server of ``model`` with the ``server`` config section's flags, serving ``draft``
    as its speculative model when one is given. ``target_cfg``: the config's ``target``
    section when ``model`` is that target (its trust_remote_code and revision apply)."""
    from draftline.serving.server import spec_from_config
    from draftline.stages.bench import speculative_config

    speculative = (speculative_config(str(draft), num_speculative_tokens, draft_sample_method)
                   if draft is not None else None)
    target_cfg = target_cfg or {}
    return spec_from_config(server_cfg, str(model), target_cfg.get("trust_remote_code", False),
                            speculative, target_cfg.get("revision"))


def serve(spec, log_path: str | Path):
    """The server of ``spec`` (use as a context manager: started healthy, stopped at exit)."""
    from draftline.serving.server import make_server

    return make_server(spec, Path(log_path))


def spec_decode_totals(counters: dict) -> dict:
    """The spec-decode counts in counters differenced over a run (``run_requests``'
    ``server["counters"]``): drafts, draft tokens, accepted tokens and the accepted tokens per
    position (position -> count); a counter the server did not export counts 0."""
    from draftline.serving.loadgen import SPEC_DECODE_PER_POS

    return {"drafts": counters.get(DRAFTS) or 0, "draft_tokens": counters.get(DRAFT_TOKENS) or 0,
            "accepted": counters.get(ACCEPTED) or 0,
            "per_position": counters.get(SPEC_DECODE_PER_POS) or {}}


def acceptance(counters: dict) -> dict:
    """Acceptance length, rate and per position from differenced counters, as the deployment
    benchmark computes them (``draftline.stages.bench.acceptance_fields``)."""
    from draftline.stages.bench import acceptance_fields

    return acceptance_fields(counters)


def server_total(root_url: str, name: str) -> float:
    """A counter of the server at ``root_url`` now, summed over its label sets."""
    from draftline.serving.loadgen import fetch_metrics

    return fetch_metrics(root_url).total(name)

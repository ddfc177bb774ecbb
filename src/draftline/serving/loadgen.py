"""One closed-loop load generator for OpenAI-compatible (vLLM) chat endpoints.

Kept whole (about 730 lines): the request shape, the SSE reader, the closed loop, the
window statistics and the /metrics reader are one measurement contract, checked together.

Used by the concurrency profiler and the deployment benchmark; the request shape
(``SamplingSpec``) is the one the generation stage sends, so a profile measures the real workload.

How it measures:

* One aiohttp session per run, its connection pool sized to the concurrency, no client-side
  retries (a retry would hide an error and distort latency). The hot path is a raw SSE reader:
  measured on this project's 2-core host, the official ``openai`` client spends about 6 ms of
  client CPU per streamed 34-token request (SSE decoding and a model object per chunk), raw httpx
  about 2.3 ms, aiohttp with ``json.loads`` about 0.5 ms. A load generator that shares the
  machine with the server, or drives thousands of tokens per second, must be the cheap one.
  The request body is the one the ``openai`` client sends for the same ``SamplingSpec``
  (``SamplingSpec.create_kwargs``), so the server sees the generation stage's requests.
* Closed loop: a fixed pool of worker coroutines, each sending its next request as soon as the
  previous one ends, so the server sees exactly ``concurrency`` requests in flight.
* Streaming chat completions with ``stream_options.include_usage``, and per-chunk exact token
  counts from either the chunk's ``token_ids`` (``return_token_ids``, as the generation stage
  asks) or vLLM's ``continuous_usage_stats`` (cumulative completion tokens in every chunk). A
  chunk can carry several tokens (speculative decoding) or none (a reasoning parser holding text
  back); without either option one token per text chunk is assumed and the final usage chunk
  settles the total.
* Time window: after a warm-up, tokens are attributed to the measured window by the arrival time
  of the chunk that carried them, including requests that started before the window or are cut
  off at its end. Throughput is then exact for the window even when no request completes inside
  it (long reasoning outputs at high concurrency). Per-request latencies (TPOT, end-to-end) come
  from requests that completed inside the window, TTFT from requests whose first chunk arrived
  inside it, ITL from chunk gaps ending inside it. TTFT, TPOT, ITL and end-to-end latency are
  defined as ``vllm bench serve`` defines them (see ``RequestResult``): per chunk, not token.

Prometheus helpers read a vLLM server's ``/metrics`` (spec-decode counters, running requests,
generated tokens) so that server-side counts can be compared over exactly the same window.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import re
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from draftline.core.records import Prompt

if TYPE_CHECKING:  # aiohttp is imported where used: fingerprints need only the standard library
    import aiohttp

    from draftline.serving.server import Endpoint

PERCENTILES = (50, 90, 99)


# ----------------------------------------------------------------------------- request shape


@dataclass(frozen=True)
class SamplingSpec:
    """What every request carries; build it from the ``generate`` config section."""

    max_tokens: int
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int | None = 0  # base seed; each prompt gets its own (request_seed), None = unseeded
    chat_template_kwargs: dict = field(default_factory=dict)  # e.g. {"thinking": False} (Kimi-K2.5)
    return_token_ids: bool = False
    ignore_eos: bool = False
    # vLLM's per-chunk cumulative usage: exact token counts per chunk. Not needed (and not sent)
    # when token ids are requested, which count exactly too; off for servers that reject it.
    continuous_usage: bool = True

    @classmethod
    def from_generate_cfg(cls, generate_cfg: dict, **overrides: Any) -> SamplingSpec:
        """The sampling of the generation stage (``generate`` config section)."""
        values = {
            "max_tokens": generate_cfg["max_tokens"],
            "temperature": generate_cfg.get("temperature", 0.7),
            "top_p": generate_cfg.get("top_p", 0.95),
            "seed": generate_cfg.get("seed", 0),
            "chat_template_kwargs": dict(generate_cfg.get("chat_template_kwargs") or {}),
            # generation asks for token ids; the profile carries the same payload
            "return_token_ids": True,
        }
        values.update(overrides)
        return cls(**values)

    def workload_params(self) -> dict:
        """The parameters that change how hard the server works (for fingerprints)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "chat_template_kwargs": dict(sorted(self.chat_template_kwargs.items())),
            "ignore_eos": self.ignore_eos,
            "seeded": self.seed is not None,  # seeded sampling has its own cost in vLLM
        }

    def request_body(self, model: str, messages: list[dict], prompt_id: str = "",
                     stream: bool = True) -> dict:
        """The JSON body of ``POST /v1/chat/completions``."""
        body: dict[str, Any] = {"model": model, "messages": messages,
                                "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "top_p": self.top_p}
        if self.seed is not None:
            body["seed"] = request_seed(self.seed, prompt_id)
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            if self.continuous_usage and not self.return_token_ids:
                body["stream_options"]["continuous_usage_stats"] = True
        return body

    def create_kwargs(self, model: str, messages: list[dict], prompt_id: str = "",
                      stream: bool = False) -> dict:
        """The same request for ``openai`` ``client.chat.completions.create(**kwargs)``."""
        body = self.request_body(model, messages, prompt_id, stream)
        extra = {k: body.pop(k) for k in _VLLM_ONLY_FIELDS if k in body}
        return {**body, "extra_body": extra}


_VLLM_ONLY_FIELDS = ("chat_template_kwargs", "return_token_ids", "ignore_eos")


def request_seed(base_seed: int, prompt_id: str) -> int:
    """Per-prompt sampling seed, stable across runs (same derivation as the generation stage)."""
    digest = hashlib.sha256(f"{base_seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# ----------------------------------------------------------------------------- one streamed request


@dataclass
class RequestResult:
    """Timings (``time.perf_counter`` seconds) and output of one streamed request."""

    prompt_id: str
    start: float
    end: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens)
    # arrival time of every chunk that carries a choice (vLLM's "token chunks", see tpot_s)
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    content: str = ""
    reasoning: str = ""
    prompt_token_ids: list[int] | None = None  # kept with keep_text and return_token_ids
    output_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    status: int | None = None
    cancelled: bool = False
    # chunks read in the same network read as an earlier chunk of this stream: the client fell
    # behind the server by at least one step, and its arrival times understate the gaps
    late_chunks: int = 0

    @property
    def ok(self) -> bool:
        return self.end is not None and self.error is None and not self.cancelled

    # Latencies as ``vllm bench serve`` defines them (vllm/benchmarks/serve.py and
    # lib/endpoint_request_func.py, chat completions): every chunk that carries a choice counts
    # as an arrival, whatever number of tokens it holds (none for the role chunk, several under
    # speculative decoding or when the API server coalesces engine steps); the usage-only chunk
    # at the end does not. TTFT is the first such arrival, the request's latency the last one,
    # ITL the gaps between consecutive arrivals, and TPOT = (latency - TTFT) / (tokens - 1)
    # with the exact output token count.

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency_s(self) -> float | None:
        """Start to the last chunk carrying a choice (vLLM's request latency, E2EL)."""
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.latency_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (the decode speed one user sees)."""
        if not self.ok or not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive chunk arrivals (one per chunk after the first)."""
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def _chunk_token_increment(chunk: dict, result: RequestResult) -> int:
    """New output tokens carried by a chunk; exact with token ids or cumulative usage."""
    choices = chunk.get("choices")
    if choices and choices[0].get("token_ids") is not None:
        return len(choices[0]["token_ids"])
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        return max(usage["completion_tokens"] - result.output_tokens, 0)  # cumulative count
    if not choices:
        return 0
    delta = choices[0].get("delta") or {}
    has_text = delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content")
    return 1 if has_text else 0  # best effort without either: one token per text chunk


def _absorb_chunk(chunk: dict, result: RequestResult, now: float, keep_text: bool) -> int:
    new = _chunk_token_increment(chunk, result)
    usage = chunk.get("usage")
    if usage and usage.get("prompt_tokens") is not None:
        result.prompt_tokens = usage["prompt_tokens"]
    if new:
        result.arrivals.append((now, new))
        result.output_tokens += new
    choices = chunk.get("choices")
    if choices:
        result.chunk_times.append(now)
        choice = choices[0]
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
        if keep_text:
            delta = choice.get("delta") or {}
            result.content += delta.get("content") or ""
            result.reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
            result.output_token_ids.extend(choice.get("token_ids") or ())
    if keep_text and chunk.get("prompt_token_ids") is not None:
        result.prompt_token_ids = chunk["prompt_token_ids"]
    return new


def _sse_payloads(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data`` and pop the complete ``data:`` lines (the rest stays in ``buffer``)."""
    buffer.extend(data)
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = bytes(buffer[:end]).split(b"\n")
    del buffer[:end + 1]
    return [line[5:].strip() for line in lines if line.startswith(b"data:")]


class ChatStreamer:
    """Streaming chat completions over one aiohttp session (create inside the event loop)."""

    def __init__(self, endpoint: Endpoint, concurrency: int, timeout_s: float = 600.0):
        import aiohttp

        pool = max(concurrency, 1) + 16  # headroom for requests being cancelled at a window end
        self.endpoint = endpoint
        self.url = f"{endpoint.base_url}/chat/completions"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=pool, limit_per_host=pool),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=timeout_s),
            headers={"Authorization": f"Bearer {endpoint.api_key}"})

    async def close(self) -> None:
        await self.session.close()

    async def stream(self, prompt: Prompt, spec: SamplingSpec,
                     on_tokens: Callable[[int], None] | None = None, keep_text: bool = False,
                     result: RequestResult | None = None) -> RequestResult:
        """Send one request and time every chunk. Never raises, except when cancelled."""
        result = result or RequestResult(prompt_id=prompt.id, start=time.perf_counter())
        body = spec.request_body(self.endpoint.model, prompt.messages, prompt.id)
        try:
            # leaving the block on cancel closes the connection, and vLLM aborts the request
            async with self.session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    result.status = resp.status
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                await self._read(resp, result, on_tokens, keep_text)
            result.end = time.perf_counter()
        except asyncio.CancelledError:
            result.cancelled = True
            raise
        except Exception as exc:  # an error is a measurement, not a crash
            result.end = time.perf_counter()
            result.error = f"{type(exc).__name__}: {exc}"[:500]
        return result

    @staticmethod
    async def _read(resp: aiohttp.ClientResponse, result: RequestResult,
                    on_tokens: Callable[[int], None] | None, keep_text: bool) -> None:
        buffer = bytearray()
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            arrivals_before = len(result.arrivals)
            try:
                for payload in _sse_payloads(buffer, data):
                    if payload == b"[DONE]":
                        if not result.chunk_times:  # vLLM's benchmark counts this as a failure
                            raise RuntimeError("stream ended without a chunk carrying a choice")
                        return
                    chunk = json.loads(payload)
                    if "error" in chunk and "choices" not in chunk:  # a mid-stream error
                        raise RuntimeError(f"stream error: {str(chunk['error'])[:300]}")
                    new = _absorb_chunk(chunk, result, now, keep_text)
                    if new and on_tokens is not None:
                        on_tokens(new)
            finally:
                # token chunks beyond the first in one read were already waiting: client lag
                result.late_chunks += max(len(result.arrivals) - arrivals_before - 1, 0)
        raise RuntimeError("stream ended without [DONE]")


# ----------------------------------------------------------------------------- closed loop


def _cycled(prompts: Sequence[Prompt]):
    """The prompts over and over; from the second pass on each request gets its own id (and so
    its own seed, ``request_seed``): a closed loop never repeats a sampled request."""
    for n in itertools.count():
        for p in prompts:
            yield p if n == 0 else Prompt(id=f"{p.id}#{n}", messages=p.messages)


class _Loop:
    """Shared state of one closed-loop run: the client, the prompt cursor, every request."""

    def __init__(self, endpoint: Endpoint, prompts: Sequence[Prompt], spec: SamplingSpec,
                 concurrency: int, cycle: bool, timeout_s: float,
                 keep_text: bool = False):
        if not prompts:
            raise ValueError("load generator: no prompts given")
        self.spec = spec
        self.client = ChatStreamer(endpoint, concurrency, timeout_s)
        self._prompts = _cycled(prompts) if cycle else iter(prompts)
        self.keep_text = keep_text
        self.results: list[RequestResult] = []
        self.tokens = 0  # output tokens received so far (all requests)
        self.completed = 0  # requests finished without error
        self.finished_at: list[float] = []  # end time of each request finished without error
        self.failed = 0
        self.stopping = False

    def _count(self, n: int) -> None:
        self.tokens += n

    async def worker(self) -> None:
        consecutive_errors = 0
        while not self.stopping:
            prompt = next(self._prompts, None)
            if prompt is None or self.stopping:
                return
            result = RequestResult(prompt_id=prompt.id, start=time.perf_counter())
            self.results.append(result)
            await self.client.stream(prompt, self.spec, self._count, self.keep_text, result)
            if result.ok:
                self.completed += 1
                self.finished_at.append(result.end)
                consecutive_errors = 0
            elif not result.cancelled:
                # a refused connection fails at once: back off so errors do not spin the loop
                self.failed += 1
                consecutive_errors += 1
                await asyncio.sleep(min(2.0, 0.05 * 2 ** min(consecutive_errors, 6)))

    def finished_since(self, t0: float) -> int:
        """Requests finished without error at or after ``t0``."""
        return sum(1 for t in self.finished_at if t >= t0)

    async def close(self) -> None:
        await self.client.close()


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ----------------------------------------------------------------------------- window statistics


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict | None:
    """p50/p90/p99 and mean (linear interpolation), times ``scale``; None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    out = {}
    for p in PERCENTILES:
        rank = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(rank), math.ceil(rank)
        value = ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)
        out[f"p{p}"] = round(value * scale, 3)
    out["mean"] = round(sum(ordered) / len(ordered) * scale, 3)
    return out


def _inside(t: float | None, t0: float, t1: float) -> bool:
    return t is not None and t0 <= t < t1


def _late_fraction(results: Sequence[RequestResult]) -> float | None:
    chunks = sum(len(r.arrivals) for r in results)
    return round(sum(r.late_chunks for r in results) / chunks, 4) if chunks else None


def window_stats(results: Sequence[RequestResult], t0: float, t1: float) -> dict:
    """Throughput and latency of the window [t0, t1) from the requests' chunk timings."""
    duration = t1 - t0
    mid = t0 + duration / 2
    tokens = first_half = 0
    itl: list[float] = []
    for r in results:
        for t, n in r.arrivals:
            if t0 <= t < t1:
                tokens += n
                first_half += n if t < mid else 0
        times = r.chunk_times
        itl += [b - a for a, b in zip(times, times[1:], strict=False) if t0 <= b < t1]
    done = [r for r in results if r.ok and _inside(r.end, t0, t1)]
    failed = [r for r in results if r.error and _inside(r.end, t0, t1)]
    finish: dict[str, int] = {}
    for r in done:
        finish[str(r.finish_reason)] = finish.get(str(r.finish_reason), 0) + 1
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "window_s": round(duration, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / duration, 2),
        # throughput of the window's two halves: a large gap says the load was not steady
        "halves_tok_s": [round(first_half / (duration / 2), 2),
                         round((tokens - first_half) / (duration / 2), 2)],
        "requests_completed": len(done),
        "requests_s": round(len(done) / duration, 3),
        "errors": len(failed),
        "error_examples": sorted({r.error for r in failed})[:3],
        "ttft_ms": percentiles([r.ttft_s for r in results if r.error is None and r.chunk_times
                                and _inside(r.chunk_times[0], t0, t1)], 1e3),
        "tpot_ms": percentiles([r.tpot_s for r in done if r.tpot_s is not None], 1e3),
        "itl_ms": percentiles(itl, 1e3),
        "e2e_s": percentiles([r.e2e_s for r in done if r.e2e_s is not None]),
        # share of the window's requests' chunks the client read late (see late_chunks)
        "late_chunk_frac": _late_fraction(done),
        "mean_output_tokens": round(sum(r.output_tokens for r in done) / len(done), 1)
        if done else None,
        "mean_prompt_tokens": round(sum(prompt_tokens) / len(prompt_tokens), 1)
        if prompt_tokens else None,
        "finish_reasons": finish,
    }


# ----------------------------------------------------------------------------- Prometheus /metrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

SPEC_DECODE_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                        "vllm:spec_decode_num_accepted_tokens")
SPEC_DECODE_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# the server's own latency histograms (recorded by vLLM's API server when a request finishes;
# TPOT per request as vllm bench serve defines it): their sums and counts over a window give
# server-side means to hold the client's figures against
LATENCY_HISTOGRAMS = {"ttft_ms": "vllm:time_to_first_token_seconds",
                      "tpot_ms": "vllm:request_time_per_output_token_seconds"}
# the engine's gauges of requests running and waiting (scraped only outside a window: at its
# edges, and while a level settles before one)
RUNNING_GAUGE = "vllm:num_requests_running"
WAITING_GAUGE = "vllm:num_requests_waiting"
# seconds requests spent running (prefill + decode), summed when each finishes
RUNNING_SECONDS = "vllm:request_inference_time_seconds_sum"
WINDOW_COUNTERS = ("vllm:generation_tokens", "vllm:prompt_tokens",
                   "vllm:num_preemptions", RUNNING_SECONDS) + SPEC_DECODE_COUNTERS + tuple(
    f"{h}_{part}" for h in LATENCY_HISTOGRAMS.values() for part in ("sum", "count"))


@dataclass
class Metrics:
    """Samples of one Prometheus text exposition: name -> [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    def _series(self, name: str) -> list[tuple[dict[str, str], float]]:
        # prometheus_client exports counter "x" as "x_total"; accept either spelling
        return self.samples.get(name) or self.samples.get(f"{name}_total") or []

    def has(self, name: str) -> bool:
        return bool(self._series(name))

    def total(self, name: str, **match: str) -> float:
        """Sum over every label set that matches ``match`` (e.g. all engines)."""
        return sum(v for labels, v in self._series(name)
                   if all(labels.get(k) == val for k, val in match.items()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Sum grouped by one label's value, e.g. ``position`` of the per-position counter."""
        out: dict[str, float] = {}
        for labels, v in self._series(name):
            if label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out


def parse_metrics(text: str) -> Metrics:
    """Parse Prometheus text format (comments and ``_created`` timestamps skipped)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1).endswith("_created"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        samples.setdefault(m.group(1), []).append((labels, value))
    return Metrics(samples)


def fetch_metrics(root_url: str, timeout_s: float = 10.0) -> Metrics:
    """GET ``<root_url>/metrics`` of a vLLM server (root URL, without /v1)."""
    with urllib.request.urlopen(f"{root_url.rstrip('/')}/metrics", timeout=timeout_s) as resp:
        return parse_metrics(resp.read().decode())


async def fetch_metrics_async(http: aiohttp.ClientSession, root_url: str) -> Metrics | None:
    import aiohttp

    try:
        async with http.get(f"{root_url.rstrip('/')}/metrics") as resp:
            resp.raise_for_status()
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return None  # metrics are a cross-check; their absence must not stop a measurement
    return parse_metrics(text)


def counter_deltas(before: Metrics, after: Metrics,
                   names: Sequence[str] = WINDOW_COUNTERS) -> dict:
    """Counter increases between two scrapes (only counters the server exports)."""
    out: dict[str, Any] = {}
    for name in names:
        if after.has(name):
            out[name] = after.total(name) - before.total(name)
    per_pos_after = after.by_label(SPEC_DECODE_PER_POS, "position")
    if per_pos_after:
        per_pos_before = before.by_label(SPEC_DECODE_PER_POS, "position")
        out[SPEC_DECODE_PER_POS] = {
            pos: per_pos_after[pos] - per_pos_before.get(pos, 0.0)
            for pos in sorted(per_pos_after, key=int)}
    return out


def server_latency_means(deltas: dict) -> dict:
    """Mean TTFT and TPOT in ms of the requests the server finished between two scrapes."""
    out = {}
    for key, histogram in LATENCY_HISTOGRAMS.items():
        count = deltas.get(f"{histogram}_count")
        if count:
            out[key] = round(deltas[f"{histogram}_sum"] / count * 1e3, 3)
    return out


def server_healthy(root_url: str, timeout_s: float = 10.0) -> bool:
    """``GET /health`` answers 200 (vLLM answers 5xx once its engine has died)."""
    try:
        with urllib.request.urlopen(f"{root_url.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def acceptance_length(deltas: dict) -> float | None:
    """Mean acceptance length 1 + accepted / drafts, pooled over the window."""
    drafts = deltas.get("vllm:spec_decode_num_drafts")
    if not drafts:
        return None
    return 1.0 + deltas.get("vllm:spec_decode_num_accepted_tokens", 0.0) / drafts


# ----------------------------------------------------------------------------- window rules


def server_load(metrics: Metrics | None) -> tuple[float, float] | None:
    """(running, waiting) from the engine's gauges; None when the server exports none."""
    if metrics is None or not metrics.has(RUNNING_GAUGE):
        return None
    return metrics.total(RUNNING_GAUGE), metrics.total(WAITING_GAUGE)


def is_drained(load: tuple[float, float] | None) -> bool:
    """Nothing running or waiting at the server: the previous level's requests are gone."""
    return load is not None and load[0] == 0 and load[1] == 0


def is_settled(load: tuple[float, float] | None, concurrency: int) -> bool:
    """Exactly ``concurrency`` requests running and none waiting: this level's own requests,
    all of them scheduled, and no earlier request left."""
    return load is not None and load[0] == concurrency and load[1] == 0


def window_may_close(elapsed_s: float, finished: int, measure_s: float, min_finished: int,
                     max_measure_s: float | None = None) -> bool:
    """A window lasts at least ``measure_s`` and until ``min_finished`` requests finished in
    it; ``max_measure_s`` closes it whatever has finished (the caller then sees too few)."""
    if max_measure_s is not None and elapsed_s >= max_measure_s:
        return True
    return elapsed_s >= measure_s and finished >= min_finished


def in_flight_mean(results: Sequence[RequestResult], t0: float, t1: float) -> float | None:
    """Mean requests in flight over [t0, t1): each request's span (start to end, or to t1 while
    open) clipped to the window, summed, per second. A closed loop of C slots never has more
    than C requests open, so this cannot exceed C."""
    if t1 <= t0:
        return None
    busy = 0.0
    for r in results:
        end = r.end if r.end is not None else t1
        busy += max(0.0, min(end, t1) - max(r.start, t0))
    return round(busy / (t1 - t0), 3)


def _load_text(load: tuple[float, float] | None) -> str:
    return ("no vllm:num_requests_running in its /metrics" if load is None
            else f"{load[0]:g} running, {load[1]:g} waiting")


async def _await_load(http: aiohttp.ClientSession, root_url: str, ready: Callable, limit_s: float,
                      interval_s: float = 0.5) -> tuple[bool, tuple[float, float] | None, float]:
    """Poll the engine's gauges until ``ready(load)`` or ``limit_s``: (ready, last load, s)."""
    t_start = time.perf_counter()
    while True:
        load = server_load(await fetch_metrics_async(http, root_url))
        waited = time.perf_counter() - t_start
        if ready(load):
            return True, load, waited
        if load is None or waited >= limit_s:
            return False, load, waited
        await asyncio.sleep(interval_s)


# ----------------------------------------------------------------------------- public runs


@dataclass
class WindowResult:
    """One closed-loop level: settings, the window's statistics, server cross-checks."""

    concurrency: int
    warmup_s: float
    stats: dict
    server: dict
    client_cpu_frac: float  # client process CPU seconds per wall second in the window
    requests_started: int
    results: list[RequestResult] = field(repr=False, default_factory=list)
    # why the window was not opened (the level never settled, ``settle_s``); None when it was
    unsettled: str | None = None

    def to_row(self) -> dict:
        return {"concurrency": self.concurrency, **self.stats,
                "warmup_s": round(self.warmup_s, 2), "requests_started": self.requests_started,
                "client_cpu_frac": round(self.client_cpu_frac, 3), "server": self.server}


def _metrics_session() -> aiohttp.ClientSession:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0))


async def _wait_warm(loop: _Loop, t_start: float, warmup_s: float, min_completions: int,
                     max_warmup_s: float, concurrency: int) -> None:
    while True:
        elapsed = time.perf_counter() - t_start
        if elapsed >= max_warmup_s:
            return
        if elapsed >= warmup_s and (loop.completed >= min_completions
                                    # a failing level never turns over: measure the failure
                                    or loop.failed >= concurrency):
            return
        await asyncio.sleep(0.05)


def running_mean(deltas: dict, window_s: float) -> float | None:
    """Mean requests running at the server over a window, by Little's law from its own counter
    of running seconds: the request-seconds of the requests it finished, per second.

    Two scrapes, none in between: ``/metrics`` is served by the API server's event loop, the
    one that writes the streams, and polling it during a window (as the running gauge needs)
    made whole answers arrive in one burst at C=1 on a 2-core host (polled at 4 Hz, 13 of 40
    answers against 5 of 40 unpolled). Like the gauge, the counter holds prefill and decode,
    not queueing. In a closed loop the requests running across either edge of the window
    balance out; a window of many request lengths keeps that error small.
    """
    busy = deltas.get(RUNNING_SECONDS)
    return None if busy is None or window_s <= 0 else round(busy / window_s, 2)


async def measure_window_async(endpoint: Endpoint, prompts: Sequence[Prompt], spec: SamplingSpec,
                               concurrency: int, warmup_s: float, measure_s: float, *,
                               warmup_turnover: float = 0.0, max_warmup_s: float | None = None,
                               server_metrics: bool = True, timeout_s: float = 600.0,
                               progress: Callable[[int], None] | None = None,
                               min_finished: int = 0, max_measure_s: float | None = None,
                               settle_s: float | None = None) -> WindowResult:
    """Closed loop at ``concurrency``; warm up, then measure ``measure_s`` seconds.

    The warm-up lasts ``warmup_s`` and, with ``warmup_turnover`` > 0, until that many requests
    per slot have completed (bounded by ``max_warmup_s``): a window that starts right after all
    requests were sent together sees only short contexts and no request churn, and overstates
    what hours of sustained generation achieve.

    With ``min_finished`` the window also lasts until that many requests finished inside it
    (a slow model's answer can outlast ``measure_s``), closed at ``max_measure_s`` whatever
    has finished. With ``settle_s`` the level must settle (the deployment benchmark's rule):
    before the first request the server must have drained (nothing running or waiting: an
    earlier level's requests are gone), and after the warm-up the window opens only once the
    engine's gauges show exactly ``concurrency`` running and none waiting; each wait is
    bounded by ``settle_s``, and a level that does not settle is returned ``unsettled``
    (reason given, nothing measured).
    """
    loop = _Loop(endpoint, prompts, spec, concurrency, cycle=True, timeout_s=timeout_s)
    helpers: list[asyncio.Task] = []
    server: dict[str, Any] = {}
    workers: list[asyncio.Task] = []
    unsettled = None
    async with _metrics_session() as http:
        try:
            if settle_s is not None:
                unsettled = await _drain(http, endpoint.root_url, settle_s, server)
            t_start = time.perf_counter()
            if unsettled is None:
                workers = [asyncio.create_task(loop.worker()) for _ in range(concurrency)]
                if progress is not None:
                    helpers.append(asyncio.create_task(_report_progress(loop, progress)))
                await _wait_warm(loop, t_start, warmup_s, math.ceil(warmup_turnover * concurrency),
                                 max_warmup_s if max_warmup_s is not None else math.inf,
                                 concurrency)
            if unsettled is None and settle_s is not None:
                unsettled = await _settle(http, endpoint.root_url, concurrency, settle_s, server)
            if unsettled is not None:
                t0 = t1 = time.perf_counter()
                cpu0 = cpu1 = time.process_time()
                before = after = None
            else:
                before = (await fetch_metrics_async(http, endpoint.root_url)
                          if server_metrics else None)
                t0, cpu0 = time.perf_counter(), time.process_time()
                await _hold_window(loop, t0, measure_s, min_finished, max_measure_s)
                t1, cpu1 = time.perf_counter(), time.process_time()
                after = (await fetch_metrics_async(http, endpoint.root_url)
                         if server_metrics else None)
        finally:
            loop.stopping = True
            await _cancel(helpers + workers)
            await loop.close()
    if before is not None and after is not None:
        deltas = counter_deltas(before, after)
        server["counters"] = deltas
        if "vllm:generation_tokens" in deltas:
            server["output_tok_s"] = round(deltas["vllm:generation_tokens"] / (t1 - t0), 2)
        running = running_mean(deltas, t1 - t0)
        if running is not None:
            server["num_requests_running_mean"] = running
        for edge, metrics in (("open", before), ("close", after)):
            load = server_load(metrics)
            if load is not None:
                server[f"running_at_{edge}"], server[f"waiting_at_{edge}"] = load
    server["in_flight_mean"] = in_flight_mean(loop.results, t0, t1)
    return WindowResult(
        concurrency=concurrency, warmup_s=t0 - t_start,
        stats=window_stats(loop.results, t0, max(t1, t0 + 1e-6)),
        server=server, client_cpu_frac=(cpu1 - cpu0) / max(t1 - t0, 1e-6),
        requests_started=len(loop.results), results=loop.results, unsettled=unsettled)


async def _drain(http: aiohttp.ClientSession, root_url: str, limit_s: float,
                 server: dict) -> str | None:
    """Wait for an idle server (an earlier level's requests gone); the reason when it is not."""
    ok, load, waited = await _await_load(http, root_url, is_drained, limit_s)
    server["drain_s"] = round(waited, 2)
    if ok:
        return None
    return (f"the server did not drain before the level started ({_load_text(load)} after "
            f"{waited:.0f} s): requests of an earlier level or of another client were still "
            "there")


async def _settle(http: aiohttp.ClientSession, root_url: str, concurrency: int, limit_s: float,
                  server: dict) -> str | None:
    """Wait until the engine runs exactly this level's requests; the reason when it does not."""
    ok, load, waited = await _await_load(http, root_url,
                                         lambda load: is_settled(load, concurrency), limit_s)
    server["settle_s"] = round(waited, 2)
    if ok:
        return None
    return (f"the level did not settle: the server never ran exactly {concurrency} requests "
            f"with none waiting within {waited:.0f} s after the warm-up (last seen: "
            f"{_load_text(load)})")


async def _hold_window(loop: _Loop, t0: float, measure_s: float, min_finished: int,
                       max_measure_s: float | None) -> None:
    """Keep the window open until ``window_may_close``."""
    await asyncio.sleep(min(measure_s, max_measure_s or math.inf))
    while not window_may_close(time.perf_counter() - t0, loop.finished_since(t0), measure_s,
                               min_finished, max_measure_s):
        await asyncio.sleep(0.1)


async def _report_progress(loop: _Loop, progress: Callable[[int], None]) -> None:
    reported = 0
    while True:
        await asyncio.sleep(0.5)
        progress(loop.tokens - reported)
        reported = loop.tokens


def measure_window(*args, **kwargs) -> WindowResult:
    """Synchronous ``measure_window_async`` (for scripts and Snakemake jobs)."""
    return asyncio.run(measure_window_async(*args, **kwargs))


@dataclass
class RunResult:
    """Every prompt sent once: per-request results plus whole-run statistics."""

    concurrency: int
    stats: dict
    server: dict
    results: list[RequestResult] = field(repr=False, default_factory=list)


async def run_requests_async(endpoint: Endpoint, prompts: Sequence[Prompt], spec: SamplingSpec,
                             concurrency: int, *, keep_text: bool = False,
                             server_metrics: bool = True, timeout_s: float = 600.0,
                             progress: Callable[[int], None] | None = None) -> RunResult:
    """Send each prompt exactly once, ``concurrency`` in flight; statistics over the whole run."""
    loop = _Loop(endpoint, prompts, spec, concurrency, cycle=False,
                 timeout_s=timeout_s, keep_text=keep_text)
    server: dict[str, Any] = {}
    async with _metrics_session() as http:
        before = await fetch_metrics_async(http, endpoint.root_url) if server_metrics else None
        t0 = time.perf_counter()
        helper = asyncio.create_task(_report_progress(loop, progress)) if progress else None
        try:
            await asyncio.gather(*(loop.worker() for _ in range(concurrency)))
        finally:
            if helper is not None:
                await _cancel([helper])
            await loop.close()
        t1 = time.perf_counter()
        after = await fetch_metrics_async(http, endpoint.root_url) if server_metrics else None
    if before is not None and after is not None:
        server["counters"] = counter_deltas(before, after)
    return RunResult(concurrency=concurrency, stats=window_stats(loop.results, t0, t1 + 1e-9),
                     server=server, results=loop.results)


def run_requests(*args, **kwargs) -> RunResult:
    """Synchronous ``run_requests_async``."""
    return asyncio.run(run_requests_async(*args, **kwargs))


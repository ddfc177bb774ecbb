"""Synthetic responses: every prompt answered exactly once by the served target.

Kept whole (about 790 lines): one stage read in order (settings, endpoint pool, shard run,
resume, summary); each part is used only here.

One shard job = a fixed pool of worker coroutines (never one task per prompt) over the
official ``AsyncOpenAI`` client. Each request holds a machine-wide slot (``SlotPool``) so that
shard jobs running side by side share the chosen concurrency and keep the server full.

Durability: results are appended and flushed to ``<out_dir>/.partial/shard-{i}.jsonl`` as they
arrive (Snakemake deletes declared outputs of failed jobs; the partial file survives). Every
kept record carries the ``fingerprint`` of what determined its answer (target, served name,
sampling settings, chat template kwargs, multi_turn, the prompt's messages). A rerun keeps
only records with the current fingerprint (the others are discarded and counted as
``discarded_stale``), takes valid answers for its ids from any shard's kept file (so a changed
shard assignment loses nothing), drops a torn last line, and only asks for the rest. At the end
the shard is written once, sorted in prompt order, by atomic rename.

What the server shows: each shard job samples every endpoint's Prometheus ``/metrics``
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:generation_tokens``)
while it runs (``ServerSampler``); the shard summary reports the server-side mean running
requests against the chosen concurrency and the server-side output tok/s, and keeps a compact
timeline; ``stage_summary`` merges the shards' timelines into one stage view (and a plot).
``client_slot_utilization`` is the client-side figure: slots held, not server work.

Failures (``failure_kind``): a refused connection sets the endpoint aside for a few seconds
and costs the prompt nothing; a timeout, a dropped connection, a retryable status or an
unparseable body costs one retry (backoff with jitter); what another try would repeat goes to
the errors file at once. When nothing has succeeded for ``endpoint_down_timeout_s`` while
requests kept failing, the shard stops with ``EndpointsDown``. The summary counts retries by kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from tqdm import tqdm

from draftline.atomic import disk_full_names, write_json, write_jsonl
from draftline.generation_report import server_view
from draftline.hub import hub_revision
from draftline.loadgen import parse_metrics, request_seed
from draftline.machine import serving_machine
from draftline.profile import resolve_concurrency
from draftline.records import Prompt, read_shard
from draftline.server import Endpoint, served_version
from draftline.slots import SlotPool

RETRYABLE_STATUS = {408, 409, 429}


class EndpointsDown(RuntimeError):
    """No endpoint answered for too long; partial results are kept for the rerun."""


@dataclass(frozen=True)
class GenerateSettings:
    concurrency: int
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 2048
    seed: int = 0
    chat_template_kwargs: dict = field(default_factory=dict)
    multi_turn: bool = False
    max_retries: int = 6
    request_timeout_s: float = 600.0
    endpoint_down_timeout_s: float = 300.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0

    @classmethod
    def from_config(cls, gen_cfg: dict, concurrency: int) -> GenerateSettings:
        keys = ("temperature", "top_p", "max_tokens", "seed", "chat_template_kwargs",
                "multi_turn", "max_retries", "request_timeout_s", "endpoint_down_timeout_s")
        return cls(concurrency=concurrency, **{k: gen_cfg[k] for k in keys if k in gen_cfg})


# ----------------------------------------------------------------------------- fingerprints

# Small files that define the target: architecture, generation defaults, tokenizer, template.
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer_config.json",
                "tokenizer.json", "chat_template.jinja", "chat_template.json",
                "model.safetensors.index.json", "pytorch_model.bin.index.json")
# Weights up to this size are hashed whole (a retrained toy keeps its config); larger ones are
# identified by their index, names and sizes (hashing 595 GB would take an hour).
HASH_WEIGHTS_UP_TO = 256 << 20


def _sha256(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def target_identity(model: str, revision: str | None = None) -> dict:
    """What identifies the target: its path or hub id, the revision and, for a local directory,
    a hash of its config, tokenizer and weights index (small weights: their content)."""
    identity = {"model": str(model), "revision": revision}
    path = Path(model)
    if not path.is_dir():
        return identity  # a hub id: the revision pins it
    parts = [f"{name}\0".encode() + (path / name).read_bytes()
             for name in TARGET_FILES if (path / name).is_file()]
    weights = sorted(p for p in path.iterdir()
                     if p.is_file() and p.suffix in (".safetensors", ".bin"))
    sizes = [p.stat().st_size for p in weights]
    whole = sum(sizes) <= HASH_WEIGHTS_UP_TO
    for weight, size in zip(weights, sizes, strict=True):
        parts.append(f"{weight.name}\0{size}\0".encode() + (weight.read_bytes() if whole else b""))
    identity["files_sha256"] = _sha256(*parts)
    return identity


def settings_fingerprint(settings: GenerateSettings, served_model: str, target: dict) -> str:
    """Everything but the prompt that determines an answer (not concurrency, retries, ...)."""
    answer_settings = {
        "target": target,
        "served_model": served_model,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "max_tokens": settings.max_tokens,
        "seed": settings.seed,
        "chat_template_kwargs": settings.chat_template_kwargs,
        "multi_turn": settings.multi_turn,
    }
    return _sha256(json.dumps(answer_settings, sort_keys=True).encode())


def record_fingerprint(settings_fp: str, messages: list[dict]) -> str:
    """The fingerprint a kept answer to ``messages`` must carry to be reused."""
    return _sha256(settings_fp.encode(),
                   json.dumps(messages, sort_keys=True, ensure_ascii=False).encode())[:32]


def request_kwargs(messages: list[dict], settings: GenerateSettings, prompt_id: str,
                   model: str) -> dict:
    extra: dict = {"return_token_ids": True}
    if settings.chat_template_kwargs:
        extra["chat_template_kwargs"] = settings.chat_template_kwargs
    return {
        "model": model,
        "messages": messages,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "max_tokens": settings.max_tokens,
        "seed": request_seed(settings.seed, prompt_id),  # as the profile and benchmark seed
        "extra_body": extra,
    }


def parse_completion(resp) -> dict:
    """The fields we keep from a vLLM chat completion (reasoning under either name)."""
    choice = resp.choices[0]
    message = choice.message
    extra_msg = message.model_extra or {}
    reasoning = extra_msg.get("reasoning") or extra_msg.get("reasoning_content")
    return {
        "reasoning": reasoning,
        "content": message.content,
        "finish_reason": choice.finish_reason,
        "prompt_token_ids": (resp.model_extra or {}).get("prompt_token_ids"),
        "output_token_ids": (choice.model_extra or {}).get("token_ids"),
        "usage": resp.usage.model_dump() if resp.usage else None,
    }


def assistant_message(parsed: dict) -> dict:
    """The assistant turn as the chat template renders it (reasoning in its own field)."""
    return {"role": "assistant", "content": parsed["content"] or "",
            "reasoning_content": parsed["reasoning"]}


def failure_kind(exc: BaseException) -> str:
    """What went wrong with one request, for the retry policy and the counts.

    ``refused``: no connection (the endpoint is down, not the prompt's fault); ``timeout``: no
    answer within the request timeout; ``disconnect``: the connection dropped before the
    whole response arrived (reset, truncated body); ``status``: a retryable HTTP status
    (408/409/429/5xx); ``invalid``: a complete response that does not parse; ``final``: an
    error that another try would repeat (400: prompt too long, ...).
    """
    cause = exc.__cause__ or exc
    if isinstance(exc, openai.APITimeoutError) or isinstance(cause, httpx.TimeoutException):
        return "timeout"
    if isinstance(cause, httpx.ConnectError):
        return "refused"
    if isinstance(exc, openai.APIConnectionError) or isinstance(cause, httpx.TransportError):
        return "disconnect"
    if isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        return "status" if code in RETRYABLE_STATUS or code >= 500 else "final"
    if isinstance(exc, openai.APIResponseValidationError | json.JSONDecodeError |
                  httpx.DecodingError):
        return "invalid"
    return "final"


def backoff_delay(attempt: int, settings: GenerateSettings, rng: random.Random) -> float:
    """Exponential backoff with full-range jitter in [d/2, d]."""
    delay = min(settings.backoff_cap_s, settings.backoff_base_s * 2**attempt)
    return delay * (0.5 + 0.5 * rng.random())


# ----------------------------------------------------------------------------- endpoints


class EndpointPool:
    """Least-in-flight balancing; an endpoint that fails to connect is set aside for a while.

    Each endpoint gets several clients of at most ``CONNECTIONS_PER_CLIENT`` connections, and a
    request goes to its endpoint's least busy one: httpx's connection pool scans every
    connection on every request event, so one pool of C connections costs O(C) per event;
    measured at C=64 on 2 busy cores it took 20 ms of client CPU per request (the server sat
    idle waiting for the client) against under 5 ms with pools of 8.
    """

    COOLDOWN_S = 5.0
    CONNECTIONS_PER_CLIENT = 8

    def __init__(self, endpoints: list[Endpoint], timeout_s: float, max_connections: int):
        per_endpoint = -(-max_connections // self.CONNECTIONS_PER_CLIENT)
        size = -(-max_connections // per_endpoint)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self.endpoints = endpoints
        self.clients = [
            [openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0,
                                timeout=timeout_s,
                                http_client=httpx.AsyncClient(limits=limits, timeout=timeout_s))
             for _ in range(per_endpoint)]
            for ep in endpoints
        ]
        self.client_in_flight = [[0] * per_endpoint for _ in endpoints]
        self.in_flight = [0] * len(endpoints)
        self.down_until = [0.0] * len(endpoints)
        self.sent = [0] * len(endpoints)
        # Since when no request has succeeded while connections kept failing (None: healthy).
        self.failing_since: float | None = None

    def client(self, index: int) -> int:
        """The endpoint's least busy client (never over its connection limit: the slots
        keep the endpoint's total at most C, and the least busy has at most C / clients)."""
        loads = self.client_in_flight[index]
        return loads.index(min(loads))

    def pick(self) -> int | None:
        now = time.monotonic()
        healthy = [i for i in range(len(self.endpoints)) if self.down_until[i] <= now]
        if not healthy:
            return None
        return min(healthy, key=lambda i: (self.in_flight[i], self.sent[i]))

    def set_aside(self, i: int) -> None:
        self.down_until[i] = time.monotonic() + self.COOLDOWN_S
        self.failed()

    def failed(self) -> None:
        """A request got no answer (refused, timed out, dropped): start the down clock."""
        self.failing_since = self.failing_since or time.monotonic()

    def succeeded(self) -> None:
        self.failing_since = None

    def down_for(self) -> float:
        return 0.0 if self.failing_since is None else time.monotonic() - self.failing_since

    async def close(self) -> None:
        for clients in self.clients:
            for client in clients:
                await client.close()


# ----------------------------------------------------------------------------- durable results


def read_jsonl_ids(path: Path, cut_torn: bool = True) -> dict[str, dict]:
    """Records of a JSONL file by id; a torn last line (killed writer) is ignored and, with
    ``cut_torn``, cut off the file (never on a file another job may be appending to)."""
    records: dict[str, dict] = {}
    if not path.exists():
        return records
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data) and cut_torn:
        with open(path, "r+b") as fh:
            fh.truncate(keep)
    for line in data[:keep].splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["id"]] = rec
    return records


class AppendLog:
    """Append-and-flush JSONL writer: every finished record survives a kill.

    A write cut short (full disk, kill) leaves at most a torn last line, which the next
    ``read_jsonl_ids`` drops: a record counts only when its line is complete.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fh = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        with disk_full_names(self.path):
            self.fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.fh.flush()

    def close(self) -> None:
        # Every complete record was flushed by write(); what a failed write left buffered is
        # a torn line at most, so a close that cannot flush it loses nothing.
        with contextlib.suppress(OSError):
            os.fsync(self.fh.fileno())
        with contextlib.suppress(OSError):
            self.fh.close()


# ----------------------------------------------------------------------------- the shard run


@dataclass
class ShardStats:
    total: int = 0
    done: int = 0
    errors: int = 0
    retries: int = 0
    retries_by_kind: dict = field(default_factory=dict)  # failure_kind -> retries it caused
    set_asides: int = 0  # refused connections: the endpoint rested, no retry spent
    prompt_tokens: int = 0
    output_tokens: int = 0
    slot_area: float = 0.0  # integral of machine-wide client slots held over the fill phase
    fill_seconds: float = 0.0
    latencies: list = field(default_factory=list)  # seconds, answered requests of this run
    t_first_request: float | None = None  # wall clock (time.time())
    t_queue_empty: float | None = None  # the last prompt of this shard was handed out
    t_end: float | None = None


SERVER_SAMPLE_EVERY_S = 0.25
SERVER_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:generation_tokens")


class ServerSampler:
    """The servers' own view, sampled from ``/metrics``: requests running and waiting (gauges,
    summed over endpoints and engines) and generated tokens (counter), with this job's count
    of completed requests, stamped with wall-clock time so shard jobs line up.

    It samples from its own thread: an event loop busy with a burst of answers would otherwise
    leave gaps in exactly the moments worth seeing.
    """

    def __init__(self, endpoints: list[Endpoint], completed: Callable[[], int],
                 every_s: float = SERVER_SAMPLE_EVERY_S):
        self.endpoints = endpoints
        self.completed = completed
        self.every_s = every_s
        self.rows: list[list[float]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _scrape(self, http: httpx.Client, ep: Endpoint):
        try:
            resp = http.get(f"{ep.root_url}/metrics",
                            headers={"Authorization": f"Bearer {ep.api_key}"})
            resp.raise_for_status()
        except httpx.HTTPError:
            return None  # the servers' view is a report, never a reason to stop generating
        return parse_metrics(resp.text)

    def sample(self, http: httpx.Client) -> None:
        sent = time.time()
        scraped = [self._scrape(http, ep) for ep in self.endpoints]
        if any(m is None or not m.has("vllm:num_requests_running") for m in scraped):
            self.failures += 1
            return
        gauges = [sum(m.total(name) for m in scraped) for name in SERVER_SERIES]
        # stamped halfway between asking and parsing: the server answered about then
        self.rows.append([(sent + time.time()) / 2, *gauges, self.completed()])

    def _loop(self, http: httpx.Client) -> None:
        try:
            while not self._stop.wait(self.every_s):
                self.sample(http)
            self.sample(http)  # the state at the end
        finally:
            http.close()

    def start(self) -> None:
        """One sample now (before the first request), then every ``every_s`` in a thread."""
        http = httpx.Client(timeout=5.0)
        self.sample(http)
        self._thread = threading.Thread(target=self._loop, args=(http,), daemon=True,
                                        name="server-sampler")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15.0)


class ShardRun:
    def __init__(self, prompts: Iterable[Prompt], fingerprints: dict[str, str],
                 endpoints: list[Endpoint], settings: GenerateSettings, slots: SlotPool,
                 results: AppendLog, errors: AppendLog, seed: int = 0):
        self.queue = iter(prompts)
        self.fingerprints = fingerprints
        self.settings = settings
        self.slots = slots
        self.pool = EndpointPool(endpoints, settings.request_timeout_s, slots.size)
        self.results = results
        self.errors = errors
        self.stats = ShardStats()
        self.rng = random.Random(seed)
        self.queue_empty = False
        self.bar: tqdm | None = None

    async def run(self, total: int) -> ShardStats:
        self.bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True,
                        mininterval=1.0)
        self.server = ServerSampler(self.pool.endpoints, lambda: self.stats.done)
        self.server.start()
        samplers = [asyncio.create_task(self._sample_slots())]
        t0 = time.monotonic()
        workers = [asyncio.create_task(self._worker()) for _ in range(self.slots.size)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in [*samplers, *workers]:
                task.cancel()
            await asyncio.gather(*samplers, *workers, return_exceptions=True)
            self.stats.t_end = time.time()
            self.server.stop()
            await self.pool.close()
            self.bar.close()
        self.stats.duration_s = time.monotonic() - t0
        return self.stats

    async def _sample_slots(self, every_s: float = 0.1) -> None:
        """Client slots held machine-wide over the fill phase (until this shard's queue is
        empty): what the clients asked for, not what the server ran."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            if not self.queue_empty:
                self.stats.slot_area += self.slots.held_anywhere() * (now - last)
                self.stats.fill_seconds += now - last
            last = now

    async def _worker(self) -> None:
        for item in self.queue:
            await self._answer(item)
        if not self.queue_empty:
            self.queue_empty = True
            self.stats.t_queue_empty = time.time()

    async def _answer(self, item: Prompt) -> None:
        messages = item.messages
        if self.settings.multi_turn:
            messages = await self._regenerate_history(item, messages)
            if messages is None:
                return
        outcome = await self._complete(item.id, messages)
        if outcome is None:
            return
        parsed, latency, endpoint = outcome
        self._record(item, messages, parsed, latency, endpoint)

    async def _regenerate_history(self, item: Prompt, messages: list[dict]) -> list[dict] | None:
        """Regenerate every earlier assistant turn in order, feeding the new history back."""
        history: list[dict] = []
        for msg in messages[:-1]:
            if msg["role"] != "assistant":
                history.append(msg)
                continue
            outcome = await self._complete(item.id, history)
            if outcome is None:
                return None
            history.append(assistant_message(outcome[0]))
        return history + [messages[-1]]

    def _record(self, item: Prompt, messages: list[dict], parsed: dict, latency: float,
                endpoint: str) -> None:
        record = {
            "id": item.id,
            "messages": messages + [assistant_message(parsed)],
            "prompt_token_ids": parsed["prompt_token_ids"],
            "output_token_ids": parsed["output_token_ids"],
            "finish_reason": parsed["finish_reason"],
            "usage": parsed["usage"],
            "latency_s": round(latency, 4),
            "endpoint": endpoint,
            "fingerprint": self.fingerprints[item.id],
        }
        self.results.write(record)
        self.stats.done += 1
        self.stats.latencies.append(latency)
        usage = parsed["usage"] or {}
        self.stats.prompt_tokens += usage.get("prompt_tokens", 0)
        self.stats.output_tokens += usage.get("completion_tokens", 0)
        self._progress()

    def _progress(self) -> None:
        elapsed = max(self.bar.format_dict["elapsed"], 1e-6)
        self.bar.set_postfix(tok_s=f"{self.stats.output_tokens / elapsed:.0f}",
                             slots=self.slots.held_here, retries=self.stats.retries,
                             errors=self.stats.errors, refresh=False)
        self.bar.update(1)

    async def _complete(self, prompt_id: str, messages: list[dict]):
        """One chat completion with retries; None when it ended in the errors file."""
        attempt = 0
        while True:
            index = await self._endpoint()
            endpoint = self.pool.endpoints[index]
            kwargs = request_kwargs(messages, self.settings, prompt_id, endpoint.model)
            async with self.slots.slot():
                client = self.pool.client(index)
                self.pool.client_in_flight[index][client] += 1
                self.pool.in_flight[index] += 1
                self.pool.sent[index] += 1
                t0 = time.monotonic()
                self.stats.t_first_request = self.stats.t_first_request or time.time()
                try:
                    resp = await self.pool.clients[index][client].chat.completions.create(
                        **kwargs)
                    self.pool.succeeded()
                    return parse_completion(resp), time.monotonic() - t0, endpoint.base_url
                except Exception as exc:  # classified below; nothing is swallowed silently
                    error = exc
                finally:
                    self.pool.in_flight[index] -= 1
                    self.pool.client_in_flight[index][client] -= 1
            kind = failure_kind(error)
            if kind == "refused":
                self.pool.set_aside(index)
                self.stats.set_asides += 1
                self._check_down()
                await asyncio.sleep(backoff_delay(0, self.settings, self.rng))
                continue  # a dead endpoint is not this prompt's fault: no retry is spent
            if kind in ("timeout", "disconnect"):
                self.pool.failed()  # a hung or dying server ends in EndpointsDown
                self._check_down()
            if kind != "final" and attempt < self.settings.max_retries:
                self.stats.retries += 1
                self.stats.retries_by_kind[kind] = self.stats.retries_by_kind.get(kind, 0) + 1
                await asyncio.sleep(backoff_delay(attempt, self.settings, self.rng))
                attempt += 1
                continue
            self._fail(prompt_id, error, attempt + 1, kind)
            return None

    async def _endpoint(self) -> int:
        while True:
            index = self.pool.pick()
            if index is not None:
                return index
            self._check_down()
            await asyncio.sleep(0.5)

    def _check_down(self) -> None:
        """Stop the shard when connections have failed for too long with no success between."""
        down_for = self.pool.down_for()
        if down_for > self.settings.endpoint_down_timeout_s:
            raise EndpointsDown(
                f"no endpoint answered for {down_for:.0f}s "
                f"({', '.join(e.base_url for e in self.pool.endpoints)}); results so far "
                "are kept, rerun to resume")

    def _fail(self, prompt_id: str, error: BaseException, attempts: int, kind: str) -> None:
        status = getattr(error, "status_code", None)
        message = getattr(error, "message", None) or str(error) or type(error).__name__
        self.errors.write({"id": prompt_id, "error": f"{type(error).__name__}: {message}"[:2000],
                           "status": status, "kind": kind, "retryable": kind != "final",
                           "attempts": attempts, "fingerprint": self.fingerprints[prompt_id]})
        self.stats.errors += 1
        self._progress()


def partial_paths(out_file: Path) -> tuple[Path, Path]:
    partial = out_file.parent / ".partial"
    stem = out_file.name.removesuffix(".jsonl")
    return partial / f"{stem}.jsonl", partial / f"{stem}.errors.jsonl"


def prompt_fingerprints(prompts: list[Prompt], settings: GenerateSettings,
                        endpoints: list[Endpoint], target: dict) -> dict[str, str]:
    """The fingerprint each prompt's kept answer must carry."""
    served = sorted({ep.model for ep in endpoints})
    settings_fp = settings_fingerprint(settings, ",".join(served), target)
    return {p.id: record_fingerprint(settings_fp, p.messages) for p in prompts}


@dataclass
class Resumed:
    records: dict[str, dict]  # valid answers for this shard's ids
    errors: dict[str, dict]  # valid final errors for this shard's ids
    discarded_stale: int  # kept records for this shard's ids made under other settings
    adopted: int  # valid answers found in another shard's kept file


def _valid(records: dict[str, dict], fingerprints: dict[str, str]) -> dict[str, dict]:
    return {k: r for k, r in records.items() if r.get("fingerprint") == fingerprints.get(k)}


def resume_shard(partial: Path, partial_errors: Path,
                 fingerprints: dict[str, str]) -> Resumed:
    """What an earlier run left that is still valid, and rewrite the kept files to hold it.

    A record counts only under the current fingerprint. Answers for this shard's ids are also
    taken from the other shards' kept files (the shard assignment may have changed); records
    for ids this shard no longer owns stay in its file for the shard that does.
    """
    own = read_jsonl_ids(partial)
    records = _valid(own, fingerprints)
    discarded = sum(1 for k in own if k in fingerprints and k not in records)
    adopted = 0
    for other in sorted(partial.parent.glob("*.jsonl")):
        if other == partial or other.name.endswith(".errors.jsonl"):
            continue
        found = _valid(read_jsonl_ids(other, cut_torn=False), fingerprints)
        new = {k: r for k, r in found.items() if k not in records}
        records.update(new)
        adopted += len(new)
    foreign = {k: r for k, r in own.items() if k not in fingerprints}
    if discarded or adopted:
        write_jsonl(partial, [*records.values(), *foreign.values()])
    # Final errors (e.g. 400: prompt too long) stay; retryable ones get another chance.
    errors = {k: e for k, e in _valid(read_jsonl_ids(partial_errors), fingerprints).items()
              if not e.get("retryable") and k not in records}
    write_jsonl(partial_errors, errors.values())
    return Resumed(records, errors, discarded, adopted)


def generate_shard(prompt_file: Path, out_file: Path, errors_file: Path, summary_file: Path,
                   endpoints: list[Endpoint], settings: GenerateSettings, slot_dir: Path,
                   target_dir: str | None = None, target: dict | None = None,
                   job_start: float | None = None, machine: dict | None = None) -> dict:
    """Answer every prompt of a shard once; resume from valid kept results; write the summary.

    ``target`` identifies the served target (``target_identity``); by default that of
    ``target_dir``, the target's directory. (The render check of the answers runs in the
    stage summary, ``draftline.generation_report``: off the shard jobs' critical path.)
    ``job_start`` (wall clock) is when the job began, for the start-up time in the summary
    (default: now). ``machine`` is what served the requests (``serving_machine``), recorded in
    the summary: the vLLM release and GPUs shape the answers.
    """
    job_start = time.time() if job_start is None else job_start
    prompts = read_shard(prompt_file)
    if target is None:
        target = target_identity(target_dir) if target_dir else {}
    fingerprints = prompt_fingerprints(prompts, settings, endpoints, target)
    partial, partial_errors = partial_paths(out_file)
    kept = resume_shard(partial, partial_errors, fingerprints)
    todo = [p for p in prompts if p.id not in kept.records and p.id not in kept.errors]
    print(f"{prompt_file}: {len(prompts)} prompts, {len(kept.records)} done "
          f"({kept.adopted} from other shards' kept files), {kept.discarded_stale} kept "
          f"answers discarded (made under other settings), {len(kept.errors)} failed before, "
          f"{len(todo)} to ask at concurrency {settings.concurrency} over "
          f"{len(endpoints)} endpoint(s)")
    slots = SlotPool(slot_dir, settings.concurrency * len(endpoints))
    results_log, errors_log = AppendLog(partial), AppendLog(partial_errors)
    try:
        run = ShardRun(todo, fingerprints, endpoints, settings, slots, results_log, errors_log)
        stats = asyncio.run(run.run(total=len(todo)))
        server_rows = run.server.rows
        sent_by_endpoint = dict(zip([e.base_url for e in endpoints], run.pool.sent, strict=True))
    finally:
        results_log.close()
        errors_log.close()
        slots.close()
    timing = {"job_start": job_start, "server_rows": server_rows}
    return finish_shard(prompts, fingerprints, kept, partial, partial_errors, out_file,
                        errors_file, summary_file, stats, settings, sent_by_endpoint,
                        timing, machine)


def finish_shard(prompts, fingerprints, kept, partial, partial_errors, out_file, errors_file,
                 summary_file, stats, settings, sent_by_endpoint, timing,
                 machine: dict | None = None) -> dict:
    order = {p.id: i for i, p in enumerate(prompts)}
    done = _valid(read_jsonl_ids(partial), fingerprints)
    errors = {k: v for k, v in _valid(read_jsonl_ids(partial_errors), fingerprints).items()
              if k not in done}
    write_jsonl(out_file, sorted(done.values(), key=lambda r: order[r["id"]]))
    write_jsonl(errors_file, sorted(errors.values(), key=lambda r: order[r["id"]]))
    fill = stats.fill_seconds
    summary = {
        "prompts": len(prompts),
        "responses": len(done),
        "errors": len(errors),
        "unanswered": len(prompts) - len(done) - len(errors),
        "resumed": len(kept.records),
        "resumed_from_other_shards": kept.adopted,
        "discarded_stale": kept.discarded_stale,
        "retries": stats.retries,
        "retries_by_kind": dict(sorted(stats.retries_by_kind.items())),
        "endpoint_set_asides": stats.set_asides,
        "prompt_tokens": stats.prompt_tokens,
        "output_tokens": stats.output_tokens,
        "duration_s": round(stats.duration_s, 3),
        "output_tok_s": round(stats.output_tokens / max(stats.duration_s, 1e-9), 2),
        "concurrency": settings.concurrency,
        "capacity": slots_total(settings, sent_by_endpoint),
        # client side: machine-wide slots held / capacity over this shard's fill phase
        "client_slot_utilization": round(stats.slot_area / fill / slots_total(
            settings, sent_by_endpoint), 4) if fill > 0 else None,
        "latency_s": _quantiles(stats.latencies),
        "requests_by_endpoint": sent_by_endpoint,
        "finish_reasons": _count(r["finish_reason"] for r in done.values()),
        "timing": {"job_start": round(timing["job_start"], 3),
                   "first_request": _round(stats.t_first_request, 3),
                   "queue_empty": _round(stats.t_queue_empty, 3),
                   "end": _round(stats.t_end, 3),
                   "startup_s": _round(stats.t_first_request and
                                       stats.t_first_request - timing["job_start"], 3)},
        "server": server_view(timing["server_rows"], slots_total(settings, sent_by_endpoint),
                              stats.t_first_request, stats.t_end),
        "machine": machine,
    }
    write_json(summary_file, summary, indent=2)
    print(json.dumps(summary))
    return summary


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    return {f"p{q}": round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 4)
            for q in (50, 90, 99)}


def process_start_time() -> float:
    """Wall-clock time this process started (Linux ``/proc``; elsewhere: now)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # seconds after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - started)


def slots_total(settings: GenerateSettings, sent_by_endpoint: dict) -> int:
    return settings.concurrency * max(len(sent_by_endpoint), 1)


def _count(values: Iterable) -> dict:
    counts: dict = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def generate_responses(prompt_file: Path, out_file: Path, errors_file: Path,
                       summary_file: Path, gen_cfg: dict, server_cfg: dict, model: str,
                       state_dir: Path, slot_dir: Path, profile_json: Path | None = None,
                       trust_remote_code: bool = False, revision: str | None = None) -> dict:
    """The generate stage: resolve concurrency, get endpoints (shared or external), run."""
    from draftline.server import endpoints_for

    job_start = process_start_time()
    revision = hub_revision(model, revision)  # refused for a local directory, before any work
    concurrency = resolve_concurrency(gen_cfg["concurrency"], profile_json)
    settings = GenerateSettings.from_config(gen_cfg, concurrency)
    with endpoints_for(server_cfg, model, Path(state_dir), trust_remote_code,
                       revision=revision) as endpoints:
        return generate_shard(Path(prompt_file), Path(out_file), Path(errors_file),
                              Path(summary_file), endpoints, settings, Path(slot_dir),
                              target_dir=model, target=target_identity(model, revision),
                              job_start=job_start, machine=serving_machine(
                                  server_cfg, [served_version(e) for e in endpoints]))

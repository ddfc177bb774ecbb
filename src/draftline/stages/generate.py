"""Synthetic responses: every prompt answered by the served target, a training-split prompt
``generate.answers_per_prompt`` times (``answer_samples``), an eval-split prompt once.

Kept whole (about 750 lines): settings, the request and its retry policy, the run and the
shard summaries are one stage read in order; the endpoint clients
(``draftline.serving.endpoint_clients``) and the kept answers (``draftline.stages.responses``)
have their own modules.

One generation job serves every shard: one process, one aiohttp client per endpoint
(``draftline.serving.endpoint_clients.EndpointClient``, which says why not the ``openai``
client) and one fixed pool of C x endpoints worker coroutines (never one task per prompt) that pull
prompts from all shard files in order (``GenerationRun``). The server so stays full across
shard boundaries (the next shard's prompts are asked while the last answers of the previous
one are still generated), the run has one tail, and the process start-up is paid once.

Durability and resume (``draftline.stages.responses``): answers are appended to a kept file
as they arrive, each with the fingerprint of what determined it; a rerun asks only for the prompts
without a valid kept answer. At the end each shard is written once, sorted in prompt order, by
atomic rename. One run at a time writes a responses folder (``generation_lock``), checked
writable before the first request; every run, however it ends, adds its counts to each shard's
history, which the shard summary reports (``attempts``, ``all_attempts``). Ctrl-C ends a run
with one line and exit status 130.

What the server shows: the run samples every endpoint's Prometheus ``/metrics`` (requests
running and waiting, generated tokens, running seconds) and the seconds so far of its open
requests while it runs (``draftline.serving.endpoint_clients.ServerSampler``); each shard summary
reports the server-side mean running requests against the chosen concurrency (from request
time, ``draftline.stages.generation_report``) and the server-side output tok/s over that shard's
requests, and keeps a compact timeline (with that shard's completed
requests); ``stage_summary`` merges them into one stage view (and a plot).
``client_slot_utilization`` is the client-side figure: requests the client had open, not
server work.

Failures (``failure_kind``): a refused connection, or an endpoint that has answered only server
errors (5xx) for a few seconds (``EndpointPool.server_error``), sets the endpoint aside for a
few seconds and costs the prompt nothing; a timeout, a dropped connection, a retryable status or
an unparseable or incomplete answer (``check_completion``) costs one retry (backoff with
jitter); what another try would repeat goes to the errors file at once, final for this run (a
rerun asks it again; the errors of every run stay in the kept errors file). When nothing has
succeeded for ``endpoint_down_timeout_s`` while requests kept failing, the run stops with
``EndpointsDown``. The summary counts retries by kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from tqdm import tqdm

from draftline.core.atomic import write_json, write_jsonl
from draftline.core.hub import hub_revision
from draftline.core.machine import serving_machine
from draftline.core.records import Prompt, RecordError, read_shard
from draftline.core.split import is_eval
from draftline.serving.endpoint_clients import EndpointPool, ServerSampler, StatusError
from draftline.serving.loadgen import request_seed
from draftline.serving.server import Endpoint, served_version
from draftline.stages.generation_report import round_or_none, server_view
from draftline.stages.profile import longest_answer_s, resolve_concurrency
from draftline.stages.responses import (
    AppendLog,
    GenerationLocked,  # noqa: F401 (raised by generate_shards, defined with the kept files)
    OutputNotWritable,  # noqa: F401 (likewise)
    Resumed,
    answer_server_settings,
    append_attempt,
    check_writable,
    fingerprinted_target,
    generation_lock,
    partial_paths,
    prompt_fingerprints,
    read_attempts,
    read_jsonl_ids,
    resume_shard,
    valid_records,
)

RETRYABLE_STATUS = {408, 409, 429}
INTERRUPTED_EXIT = 128 + 2  # as a shell reports a process ended by SIGINT


class EndpointsDown(RuntimeError):
    """No endpoint answered for too long; partial results are kept for the rerun."""


@dataclass(frozen=True)
class GenerateSettings:
    concurrency: int
    temperature: float = 0.7
    # the eval split's answers (dataset.eval_fraction of the prompts, by id) at this temperature
    # instead: at 0 they are the target's greedy answers, what a temperature-0 server emits, so
    # that training's walk over them is the server's drafting (None: sampled like the rest)
    eval_temperature: float | None = None
    eval_fraction: float = 0.0
    top_p: float = 0.95
    max_tokens: int = 2048
    seed: int = 0
    answers_per_prompt: int = 1
    chat_template_kwargs: dict = field(default_factory=dict)
    multi_turn: bool = False
    max_retries: int = 6
    request_timeout_s: float = 600.0
    endpoint_down_timeout_s: float = 300.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0

    @classmethod
    def from_config(cls, gen_cfg: dict, concurrency: int,
                    eval_fraction: float = 0.0) -> GenerateSettings:
        keys = ("temperature", "eval_temperature", "top_p", "max_tokens", "seed",
                "answers_per_prompt", "chat_template_kwargs", "multi_turn", "max_retries",
                "request_timeout_s", "endpoint_down_timeout_s")
        return cls(concurrency=concurrency, eval_fraction=eval_fraction,
                   **{k: gen_cfg[k] for k in keys if k in gen_cfg})

    def temperature_for(self, prompt_id: str) -> float:
        """The temperature of this prompt's answer: ``eval_temperature`` in the eval split
        (``prompt_id``: the prompt's, ``Prompt.split_id``)."""
        if self.eval_temperature is not None and is_eval(prompt_id, self.eval_fraction):
            return self.eval_temperature
        return self.temperature


def request_body(messages: list[dict], settings: GenerateSettings, prompt_id: str,
                 model: str, split_id: str | None = None) -> dict:
    """The chat completion request as vLLM receives it (``return_token_ids``: exact ids).
    ``prompt_id`` is the answer's own id (its seed), ``split_id`` its prompt's (its
    temperature; default the same)."""
    body = {
        "model": model,
        "messages": messages,
        "temperature": settings.temperature_for(split_id or prompt_id),
        "top_p": settings.top_p,
        "max_tokens": settings.max_tokens,
        "seed": request_seed(settings.seed, prompt_id),  # as the profile and benchmark seed
        "return_token_ids": True,
    }
    if settings.chat_template_kwargs:
        body["chat_template_kwargs"] = settings.chat_template_kwargs
    return body


class MalformedCompletion(ValueError):
    """A complete response body that is JSON but not a chat completion we can keep (its
    ``invalid`` failure kind is retried: the prompt is asked again)."""


def parse_completion(body: dict) -> dict:
    """The fields we keep from a vLLM chat completion's JSON (reasoning under either name)."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise MalformedCompletion(f"not a chat completion: {str(body)[:200]}") from exc
    if not isinstance(message, dict):
        raise MalformedCompletion(f"choice without a message (message: {message!r})")
    reasoning = message.get("reasoning")
    if reasoning is None:  # an empty reasoning ("": the think block was empty) is kept as such
        reasoning = message.get("reasoning_content")
    return {
        "reasoning": reasoning,
        "content": message.get("content"),
        "finish_reason": choice.get("finish_reason"),
        "prompt_token_ids": body.get("prompt_token_ids"),
        "output_token_ids": choice.get("token_ids"),
        "usage": body.get("usage"),
    }


def _token_ids(parsed: dict, key: str) -> list[int]:
    ids = parsed[key]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise MalformedCompletion(f"{key} missing, empty or not integers (got {str(ids)[:80]})")
    return ids


def check_completion(parsed: dict) -> None:
    """Raise ``MalformedCompletion`` unless the answer can be trained on: both token id lists
    present and non-empty, and as long as the usage figures say. The ids are what the dataset
    is built from, and the usage is the server's own count of them: an answer where they
    disagree was cut or mangled on its way, so it is asked again rather than kept."""
    prompt_ids = _token_ids(parsed, "prompt_token_ids")
    output_ids = _token_ids(parsed, "output_token_ids")
    usage = parsed["usage"]
    if not isinstance(usage, dict):
        raise MalformedCompletion(f"no usage figures (usage: {usage!r})")
    for figure, ids in (("prompt_tokens", prompt_ids), ("completion_tokens", output_ids)):
        if usage.get(figure) != len(ids):
            raise MalformedCompletion(
                f"usage.{figure} is {usage.get(figure)!r} but the answer has {len(ids)} ids")


def assistant_message(parsed: dict) -> dict:
    """The assistant turn as the chat template renders it (reasoning in its own field)."""
    return {"role": "assistant", "content": parsed["content"] or "",
            "reasoning_content": parsed["reasoning"]}


def failure_kind(exc: BaseException) -> str:
    """What went wrong with one request, for the retry policy and the counts.

    ``refused``: no connection (the endpoint is down, not the prompt's fault); ``timeout``: no
    answer within the request timeout; ``disconnect``: the connection dropped before the
    whole response arrived (reset, truncated body); ``status``: a retryable HTTP status
    (408/409/429/5xx); ``invalid``: a complete response that does not parse or is not a whole
    answer (``check_completion``: no message, token ids missing or disagreeing with the usage
    figures); ``final``: an
    error that another try would repeat (400: prompt too long, ...).
    """
    if isinstance(exc, StatusError):
        code = exc.status_code
        return "status" if code in RETRYABLE_STATUS or code >= 500 else "final"
    if isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(exc, TimeoutError):
        return "refused"
    if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors
        return "timeout"
    if isinstance(exc, aiohttp.ClientError):  # dropped, reset, truncated, malformed HTTP
        return "disconnect"
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError | MalformedCompletion):
        return "invalid"
    return "final"


def was_resent(exc: BaseException) -> bool:
    """Whether the client sent the failed request once more over a new connection (its
    resend failed to connect or answer, or answered with an error status)."""
    return bool(getattr(exc, "resent", False))


def backoff_delay(attempt: int, settings: GenerateSettings, rng: random.Random) -> float:
    """Exponential backoff with full-range jitter in [d/2, d]."""
    delay = min(settings.backoff_cap_s, settings.backoff_base_s * 2**attempt)
    return delay * (0.5 + 0.5 * rng.random())


# ----------------------------------------------------------------------------- the run


@dataclass
class ShardStats:
    """One shard's counts within a run (the run serves all shards through one pool)."""

    total: int = 0
    done: int = 0
    errors: int = 0
    retries: int = 0
    retries_by_kind: dict = field(default_factory=dict)  # failure_kind -> retries it caused
    set_asides: int = 0  # refused connections: the endpoint rested, no retry spent
    # sent once more at once over a new connection: the server had closed the kept-alive one
    # (``draftline.serving.endpoint_clients.AiohttpTransport``)
    connection_resends: int = 0
    requests_by_endpoint: dict = field(default_factory=dict)  # base URL -> requests sent
    prompt_tokens: int = 0
    output_tokens: int = 0
    inflight_area: float = 0.0  # integral of the run's open requests over this shard's fill
    fill_seconds: float = 0.0
    latencies: list = field(default_factory=list)  # seconds, answered requests of this run
    t_first_request: float | None = None  # wall clock (time.time())
    t_queue_empty: float | None = None  # the last prompt of this shard was handed out
    t_end: float | None = None  # its last request ended

    @property
    def duration_s(self) -> float:
        if self.t_first_request is None or self.t_end is None:
            return 0.0
        return self.t_end - self.t_first_request


@dataclass
class ShardWork:
    """One shard's part of a run: the prompts still to ask, where its answers and final errors
    go, and its own counts. ``remaining`` counts prompts not finished yet (None: open-ended)."""

    todo: Iterable[Prompt]
    fingerprints: dict[str, str]
    results: AppendLog
    errors: AppendLog
    remaining: int | None = None
    stats: ShardStats = field(default_factory=ShardStats)
    filling: bool = False  # its prompts are being handed out


class GenerationRun:
    """One pool of ``capacity`` workers (C x endpoints) over one set of clients answers the
    prompts of all shards, in shard order.

    The workers pull from one queue that runs through the shards one after another, so while a
    shard's last answers are still being generated the free workers already ask the next
    shard's prompts: the server sees C requests from the first to the last fill second, with
    no drain at a shard boundary and one tail for the whole run.
    """

    def __init__(self, shards: list[ShardWork], endpoints: list[Endpoint],
                 settings: GenerateSettings, seed: int = 0):
        self.shards = shards
        self.settings = settings
        self.capacity = settings.concurrency * len(endpoints)
        self.pool = EndpointPool(endpoints, settings.request_timeout_s, self.capacity)
        self.rng = random.Random(seed)
        self.queue = self._items()
        self.in_flight = 0  # requests open in this client
        # (their count, the sum of their send times): one tuple, replaced whole, so the
        # server sampler's thread never reads a count without its sum
        self.open_requests: tuple[int, float] = (0, 0.0)
        self.bar: tqdm | None = None
        self.server: ServerSampler | None = None

    def _items(self):
        """(shard, prompt) in shard order, marking when each shard's prompts are handed out."""
        for shard in self.shards:
            shard.filling = True
            for prompt in shard.todo:
                yield shard, prompt
            shard.filling = False
            shard.stats.t_queue_empty = time.time()
            if shard.remaining == 0:  # nothing was asked, or its last answer is already in
                shard.stats.t_end = shard.stats.t_end or shard.stats.t_queue_empty

    async def run(self, total: int | None) -> None:
        self.bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True,
                        mininterval=1.0)
        self.server = ServerSampler(self.pool.endpoints,
                                    lambda: [s.stats.done for s in self.shards],
                                    lambda: self.open_requests)
        self.server.start()
        samplers = [asyncio.create_task(self._sample_in_flight())]
        workers = [asyncio.create_task(self._worker()) for _ in range(self.capacity)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in [*samplers, *workers]:
                task.cancel()
            await asyncio.gather(*samplers, *workers, return_exceptions=True)
            end = time.time()
            for shard in self.shards:  # open-ended or stopped early: it ended now
                shard.stats.t_end = shard.stats.t_end or end
            self.server.stop()
            await self.pool.close()
            self.bar.close()

    async def _sample_in_flight(self, every_s: float = 0.1) -> None:
        """Requests open in the client over each shard's fill phase (until its last prompt was
        handed out): what the client asked for, not what the server ran."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for shard in self.shards:
                if shard.filling:
                    shard.stats.inflight_area += self.in_flight * (now - last)
                    shard.stats.fill_seconds += now - last
            last = now

    async def _worker(self) -> None:
        for shard, item in self.queue:
            if await self._answer(shard, item) and shard.remaining is not None:
                shard.remaining -= 1
                if shard.remaining == 0 and not shard.filling:
                    shard.stats.t_end = time.time()

    async def _answer(self, shard: ShardWork, item: Prompt) -> bool:
        """Ask for one prompt's answer (its history first, with ``multi_turn``); True once it
        is kept or in the errors file."""
        messages = item.messages
        if self.settings.multi_turn:
            messages = await self._regenerate_history(shard, item, messages)
            if messages is None:
                return True
        outcome = await self._complete(shard, item, messages)
        if outcome is not None:
            self._record(shard, item, messages, *outcome)
        return True

    async def _regenerate_history(self, shard: ShardWork, item: Prompt,
                                  messages: list[dict]) -> list[dict] | None:
        """Regenerate every earlier assistant turn in order, feeding the new history back."""
        history: list[dict] = []
        for msg in messages[:-1]:
            if msg["role"] != "assistant":
                history.append(msg)
                continue
            outcome = await self._complete(shard, item, history)
            if outcome is None:
                return None
            history.append(assistant_message(outcome[0]))
        return history + [messages[-1]]

    def _record(self, shard: ShardWork, item: Prompt, messages: list[dict], parsed: dict,
                latency: float, endpoint: str) -> None:
        record = {
            "id": item.id,
            **({"prompt_id": item.prompt_id} if item.prompt_id else {}),
            "messages": messages + [assistant_message(parsed)],
            "prompt_token_ids": parsed["prompt_token_ids"],
            "output_token_ids": parsed["output_token_ids"],
            "finish_reason": parsed["finish_reason"],
            "usage": parsed["usage"],
            "latency_s": round(latency, 4),
            "endpoint": endpoint,
            "fingerprint": shard.fingerprints[item.id],
        }
        shard.results.write(record)
        stats = shard.stats
        stats.done += 1
        stats.latencies.append(latency)
        # checked against the usage figures (``check_completion``)
        stats.prompt_tokens += len(parsed["prompt_token_ids"])
        stats.output_tokens += len(parsed["output_token_ids"])
        self._progress()

    def _progress(self) -> None:
        elapsed = max(self.bar.format_dict["elapsed"], 1e-6)
        tokens = sum(s.stats.output_tokens for s in self.shards)
        self.bar.set_postfix(tok_s=f"{tokens / elapsed:.0f}", in_flight=self.in_flight,
                             retries=sum(s.stats.retries for s in self.shards),
                             errors=sum(s.stats.errors for s in self.shards), refresh=False)
        self.bar.update(1)

    async def _complete(self, shard: ShardWork, item: Prompt, messages: list[dict]):
        """One chat completion with retries; None when it ended in the errors file."""
        stats = shard.stats
        attempt = 0
        while True:
            index = await self._endpoint()
            endpoint = self.pool.endpoints[index]
            body = request_body(messages, self.settings, item.id, endpoint.model,
                                item.split_id)
            self.pool.in_flight[index] += 1
            self.pool.sent[index] += 1
            sent = time.time()
            self.in_flight += 1
            count, sent_sum = self.open_requests
            self.open_requests = (count + 1, sent_sum + sent)
            stats.requests_by_endpoint[endpoint.base_url] = (
                stats.requests_by_endpoint.get(endpoint.base_url, 0) + 1)
            t0 = time.monotonic()
            stats.t_first_request = stats.t_first_request or sent
            try:
                answer = await self.pool.clients[index].complete(body)
                stats.connection_resends += answer.resent
                parsed = parse_completion(answer.body)
                check_completion(parsed)
                self.pool.succeeded(index)
                return parsed, time.monotonic() - t0, endpoint.base_url
            except Exception as exc:  # classified below; nothing is swallowed silently
                error = exc
                stats.connection_resends += was_resent(exc)
            finally:
                self.in_flight -= 1
                count, sent_sum = self.open_requests
                # (reset when none is open: no rounding error of large sums carries on)
                self.open_requests = (count - 1, sent_sum - sent) if count > 1 else (0, 0.0)
                self.pool.in_flight[index] -= 1
            kind = failure_kind(error)
            if kind == "refused" or self._server_down(index, item.id, error):
                if kind == "refused":
                    self.pool.set_aside(index)
                stats.set_asides += 1
                self._check_down()
                await asyncio.sleep(backoff_delay(0, self.settings, self.rng))
                continue  # a dead endpoint is not this prompt's fault: no retry is spent
            if kind in ("timeout", "disconnect", "status"):
                self.pool.failed()  # a hung, dying or failing server ends in EndpointsDown
                self._check_down()
            if kind != "final" and attempt < self.settings.max_retries:
                stats.retries += 1
                stats.retries_by_kind[kind] = stats.retries_by_kind.get(kind, 0) + 1
                await asyncio.sleep(backoff_delay(attempt, self.settings, self.rng))
                attempt += 1
                continue
            self._fail(shard, item.id, error, attempt + 1, kind)
            return None

    def _server_down(self, index: int, prompt_id: str, error: BaseException) -> bool:
        """A 5xx counts toward setting its endpoint aside (``EndpointPool.server_error``);
        True once the endpoint is down, and the answer no fault of the prompt's."""
        if getattr(error, "status_code", 0) < 500:
            return False
        return self.pool.server_error(index, prompt_id)

    async def _endpoint(self) -> int:
        while True:
            index = self.pool.pick()
            if index is not None:
                return index
            self._check_down()
            await asyncio.sleep(0.5)

    def _check_down(self) -> None:
        """Stop the run when connections have failed for too long with no success between."""
        down_for = self.pool.down_for()
        if down_for > self.settings.endpoint_down_timeout_s:
            raise EndpointsDown(
                f"no endpoint answered for {down_for:.0f}s "
                f"({', '.join(e.base_url for e in self.pool.endpoints)}); results so far "
                "are kept, rerun to resume")

    def _fail(self, shard: ShardWork, prompt_id: str, error: BaseException, attempts: int,
              kind: str) -> None:
        status = getattr(error, "status_code", None)
        message = getattr(error, "message", None) or str(error) or type(error).__name__
        shard.errors.write({"id": prompt_id,
                            "error": f"{type(error).__name__}: {message}"[:2000],
                            "status": status, "kind": kind, "retryable": kind != "final",
                            "attempts": attempts, "fingerprint": shard.fingerprints[prompt_id],
                            "time": round(time.time(), 3)})  # which run, in the history
        shard.stats.errors += 1
        self._progress()


@dataclass(frozen=True)
class ShardFiles:
    """One shard's prompt file and the three files its answers go to."""

    prompts: Path
    responses: Path
    errors: Path
    summary: Path

    @classmethod
    def of(cls, prompts, responses, errors, summary) -> ShardFiles:
        return cls(Path(prompts), Path(responses), Path(errors), Path(summary))


@dataclass
class PreparedShard:
    files: ShardFiles
    prompts: list[Prompt]
    fingerprints: dict[str, str]
    kept: Resumed
    todo: list[Prompt]


def prepare_shard(files: ShardFiles, settings: GenerateSettings, endpoints: list[Endpoint],
                  target: dict) -> PreparedShard:
    """Read a shard's prompts and what an earlier run left valid; what is left to ask."""
    prompts = answer_samples(read_shard(files.prompts), settings, files.prompts)
    fingerprints = prompt_fingerprints(prompts, settings, endpoints, target)
    kept = resume_shard(*partial_paths(files.responses), fingerprints)
    # every prompt without a kept answer, those an earlier run filed as errors included
    todo = [p for p in prompts if p.id not in kept.records]
    failed_before = sum(1 for p in todo if p.id in kept.errors)
    print(f"{files.prompts}: {len(prompts)} prompts, {len(kept.records)} done "
          f"({kept.adopted} from other shards' kept files), {kept.discarded_stale} kept "
          f"answers discarded (made under other settings), {kept.discarded_incomplete} "
          f"(without token ids), {len(todo)} to ask ({failed_before} of them failed in an "
          f"earlier run)")
    return PreparedShard(files, prompts, fingerprints, kept, todo)


def answer_samples(prompts: list[Prompt], settings: GenerateSettings,
                   where: Path | str = "prompts") -> list[Prompt]:
    """What a shard asks for: each prompt, and a training-split prompt's further answers
    (``settings.answers_per_prompt``), answer n >= 1 of prompt ``a`` as ``a#<n>`` (the
    closed-loop client's spelling of a repeat) with ``prompt_id`` ``a``: its own seed
    (``request_seed`` of its id), its prompt's split and temperature. An eval-split prompt is
    answered once (at ``eval_temperature`` 0 every answer would be the same greedy text).
    Adding answers keeps those already asked: answer 0 keeps the prompt's id."""
    if settings.answers_per_prompt == 1:
        return prompts
    ids = {p.id for p in prompts}
    samples = []
    for prompt in prompts:
        samples.append(prompt)
        if is_eval(prompt.id, settings.eval_fraction):
            continue
        for n in range(1, settings.answers_per_prompt):
            answer = Prompt(f"{prompt.id}#{n}", prompt.messages, prompt_id=prompt.id)
            if answer.id in ids:
                raise RecordError("duplicate_id", f"{where}: prompt id {answer.id!r} is also "
                                  f"answer {n} of prompt {prompt.id!r} (generate."
                                  f"answers_per_prompt {settings.answers_per_prompt}): "
                                  f"rename that prompt")
            samples.append(answer)
    return samples


def generate_shards(shards: list[ShardFiles], endpoints: list[Endpoint],
                    settings: GenerateSettings, target_dir: str | None = None,
                    target: dict | None = None, job_start: float | None = None,
                    machine: Callable[[], dict | None] | dict | None = None) -> list[dict]:
    """Answer every prompt of every shard once, through one client and one pool of C x
    endpoints requests in flight (``GenerationRun``); resume each shard from its valid kept
    results; write each shard's outputs and summary.

    ``target`` identifies the served target (``fingerprinted_target``); by default that of
    ``target_dir``, the target's directory. (The render check of the answers runs in the
    stage summary, ``draftline.stages.generation_report``: off generation's critical path.)
    ``job_start`` (wall clock) is when the job began, for the start-up time in the summaries
    (default: now). ``machine`` is what served the requests (``serving_machine``, or a callable
    giving it, asked once the requests are done), recorded in the summaries: the vLLM release
    and GPUs shape the answers.
    """
    job_start = time.time() if job_start is None else job_start
    if target is None:
        target = fingerprinted_target(target_dir) if target_dir else {}
    with contextlib.ExitStack() as locks:
        for partial_dir in writable_output_folders(shards):
            locks.enter_context(generation_lock(partial_dir))
        return _generate_locked(shards, endpoints, settings, target, job_start, machine)


def writable_output_folders(shards: list[ShardFiles]) -> list[Path]:
    """Check that every folder the run writes to can be written (``OutputNotWritable``, naming
    it); the kept-files folders, one lock each."""
    partial_dirs = sorted({partial_paths(f.responses)[0].parent for f in shards})
    folders = {f.parent for s in shards for f in (s.responses, s.errors, s.summary)}
    for folder in sorted(folders | set(partial_dirs)):
        check_writable(folder)
    return partial_dirs


def _generate_locked(shards: list[ShardFiles], endpoints: list[Endpoint],
                     settings: GenerateSettings, target: dict, job_start: float,
                     machine: Callable[[], dict | None] | dict | None) -> list[dict]:
    prepared = [prepare_shard(files, settings, endpoints, target) for files in shards]
    print(f"{sum(len(p.todo) for p in prepared)} prompts to ask over {len(prepared)} shard(s) "
          f"at concurrency {settings.concurrency} x {len(endpoints)} endpoint(s)")
    logs, works = [], []
    outcome = "failed"
    try:
        for shard in prepared:
            results, errors = (AppendLog(p) for p in partial_paths(shard.files.responses))
            logs += [results, errors]
            works.append(ShardWork(shard.todo, shard.fingerprints, results, errors,
                                   remaining=len(shard.todo),
                                   stats=ShardStats(total=len(shard.todo))))
        run = GenerationRun(works, endpoints, settings)
        asyncio.run(run.run(total=sum(len(p.todo) for p in prepared)))
        outcome = "complete"
    except KeyboardInterrupt:
        outcome = "interrupted"
        # Every answer is already in the kept files (flushed as it came): a traceback would
        # only hide that the rerun resumes.
        kept = sum(len(p.kept.records) for p in prepared) + sum(w.stats.done for w in works)
        folders = ", ".join(sorted({str(partial_paths(p.files.responses)[0].parent)
                                    for p in prepared}))
        print(f"generate interrupted: {kept} answers kept in {folders}; rerun to resume",
              file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None
    except Exception as exc:
        outcome = type(exc).__name__  # e.g. EndpointsDown
        raise
    finally:
        for log in logs:
            log.close()
        # (a shard whose kept files could not be opened has no work and no attempt)
        for shard, work in zip(prepared, works, strict=False):
            append_attempt(shard.files.responses, attempt_record(work, job_start, outcome))
    machine = machine() if callable(machine) else machine
    capacity = run.capacity
    urls = [e.base_url for e in endpoints]
    return [finish_shard(shard, work.stats, settings, capacity, urls,
                         {"job_start": job_start, "server_rows": run.server.shard_rows(i)},
                         machine)
            for i, (shard, work) in enumerate(zip(prepared, works, strict=True))]


def attempt_record(work: ShardWork, job_start: float, outcome: str) -> dict:
    """One run's part in a shard's history: what it asked, got and retried, how it ended."""
    stats = work.stats
    return {"job_start": round(job_start, 3), "end": round(time.time(), 3), "outcome": outcome,
            "asked": stats.total, "answered": stats.done, "errors": stats.errors,
            "retries": stats.retries,
            "retries_by_kind": dict(sorted(stats.retries_by_kind.items())),
            "endpoint_set_asides": stats.set_asides,
            "connection_resends": stats.connection_resends}


ATTEMPT_COUNTS = ("asked", "answered", "errors", "retries", "endpoint_set_asides",
                  "connection_resends")


def all_attempts(attempts: list[dict]) -> dict:
    """A shard's counts summed over every run that worked on it."""
    by_kind: dict[str, int] = {}
    for attempt in attempts:
        for kind, n in attempt.get("retries_by_kind", {}).items():
            by_kind[kind] = by_kind.get(kind, 0) + n
    totals = {key: sum(a.get(key, 0) for a in attempts) for key in ATTEMPT_COUNTS}
    return {"attempts": len(attempts), **totals, "retries_by_kind": dict(sorted(by_kind.items()))}


def generate_shard(prompt_file: Path, out_file: Path, errors_file: Path, summary_file: Path,
                   endpoints: list[Endpoint], settings: GenerateSettings, **kwargs) -> dict:
    """``generate_shards`` for one shard: its summary."""
    files = ShardFiles.of(prompt_file, out_file, errors_file, summary_file)
    return generate_shards([files], endpoints, settings, **kwargs)[0]


def finish_shard(shard: PreparedShard, stats: ShardStats, settings: GenerateSettings,
                 capacity: int, endpoint_urls: list[str], timing: dict,
                 machine: dict | None = None) -> dict:
    """Write the shard's answers and errors once, in prompt order, and its summary.

    The errors file holds one record per prompt left without an answer: its last error (this
    run's, as every such prompt was asked in it). The earlier runs' errors stay in the kept
    errors file; the summary counts them (``earlier_errors``)."""
    files, fingerprints, kept = shard.files, shard.fingerprints, shard.kept
    partial, partial_errors = partial_paths(files.responses)
    order = {p.id: i for i, p in enumerate(shard.prompts)}
    done = valid_records(read_jsonl_ids(partial), fingerprints)
    errors = {k: v for k, v in valid_records(read_jsonl_ids(partial_errors), fingerprints).items()
              if k not in done}
    write_jsonl(files.responses, sorted(done.values(), key=lambda r: order[r["id"]]))
    write_jsonl(files.errors, sorted(errors.values(), key=lambda r: order[r["id"]]))
    fill = stats.fill_seconds
    summary = {
        "prompts": len(shard.prompts),  # answers asked: a prompt asked N times counts N
        "responses": len(done),
        "errors": len(errors),
        "unanswered": len(shard.prompts) - len(done) - len(errors),
        # prompts an earlier run filed as errors, and how many of them have an answer now
        "earlier_errors": len(kept.errors),
        "earlier_errors_answered": sum(1 for k in kept.errors if k in done),
        "resumed": len(kept.records),
        "resumed_from_other_shards": kept.adopted,
        "discarded_stale": kept.discarded_stale,
        "discarded_incomplete": kept.discarded_incomplete,
        "retries": stats.retries,
        "retries_by_kind": dict(sorted(stats.retries_by_kind.items())),
        "endpoint_set_asides": stats.set_asides,
        "connection_resends": stats.connection_resends,
        "prompt_tokens": stats.prompt_tokens,
        "output_tokens": stats.output_tokens,
        "duration_s": round(stats.duration_s, 3),
        "output_tok_s": round(stats.output_tokens / max(stats.duration_s, 1e-9), 2),
        "concurrency": settings.concurrency,
        "capacity": capacity,
        # client side: the run's open requests / capacity over this shard's fill phase
        "client_slot_utilization": round(stats.inflight_area / fill / capacity, 4)
        if fill > 0 else None,
        "latency_s": _quantiles(stats.latencies),
        "requests_by_endpoint": {url: stats.requests_by_endpoint.get(url, 0)
                                 for url in endpoint_urls},
        "finish_reasons": _count(r["finish_reason"] for r in done.values()),
        "timing": {"job_start": round(timing["job_start"], 3),
                   "first_request": round_or_none(stats.t_first_request, 3),
                   "queue_empty": round_or_none(stats.t_queue_empty, 3),
                   "end": round_or_none(stats.t_end, 3),
                   "startup_s": round_or_none(stats.t_first_request and
                                       stats.t_first_request - timing["job_start"], 3)},
        "server": server_view(timing["server_rows"], capacity, stats.t_first_request,
                              stats.t_end),
        "machine": machine,
        # every run on this shard (the figures above are this run's): a rerun that answers
        # what a faulted run could not keeps that run's retries and errors in view
        "attempts": (attempts := read_attempts(files.responses)),
        "all_attempts": all_attempts(attempts),
    }
    write_json(files.summary, summary, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "server"}))
    return summary


def _quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    return {f"p{q}": round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 4)
            for q in (50, 90, 99)}


def this_process_start_time() -> float:
    """Wall-clock time this process started (Linux ``/proc``; elsewhere: now)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # seconds after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - started)


def _count(values: Iterable) -> dict:
    counts: dict = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


# a request's deadline is this many times the profile's time for the longest answer
DEADLINE_MARGIN = 2.0


def with_request_deadline(settings: GenerateSettings,
                          longest_s: float | None) -> GenerateSettings:
    """``settings`` whose request deadline also lets the longest answer finish: twice the
    profile's time for an answer of ``max_tokens`` at this concurrency when that is above
    ``generate.request_timeout_s``. On a slow target (SmolLM2 on a 2-core CPU at C = 64: 1.1 s
    a token) an answer that runs to the cap outlasts a fixed 600 s, and each retry would be
    cut again and lost."""
    if longest_s is None or DEADLINE_MARGIN * longest_s <= settings.request_timeout_s:
        return settings
    deadline = round(DEADLINE_MARGIN * longest_s)
    print(f"request deadline {deadline} s: {DEADLINE_MARGIN:g} x {longest_s:.0f} s, the "
          f"profile's time for a {settings.max_tokens}-token answer at concurrency "
          f"{settings.concurrency} (generate.request_timeout_s {settings.request_timeout_s:g} "
          f"is the least)", flush=True)
    return replace(settings, request_timeout_s=float(deadline))


def generate_responses(prompt_files: list, out_files: list, errors_files: list,
                       summary_files: list, gen_cfg: dict, server_cfg: dict, model: str,
                       state_dir: Path, profile_json: Path | None = None,
                       trust_remote_code: bool = False, revision: str | None = None,
                       eval_fraction: float = 0.0) -> list[dict]:
    """The generate stage, all shards in one run: resolve concurrency, get endpoints (shared or
    external), answer every shard's prompts through one pool (``generate_shards``);
    ``eval_fraction`` (``dataset.eval_fraction``) names the prompts answered at
    ``generate.eval_temperature``."""
    from draftline.serving.server import endpoints_for

    job_start = this_process_start_time()
    revision = hub_revision(model, revision)  # refused for a local directory, before any work
    concurrency = resolve_concurrency(gen_cfg["concurrency"], profile_json)
    settings = GenerateSettings.from_config(gen_cfg, concurrency, eval_fraction)
    settings = with_request_deadline(settings, longest_answer_s(profile_json, concurrency,
                                                                settings.max_tokens))
    shards = [ShardFiles.of(*files) for files in zip(prompt_files, out_files, errors_files,
                                                     summary_files, strict=True)]
    with endpoints_for(server_cfg, model, Path(state_dir), trust_remote_code,
                       revision=revision) as endpoints:
        return generate_shards(
            shards, endpoints, settings,
            target={**fingerprinted_target(model, revision),
                    "server": answer_server_settings(server_cfg)},
            job_start=job_start,
            machine=lambda: serving_machine(server_cfg, [served_version(e) for e in endpoints]))

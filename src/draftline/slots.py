"""A cross-process in-flight limit built on ``flock``-ed slot files.

Shard jobs of one Snakemake run are separate processes talking to the same server. Each
request holds one of ``n`` slot locks while it is in flight, so the jobs together never exceed
the chosen concurrency, and a slot freed by one shard's tail is taken at once by another
shard. The kernel releases a dead process's locks, so a crashed job never leaks capacity.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import os
from pathlib import Path


class SlotPool:
    """``async with pool.slot(): ...`` holds one of ``size`` machine-wide slots."""

    POLL_MIN_S = 0.001
    POLL_MAX_S = 0.01

    def __init__(self, directory: Path, size: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.size = size
        self._fds = [
            os.open(self.directory / f"slot-{i:04d}", os.O_RDWR | os.O_CREAT, 0o600)
            for i in range(size)
        ]
        self._held: set[int] = set()
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._pump_task: asyncio.Task | None = None
        self._next = os.getpid() % size  # spread processes over the slots

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    @property
    def held_here(self) -> int:
        return len(self._held)

    def _try_take(self) -> int | None:
        for step in range(self.size):
            i = (self._next + step) % self.size
            if i in self._held:
                continue
            try:
                fcntl.flock(self._fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self._held.add(i)
            self._next = (i + 1) % self.size
            return i
        return None

    def held_anywhere(self) -> int:
        """Slots held by all processes right now (probes free-looking slots without blocking)."""
        busy = len(self._held)
        for i in range(self.size):
            if i in self._held:
                continue
            try:
                fcntl.flock(self._fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy += 1
            else:
                fcntl.flock(self._fds[i], fcntl.LOCK_UN)
        return busy

    async def acquire(self) -> int:
        if not self._waiters:
            slot = self._try_take()
            if slot is not None:
                return slot
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.create_task(self._pump())
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())  # handed over just as we were cancelled
            raise

    def release(self, slot: int) -> None:
        self._held.discard(slot)
        fcntl.flock(self._fds[slot], fcntl.LOCK_UN)
        self._serve_waiters()

    def _serve_waiters(self) -> None:
        while self._waiters:
            if self._waiters[0].done():  # cancelled waiter
                self._waiters.popleft()
                continue
            slot = self._try_take()
            if slot is None:
                return
            self._waiters.popleft().set_result(slot)

    async def _pump(self) -> None:
        """Poll for slots freed by other processes while local requests wait."""
        delay = self.POLL_MIN_S
        while self._waiters:
            before = len(self._waiters)
            self._serve_waiters()
            delay = self.POLL_MIN_S if len(self._waiters) < before else min(
                delay * 2, self.POLL_MAX_S)
            await asyncio.sleep(delay)

    def slot(self) -> _SlotContext:
        return _SlotContext(self)


class _SlotContext:
    def __init__(self, pool: SlotPool):
        self.pool = pool
        self.index: int | None = None

    async def __aenter__(self) -> int:
        self.index = await self.pool.acquire()
        return self.index

    async def __aexit__(self, *exc) -> None:
        if self.index is not None:
            self.pool.release(self.index)

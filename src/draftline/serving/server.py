"""vLLM server lifecycle: managed processes, a shared server per run, and external endpoints.

The spec a server is started from (``ServerSpec``), its endpoint and address live in
``draftline.serving.spec``, shared with the Docker launcher. Kept whole here (about 500
lines): the two layers below share the process-group handling and the lease protocol; split
apart, the locking would be spread over files.

* ``ManagedServer`` - one ``python -m vllm.entrypoints.openai.api_server`` process in its own
  process group, bound to 127.0.0.1 by default, health-checked, stopped as a group.
* ``shared_server`` - the mechanism that lets every job of a Snakemake run use one server per
  spec. The first job spawns a small supervisor (``python -m draftline.serving.server supervise``)
  that owns the vLLM process; each job holds a shared ``flock`` lease while it sends requests.
  The supervisor stops vLLM once no lease has been held for ``idle_timeout_s`` seconds, or at
  once when the Snakefile's ``onsuccess``/``onerror`` handler calls ``draftline server stop-all``.
  Locks die with their process, so a crashed job never keeps a server alive.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx

from draftline.core.atomic import write_json
from draftline.serving import owned_child
from draftline.serving.spec import (  # noqa: F401 (the names callers import from here)
    API_SERVER_MODULE,
    PORT_ATTEMPTS,
    RUN_KEY_ENV,
    Endpoint,
    ServerAddress,
    ServerError,
    ServerSpec,
    configured_key_env,
    free_port,
    has_gpu,
    key_id,
    log_tail,
    port_in_use,
    run_api_key,
    spec_from_config,
)


class ManagedServer(ServerAddress):
    """One vLLM API server process (group). Use as a context manager."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log_path = Path(log_path)
        self.port = spec.port or free_port(spec.host)
        self.proc: subprocess.Popen | None = None

    def handle(self) -> dict:
        """What the shared-server state file records to find this server again."""
        return {"server_pgid": self.proc.pid if self.proc else None}

    def start(self) -> ManagedServer:
        """Start the server and wait until it is healthy. A port this object chose (none set in
        the spec) may be taken by another process before the server binds it: the server is
        then started again on another one."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if self._launch():
                return self
            lost = self.port
            self.port = free_port(self.spec.host)
            self._note(f"port {lost} was taken before the server bound it; starting again on "
                       f"port {self.port} ({attempt}/{PORT_ATTEMPTS - 1} retries)")
        raise ServerError(f"vLLM server found no free port in {PORT_ATTEMPTS} tries; "
                          f"log {self.log_path}")

    def _launch(self) -> bool:
        """One start on ``self.port``: True once healthy, False when the server exited having
        lost a port of our choosing to another process; any other failure raises."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                owned_child.command(os.getpid(), self.spec.nice, self.spec.command(self.port)),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.spec.environment(),
                start_new_session=True,  # own process group: stop() takes every worker with it
            )
        try:
            wait_healthy(self.url, self.spec.startup_timeout_s, self.proc, self.log_path)
        except ServerError:
            lost_port = (not self.spec.port and self.proc.poll() is not None
                         and port_in_use(self.spec.host, self.port))
            self.stop()
            if lost_port:
                return False
            raise
        except BaseException:
            self.stop()
            raise
        return True

    def _note(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"draftline: {line}\n")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None:
            return
        stop_process_group(self.proc.pid, grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def make_server(spec: ServerSpec, log_path: Path):
    """A ManagedServer, or a DockerServer (same interface) for ``launcher: docker``."""
    if spec.launcher == "docker":
        from draftline.serving.docker_launcher import DockerServer

        return DockerServer(spec, log_path)
    return ManagedServer(spec, log_path)


def stop_process_group(pgid: int, grace_s: float = 30.0) -> None:
    """SIGTERM the group, wait up to ``grace_s``, then SIGKILL whatever is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            time.sleep(0.2)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # A zombie leader still counts for killpg; reap it if it is our child.
    with contextlib.suppress(ChildProcessError):
        pid, _ = os.waitpid(pgid, os.WNOHANG)
        if pid == pgid:
            return group_alive(pgid)
    return True


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 log_path: Path | None = None) -> None:
    """Poll ``url/health`` until 200; raise ServerError with the log tail on death or timeout."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with code {proc.returncode} during start-up; "
                    f"log {log_path}:\n{log_tail(log_path) if log_path else ''}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(1.0)
    raise ServerError(
        f"vLLM server at {url} not healthy after {timeout_s:.0f}s; "
        f"log {log_path}:\n{log_tail(log_path) if log_path else ''}"
    )


# ---------------------------------------------------------------------------- shared server per run


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # closing releases the lock


def _try_flock(path: Path, mode: int) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


class _Paths:
    def __init__(self, state_dir: Path, fingerprint: str):
        base = Path(state_dir) / fingerprint
        self.startup = base.with_suffix(".startup.lock")
        self.lease = base.with_suffix(".lease.lock")
        self.state = base.with_suffix(".json")
        self.log = base.with_suffix(".log")
        self.spec = base.with_suffix(".spec")


def _read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ready(state: dict | None) -> bool:
    return bool(state) and state.get("status") == "ready" and _pid_alive(state["supervisor_pid"])


def shared_server_is_up(spec: ServerSpec, state_dir: Path) -> bool:
    """Whether this run already has a ready server for ``spec``: ``shared_server`` would reuse
    it rather than start one (a server under another run's key it would replace)."""
    spec = replace(spec, use_run_key=True)
    state = _read_state(_Paths(state_dir, spec.fingerprint()).state)
    return _ready(state) and state.get("key_id") == key_id(spec.api_key())


@contextlib.contextmanager
def shared_server(spec: ServerSpec, state_dir: Path, idle_timeout_s: float = 120.0,
                  log=print) -> Iterator[Endpoint]:
    """Yield an endpoint of the one server for ``spec`` in this run, starting it if needed.

    The run's servers for other specs are stopped first (once no job uses them): each takes
    the accelerators' memory (``gpu_memory_utilization``) and keeps it until its idle timeout.
    The server requires the run's key (``RUN_KEY_ENV``) unless the config names one; one left
    by another run, under another key, is stopped and replaced.
    """
    spec = replace(spec, use_run_key=True)
    key = spec.api_key()  # made before the supervisor is, which inherits it
    paths = _Paths(state_dir, spec.fingerprint())
    release_other_servers(state_dir, keep=spec.fingerprint(), log=log)
    with _flock(paths.startup, fcntl.LOCK_EX):
        state = _read_state(paths.state)
        running = _ready(state)
        if running and state.get("key_id") != key_id(key):
            log(f"stopping vLLM server {state['url']}: it requires another run's key")
            _stop_leased(paths, state, log)
            running = False
        if running:
            log(f"reusing vLLM server {state['url']} (log {paths.log})")
        else:
            log(f"starting vLLM server for {spec.model} (log {paths.log})")
            state = _spawn_supervisor(spec, paths, idle_timeout_s)
            log(f"vLLM server ready at {state['url']} after {state['startup_s']:.0f}s")
        lease_fd = os.open(paths.lease, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lease_fd, fcntl.LOCK_SH)
    try:
        yield Endpoint(base_url=f"{state['url']}/v1", model=spec.served_name, api_key=key)
    finally:
        os.close(lease_fd)


def _stop_leased(paths: _Paths, state: dict, log, wait_s: float = 3600.0) -> None:
    """Stop a shared server once the jobs holding its lease are done (startup lock held)."""
    with _wait_flock(paths.lease, time.monotonic() + wait_s, log):
        _stop_supervised(state)
        paths.state.unlink(missing_ok=True)


def shared_server_log(spec: ServerSpec, state_dir: Path) -> Path:
    """The log of the run's shared server for ``spec`` (where its errors are to be read)."""
    return _Paths(state_dir, spec.fingerprint()).log


def write_spec(path: Path, spec: ServerSpec) -> None:
    """The supervisor's spec file, readable by its owner only whatever the umask: it holds no
    secret (those go by variable name), but names what the run serves and from where."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an earlier run keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        fh.write(spec.to_json())


def _spawn_supervisor(spec: ServerSpec, paths: _Paths, idle_timeout_s: float) -> dict:
    paths.state.unlink(missing_ok=True)
    write_spec(paths.spec, spec)
    cmd = [sys.executable, "-m", "draftline.serving.server", "supervise", "--spec", str(paths.spec),
           "--idle-timeout", str(idle_timeout_s)]
    with open(paths.log, "ab") as log:
        sup = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + spec.startup_timeout_s + 60
    while time.monotonic() < deadline:
        state = _read_state(paths.state)
        if state and state.get("status") == "ready":
            return state
        if state and state.get("status") == "failed" or sup.poll() is not None:
            raise ServerError(f"shared vLLM server failed to start; log {paths.log}:\n"
                              f"{log_tail(paths.log)}")
        time.sleep(0.5)
    stop_process_group(sup.pid)
    raise ServerError(f"shared vLLM server not ready in time; log {paths.log}:\n"
                      f"{log_tail(paths.log)}")


def _write_state(path: Path, state: dict) -> None:
    write_json(path, state, indent=None)


def supervise(spec_path: Path, idle_timeout_s: float) -> int:
    """Own one vLLM server; stop it when idle, on SIGTERM, or when it dies."""
    spec = ServerSpec.from_json(Path(spec_path).read_text())
    paths = _Paths(Path(spec_path).parent, spec.fingerprint())
    server = make_server(spec, paths.log)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        server.start()
    except Exception as exc:
        _write_state(paths.state, {"status": "failed", "error": str(exc)[-2000:]})
        return 1
    _write_state(paths.state, {
        "status": "ready", "url": server.url, "supervisor_pid": os.getpid(),
        "startup_s": time.monotonic() - t0, "key_id": key_id(spec.api_key()),
        **server.handle(),
    })
    idle_since: float | None = None
    try:
        while not stopping and server.alive():
            time.sleep(1.0)
            fd = _try_flock(paths.lease, fcntl.LOCK_EX)
            if fd is None:
                idle_since = None
                continue
            os.close(fd)
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= idle_timeout_s and _retire(paths):
                break
    finally:
        paths.state.unlink(missing_ok=True)
        server.stop()
    return 0


def _retire(paths: _Paths) -> bool:
    """Withdraw the state file unless a job is just arriving. Never blocks (no deadlock)."""
    startup_fd = _try_flock(paths.startup, fcntl.LOCK_EX)
    if startup_fd is None:
        return False
    try:
        lease_fd = _try_flock(paths.lease, fcntl.LOCK_EX)
        if lease_fd is None:
            return False
        paths.state.unlink(missing_ok=True)
        os.close(lease_fd)
        return True
    finally:
        os.close(startup_fd)


def release_other_servers(state_dir: Path, keep: str | None = None, wait_s: float = 3600.0,
                          log=print) -> int:
    """Stop the run's shared servers other than ``keep`` (a spec fingerprint) before another
    vLLM starts, and return how many were stopped.

    A server still leased by a job is waited for (up to ``wait_s``): two vLLM instances on the
    same accelerators do not fit. The server's startup and lease locks are held while it stops,
    so no job can start using it meanwhile.
    """
    stopped = 0
    for state_path in sorted(Path(state_dir).glob("*.json")):
        fingerprint = state_path.stem
        state = _read_state(state_path)
        if fingerprint == keep or not state or "supervisor_pid" not in state:
            continue
        if not _pid_alive(state["supervisor_pid"]):
            continue
        paths = _Paths(Path(state_dir), fingerprint)
        deadline = time.monotonic() + wait_s
        with _wait_flock(paths.startup, deadline, log), _wait_flock(paths.lease, deadline, log):
            log(f"stopping the idle vLLM server {state.get('url')} before another starts")
            _stop_supervised(state)
            paths.state.unlink(missing_ok=True)
            stopped += 1
    return stopped


@contextlib.contextmanager
def _wait_flock(path: Path, deadline: float, log) -> Iterator[None]:
    """An exclusive lock on ``path``, polled until ``deadline`` (never a blocking deadlock)."""
    announced = False
    while (fd := _try_flock(path, fcntl.LOCK_EX)) is None:
        if time.monotonic() > deadline:
            raise ServerError(f"{path}: another job still uses this server; two vLLM servers "
                              "cannot share the accelerators")
        if not announced:
            log(f"waiting for the jobs using {path.stem} to finish before stopping it")
            announced = True
        time.sleep(0.5)
    try:
        yield
    finally:
        os.close(fd)


def _stop_supervised(state: dict, wait_s: float = 60.0) -> None:
    """SIGTERM a supervisor, wait for it, and make sure its server (process or container) is
    gone even if the supervisor was not the one to stop it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(state["supervisor_pid"], signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while _pid_alive(state["supervisor_pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if state.get("server_pgid"):
        stop_process_group(state["server_pgid"], grace_s=5)
    if state.get("container_id"):  # launcher docker: the supervisor died before removing it
        from draftline.serving.docker_launcher import remove_container

        with contextlib.suppress(ServerError):
            remove_container(state["container_id"])


def stop_all(state_dir: Path) -> int:
    """Stop every shared server recorded in ``state_dir``; return how many were stopped."""
    stopped = 0
    for state_path in Path(state_dir).glob("*.json"):
        state = _read_state(state_path)
        if not state or "supervisor_pid" not in state:
            continue
        stopped += _pid_alive(state["supervisor_pid"])
        _stop_supervised(state)
    return stopped


# ---------------------------------------------------------------------------- endpoints from config


def served_version(endpoint: Endpoint, timeout_s: float = 10.0) -> str | None:
    """The vLLM release behind ``endpoint``, from its own ``/version`` (None if it says none)."""
    try:
        reply = httpx.get(f"{endpoint.root_url}/version", timeout=timeout_s,
                          headers={"Authorization": f"Bearer {endpoint.api_key}"})
        return reply.json().get("version") if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def external_endpoints(server_cfg: dict) -> list[Endpoint]:
    """Endpoints of already running servers; the key is read from the named env variable."""
    ext = server_cfg["external"]
    key = "EMPTY"
    if ext["api_key_env"]:
        if ext["api_key_env"] not in os.environ:
            raise ServerError(f"config key 'server.external.api_key_env': environment variable "
                              f"{ext['api_key_env']} is not set")
        key = os.environ[ext["api_key_env"]]
    model = ext["model"] or server_cfg["served_name"]
    return [Endpoint(base_url=_with_v1(url), model=model, api_key=key) for url in ext["base_urls"]]


def _with_v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


@contextlib.contextmanager
def endpoints_for(server_cfg: dict, model: str, state_dir: Path, trust_remote_code: bool = False,
                  speculative_config: dict | None = None, log=print,
                  revision: str | None = None) -> Iterator[list[Endpoint]]:
    """The endpoints a stage should use: external ones, or the run's shared managed server."""
    if server_cfg["mode"] == "external" and speculative_config is None:
        yield external_endpoints(server_cfg)
        return
    spec = spec_from_config(server_cfg, model, trust_remote_code, speculative_config, revision)
    with shared_server(spec, state_dir, server_cfg["idle_timeout_s"], log=log) as endpoint:
        yield [endpoint]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftline.serving.server")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sup = sub.add_parser("supervise", help="internal: own one shared server")
    sup.add_argument("--spec", type=Path, required=True)
    sup.add_argument("--idle-timeout", type=float, default=120.0)
    stop = sub.add_parser("stop-all", help="stop every shared server of a run")
    stop.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "supervise":
        return supervise(args.spec, args.idle_timeout)
    print(f"stopped {stop_all(args.state_dir)} shared server(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""vLLM server lifecycle: command line, loopback binding, shared server, no orphans."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import requires_vllm

from draftline.serving import owned_child
from draftline.serving import server as server_module
from draftline.serving.server import (
    Endpoint,
    ManagedServer,
    ServerError,
    ServerSpec,
    _pid_alive,
    external_endpoints,
    group_alive,
    served_version,
    shared_server,
    shared_server_is_up,
    spec_from_config,
    stop_all,
)


def test_command_binds_loopback_and_sets_cpu_flags(config, monkeypatch):
    monkeypatch.setattr("draftline.serving.server.has_gpu", lambda: False)
    spec = spec_from_config(config["server"], "/models/toy")
    cmd = spec.command(port=12345)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.3"
    assert cmd[cmd.index("--reasoning-parser") + 1] == "deepseek_r1"
    assert "--trust-remote-code" not in cmd
    assert "--no-enable-chunked-prefill" in cmd  # seeded requests crash chunked prefill on CPU
    assert spec.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_trust_remote_code_only_when_configured(config):
    assert "--trust-remote-code" in spec_from_config(config["server"], "m", True).command(1)
    assert "--trust-remote-code" not in spec_from_config(config["server"], "m", False).command(1)


def test_fingerprint_tracks_what_defines_the_server(config):
    base = spec_from_config(config["server"], "/m")
    assert base.fingerprint() == spec_from_config(config["server"], "/m").fingerprint()
    longer = dict(config["server"], max_model_len=2048)
    assert spec_from_config(longer, "/m").fingerprint() != base.fingerprint()
    assert ServerSpec.from_json(base.to_json()) == base


def test_external_endpoints_take_key_from_named_variable(config, monkeypatch):
    cfg = dict(config["server"], mode="external",
               external={"base_urls": ["http://127.0.0.1:9/"], "model": None,
                         "api_key_env": "DRAFTLINE_TEST_KEY"})
    with pytest.raises(ServerError, match="DRAFTLINE_TEST_KEY"):
        external_endpoints(cfg)
    monkeypatch.setenv("DRAFTLINE_TEST_KEY", "sk-secret-123")
    (ep,) = external_endpoints(cfg)
    assert ep.base_url == "http://127.0.0.1:9/v1" and ep.api_key == "sk-secret-123"
    assert "sk-secret" not in repr(ep)


@requires_vllm
def test_failed_start_reports_log_tail(tmp_path, config):
    spec = spec_from_config(dict(config["server"], startup_timeout_s=120), str(tmp_path / "nope"))
    server = ManagedServer(spec, tmp_path / "server.log")
    with pytest.raises(ServerError, match="exited with code"):
        server.start()
    assert not group_alive(server.proc.pid)


@requires_vllm
@pytest.mark.vllm
def test_shared_server_serves_reasoning_and_stops_when_idle(tmp_path, toy_target, config):
    """Start through the shared mechanism, answer a chat with reasoning and token ids, reuse
    the same server from a second user, then idle out with no process left."""
    spec = spec_from_config(config["server"], str(toy_target))
    state_dir = tmp_path / "servers"
    assert not shared_server_is_up(spec, state_dir)
    with shared_server(spec, state_dir, idle_timeout_s=3) as endpoint:
        state = json.loads((state_dir / f"{spec.fingerprint()}.json").read_text())
        assert shared_server_is_up(spec, state_dir)
        assert not shared_server_is_up(spec_from_config(config["server"], "/another/model"),
                                       state_dir)
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        resp = client.chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
            max_tokens=96, temperature=0, extra_body={"return_token_ids": True})
        with shared_server(spec, state_dir, idle_timeout_s=3) as again:
            assert again.base_url == endpoint.base_url  # one server for both users
            assert again.api_key == endpoint.api_key  # the run's key, which the server requires
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=endpoint.base_url, api_key="EMPTY").models.list()
    message = resp.choices[0].message.model_extra
    assert message.get("reasoning") or message.get("reasoning_content")
    assert resp.model_extra["prompt_token_ids"] and resp.choices[0].model_extra["token_ids"]
    assert state["url"].startswith("http://127.0.0.1:")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and group_alive(state["server_pgid"]):
        time.sleep(0.5)
    assert not group_alive(state["server_pgid"]), "server outlived its idle timeout"
    while time.monotonic() < deadline and _pid_alive(state["supervisor_pid"]):
        time.sleep(0.2)  # the supervisor exits right after its server
    assert not _pid_alive(state["supervisor_pid"])
    assert not shared_server_is_up(spec, state_dir)
    assert stop_all(state_dir) == 0


def test_a_server_under_another_runs_key_is_not_this_runs(tmp_path, config, monkeypatch):
    """The state a supervisor writes (``supervise``), here for a live process: up for this
    run only under its key, and only while the supervisor lives."""
    from draftline.serving.spec import RUN_KEY_ENV, key_id

    monkeypatch.setenv(RUN_KEY_ENV, "this-run")
    spec = spec_from_config(config["server"], "/models/toy")
    state_path = tmp_path / f"{spec.fingerprint()}.json"

    def write_state(pid: int, key: str) -> None:
        state_path.write_text(json.dumps({"status": "ready", "url": "http://127.0.0.1:1",
                                          "supervisor_pid": pid, "key_id": key_id(key)}))

    write_state(os.getpid(), "this-run")
    assert shared_server_is_up(spec, tmp_path)
    write_state(os.getpid(), "another-run")
    assert not shared_server_is_up(spec, tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_state(gone.pid, "this-run")
    assert not shared_server_is_up(spec, tmp_path)


class _SpawnProbe(Exception):
    """Raised by the spy in place of starting a second server (its start is not under test)."""


@requires_vllm
@pytest.mark.vllm
def test_a_server_for_another_spec_starts_only_after_the_idle_one_is_gone(
        tmp_path, toy_target, config, monkeypatch):
    """Generation's shared server idles for server.idle_timeout_s after its last job; the next
    stage's server (another spec: hidden states, the benchmark's EAGLE-3 server) must not start
    beside it, and must wait while a job still uses it."""
    import threading

    import draftline.serving.server as server

    state_dir = tmp_path / "servers"
    first = spec_from_config(config["server"], str(toy_target))
    second = spec_from_config(dict(config["server"], max_num_seqs=8), str(toy_target))
    with shared_server(first, state_dir, idle_timeout_s=600):
        pass
    state = json.loads((state_dir / f"{first.fingerprint()}.json").read_text())
    assert group_alive(state["server_pgid"])  # idle, lease-free, still holding its memory

    released = threading.Event()

    def last_job_of_the_first_spec():
        with shared_server(first, state_dir, idle_timeout_s=600):
            time.sleep(4)
        released.set()

    seen = {}

    def spawn_spy(spec, paths, idle_timeout_s):
        seen.update(first_alive=group_alive(state["server_pgid"]) or _pid_alive(
            state["supervisor_pid"]), lease_released=released.is_set(), spec=spec)
        raise _SpawnProbe

    job = threading.Thread(target=last_job_of_the_first_spec)
    job.start()
    time.sleep(1)  # the job holds its lease now
    monkeypatch.setattr(server, "_spawn_supervisor", spawn_spy)
    with pytest.raises(_SpawnProbe), shared_server(second, state_dir, idle_timeout_s=600):
        pass
    job.join()
    assert seen == {"first_alive": False, "lease_released": True, "spec": second}
    assert not (state_dir / f"{first.fingerprint()}.json").exists()
    assert stop_all(state_dir) == 0


@requires_vllm
@pytest.mark.vllm
def test_served_version_is_the_release_the_server_runs(vllm_server):
    from importlib.metadata import version

    assert served_version(vllm_server.endpoint) == version("vllm-cpu")
    assert served_version(Endpoint(base_url="http://127.0.0.1:9/v1", model="x")) is None


def _autogroup_nice(pid: int) -> int | None:
    """The nice of a process's session as the scheduler weighs it (None: autogroups off).

    The file reads ``/autogroup-12 nice 0``; with autogroups off (``noautogroup``, some
    containers) it is missing or empty."""
    path = Path(f"/proc/{pid}/autogroup")
    text = path.read_text() if path.exists() else ""
    return int(text.split("nice")[1]) if "nice" in text else None


def test_a_process_started_as_servers_are_runs_below_its_owner():
    """``owned_child``: the child's own session weighs ``server.nice`` less than ours, and
    the child's own nice says the same; ours stays as it was."""
    mine = (_autogroup_nice(os.getpid()), os.getpriority(os.PRIO_PROCESS, 0))
    child = subprocess.Popen(owned_child.command(os.getpid(), 7, ["sleep", "30"]),
                             start_new_session=True)
    try:
        time.sleep(0.5)  # the wrapper's interpreter starts, then execs sleep
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "sleep"
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == mine[1] + 7
        if mine[0] is not None:
            assert _autogroup_nice(child.pid) == 7
    finally:
        child.kill()
        child.wait()
    assert (_autogroup_nice(os.getpid()), os.getpriority(os.PRIO_PROCESS, 0)) == mine


def test_the_managed_server_runs_at_the_configured_nice(vllm_server, config):
    """The real server (default ``server.nice``) and its engine processes run below the tests
    that feed it."""
    nice = config["server"]["nice"]
    assert nice > 0
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()
            and _session(int(p)) == vllm_server.proc.pid]
    assert len(pids) >= 2  # the API server and its engine core
    for pid in pids:
        assert os.getpriority(os.PRIO_PROCESS, pid) >= nice
        if _autogroup_nice(pid) is not None:
            assert _autogroup_nice(pid) == nice


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


# ---------------------------------------------------------------------------- start-up, no vLLM

HEALTH_SERVER = """
import http.server, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class HealthOnlySpec(ServerSpec):
    """A server that answers /health and nothing else: start-up and ownership without vLLM."""

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-c", HEALTH_SERVER, str(port)]


def test_a_server_whose_port_is_taken_before_it_binds_starts_on_another(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        occupied = taken.getsockname()[1]
        choices = iter([occupied])
        any_free = server_module.free_port
        monkeypatch.setattr(server_module, "free_port",
                            lambda host="127.0.0.1": next(choices, None) or any_free(host))
        server = ManagedServer(HealthOnlySpec(model="none", startup_timeout_s=60),
                               tmp_path / "server.log")
        assert server.port == occupied
        with server:
            assert server.port != occupied
            assert httpx.get(f"{server.url}/health", timeout=5).text == "ok"
    assert f"port {occupied} was taken" in (tmp_path / "server.log").read_text()


OWNER = """
import importlib.abc, importlib.util, os, signal, sys, threading, time
from pathlib import Path

from draftline.serving.server import ManagedServer, ServerSpec

scenario, log_path, health_server = sys.argv[1:4]


class HealthOnlySpec(ServerSpec):
    def command(self, port):
        return [sys.executable, "-c", health_server, str(port)]


if scenario == "importing":
    # another thread is importing ctypes, and holds its import lock, while the server starts
    sys.modules.pop("ctypes", None)
    importing = threading.Event()

    class SlowLoader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            importing.set()
            time.sleep(3600)

    class SlowCtypes(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ctypes" and threading.current_thread() is not threading.main_thread():
                return importlib.util.spec_from_loader(name, SlowLoader())
            return None

    sys.meta_path.insert(0, SlowCtypes())
    threading.Thread(target=__import__, args=("ctypes",), daemon=True).start()
    importing.wait()
server = ManagedServer(HealthOnlySpec(model="none", startup_timeout_s=60), Path(log_path))
server.start()
print(server.proc.pid, flush=True)
if scenario == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
server.stop()
os._exit(0)
"""


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def run_owner(tmp_path: Path, scenario: str, timeout_s: float = 60) -> tuple[int, str]:
    """A process that starts a managed server (``scenario``): its exit status and output."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, scenario, str(tmp_path / "server.log"),
                              HEALTH_SERVER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        out, _ = owner.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in children_of(owner.pid):  # a child stuck before exec: its own session
            os.kill(pid, signal.SIGKILL)
        os.killpg(owner.pid, signal.SIGKILL)
        owner.communicate()
        pytest.fail(f"no server started in {timeout_s:.0f} s")
    return owner.returncode, out


def test_a_server_starts_while_another_thread_of_its_owner_is_importing(tmp_path):
    """Nothing runs in the forked child before exec: a lock held by another thread of the
    owner at the fork (here ctypes' import lock) cannot hang the server's start."""
    code, out = run_owner(tmp_path, "importing", timeout_s=30)
    assert code == 0, out
    assert int(out.split()[0]) > 0


def test_a_server_dies_with_its_owner(tmp_path):
    code, out = run_owner(tmp_path, "killed")
    assert code == -signal.SIGKILL, out
    server_pid = int(out.split()[0])
    deadline = time.monotonic() + 10
    while _pid_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(server_pid)

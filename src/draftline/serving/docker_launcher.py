"""Server launcher ``docker``: vLLM in a digest-pinned serving image, run with the Docker SDK.

``DockerServer`` has the interface of ``draftline.serving.server.ManagedServer`` (``start``,
``stop``,
``alive``, ``url``, ``endpoint``, ``handle``, context manager), so the shared-server
supervisor owns a container exactly as it owns a process (``server.launcher: docker``).

The container:

* runs ``server.image`` (pinned by digest: ``repo@sha256:...`` or a local image id
  ``sha256:...``), pulled by digest when missing and ``server.docker.pull`` allows it;
* uses host networking (the server binds ``server.host``, 127.0.0.1 by default, so traffic
  stays on loopback), host IPC (or a sized ``/dev/shm``), and, on GPU hosts, a GPU device
  request (the job's ``CUDA_VISIBLE_DEVICES`` when set, else every GPU);
* sees the model, a speculative draft, ``server.docker.mounts`` and the HF cache read-only
  at their host paths;
* gets the API key from the environment variable named by ``server.api_key_env`` (or
  ``server.docker.api_key_env``), else the run's key (``draftline.serving.server.RUN_KEY_ENV``), as
  ``VLLM_API_KEY``: never on a command line, never in a log;
* gets ``server.env`` and the values of the variables ``server.pass_env`` names (read from
  this process's environment when the container is created, never written down);
* streams its output into the server log, and is removed on success, failure and Ctrl-C.

Every container carries labels naming its owner process (host, pid, process start time). A
run that crashed without removing its container (SIGKILL, power loss) leaves one whose owner
is gone: the next start removes such leftovers, and so does
``python -m draftline.serving.docker_launcher cleanup``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from draftline.serving.spec import (
    API_SERVER_MODULE,
    ServerAddress,
    ServerError,
    ServerSpec,
    free_port,
    has_gpu,
    log_tail,
)

LABEL_MANAGED = "org.draftline.managed"
LABEL_FINGERPRINT = "org.draftline.fingerprint"
LABEL_OWNER = "org.draftline.owner"  # "<host>:<pid>:<process start time>"
CONTAINER_HF_HOME = "/root/.cache/huggingface"
CONTAINER_COMPILE_CACHE = "/root/.cache/vllm"
DEFAULT_OPTIONS = {
    "gpus": "auto", "ipc_host": True, "shm_size": "16g", "cache_dir": None,
    "compile_cache_dir": None, "mounts": [], "api_key_env": None, "pull": True,
}


def docker_client(timeout_s: float = 120.0):
    """A Docker SDK client; ServerError naming what is missing when there is none."""
    try:
        import docker
    except ImportError as exc:
        raise ServerError("server.launcher docker needs the Docker SDK for Python: "
                          "pip install 'draftline[docker]'") from exc
    try:
        client = docker.from_env(timeout=int(timeout_s))
        client.ping()
    except docker.errors.DockerException as exc:
        raise ServerError(f"server.launcher docker: no Docker daemon answers ({exc})") from exc
    return client


def options(spec: ServerSpec) -> dict:
    """``server.docker`` with defaults for keys a hand-made spec leaves out."""
    return {**DEFAULT_OPTIONS, **(spec.docker or {})}


# ----------------------------------------------------------------------------- ownership


def process_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of stat, counted after "(comm)"


def owner_label(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{process_start_time(pid)}"


def owner_alive(label: str) -> bool:
    """False when the owner ran on this host and is gone; True for other hosts' owners."""
    host, _, rest = label.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    return process_start_time(int(pid)) == started


def leftover_containers(client) -> list:
    """Containers of this host's draftline servers whose owning process no longer exists."""
    managed = client.containers.list(all=True, filters={"label": f"{LABEL_MANAGED}=1"})
    return [c for c in managed if not owner_alive(c.labels.get(LABEL_OWNER, ""))]


def remove_leftovers(client, log=print) -> int:
    removed = 0
    for container in leftover_containers(client):
        log(f"removing leftover container {container.name} of a crashed run "
            f"(owner {container.labels.get(LABEL_OWNER)})")
        with contextlib.suppress(Exception):
            container.remove(force=True)
            removed += 1
    return removed


def remove_container(container_id: str) -> None:
    """Stop and remove one container by id; nothing when it is already gone."""
    import docker

    client = docker_client()
    with contextlib.suppress(docker.errors.NotFound):
        client.containers.get(container_id).remove(force=True)


# ----------------------------------------------------------------------------- the container


def gpu_device_requests(gpus) -> list:
    """Device requests for ``server.docker.gpus``: auto, all, none or a list of device ids.

    auto: none on a CPU host; on a GPU host the GPUs this job was given
    (``CUDA_VISIBLE_DEVICES``: Snakemake does not set it, a GPU profile or Slurm does), else all.
    """
    from docker.types import DeviceRequest

    if gpus == "auto":
        if not has_gpu():
            return []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [d.strip() for d in visible.split(",") if d.strip()] if visible else "all"
    if gpus == "none" or gpus == []:
        return []
    if gpus == "all":
        return [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return [DeviceRequest(device_ids=[str(d) for d in gpus], capabilities=[["gpu"]])]


def _absolute_if_local(path: str) -> str:
    """A local path as an absolute one (the container has another working directory); a hub
    id unchanged."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def with_absolute_paths(spec: ServerSpec) -> ServerSpec:
    """The spec with local model and draft paths made absolute: they are mounted at their host
    paths, and Snakemake hands relative ones (``results/target``)."""
    speculative = spec.speculative_config
    if speculative:
        draft = json.loads(speculative)
        if draft.get("model"):
            draft["model"] = _absolute_if_local(draft["model"])
        speculative = json.dumps(draft, sort_keys=True)
    return dataclasses.replace(spec, model=_absolute_if_local(spec.model),
                               speculative_config=speculative)


def read_only_paths(spec: ServerSpec) -> list[str]:
    """Host paths the server reads: the model and draft dirs (when local) and extra mounts."""
    mounts = options(spec)["mounts"]
    for path in mounts:
        if not Path(path).expanduser().exists():
            raise ServerError(f"config key 'server.docker.mounts': path not found: {path}")
    paths = [spec.model, *mounts]
    if spec.speculative_config:
        paths.append(json.loads(spec.speculative_config).get("model") or "")
    return sorted({str(Path(p).expanduser().resolve()) for p in paths
                   if p and Path(p).expanduser().exists()})


def container_environment(spec: ServerSpec) -> dict[str, str]:
    """The server's environment inside the container (nothing inherited from this process)."""
    opts = options(spec)
    env = {}
    if not gpu_device_requests(opts["gpus"]):
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{spec.cpu_kvcache_space_gib:g}"
    if opts["cache_dir"]:
        env.update(HF_HOME=CONTAINER_HF_HOME, HF_HUB_OFFLINE="1")  # read-only: no downloads
    if opts["compile_cache_dir"]:
        env["VLLM_CACHE_ROOT"] = CONTAINER_COMPILE_CACHE
    env.update(dict(spec.env))
    env.update(spec.passed_environment())
    key = spec.api_key()
    if key:
        env["VLLM_API_KEY"] = key
    return env


def container_volumes(spec: ServerSpec) -> dict[str, dict]:
    opts = options(spec)
    volumes = {path: {"bind": path, "mode": "ro"} for path in read_only_paths(spec)}
    if opts["cache_dir"]:
        volumes[str(Path(opts["cache_dir"]).expanduser().resolve())] = {
            "bind": CONTAINER_HF_HOME, "mode": "ro"}
    if opts["compile_cache_dir"]:
        cache = Path(opts["compile_cache_dir"]).expanduser().resolve()
        cache.mkdir(parents=True, exist_ok=True)
        volumes[str(cache)] = {"bind": CONTAINER_COMPILE_CACHE, "mode": "rw"}
    return volumes


def container_config(spec: ServerSpec, port: int, owner: str) -> dict:
    """Keyword arguments of ``client.containers.create`` for this server."""
    opts = options(spec)
    fingerprint = spec.fingerprint()  # the shared server's identity (paths as configured)
    spec = with_absolute_paths(spec)
    config = {
        "image": spec.image,
        "entrypoint": ["python3", "-m", API_SERVER_MODULE],
        "command": spec.server_args(port),
        "environment": container_environment(spec),
        "volumes": container_volumes(spec),
        "network_mode": "host",
        "device_requests": gpu_device_requests(opts["gpus"]),
        "labels": {LABEL_MANAGED: "1", LABEL_FINGERPRINT: fingerprint, LABEL_OWNER: owner},
        "name": f"draftline-{fingerprint}-{port}",
        "init": True,  # tini as pid 1: signals reach vLLM, its workers are reaped
        "detach": True,
    }
    if opts["ipc_host"]:
        config["ipc_mode"] = "host"
    else:
        config["shm_size"] = opts["shm_size"]
    if not config["device_requests"]:
        # vLLM's CPU backend binds memory to NUMA nodes (set_mempolicy, mbind): allowed by
        # Docker's default seccomp profile only with CAP_SYS_NICE.
        config["cap_add"] = ["SYS_NICE"]
    return config


def ensure_image(client, ref: str, pull: bool, log=print):
    """The local image for ``ref``; pulled (by digest) when missing and allowed."""
    import docker

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        if not pull:
            raise ServerError(f"config key 'server.image': image {ref} is not present and "
                              "server.docker.pull is false") from None
    log(f"pulling {ref}")
    try:
        return client.images.pull(ref)
    except docker.errors.DockerException as exc:
        raise ServerError(f"config key 'server.image': cannot pull {ref}: {exc}") from exc


class DockerServer(ServerAddress):
    """One vLLM API server in a container. Use as a context manager."""

    def __init__(self, spec: ServerSpec, log_path: Path, client=None):
        if not spec.image:
            raise ServerError("config key 'server.image': required when server.launcher is "
                              "docker")
        self.spec = spec
        self.log_path = Path(log_path)
        self.port = spec.port or free_port(spec.host)
        self.client = client
        self.container = None
        self._log_thread: threading.Thread | None = None

    def handle(self) -> dict:
        """What the shared-server state file records to find this server again."""
        return {"container_id": self.container.id if self.container else None}

    def start(self) -> DockerServer:
        import docker

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.client = self.client or docker_client()
        self._log(f"docker launcher: image {self.spec.image}")
        ensure_image(self.client, self.spec.image, options(self.spec)["pull"], log=self._log)
        remove_leftovers(self.client, log=self._log)
        config = container_config(self.spec, self.port, owner_label())
        try:
            self.container = self.client.containers.create(**config)
            self._log(f"docker launcher: container {self.container.name} "
                      f"({self.container.short_id}) serving on {self.url}")
            self.container.start()
            self._log_thread = threading.Thread(target=self._stream_logs, daemon=True)
            self._log_thread.start()
            self._wait_healthy()
        except docker.errors.DockerException as exc:
            self.stop()
            raise ServerError(f"docker launcher: cannot run {self.spec.image}: {exc}") from exc
        except BaseException:  # failure or Ctrl-C during start-up: leave nothing behind
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        if self.container is None:
            return False
        try:
            self.container.reload()
        except Exception:
            return False
        return self.container.status in ("created", "running", "restarting")

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop (SIGTERM, then SIGKILL after ``grace_s``) and remove the container."""
        if self.container is None:
            return
        import docker

        with contextlib.suppress(docker.errors.DockerException, httpx.HTTPError, OSError):
            self.container.stop(timeout=int(grace_s))
        if self._log_thread is not None:
            self._log_thread.join(timeout=10)
        try:
            self.container.remove(force=True)
            self._log(f"docker launcher: container {self.container.name} removed")
        except docker.errors.NotFound:
            self._log(f"docker launcher: container {self.container.name} removed")
        except docker.errors.APIError as exc:  # its labels let the next start remove it
            self._log(f"docker launcher: could not remove {self.container.name}: {exc}")
        self.container = None

    def __enter__(self) -> DockerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(line + "\n")

    def _stream_logs(self) -> None:
        """Copy the container's stdout/stderr into the server log until it stops."""
        with contextlib.suppress(Exception), open(self.log_path, "ab") as log:
            for chunk in self.container.logs(stream=True, follow=True):
                log.write(chunk)
                log.flush()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline:
                self.container.reload()
                if self.container.status in ("exited", "dead"):
                    code = self.container.attrs["State"].get("ExitCode")
                    time.sleep(0.5)  # let the log stream catch up with the last lines
                    raise ServerError(
                        f"vLLM container exited with code {code} during start-up; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(1.0)
        raise ServerError(f"vLLM container at {self.url} not healthy after "
                          f"{self.spec.startup_timeout_s:.0f}s; log {self.log_path}:\n"
                          f"{log_tail(self.log_path)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftline.serving.docker_launcher")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("cleanup", help="remove containers of draftline servers whose run is gone")
    sub.add_parser("list", help="list containers of draftline servers on this daemon")
    args = parser.parse_args(argv)
    client = docker_client()
    if args.cmd == "cleanup":
        print(f"removed {remove_leftovers(client)} leftover container(s)")
        return 0
    for c in client.containers.list(all=True, filters={"label": f"{LABEL_MANAGED}=1"}):
        state = "alive" if owner_alive(c.labels.get(LABEL_OWNER, "")) else "leftover"
        print(f"{c.short_id} {c.name} {c.status} owner={c.labels.get(LABEL_OWNER)} ({state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

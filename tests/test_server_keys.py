"""API keys of managed servers: a non-loopback bind needs a configured key, and every managed
server requires the run's own key (or the configured one), which draftline's clients send."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import pytest
from conftest import default_config

import draftline.serving.server as server
from draftline.core.config import ConfigError
from draftline.serving.server import spec_from_config


def test_a_non_loopback_bind_without_a_key_is_refused_naming_the_keys():
    with pytest.raises(ConfigError, match=r"'server\.host'.*0\.0\.0\.0.*server\.api_key_env"):
        default_config(**{"server.host": "0.0.0.0"})
    cfg = default_config(**{"server.host": "0.0.0.0", "server.api_key_env": "MY_SERVER_KEY"})
    assert cfg["server"]["api_key_env"] == "MY_SERVER_KEY"
    for loopback in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert default_config(**{"server.host": loopback})["server"]["api_key_env"] is None


# ----------------------------------------------------------------------------- the run's key


def test_a_literal_api_key_option_is_refused_naming_the_key_to_use():
    with pytest.raises(ConfigError, match=r"'server\.extra_args'.*--api-key.*server\.api_key_env"):
        default_config(**{"server.extra_args": ["--api-key", "sk-literal-0123456789"]})


def test_shared_servers_require_the_runs_key_which_is_never_in_the_spec(monkeypatch):
    monkeypatch.setenv(server.RUN_KEY_ENV, "run-key-0123456789abcdef")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    plain = spec_from_config(default_config()["server"], "/m")
    shared = replace(plain, use_run_key=True)
    assert shared.api_key() == "run-key-0123456789abcdef"
    assert shared.environment()["VLLM_API_KEY"] == "run-key-0123456789abcdef"
    assert "run-key" not in shared.to_json() + " ".join(shared.command(8000))
    # the same server by identity; a spec not shared keeps the old, keyless behaviour
    assert shared.fingerprint() == plain.fingerprint() and shared == plain
    assert plain.api_key() is None and "VLLM_API_KEY" not in plain.environment()


def test_a_configured_key_wins_over_the_runs(monkeypatch):
    monkeypatch.setenv(server.RUN_KEY_ENV, "run-key-0123456789abcdef")
    monkeypatch.setenv("MY_SERVER_KEY", "mine-0123456789")
    cfg = default_config(**{"server.host": "0.0.0.0", "server.api_key_env": "MY_SERVER_KEY"})
    spec = spec_from_config(cfg["server"], "/m")
    assert spec.api_key() == "mine-0123456789"
    assert spec.environment()["VLLM_API_KEY"] == "mine-0123456789"


def test_without_a_run_key_one_is_made_for_this_process_and_its_children(monkeypatch):
    monkeypatch.delenv(server.RUN_KEY_ENV, raising=False)
    key = server.run_api_key()
    assert len(key) >= 32 and os.environ[server.RUN_KEY_ENV] == key
    assert server.run_api_key() == key


@pytest.fixture()
def idle_supervisor():
    """A live process standing in for a shared server's supervisor."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _ready_state(tmp_path, spec, supervisor, key: str) -> None:
    state_dir = tmp_path / "servers"
    state_dir.mkdir(exist_ok=True)
    (state_dir / f"{spec.fingerprint()}.json").write_text(json.dumps({
        "status": "ready", "url": "http://127.0.0.1:9", "supervisor_pid": supervisor.pid,
        "startup_s": 0.0, "key_id": server.key_id(key)}))


class _Spawned(Exception):
    pass


def test_a_server_started_under_the_runs_key_is_reused_with_it(tmp_path, monkeypatch,
                                                               idle_supervisor):
    monkeypatch.setenv(server.RUN_KEY_ENV, "run-key-0123456789abcdef")
    spec = spec_from_config(default_config()["server"], "/m")
    _ready_state(tmp_path, spec, idle_supervisor, "run-key-0123456789abcdef")
    with server.shared_server(spec, tmp_path / "servers", log=lambda _: None) as endpoint:
        assert endpoint.api_key == "run-key-0123456789abcdef"
        assert endpoint.base_url == "http://127.0.0.1:9/v1"


def test_a_server_of_another_key_is_stopped_not_reused(tmp_path, monkeypatch, idle_supervisor):
    monkeypatch.setenv(server.RUN_KEY_ENV, "run-key-0123456789abcdef")
    spec = spec_from_config(default_config()["server"], "/m")
    _ready_state(tmp_path, spec, idle_supervisor, "another-runs-key-0123456789")

    def spawn(*_):
        raise _Spawned

    monkeypatch.setattr(server, "_spawn_supervisor", spawn)
    with pytest.raises(_Spawned), server.shared_server(spec, tmp_path / "servers",
                                                       log=lambda _: None):
        pass
    assert idle_supervisor.wait(timeout=10) is not None  # told to stop (SIGTERM)

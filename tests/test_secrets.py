"""Secrets reach servers only by the name of an environment variable: refused when written into
a config, never in a spec file, a Snakemake param or a log."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import default_config

import draftline.serving.server as server
from draftline.core.config import ConfigError
from draftline.serving.server import ServerError, spec_from_config

HF_LITERAL = "hf_literaltoken0123456789"


# ----------------------------------------------------------------------------- config check


def test_a_secret_written_into_server_env_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"'server\.env\.HF_TOKEN'.*server\.pass_env"):
        default_config(**{"server.env": {"HF_TOKEN": HF_LITERAL}})


def test_ordinary_server_env_values_are_accepted():
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2", "HF_TOKEN": ""}
    assert default_config(**{"server.env": env})["server"]["env"] == env


def test_a_secret_option_in_extra_args_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"'server\.extra_args'.*--hf-token.*server\.pass_env"):
        default_config(**{"server.extra_args": ["--hf-token=hf_literal0123456789"]})


# ----------------------------------------------------------------------------- pass-through env


def test_pass_env_hands_the_value_to_the_server_and_only_the_name_to_the_spec(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF_LITERAL)
    cfg = default_config(**{"server.pass_env": ["HF_TOKEN"]})
    spec = spec_from_config(cfg["server"], "/m")
    assert spec.pass_env == ("HF_TOKEN",)
    assert spec.environment()["HF_TOKEN"] == HF_LITERAL
    assert HF_LITERAL not in spec.to_json()
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ServerError, match=r"'server\.pass_env'.*HF_TOKEN"):
        spec.environment()


def test_pass_env_reaches_the_container(monkeypatch):
    from draftline.serving import docker_launcher as D

    monkeypatch.setattr(D, "has_gpu", lambda: False)
    monkeypatch.setenv("HF_TOKEN", HF_LITERAL)
    cfg = default_config(**{"server.pass_env": ["HF_TOKEN"], "server.launcher": "docker",
                            "server.image": "vllm@sha256:" + "0" * 64})
    spec = spec_from_config(cfg["server"], "/m")
    assert D.container_environment(spec)["HF_TOKEN"] == HF_LITERAL


def test_spec_files_are_private(tmp_path):
    spec = spec_from_config(default_config()["server"], "/m")
    path = tmp_path / "abc.spec"
    path.write_text("old")
    path.chmod(0o644)
    old_umask = os.umask(0o022)
    try:
        server.write_spec(path, spec)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert server.ServerSpec.from_json(path.read_text()) == spec

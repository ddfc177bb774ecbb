"""The whole workflow with the real Snakemake on the toy target, then what reruns when.

One complete run (module-scoped: it is the expensive part), then staleness proven by dry runs
listing the jobs Snakemake would run, and one real partial rerun. The workflow is copied into a
temporary folder so that editing a stage's library code there (case 5) touches nothing here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, copy_workflow, default_config, requires_vllm, write_workflow_config

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

# As in the workflow catalog: the test run is a config of its own (CI also lints with it).
TEST_CONFIG = REPO / ".test" / "config" / "config.yaml"

ALL_AFTER_TARGET = {"prompt_shards", "concurrency_profile", "generate", "generation_summary",
                    "dataset", "vocab_map", "hidden_states", "train_draft", "export_draft",
                    "bench", "bundle", "all"}


def snakemake(workdir: Path, *args: str, timeout: int = 3000) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("snakemake")
    cmd = [str(exe) if exe.exists() else "snakemake", "--snakefile", str(workdir / "Snakefile"),
           "--directory", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def jobs_to_run(workdir: Path, config: dict | None = None) -> set[str]:
    """Rule names a dry run would execute (from Snakemake's job-stats table)."""
    args = ["-n", "--quiet", "rules"]
    if config is not None:
        path = workdir / "changed.yaml"
        path.write_text(yaml.safe_dump(config))
        args += ["--configfile", str(path)]
    result = snakemake(workdir, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout + result.stderr
    (workdir / "last_dry_run.log").write_text(text)  # reasons, for a failing assertion
    if "Nothing to be done" in text:
        return set()
    table = text[text.index("Job stats"):] if "Job stats" in text else text
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+\s*$", table, re.M)} - {"total"}


def write_config(workdir: Path, config: dict) -> None:
    write_workflow_config(workdir, config)


def deep_update(base: dict, change: dict) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_update(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, toy_target):
    """A complete run of the test config (.test/config/config.yaml: the default, reduced sizes)
    in a copy of the workflow."""
    workdir = tmp_path_factory.mktemp("pipeline")
    copy_workflow(workdir)
    base = yaml.safe_load(TEST_CONFIG.read_text())
    write_config(workdir, base)
    # The toy target is the cached build of the same config: its own rule is tested in
    # test_toy.py; building it again here would only cost minutes.
    shutil.copytree(toy_target, workdir / "results" / "target")
    result = snakemake(workdir, "--cores", "2", "--allowed-rules", *sorted(ALL_AFTER_TARGET))
    log = result.stdout + result.stderr
    (workdir / "snakemake.log").write_text(log)
    assert result.returncode == 0, log[-5000:]
    return workdir, base


def test_complete_run_produces_every_artifact(pipeline):
    workdir, _ = pipeline
    results = workdir / "results"
    profile = json.loads((results / "profile/concurrency.json").read_text())
    assert profile["chosen_concurrency"] in [r["concurrency"] for r in profile["levels"]]
    assert profile["sweep_stop"]["reason"] in ("plateau", "past_peak", "cap")
    for i in range(2):
        summary = json.loads((results / f"responses/shard-{i}.summary.json").read_text())
        assert summary["unanswered"] == 0 and summary["responses"] + summary["errors"] == 24
    # the stage as the server saw it: both shard jobs on one time axis
    stage = json.loads((results / "responses/summary.json").read_text())
    assert stage["shards"] == 2 and stage["capacity"] == profile["chosen_concurrency"]
    server = stage["server"]
    assert 0 < server["utilization"] <= 1.0
    if stage["new_requests"] > stage["capacity"]:  # the server can be full until C are left
        assert server["utilization"] <= server["utilization_fill"] <= 1.0
    else:  # fewer requests than C (the toy's 48 at the profiled C): no fill phase
        assert server["utilization_fill"] is None and stage["fill_s"] is None
    assert stage["server"]["output_tokens"] == stage["client"]["output_tokens"]
    assert stage["startup_s"]["first_job_to_first_request"] > 0
    assert (results / "responses/server_running.png").stat().st_size > 10_000
    mismatches = stage["render_mismatches"]
    assert len(mismatches["per_shard"]) == 2 and 0 <= mismatches["total"] < 48 / 2
    stats = json.loads((results / "dataset/stats.json").read_text())
    assert stats["samples_out"]["train"] > 0 and stats["samples_out"]["eval"] > 0
    coverage = json.loads((results / "vocab/coverage.json").read_text())
    assert coverage
    index = json.loads((results / "hidden/index.json").read_text())
    assert index["layer_ids"] == [2, 4, 5]
    draft_config = json.loads((results / "draft/checkpoint/config.json").read_text())
    assert draft_config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert draft_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    bench = json.loads((results / "bench/results.json").read_text())
    eagle = [s for s in bench["summary"] if s["config"] == "eagle3-k3"]
    assert eagle and all(s["acceptance_length"] > 1.0 for s in eagle)
    for row in (r for r in bench["rows"] if r["config"] == "eagle3-k3"):
        c = row["counters"]
        expected = 1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"]
        assert row["acceptance_length"] == pytest.approx(expected, abs=1e-3)
    assert (results / "bundle.tar").stat().st_size > 0
    verify = subprocess.run([str(Path(sys.executable).with_name("draftline")), "verify",
                             str(results / "bundle.tar")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # the shared server mechanism: one start served the profile and both shard jobs
    logs = [workdir / "logs/concurrency_profile/profile.log",
            *sorted((workdir / "logs/generate").glob("shard-*.log"))]
    text = "".join(p.read_text() for p in logs)
    assert text.count("starting vLLM server") == 1
    assert text.count("reusing vLLM server") == 2
    assert not list((results / ".servers").glob("*.json")), "a shared server outlived the run"


def test_rerun_has_nothing_to_do(pipeline):
    workdir, _ = pipeline
    assert jobs_to_run(workdir) == set()


def test_training_change_reruns_training_bench_and_bundle_only(pipeline):
    workdir, base = pipeline
    jobs = jobs_to_run(workdir, deep_update(base, {"train": {"lr": 0.001}}))
    assert jobs == {"train_draft", "export_draft", "bench", "bundle", "all"}


def test_temperature_change_reruns_generation_and_downstream(pipeline):
    workdir, base = pipeline
    jobs = jobs_to_run(workdir, deep_update(base, {"generate": {"temperature": 0.3}}))
    assert {"generate", "dataset", "vocab_map", "hidden_states", "train_draft", "bench",
            "bundle"} <= jobs
    assert "prompt_shards" not in jobs and "toy_target" not in jobs


def test_bench_change_reruns_bench_and_bundle_for_real(pipeline):
    workdir, base = pipeline
    changed = deep_update(base, {"bench": {"max_tokens": 32}})
    assert jobs_to_run(workdir, changed) == {"bench", "bundle", "all"}
    write_config(workdir, changed)
    before = (workdir / "results/draft/checkpoint/model.safetensors").stat().st_mtime_ns
    result = snakemake(workdir, "--cores", "2")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ran = set(re.findall(r"rule (\w+):", result.stdout + result.stderr))
    assert ran == {"bench", "bundle", "all"}
    assert (workdir / "results/draft/checkpoint/model.safetensors").stat().st_mtime_ns == before
    assert json.loads((workdir / "results/bench/results.json").read_text())["max_tokens"] == 32
    write_config(workdir, base)


def test_editing_a_stage_library_makes_that_stage_stale(pipeline):
    workdir, _ = pipeline
    module = workdir / "src" / "draftline" / "vocab.py"
    original = module.read_text()
    module.write_text(original + "\n# a change in the vocab stage's code\n")
    try:
        jobs = jobs_to_run(workdir)
    finally:
        module.write_text(original)
    assert "vocab_map" in jobs and "train_draft" in jobs
    assert not jobs & {"generate", "dataset", "hidden_states", "prompt_shards"}


def test_bench_against_external_endpoints(pipeline, vllm_server, tmp_path):
    """``bench.endpoints``: both configurations measured on servers the test started itself."""
    from draftline.bench import run_bench
    from draftline.server import ManagedServer, spec_from_config

    workdir, base = pipeline
    results = workdir / "results"
    config = deep_update(base, {})
    draft = results / "draft" / "checkpoint"
    server_cfg = default_config()["server"]
    eagle_spec = spec_from_config(server_cfg, str(results / "target"), speculative_config={
        "method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    with ManagedServer(eagle_spec, tmp_path / "eagle.log") as eagle:
        bench_cfg = dict(config["bench"], repetitions=3, levels=[2], num_prompts=6,
                         endpoints={"baseline": vllm_server.url, "eagle3-k3": eagle.url})
        result = run_bench(
            sorted(str(p) for p in (results / "responses").glob("shard-?.jsonl")), str(draft),
            str(results / "draft/eval.json"), None, str(tmp_path / "bench"),
            bench_cfg=bench_cfg, generate_cfg=default_config()["generate"],
            eval_fraction=config["dataset"]["eval_fraction"], server_cfg=server_cfg,
            model=str(results / "target"), state_dir=str(tmp_path / "servers"))
    assert not (tmp_path / "servers").exists()  # nothing managed was started
    assert {r["config"] for r in result["rows"]} == {"baseline", "eagle3-k3"}
    eagle_cells = [s for s in result["summary"] if s["config"] == "eagle3-k3"]
    assert eagle_cells and all(s["acceptance_length"] > 1.0 for s in eagle_cells)
    assert all(s["speedup_throughput"] is not None for s in eagle_cells)

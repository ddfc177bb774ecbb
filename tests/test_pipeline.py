"""The whole workflow with the real Snakemake on the toy target, then what reruns when.

One complete run (module-scoped: it is the expensive part), then staleness proven by dry runs
listing the jobs Snakemake would run, and one real partial rerun. The workflow is copied into a
temporary folder so that editing a stage's library code there (case 5) touches nothing here.
"""

from __future__ import annotations

import hashlib
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


def jobs_to_run(workdir: Path, config: dict | None = None, *extra: str) -> set[str]:
    """Rule names a dry run would execute (from Snakemake's job-stats table)."""
    args = ["-n", "--quiet", "rules", *extra]
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
    assert profile["sweep_stop"]["reason"] in ("plateau", "past_peak", "cap")
    # the choice by the rule as written here: the smallest level within 5% of the peak
    working = [r for r in profile["levels"] if r["errors"] == 0 and r["output_tok_s"] > 0]
    peak = max(r["output_tok_s"] for r in working)
    assert profile["chosen_concurrency"] == min(
        r["concurrency"] for r in working if r["output_tok_s"] >= 0.95 * peak)
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
    # the shared server mechanism: one start served the profile and the generate job, which
    # answered both shards in one run (one client, one pool of C over both shard files)
    logs = [results / "logs/concurrency_profile/profile.log",
            results / "logs/generate/generate.log"]
    text = "".join(p.read_text() for p in logs)
    assert text.count("starting vLLM server") == 1
    assert text.count("reusing vLLM server") == 1
    assert "prompts to ask over 2 shard(s)" in text
    # ... and the bench's baseline, measured first while that server was still up: one start
    # for the EAGLE-3 server is all the bench needed
    bench_log = (results / "logs/bench/bench.log").read_text()
    assert bench_log.index("reusing vLLM server") < bench_log.index("starting vLLM server")
    assert bench_log.count("starting vLLM server") == 1
    assert not list((results / ".servers").glob("*.json")), "a shared server outlived the run"


def split_by_hash(sample_id: str, eval_fraction: float) -> str:
    """The split rule of docs/formats.md, computed here."""
    bucket = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") % 10**6
    return "eval" if bucket < round(eval_fraction * 10**6) else "train"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shards_and_sample_counts_are_the_ones_the_config_gives(pipeline):
    """Prompt shards, responses and dataset splits recomputed from the bundled prompts and the
    config: the first max_samples records in source order, dealt round-robin in the order of
    sha256("{seed}:{id}"); every prompt answered; the splits by the id hash."""
    workdir, base = pipeline
    results = workdir / "results"
    bundled = workdir / "src" / "draftline" / "data" / "prompts.jsonl"
    first = [r["id"] for r in read_jsonl(bundled)][:base["prompts"]["max_samples"]]
    num_shards = base["prompts"]["num_shards"]
    seed = base["prompts"].get("seed", default_config()["prompts"]["seed"])
    dealt = sorted(first, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    assert sorted(p.name for p in (results / "prompts").glob("shard-*.jsonl")) == [
        f"shard-{k}.jsonl" for k in range(num_shards)]
    for k in range(num_shards):
        prompts = read_jsonl(results / f"prompts/shard-{k}.jsonl")
        assert [r["id"] for r in prompts] == dealt[k::num_shards]
        answered = read_jsonl(results / f"responses/shard-{k}.jsonl")
        errors = read_jsonl(results / f"responses/shard-{k}.errors.jsonl")
        assert sorted([r["id"] for r in answered] + [e["id"] for e in errors]) == sorted(
            dealt[k::num_shards])
    answered_ids = [r["id"] for k in range(num_shards)
                    for r in read_jsonl(results / f"responses/shard-{k}.jsonl")]
    stats = json.loads((results / "dataset/stats.json").read_text())
    dropped = {i for ids in stats["dropped_ids"].values() for i in ids}
    fraction = base["dataset"]["eval_fraction"]
    expected = {split: {i for i in answered_ids if split_by_hash(i, fraction) == split}
                for split in ("train", "eval")}
    assert stats["samples_in"] == {s: len(ids) for s, ids in expected.items()}
    assert stats["samples_out"] == {s: len(ids - dropped) for s, ids in expected.items()}
    from datasets import load_from_disk

    dataset = load_from_disk(str(results / "dataset"))
    assert {s: set(dataset[s]["id"]) for s in ("train", "eval")} == {
        s: ids - dropped for s, ids in expected.items()}


def test_bench_rows_are_clean_and_the_summary_says_what_results_json_holds(pipeline):
    workdir, base = pipeline
    bench_dir = workdir / "results" / "bench"
    bench = json.loads((bench_dir / "results.json").read_text())
    rows = bench["rows"]
    cfg = base["bench"]
    per_config = len(cfg["levels"]) * len(cfg["temperatures"]) * cfg["repetitions"]
    assert len(rows) == 2 * per_config
    # no failed request in any window (a short window on a busy host may complete none)
    assert [r["errors"] for r in rows] == [0] * len(rows)
    for row in (r for r in rows if r["config"] == "baseline"):
        assert not [k for k in row["counters"] if k.startswith("vllm:spec_decode")], row
        assert row["acceptance_length"] is None and row["acceptance_rate"] is None
    for row in (r for r in rows if r["config"] == "eagle3-k3"):
        assert row["counters"]["vllm:spec_decode_num_drafts"] > 0
    # summary.md: one table row per summary cell, its numbers those of results.json
    lines = (bench_dir / "summary.md").read_text().splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    start = next(i for i, line in enumerate(lines) if line.startswith("| config | T | C |"))
    header = cells(lines[start])
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break  # the end of the results table
        row = dict(zip(header, cells(line), strict=True))
        if row.get("config") in ("baseline", "eagle3-k3"):
            table[(row["config"], float(row["T"]), int(row["C"]))] = row
    assert len(table) == len(bench["summary"]) == 2 * len(cfg["levels"])
    for cell in bench["summary"]:
        md = table[(cell["config"], cell["temperature"], cell["concurrency"])]
        tok = cell["output_tok_s"]
        assert md["output tok/s"].startswith(
            f"{tok['median']:.1f} ({tok['min']:.1f}-{tok['max']:.1f})")
        # a window in which no request's first token arrived (a slow C = 1 window on a busy
        # host) has no TTFT: the summary shows "-", as results.json holds null
        ttft, tpot = cell["ttft_ms_p50"], cell["tpot_ms_p50"]
        assert md["TTFT p50 ms"] == ("-" if ttft is None else f"{ttft['median']:.2f}")
        assert md["TPOT p50 ms"].startswith("-" if tpot is None else f"{tpot['median']:.2f}")
        assert md["acceptance length"] == str(cell["acceptance_length"] or "-")
        assert md["speedup (tok/s)"] == str(cell["speedup_throughput"] or "-")
        assert md["speedup (TPOT)"] == str(cell["speedup_tpot"] or "-")


def test_rerun_has_nothing_to_do(pipeline):
    workdir, _ = pipeline
    assert jobs_to_run(workdir) == set()


def test_relocated_run_has_nothing_to_do(pipeline, tmp_path):
    """A finished run copied to another folder is finished there too, with the default rerun
    triggers: no recorded input, param or code hash names the folder the run was made in."""
    workdir, _ = pipeline
    moved = tmp_path / "moved"
    shutil.copytree(workdir, moved, symlinks=True)
    assert jobs_to_run(moved) == set()
    assert "Nothing to be done" in (moved / "last_dry_run.log").read_text()


def test_training_change_reruns_training_bench_and_bundle_only(pipeline):
    workdir, base = pipeline
    jobs = jobs_to_run(workdir, deep_update(base, {"train": {"lr": 0.001}}))
    assert jobs == {"train_draft", "export_draft", "bench", "bundle", "all"}


def test_adding_a_draft_variant_leaves_the_main_draft_valid(pipeline):
    """train.variants is not a param of the main training: a new variant trains and exports
    itself, and the benchmark and the bundle take it in; nothing upstream reruns."""
    workdir, base = pipeline
    variant = {"name": "p-eagle", "draft": {"drafting": "parallel"}}
    jobs = jobs_to_run(workdir, deep_update(base, {"train": {"variants": [variant]}}))
    assert jobs == {"train_variant", "export_variant", "bench", "bundle", "all"}


def test_temperature_change_reruns_generation_and_downstream(pipeline):
    workdir, base = pipeline
    jobs = jobs_to_run(workdir, deep_update(base, {"generate": {"temperature": 0.3}}))
    # the profile measures at the generation's sampling settings: it is stale too
    assert jobs == ALL_AFTER_TARGET - {"prompt_shards"}


def test_bench_change_reruns_bench_and_bundle_for_real(pipeline, vllm_server):
    workdir, base = pipeline
    # one window a configuration: the rerun proves what runs, not the draft's speed; the
    # session's server serves the baseline (bench.endpoints), the draft's is started here
    changed = deep_update(base, {"bench": {"max_tokens": 32, "levels": [1], "repetitions": 1,
                                           "endpoints": {"baseline": vllm_server.url}}})
    assert jobs_to_run(workdir, changed) == {"bench", "bundle", "all"}
    write_config(workdir, changed)
    before = (workdir / "results/draft/checkpoint/model.safetensors").stat().st_mtime_ns
    result = snakemake(workdir, "--cores", "2")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ran = set(re.findall(r"rule (\w+):", result.stdout + result.stderr))
    assert ran == {"bench", "bundle", "all"}
    assert (workdir / "results/draft/checkpoint/model.safetensors").stat().st_mtime_ns == before
    bench = json.loads((workdir / "results/bench/results.json").read_text())
    assert bench["max_tokens"] == 32
    assert sorted((s["config"], s["concurrency"]) for s in bench["summary"]) == [
        ("baseline", 1), ("eagle3-k3", 1)]
    write_config(workdir, base)


def test_editing_a_stage_library_makes_that_stage_stale(pipeline):
    workdir, _ = pipeline
    module = workdir / "src" / "draftline" / "stages" / "vocab.py"
    original = module.read_text()
    module.write_text(original + "\n# a change in the vocab stage's code\n")
    try:
        jobs = jobs_to_run(workdir)
    finally:
        module.write_text(original)
    assert jobs == {"vocab_map", "train_draft", "export_draft", "bench", "bundle", "all"}


def test_online_mode_runs_end_to_end_without_stored_states(pipeline, vllm_server, tmp_path):
    """hidden.mode online: no hidden_states job; training, export, bench and bundle run for
    real on states the training job produces, and the draft equals the offline one. The bench
    starts a server for the draft; the session's server serves the baseline."""
    from safetensors.torch import load_file

    workdir, base = pipeline
    online_dir = tmp_path / "online"
    shutil.copytree(workdir, online_dir, symlinks=True)
    online = deep_update(base, {"hidden": {"mode": "online",
                                           "online": {"max_buffer_bytes": 1 << 20}},
                                "bench": {"levels": [1], "repetitions": 1,
                                          "endpoints": {"baseline": vllm_server.url}}})
    assert jobs_to_run(online_dir, online) == {"train_draft", "export_draft", "bench",
                                               "bundle", "all"}
    shutil.rmtree(online_dir / "results" / "hidden")  # nothing stored may be read
    write_config(online_dir, online)
    result = snakemake(online_dir, "--cores", "2")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert set(re.findall(r"rule (\w+):", log)) == {"train_draft", "export_draft", "bench",
                                                      "bundle", "all"}
    results = online_dir / "results"
    assert not (results / "hidden").exists()
    stats = json.loads((results / "draft/hidden_stats.json").read_text())
    assert stats["mode"] == "online" and 0 < stats["peak_buffer_bytes"] <= 1 << 20
    assert json.loads((results / "draft/eval.json").read_text())["hidden_mode"] == "online"
    # the same draft as offline (bucketed hf states, same data order and seed) to float
    # rounding: two Snakemake jobs have produced states a last bit apart (step 1's loss
    # 14.995426 vs 14.995425 from identical weights, in 2 of 5 runs on a loaded 2-core
    # host), which 9 Muon steps grow to 2.3e-4; states of a wrong layer or a wrong shift
    # are off by far more. tests/test_online.py holds online == offline bit for bit in
    # one process.
    got = load_file(str(results / "draft/best/model.safetensors"))
    ref = load_file(str(workdir / "results/draft/best/model.safetensors"))
    assert got.keys() == ref.keys()
    diffs = {k: float((got[k].float() - ref[k].float()).abs().max()) for k in ref}
    assert max(diffs.values()) < 1e-3, diffs
    losses = [[r["loss"] for r in map(json.loads, (root / "draft/metrics.jsonl").open())
               if "grad_norm" in r] for root in (results, workdir / "results")]
    assert len(losses[0]) == len(losses[1]) > 0
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)  # every step's training loss
    online_eval = json.loads((results / "draft/eval.json").read_text())["final_eval"]
    offline_eval = json.loads((workdir / "results/draft/eval.json").read_text())["final_eval"]
    assert online_eval["step"] == offline_eval["step"]
    assert online_eval["loss"] == pytest.approx(offline_eval["loss"], rel=1e-4)
    bench = json.loads((results / "bench/results.json").read_text())
    assert all(s["acceptance_length"] > 1.0 for s in bench["summary"]
               if s["config"] == "eagle3-k3")
    assert "Hidden states: online" in _bundle_readme(results / "bundle.tar")


def _bundle_readme(tar_path: Path) -> str:
    import tarfile

    with tarfile.open(tar_path) as tar:
        name = next(n for n in tar.getnames() if n.endswith("README.md"))
        return tar.extractfile(name).read().decode()


SPEC_DECODE = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


def spec_decode_totals(url: str) -> dict[str, float]:
    """The server's spec-decode counters, read from its /metrics text and parsed here."""
    import httpx

    totals = dict.fromkeys(SPEC_DECODE, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample, value = line.rsplit(" ", 1)  # name{labels} value
        name = sample.split("{", 1)[0].removesuffix("_total")
        if name in totals:
            totals[name] += float(value)
    return totals


def test_bench_against_external_endpoints(pipeline, vllm_server, trained_toy_draft,
                                         trained_eagle_server, tmp_path):
    """``bench.endpoints``: both configurations measured on the session's servers (the toy
    target, and the toy with the session's trained draft); the acceptance the bench reports
    agrees with the server's own counters read by the test, and at T=0 the EAGLE-3 server
    answers with the baseline's tokens."""
    import openai

    from draftline.stages.bench import eval_prompts, measure_deployment_benchmark

    workdir, base = pipeline
    results = workdir / "results"
    config = deep_update(base, {})
    server_cfg = default_config()["server"]
    responses = sorted(str(p) for p in (results / "responses").glob("shard-?.jsonl"))
    draft = trained_toy_draft["checkpoint"]
    endpoints = {"baseline": vllm_server.url, "eagle3-k3": trained_eagle_server.url}
    bench_cfg = dict(config["bench"], repetitions=3, levels=[2], num_prompts=6,
                     endpoints=endpoints)
    before = spec_decode_totals(trained_eagle_server.url)
    result = measure_deployment_benchmark(
        responses, str(draft), str(trained_toy_draft["root"] / "draft/eval.json"), None,
        str(tmp_path / "bench"),
        bench_cfg=bench_cfg, generate_cfg=default_config()["generate"],
        eval_fraction=config["dataset"]["eval_fraction"], server_cfg=server_cfg,
        model=str(results / "target"), state_dir=str(tmp_path / "servers"))
    after = spec_decode_totals(trained_eagle_server.url)
    # T=0: the same prompts straight through the OpenAI client to both servers
    prompts = eval_prompts([Path(p) for p in responses], config["dataset"]["eval_fraction"],
                           4)
    answers = {}
    for name, url in endpoints.items():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        answers[name] = [client.chat.completions.create(
            model=server_cfg["served_name"], messages=p.messages, temperature=0.0,
            max_tokens=config["bench"]["max_tokens"], extra_body={"return_token_ids": True},
        ).choices[0].model_extra["token_ids"] for p in prompts]
    assert not (tmp_path / "servers").exists()  # nothing managed was started
    assert {r["config"] for r in result["rows"]} == {"baseline", "eagle3-k3"}
    eagle_cells = [s for s in result["summary"] if s["config"] == "eagle3-k3"]
    assert eagle_cells and all(s["acceptance_length"] > 1.0 for s in eagle_cells)
    assert all(s["speedup_throughput"] is not None for s in eagle_cells)
    # acceptance from the server's counters as the test read them: the bench's windows are a
    # part of the server's traffic (warm-ups are outside them), with the same prompts at T=0
    served = {k: after[k] - before[k] for k in SPEC_DECODE}
    eagle_rows = [r for r in result["rows"] if r["config"] == "eagle3-k3"]
    for name in SPEC_DECODE:
        in_windows = sum(r["counters"][name] for r in eagle_rows)
        assert 0 < in_windows <= served[name], (name, in_windows, served[name])
    served_length = 1 + served["vllm:spec_decode_num_accepted_tokens"] / served[
        "vllm:spec_decode_num_drafts"]
    (cell,) = eagle_cells
    assert cell["acceptance_length"] == pytest.approx(served_length, rel=0.15)
    # greedy speculative decoding changes the speed, never the answer
    assert all(answers["baseline"]) and answers["eagle3-k3"] == answers["baseline"]


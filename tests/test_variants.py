"""Draft variants (train.variants): several drafts trained in one run, benchmarked side by side,
bundled, planned and recommended per concurrency."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, copy_workflow, default_config
from test_bench import _row

from draftline.core import variants
from draftline.core.config import load_config
from draftline.core.config_check import ConfigError
from draftline.core.layout import Layout
from draftline.plan import format_plan, plan
from draftline.stages import bench_variants
from draftline.stages.bench import summarise, summary_markdown, train_serve_gap

P_EAGLE = {"name": "p-eagle", "draft": {"drafting": "parallel"}}
EAGLE31 = {"name": "eagle3.1", "draft": {"fc_norm": True, "norm_output": True}}


# ----------------------------------------------------------------------------- the config


def test_a_variant_is_the_main_draft_with_its_keys_changed():
    config = load_config(overrides={"train.draft": {"norm_before_residual": True},
                                    "train.variants": [P_EAGLE]})
    main = variants.main_train(config["train"])
    assert "variants" not in main  # a new variant leaves the main training's params as they were
    variant = variants.variant_train(config["train"], "p-eagle")
    assert variant["draft"]["drafting"] == "parallel"
    assert variant["draft"]["norm_before_residual"] is True  # inherited, not the schema default
    assert {k: v for k, v in variant.items() if k != "draft"} == {
        k: v for k, v in main.items() if k != "draft"}
    assert main["draft"]["drafting"] == "autoregressive"
    assert [key for key, _ in variants.drafts(config["train"])] == [
        "train.draft", "train.variants[0].draft"]


@pytest.mark.parametrize("entries, key, says", [
    ([{"name": "x", "draft": {"drafting": "paralel"}}], "train.variants[0].draft.drafting",
     "is not one of"),
    ([{"name": "x", "draft": {"fcnorm": True}}], "train.variants[0].draft.fcnorm",
     "not a train.draft key"),
    ([{"name": "x", "draft": {"fc_norm": False}}], "train.variants[0].draft", "changes nothing"),
    ([P_EAGLE, dict(P_EAGLE, draft={"fc_norm": True})], "train.variants[1].name", "twice"),
    ([{"name": "eagle3", "draft": {"fc_norm": True}}], "train.variants[0].name", ""),
    ([{"name": "x", "draft": {"arch": "deepseek_mla", "norm_before_fc": False}}],
     "train.variants[0].draft.arch", "needs a target with MLA attention"),
    ([{"name": "x", "draft": {"intermediate_size": 0}}],
     "train.variants[0].draft.intermediate_size", "minimum"),
])
def test_a_bad_variant_is_refused_naming_its_key(entries, key, says):
    with pytest.raises(ConfigError, match=rf"config key '{re.escape(key)}'.*{says}"):
        load_config(overrides={"train.variants": entries})


def test_a_variant_no_server_runs_is_refused_before_any_job(tmp_path):
    """P-EAGLE beside an MLA draft: vLLM's MLA draft class has no mask_hidden to draft in
    parallel from. A Kimi-like target (MLA) makes the MLA draft itself servable."""
    target = tmp_path / "mla-target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "kv_lora_rank": 512, "tie_word_embeddings": False}))
    mla = {"arch": "deepseek_mla", "norm_before_fc": False}
    overrides = {"target.model": str(target), "train.draft": mla}
    load_config(overrides=overrides)  # the MLA draft alone is served beside an MLA target
    with pytest.raises(ConfigError, match=r"'train.variants\[0\].draft.drafting'.*Llama"):
        load_config(overrides={**overrides, "train.variants": [P_EAGLE]})
    with pytest.raises(ConfigError, match=r"'train.draft.drafting'"):
        load_config(overrides={**overrides, "train.draft": {**mla, "drafting": "parallel"}})


def test_a_variant_cannot_take_a_further_drafts_name(tmp_path):
    folder = tmp_path / "public"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"'train.variants\[0\].name'.*taken"):
        load_config(overrides={"bench.compare_drafts": [{"name": "p-eagle",
                                                         "model": str(folder)}],
                               "train.variants": [P_EAGLE]})


def test_the_workflow_trains_exports_benchmarks_and_bundles_each_variant(tmp_path):
    """A dry run of the real Snakefile: one train and export job per variant, and the
    benchmark and the bundle read their checkpoints."""
    copy_workflow(tmp_path)
    config_file = tmp_path / "variants.yaml"
    config_file.write_text(yaml.safe_dump({"train": {"variants": [P_EAGLE, EAGLE31]}}))
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--directory", str(tmp_path),
         "--snakefile", str(tmp_path / "Snakefile"), "--configfile", str(config_file),
         "--quiet", "rules"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout + result.stderr
    counts = {line.split()[0]: int(line.split()[1]) for line in text.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    assert counts["train_draft"] == 1 and counts["export_draft"] == 1
    assert counts["train_variant"] == 2 and counts["export_variant"] == 2
    assert counts["bench"] == 1 and counts["bundle"] == 1


# ----------------------------------------------------------------------------- the benchmark


def variant_rows():
    """k=3 and k=5 at C=1 and C=16: P-EAGLE accepts less but drafts cheaper, so it is faster
    at C=16 only (at k=5); the main draft wins C=1 (at k=3)."""
    rows = []
    cells = {1: {"eagle3-k3": (40.0, 200), "eagle3-k5": (38.0, 240),
                 "p-eagle-k3": (35.0, 150), "p-eagle-k5": (33.0, 170)},
             16: {"eagle3-k3": (200.0, 200), "eagle3-k5": (190.0, 240),
                  "p-eagle-k3": (205.0, 150), "p-eagle-k5": (230.0, 170)}}
    for level, by_config in cells.items():
        rows.append(_row("baseline", level, 0, 30.0 * level ** 0.5, 6.0))
        for name, (tok_s, accepted) in by_config.items():
            rows.append(_row(name, level, 0, tok_s, 4.0, drafts=100, accepted=accepted))
    return rows


def variant_configs():
    return [{"name": "baseline", "num_speculative_tokens": None},
            {"name": "eagle3-k3", "num_speculative_tokens": 3},
            {"name": "eagle3-k5", "num_speculative_tokens": 5},
            *bench_variants.configurations(["p-eagle"], [3, 5])]


def test_each_variant_is_benchmarked_at_every_length_and_the_fastest_is_recommended():
    configs = variant_configs()
    assert configs[3] == {"name": "p-eagle-k3", "num_speculative_tokens": 3,
                          "variant": "p-eagle"}
    summary = summarise(variant_rows())
    rows = bench_variants.comparison(summary, configs,
                                     {"eagle3": "EAGLE-3", "p-eagle": "P-EAGLE"})
    by_level = {r["concurrency"]: r for r in rows}
    assert by_level[1]["serve"] == "eagle3" and by_level[1]["runner_up"] == "p-eagle"
    assert by_level[1]["drafts"]["eagle3"]["config"] == "eagle3-k3"  # its fastest length
    assert by_level[1]["drafts"]["p-eagle"]["config"] == "p-eagle-k3"
    assert by_level[1]["margin"] == pytest.approx(40 / 35, abs=1e-4)
    assert by_level[16]["serve"] == "p-eagle"
    assert by_level[16]["drafts"]["p-eagle"]["num_speculative_tokens"] == 5
    assert by_level[16]["drafts"]["p-eagle"]["acceptance_length"] == pytest.approx(2.7)
    assert by_level[16]["margin"] == pytest.approx(230 / 200, abs=1e-4)
    text = summary_markdown({"summary": summary, "num_prompts": 4, "repetitions": 1,
                             "train_serve_gap": [], "variants": rows})
    assert "## Draft variants trained in this run" in text
    assert "| 0 | 16 | 3.0 / 200.0 / 4.00 (k3) | 2.7 / 230.0 / 4.00 (k5) | p-eagle | 1.15 |" \
        in text
    assert "| T | C | eagle3 (EAGLE-3) | p-eagle (P-EAGLE) | serve | margin |" in text


def test_no_variant_no_comparison():
    configs = variant_configs()[:3]
    summary = summarise([r for r in variant_rows() if not r["config"].startswith("p-")])
    assert bench_variants.comparison(summary, configs, {}) == []


def test_a_variants_served_acceptance_is_held_against_its_own_evaluation():
    gaps = train_serve_gap(variant_rows(), variant_configs(),
                           {"simulated_acceptance_length_by_num_drafts": [1.5, 2.0, 3.0, 3.1,
                                                                          3.2]},
                           variant_evals={"p-eagle": {
                               "simulated_acceptance_length_by_num_drafts": [1.4, 1.9, 2.5,
                                                                             2.6, 2.7]}})
    by_config = {g["config"]: g for g in gaps}
    assert by_config["p-eagle-k3"]["simulated"] == 2.5  # its own, not the main draft's 3.0
    assert by_config["eagle3-k3"]["simulated"] == 3.0


@pytest.mark.parametrize("draft_cfg, label", [
    ({"architectures": ["LlamaForCausalLMEagle3"]}, "EAGLE-3"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "parallel_drafting": True}, "P-EAGLE"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "fc_norm": True}, "EAGLE-3.1"),
    ({"architectures": ["Eagle3DeepseekV3ForCausalLM"]}, "EAGLE-3 MLA"),
])
def test_the_family_label_comes_from_the_exported_config(draft_cfg, label):
    assert bench_variants.family_of(draft_cfg) == label


def test_the_benchmark_serves_each_variant_from_its_own_checkpoint(tmp_path, config,
                                                                  monkeypatch):
    import draftline.stages.bench as bench

    responses = tmp_path / "shard-0.jsonl"
    with open(responses, "w") as fh:
        for i in range(100):
            fh.write(json.dumps({"id": f"s{i}", "messages": [
                {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})
                     + "\n")
    lay = Layout(tmp_path / "results")
    lay.variant_checkpoint("p-eagle").mkdir(parents=True)
    lay.variant_checkpoint_config("p-eagle").write_text(json.dumps({"parallel_drafting": True}))
    lay.variant_eval("p-eagle").write_text(json.dumps(
        {"simulated_acceptance_length_by_num_drafts": [1.4, 1.9, 2.5]}))
    served = {}

    def record_measure_one(cfg, external, prompts, levels, temperatures, sampling, windows,
                           bench_cfg, server_cfg, model, draft_dir, *args, **kwargs):
        served[cfg["name"]] = str(draft_dir)  # test double: what each server would load
        row = _row(cfg["name"], 1, 0, 10.0, 5.0, accepted=10,
                   drafts=10 if cfg["num_speculative_tokens"] else 0)
        return [{**row, "vllm_version": "0.32.0"}]

    monkeypatch.setattr(bench, "_measure_one", record_measure_one)
    result = bench.measure_deployment_benchmark(
        [str(responses)], str(tmp_path / "draft"), None, None, str(tmp_path / "bench"),
        bench_cfg=dict(config["bench"], levels=[1], temperatures=[0.0]),
        generate_cfg=config["generate"], eval_fraction=0.2, server_cfg=config["server"],
        model=str(tmp_path / "no-such"), state_dir=str(tmp_path),
        variant_dirs={"p-eagle": str(lay.variant("p-eagle"))})
    assert served["p-eagle-k3"] == str(lay.variant_checkpoint("p-eagle"))
    assert served["eagle3-k3"] == str(tmp_path / "draft")
    [row] = result["variants"]
    assert row["drafts"]["p-eagle"]["family"] == "P-EAGLE"
    assert [g["simulated"] for g in result["train_serve_gap"]
            if g["config"] == "p-eagle-k3"] == [2.5]
    assert bench.speculative_config(served["p-eagle-k3"], 3)["parallel_drafting"] is True


# ----------------------------------------------------------------------------- plan and bundle


def test_the_plan_counts_each_variants_parameters_memory_and_time():
    config = default_config()
    alone = {r["stage"]: r for r in plan(config)}
    config["train"]["variants"] = [P_EAGLE, {"name": "small", "draft": {"intermediate_size": 64}}]
    rows = {r["stage"]: r for r in plan(config)}
    assert rows["train"]["draft_params"] == alone["train"]["draft_params"]
    hidden = 128  # the toy's
    assert rows["train p-eagle"]["draft_params"] == alone["train"]["draft_params"] + 3 * hidden
    assert rows["train small"]["draft_params"] < alone["train"]["draft_params"]
    assert rows["train p-eagle"]["basis"].startswith("P-EAGLE draft")
    per_param = 12 if config["train"]["optimizer"] == "muon" else 16  # fp32 + moments
    assert rows["train small"]["state_bytes"] == per_param * rows["train small"]["draft_params"]
    # each training takes its time; the benchmark serves two more configurations
    assert rows["total"]["time_s"] > alone["total"]["time_s"] + rows["train small"]["time_s"]
    starts = [int(re.search(r"(\d+) server starts", r["bench"]["basis"]).group(1))
              for r in (alone, rows)]
    assert starts[1] == starts[0] + 2 * len(config["bench"]["num_speculative_tokens"])
    assert "train p-eagle" in format_plan(plan(config))


def test_the_bundle_holds_each_variant_and_the_card_names_it(tmp_path):
    from test_bundle import build, make_results

    results = make_results(tmp_path / "results")
    lay = Layout(results)
    lay.variant_checkpoint("p-eagle").mkdir(parents=True)
    main_cfg = json.loads(lay.checkpoint_config.read_text())
    lay.variant_checkpoint_config("p-eagle").write_text(
        json.dumps(dict(main_cfg, parallel_drafting=True, mask_token_id=0)))
    lay.variant_checkpoint_weights("p-eagle").write_bytes(lay.checkpoint_weights.read_bytes())
    lay.variant_eval("p-eagle").write_text(json.dumps({"simulated_acceptance_length": 2.1}))
    lay.variant_metrics("p-eagle").write_text('{"step": 1, "loss": 3.0}\n')
    bench = json.loads(lay.bench_results.read_text())
    bench["variants"] = [{"temperature": 0.0, "concurrency": 16, "serve": "p-eagle",
                          "runner_up": "eagle3", "margin": 1.15, "drafts": {
                              "p-eagle": {"num_speculative_tokens": 5}}},
                         {"temperature": 0.0, "concurrency": 1, "serve": "eagle3",
                          "runner_up": "p-eagle", "margin": 1.0013, "drafts": {
                              "eagle3": {"num_speculative_tokens": 3}}}]
    lay.bench_results.write_text(json.dumps(bench))
    manifest = build(results)
    listed = {f["path"] for f in manifest["files"]}
    assert {"variants/p-eagle/config.json", "variants/p-eagle/model.safetensors",
            "variants/p-eagle/training/eval.json",
            "variants/p-eagle/training/metrics.jsonl"} <= listed
    card = (results / "bundle" / "README.md").read_text()
    assert "## Draft variants" in card
    assert "| p-eagle | P-EAGLE | variants/p-eagle |" in card
    assert "| 0 | 16 | p-eagle | 5 | 1.15 |" in card
    assert "| 0 | 1 | eagle3 | 3 | 1.0013 ~ |" in card  # a tie within noise says so
    assert '"parallel_drafting": true' in card and "/variants/p-eagle" in card


def test_bundle_inputs_find_the_variants_of_a_results_folder(tmp_path):
    from draftline.stages.bundle import BundleInputs

    lay = Layout(tmp_path)
    lay.variant_checkpoint("b").mkdir(parents=True)
    lay.variant_checkpoint_config("b").write_text("{}")
    (lay.variants / "half-written").mkdir()  # no exported checkpoint: not a variant yet
    assert BundleInputs.from_results(tmp_path).variant_dirs == {"b": lay.variant("b")}


def test_the_layout_keeps_each_variant_apart_from_the_main_draft(tmp_path):
    lay = Layout(tmp_path)
    assert lay.variant_checkpoint_config("p") == tmp_path / "variants/p/checkpoint/config.json"
    assert lay.variant_eval("p").name == lay.train_eval.name
    assert not lay.variant("p").is_relative_to(lay.draft)
    assert Path(REPO / "rules" / "draft.smk").read_text().count("use rule") == 2

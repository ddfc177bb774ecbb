"""Token counting for the draft vocab: vectorised streaming count vs a naive Counter loop.

Builds a synthetic dataset in the pipeline's format (``input_ids`` int64, ``loss_mask`` int8;
Zipf-distributed ids over a 163,840-token vocabulary, as Kimi-K2.5's; the first part of each
sample unsupervised, like a prompt), saves it with ``datasets``, then measures each method
in a fresh subprocess:

* ``draftline.stages.vocab.count_tokens`` (Arrow batches + ``np.bincount``) on the small and the
  large dataset: equal peak memory on both shows it does not grow with the dataset;
* a naive loop (``for row in dataset: Counter(...)``) on the small dataset, for the ratio.

Peak memory: ``VmHWM`` (peak resident set, includes pages of the memory-mapped dataset the
kernel may drop at will) and the peak of ``RssAnon`` (anonymous memory, i.e. what the process
itself allocated), sampled every 5 ms, both minus the value after imports.

    python benchmarks/vocab.py [--tokens 10_000_000] [--scale 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

VOCAB = 163_840


def make_dataset(path: Path, tokens: int, vocab: int, seed: int) -> dict:
    """Synthetic DatasetDict (train split) of about ``tokens`` tokens at ``path``."""
    from datasets import Dataset, DatasetDict

    from draftline.stages.dataset import SplitWriter, dataset_features, make_sample

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    writer = SplitWriter(path / "scratch.arrow", dataset_features().arrow_schema)
    total = supervised = n = 0
    while total < tokens:
        length = int(rng.integers(256, 4096))
        ids = (rng.zipf(1.2, length) - 1) % vocab  # frequent low ids, a long tail
        n_prompt = int(rng.integers(16, length // 2))
        writer.add(make_sample(f"s{n}", ids.tolist(), n_prompt, length))
        total, supervised, n = total + length, supervised + length - n_prompt, n + 1
    writer.close()
    DatasetDict({"train": Dataset.from_file(str(writer.path))}).save_to_disk(str(path / "ds"))
    (path / "scratch.arrow").unlink()
    return {"samples": n, "tokens": total, "supervised": supervised}


class MemoryWatch:
    """Peak RssAnon (sampled) and VmHWM from /proc/self/status, relative to a baseline."""

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.base_anon = self._read("RssAnon")
        self.base_hwm = self._read("VmRSS")
        self.peak_anon = self.base_anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, self._read("RssAnon"))
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_anon = max(self.peak_anon, self._read("RssAnon"))
        self.peak_rss = self._read("VmHWM")

    def result(self) -> dict:
        return {
            "peak_anon_mib": (self.peak_anon - self.base_anon) / 2**20,
            "peak_rss_mib": (self.peak_rss - self.base_hwm) / 2**20,
        }


def naive_count(ds_dir: Path) -> Counter:
    from datasets import load_from_disk

    counter: Counter = Counter()
    for row in load_from_disk(str(ds_dir))["train"]:
        for token, supervised in zip(row["input_ids"], row["loss_mask"], strict=True):
            if supervised:
                counter[token] += 1
    return counter


def worker(method: str, ds_dir: Path, vocab: int, batch_size: int, check: Path | None) -> dict:
    import datasets  # noqa: F401  (imported before the memory baseline)

    from draftline.stages.vocab import count_tokens

    with MemoryWatch() as watch:
        start = time.perf_counter()
        if method == "vectorised":
            counts = count_tokens(ds_dir, vocab, batch_size=batch_size)
        else:
            counter = naive_count(ds_dir)
        seconds = time.perf_counter() - start
    if method == "vectorised":
        if check is not None:
            np.save(check, counts)
        counted = int(counts.sum())
    else:
        counted = sum(counter.values())
        if check is not None:
            reference = np.load(check)
            got = np.zeros(vocab, dtype=np.int64)
            got[list(counter)] = list(counter.values())
            assert np.array_equal(got, reference), "naive and vectorised counts differ"
    return {"seconds": seconds, "supervised_counted": counted, **watch.result()}


def run_worker(method: str, ds_dir: Path, args, check: Path | None) -> dict:
    cmd = [
        sys.executable, __file__, "--worker", method, "--data", str(ds_dir),
        "--vocab", str(args.vocab), "--batch-size", str(args.batch_size),
    ]  # fmt: skip
    if check is not None:
        cmd += ["--check", str(check)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=10_000_000, help="small dataset size")
    parser.add_argument("--scale", type=int, default=4, help="large dataset = scale x small")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per Arrow batch")
    parser.add_argument("--worker", choices=["vectorised", "naive"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--check", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.data, args.vocab, args.batch_size, args.check)))
        return

    with tempfile.TemporaryDirectory(prefix="vocab-bench-") as tmp:
        tmp = Path(tmp)
        small = make_dataset(tmp / "small", args.tokens, args.vocab, seed=0)
        large = make_dataset(tmp / "large", args.tokens * args.scale, args.vocab, seed=1)
        check = tmp / "counts.npy"
        runs = [
            ("vectorised", small, run_worker("vectorised", tmp / "small/ds", args, check)),
            ("naive Counter", small, run_worker("naive", tmp / "small/ds", args, check)),
            ("vectorised", large, run_worker("vectorised", tmp / "large/ds", args, None)),
        ]
    naive_rate = runs[1][1]["tokens"] / runs[1][2]["seconds"]
    print(f"vocab {args.vocab:,}, {args.batch_size} samples per batch")
    header = (
        f"{'method':<14} {'tokens':>12} {'supervised':>12} {'seconds':>8} "
        f"{'tokens/s':>13} {'x naive':>8} {'peak anon MiB':>14} {'peak RSS MiB':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, data, r in runs:
        rate = data["tokens"] / r["seconds"]
        print(
            f"{name:<14} {data['tokens']:>12,} {data['supervised']:>12,} {r['seconds']:>8.2f} "
            f"{rate:>13,.0f} {rate / naive_rate:>8.1f} {r['peak_anon_mib']:>14.1f} "
            f"{r['peak_rss_mib']:>13.1f}"
        )
    print("naive and vectorised counts are identical on the small dataset")


if __name__ == "__main__":
    main()

"""Benchmark of online training (hidden.mode online) against offline, on the toy.

On the same dataset, target, vocab map and train config (same data order and seed):

* offline: ``extract`` (hf backend) then ``train`` on the stored states: wall time of each,
  bytes of hidden states stored;
* online: ``train`` producing the states in the training process: wall time, the peak bytes
  of states held (in memory; nothing is written), the producer's time and tokens/s, the time
  the trainer waited on the producer;
* the simulated acceptance length of both drafts (equal: the weights are bit-identical on
  CPU, which is checked), and the ratios the issue sets targets for. ``--epoch-cache-bytes 0``
  measures online mode producing every epoch's states again (the toy's states fit the default
  epoch cache, so by default they are produced once).

``--producer vllm`` compares the vllm pair instead: offline extraction with the vllm backend
(an in-process engine, started in every repetition) then training, against online training
whose states a vLLM server writes into the spool (one shared managed server for all
repetitions, its start reported apart); the online figures then add the consumer's rate and
the spool's peak bytes on disk.

Usage (a results folder of the toy pipeline, with dataset/, target/ and vocab/)::

    snakemake --cores all vocab_map     # once, the default toy config (dataset too)
    python benchmarks/online.py --results results --out /tmp/online-bench
    python benchmarks/online.py --results results --out /tmp/online-bench-0 --epoch-cache-bytes 0
    python benchmarks/online.py --results results --out /tmp/online-bench-vllm --producer vllm

Runs one after the other, in one process, with the same torch thread count: ``--repetitions``
interleaved offline/online pairs (medians and ranges; this host is shared). Prints a table
and writes ``online_benchmark.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from benchlib.inputs import default_config, folder_bytes

from draftline.stages.hidden import extract_hidden_states
from draftline.stages.train import train_draft


def weights_equal(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _offline_once(dataset: Path, target: Path, vocab_map: Path, out: Path, hidden_cfg: dict,
                  train_cfg: dict, server: dict) -> dict:
    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    started = time.perf_counter()
    extract_hidden_states(dataset, target, out / "hidden", {**hidden_cfg, "mode": "offline"},
                          server["server"])
    extract_s = time.perf_counter() - started
    if multiprocessing is None:  # set by vllm's in-process engine; not for the producer server
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    started = time.perf_counter()
    result = train_draft(out / "hidden", vocab_map, target, out / "offline", train_cfg)
    train_s = time.perf_counter() - started
    return {"extract_s": extract_s, "train_s": train_s, "total_s": extract_s + train_s,
            "stored_state_bytes": folder_bytes(out / "hidden"),
            "simulated_acceptance_length": result["simulated_acceptance_length"]}


def _online_once(dataset: Path, target: Path, vocab_map: Path, out: Path, hidden_cfg: dict,
                 train_cfg: dict, server: dict) -> dict:
    started = time.perf_counter()
    result = train_draft(None, vocab_map, target, out / "online", train_cfg,
                         online={"dataset_dir": dataset, **server,
                                 "hidden": {**hidden_cfg, "mode": "online"}})
    train_s = time.perf_counter() - started
    stats = json.loads((out / "online" / "hidden_stats.json").read_text())
    # state files of the online run: any safetensors besides the draft's own weights
    on_disk = sum(p.stat().st_size for p in (out / "online").rglob("*.safetensors")
                  if not {"state", "best"} & set(p.relative_to(out / "online").parts))
    start_s = stats.get("start_s") or 0.0  # the producer's start (vllm: the server's)
    # vllm: the server's start is reported apart (a run starts it once; hf loads the target
    # in the training process, as extraction does, and keeps it in train_s)
    apart = start_s if hidden_cfg["backend"] == "vllm" else 0.0
    return {"train_s": train_s - apart, "producer_start_s": start_s,
            "consumer_tok_s": stats["consumer_tok_s"],
            "peak_spool_bytes": stats.get("peak_spool_bytes") or 0,
            "peak_buffer_bytes": stats["peak_buffer_bytes"],
            "max_buffer_bytes": stats["max_buffer_bytes"], "state_bytes_on_disk": on_disk,
            "produce_s": stats["produce_s"], "producer_tok_s": stats["producer_tok_s"],
            "trainer_wait_s": stats["wait_s"],
            "cached_share": round(stats.get("cached_tokens", 0) / max(
                1, stats.get("cached_tokens", 0) + stats["produced_tokens"]), 3),
            "simulated_acceptance_length": result["simulated_acceptance_length"]}


def _medians(runs: list[dict]) -> dict:
    """Per key: the median over the runs (numbers), with the runs' range for timings."""
    out = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            out[key] = round(statistics.median(values), 3)
            if key.endswith("_s"):
                out[f"{key}_range"] = [round(min(values), 1), round(max(values), 1)]
        else:
            out[key] = first
    return out


def run(results: Path, out: Path, config: dict, repetitions: int, producer: str = "hf") -> dict:
    """``repetitions`` interleaved pairs (offline then online, then online then offline, ...);
    the figures are medians, the ratio is the ratio of the medians."""
    from draftline.serving.server import stop_all

    hidden_cfg = {**config["hidden"], "trust_remote_code": False, "backend": producer}
    train_cfg = config["train"]
    dataset, target = results / "dataset", results / "target"
    vocab_map = results / "vocab" / "vocab_map.safetensors"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # vllm online: one shared server for every repetition (long idle timeout), stopped at the end
    server = {"server": {**config["server"], "idle_timeout_s": 3600},
              "server_state_dir": str(out / "servers")}
    try:
        result = _repetitions(dataset, target, vocab_map, out, hidden_cfg, train_cfg, server,
                              repetitions)
    finally:
        stop_all(out / "servers")
    return {"producer": producer, **result}


def _repetitions(dataset: Path, target: Path, vocab_map: Path, out: Path, hidden_cfg: dict,
                 train_cfg: dict, server: dict, repetitions: int) -> dict:
    packed_s = None
    if hidden_cfg["backend"] == "hf":  # packed batching: the cost of bucketing, for reference
        started = time.perf_counter()
        extract_hidden_states(dataset, target, out / "hidden-packed",
                              {**hidden_cfg, "hf_batching": "packed"})
        packed_s = round(time.perf_counter() - started, 1)
    offline_runs, online_runs, identical_runs = [], [], []
    for rep in range(repetitions):
        rep_dir = out / f"rep-{rep}"
        args = (dataset, target, vocab_map, rep_dir, hidden_cfg, train_cfg, server)
        if rep % 2 == 0:
            offline_runs.append(_offline_once(*args))
            online_runs.append(_online_once(*args))
        else:
            online_runs.append(_online_once(*args))
            offline_runs.append(_offline_once(*args))
        identical = weights_equal(rep_dir / "offline" / "best", rep_dir / "online" / "best")
        if rep:  # keep the first repetition's folders for inspection, and the disk free
            shutil.rmtree(rep_dir)
        identical_runs.append(identical)
        if not identical and hidden_cfg["backend"] == "hf":  # hf: bit-identical by contract
            raise SystemExit(f"repetition {rep}: online and offline weights differ")
    offline, online = _medians(offline_runs), _medians(online_runs)
    offline["extract_packed_s"] = packed_s
    online["producer_start_s"] = round(max(r["producer_start_s"] for r in online_runs), 1)
    # what online mode holds at most: the spool on disk (vllm) or the queue in memory (hf)
    held = online["peak_spool_bytes"] if hidden_cfg["backend"] == "vllm" else \
        online["peak_buffer_bytes"]
    return {
        "config": {"train": train_cfg, "hidden": hidden_cfg}, "repetitions": repetitions,
        "offline": offline, "online": online,
        "ratios": {"online_time_vs_offline": round(online["train_s"] / offline["total_s"], 3),
                   "offline_bytes_vs_online_peak": round(offline["stored_state_bytes"] / held,
                                                         1),
                   "acceptance_online_vs_offline": round(
                       online["simulated_acceptance_length"]
                       / offline["simulated_acceptance_length"], 4)},
        "bit_identical_weights": all(identical_runs),  # every repetition checked above
    }


def _timed(fig: dict, key: str) -> str:
    low, high = fig[f"{key}_range"]
    return f"{fig[key]:.1f} s ({low}-{high})"


def table(result: dict) -> str:
    off, on, ratio = result["offline"], result["online"], result["ratios"]
    vllm = result["producer"] == "vllm"
    held = (f"{on['peak_spool_bytes']:,} B (spool peak on disk, bound "
            f"{on['max_buffer_bytes']:,} B)" if vllm else
            f"{on['state_bytes_on_disk']:,} B (queue peak {on['peak_buffer_bytes']:,} B in "
            f"memory, bound {on['max_buffer_bytes']:,} B)")
    packed = "" if vllm else f" (packed batching: {off['extract_packed_s']} s)"
    start = f"server start {on['producer_start_s']} s apart; " if vllm else ""
    rows = [
        ("producer (hidden.backend)", result["producer"], result["producer"]),
        ("hidden states on disk (peak)", f"{off['stored_state_bytes']:,} B", held),
        ("extraction", f"{_timed(off, 'extract_s')}{packed}",
         f"{_timed(on, 'produce_s')} inside training "
         f"({on['producer_tok_s']} tok/s; {on['cached_share']:.0%} of the states from the "
         f"epoch cache of {result['config']['hidden']['online']['epoch_cache_bytes']:,} B)"),
        ("train stage", _timed(off, "train_s"),
         f"{_timed(on, 'train_s')} ({start}trainer waited {on['trainer_wait_s']} s, "
         f"consumed {on['consumer_tok_s']} tok/s)"),
        ("extraction + training", _timed(off, "total_s"),
         f"{_timed(on, 'train_s')} ({ratio['online_time_vs_offline']}x offline)"),
        ("simulated acceptance length", f"{off['simulated_acceptance_length']:.4f}",
         f"{on['simulated_acceptance_length']:.4f} (bit-identical weights: "
         f"{result['bit_identical_weights']})"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"medians (ranges) of {result['repetitions']} interleaved repetitions",
             f"{'':<{width}}  offline | online", "-" * 100]
    lines += [f"{name:<{width}}  {a} | {b}" for name, a, b in rows]
    lines.append(f"offline stored bytes / online peak {'spool' if vllm else 'queue in memory'}"
                 f": {ratio['offline_bytes_vs_online_peak']}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--out", type=Path, default=Path("/tmp/draftline-online-bench"))
    parser.add_argument("--max-buffer-bytes", type=int, default=4 << 20)
    parser.add_argument("--prefetch", type=int, default=None,
                        help="hidden.online.prefetch (default: the producer's, hf 0, vllm 2)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--epoch-cache-bytes", type=int, default=None,
                        help="hidden.online.epoch_cache_bytes (0: produce every epoch again; "
                             "default: the config's)")
    parser.add_argument("--producer", choices=("hf", "vllm"), default="hf",
                        help="hidden.backend of both modes (vllm: engine offline, server online)")
    args = parser.parse_args()
    overrides = {"hidden.online.max_buffer_bytes": args.max_buffer_bytes}
    if args.prefetch is not None:
        overrides["hidden.online.prefetch"] = args.prefetch
    if args.epoch_cache_bytes is not None:
        overrides["hidden.online.epoch_cache_bytes"] = args.epoch_cache_bytes
    config = default_config(args.config, overrides)
    result = run(args.results, args.out, config, args.repetitions, args.producer)
    (args.out / "online_benchmark.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

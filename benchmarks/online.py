"""Benchmark of online training (hidden.mode online) against offline, on the toy.

On the same dataset, target, vocab map and train config (same data order and seed):

* offline: ``extract`` (hf backend) then ``train`` on the stored states: wall time of each,
  bytes of hidden states stored;
* online: ``train`` producing the states in the training process: wall time, the peak bytes
  of states held (in memory; nothing is written), the producer's time and tokens/s, the time
  the trainer waited on the producer;
* the simulated acceptance length of both drafts (equal: the weights are bit-identical on
  CPU, which is checked), the ratios the issue sets targets for, and what re-producing the
  states every epoch costs (the producer time per epoch).

Usage (a results folder of the toy pipeline, with dataset/, target/ and vocab/)::

    snakemake --cores all --until dataset vocab_map     # once, the default toy config
    python benchmarks/online.py --results results --out /tmp/online-bench

Runs one after the other, in one process, with the same torch thread count. Prints a table
and writes ``online_benchmark.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from draftline.config import load_config
from draftline.hidden import extract_hidden_states
from draftline.train import train_draft


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def weights_equal(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def run(results: Path, out: Path, config: dict) -> dict:
    hidden_cfg = {**config["hidden"], "trust_remote_code": False}
    train_cfg = config["train"]
    dataset, target = results / "dataset", results / "target"
    vocab_map = results / "vocab" / "vocab_map.safetensors"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    started = time.perf_counter()  # packed batching: the cost of bucketing, for reference
    extract_hidden_states(dataset, target, out / "hidden-packed",
                          {**hidden_cfg, "hf_batching": "packed"})
    packed_s = time.perf_counter() - started
    started = time.perf_counter()
    extract_hidden_states(dataset, target, out / "hidden", {**hidden_cfg, "mode": "offline"})
    extract_s = time.perf_counter() - started
    stored = folder_bytes(out / "hidden")
    started = time.perf_counter()
    offline = train_draft(out / "hidden", vocab_map, target, out / "offline", train_cfg)
    offline_train_s = time.perf_counter() - started

    started = time.perf_counter()
    online = train_draft(None, vocab_map, target, out / "online", train_cfg,
                   online={"dataset_dir": dataset, "hidden": {**hidden_cfg, "mode": "online"}})
    online_s = time.perf_counter() - started
    stats = json.loads((out / "online" / "hidden_stats.json").read_text())
    # state files of the online run: any safetensors besides the draft's own weights
    online_disk = sum(p.stat().st_size for p in (out / "online").rglob("*.safetensors")
                      if not {"state", "best"} & set(p.relative_to(out / "online").parts))
    epochs = train_cfg["epochs"]
    return {
        "config": {"train": train_cfg, "hidden": hidden_cfg},
        "offline": {"extract_s": round(extract_s, 1), "extract_packed_s": round(packed_s, 1),
                    "train_s": round(offline_train_s, 1),
                    "total_s": round(extract_s + offline_train_s, 1),
                    "stored_state_bytes": stored,
                    "simulated_acceptance_length": offline["simulated_acceptance_length"]},
        "online": {"train_s": round(online_s, 1),
                   "peak_buffer_bytes": stats["peak_buffer_bytes"],
                   "max_buffer_bytes": stats["max_buffer_bytes"],
                   "state_bytes_on_disk": online_disk,
                   "produce_s": stats["produce_s"], "producer_tok_s": stats["producer_tok_s"],
                   "produce_s_per_epoch": round(stats["produce_s"] / epochs, 1),
                   "trainer_wait_s": stats["wait_s"],
                   "simulated_acceptance_length": online["simulated_acceptance_length"]},
        "ratios": {"online_time_vs_offline": round(online_s / (extract_s + offline_train_s), 3),
                   "offline_bytes_vs_online_peak": round(stored / stats["peak_buffer_bytes"], 1),
                   "acceptance_online_vs_offline": round(
                       online["simulated_acceptance_length"]
                       / offline["simulated_acceptance_length"], 4)},
        "bit_identical_weights": weights_equal(out / "offline" / "best", out / "online" / "best"),
    }


def table(result: dict) -> str:
    off, on, ratio = result["offline"], result["online"], result["ratios"]
    rows = [
        ("hidden states on disk (peak)", f"{off['stored_state_bytes']:,} B",
         f"{on['state_bytes_on_disk']:,} B (buffer peak {on['peak_buffer_bytes']:,} B in memory"
         f", bound {on['max_buffer_bytes']:,} B)"),
        ("extraction", f"{off['extract_s']} s (packed batching: {off['extract_packed_s']} s)",
         f"{on['produce_s']} s inside training "
         f"({on['produce_s_per_epoch']} s/epoch, {on['producer_tok_s']} tok/s)"),
        ("train stage", f"{off['train_s']} s", f"{on['train_s']} s (trainer waited "
         f"{on['trainer_wait_s']} s)"),
        ("extraction + training", f"{off['total_s']} s", f"{on['train_s']} s "
         f"({ratio['online_time_vs_offline']}x offline)"),
        ("simulated acceptance length", f"{off['simulated_acceptance_length']:.4f}",
         f"{on['simulated_acceptance_length']:.4f} (bit-identical weights: "
         f"{result['bit_identical_weights']})"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  offline | online", "-" * 100]
    lines += [f"{name:<{width}}  {a} | {b}" for name, a, b in rows]
    lines.append(f"offline stored bytes / online peak buffer: "
                 f"{ratio['offline_bytes_vs_online_peak']}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--out", type=Path, default=Path("/tmp/draftline-online-bench"))
    parser.add_argument("--max-buffer-bytes", type=int, default=4 << 20)
    parser.add_argument("--prefetch", type=int, default=2)
    args = parser.parse_args()
    config = load_config(args.config, {"hidden.online.max_buffer_bytes": args.max_buffer_bytes,
                                       "hidden.online.prefetch": args.prefetch})
    result = run(args.results, args.out, config)
    (args.out / "online_benchmark.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

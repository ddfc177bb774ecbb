"""The peer trainer, speculators 0.9.0: its EAGLE-3, P-EAGLE, DFlash or DSpark draft trained
on draftline's stored hidden states (``train_peer``), for ``benchmarks/draft_quality.py``'s
peer rows and the ``benchmarks/peer_speculators.py`` command, which documents it in full.

speculators is installed, without its dependencies, into a private folder (``ensure_peer``)
and imported only by a subprocess (``benchmarks/peer_speculators.py --worker``) that appends
that folder to its module path; nothing of speculators enters the caller's process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the script the worker subprocess runs (its ``--worker``): draftline's process never imports
# speculators
PEER_SCRIPT = ROOT / "benchmarks" / "peer_speculators.py"
PEER_VERSION = "0.9.0"
PEER_REQUIREMENTS = (f"speculators=={PEER_VERSION}", f"hs-connectors=={PEER_VERSION}",
                     "loguru", "pydantic-settings", "typer")
DEFAULT_PEER_DIR = ROOT / "benchmarks" / ".peer" / f"speculators-{PEER_VERSION}"
INSTALLED_MARKER = ".installed.json"
# What a CPU needs that the CLI's defaults do not give (see the module docstring).
CPU_FLAGS = {"--draft-attn-impl": "sdpa", "--loss-implementation": "eager", "--num-workers": "0"}
LOG_TAIL_CHARS = 4000
# the peer's draft families (its --speculator-type) this harness trains, and the architecture
# flags each takes: unset ones stay at the CLI's defaults (num_layers: 1 for eagle3/peagle, 5
# for dflash/dspark; block_size: 16 for dflash, 8 for dspark; num_depths: 8)
FAMILIES = {"eagle3": ("num_layers",),
            "peagle": ("num_layers", "num_depths"),
            "dflash": ("num_layers", "block_size", "mask_token_id"),
            "dspark": ("num_layers", "block_size", "mask_token_id")}


# ----------------------------------------------------------------------------- install


def ensure_peer(folder: Path | None = None) -> Path:
    """Install speculators and the modules it imports into ``folder`` unless already there."""
    folder = Path(folder or DEFAULT_PEER_DIR).resolve()
    marker = folder / INSTALLED_MARKER
    if marker.exists() and json.loads(marker.read_text()) == list(PEER_REQUIREMENTS):
        return folder
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(staging), *PEER_REQUIREMENTS], check=True)
    (staging / INSTALLED_MARKER).write_text(json.dumps(list(PEER_REQUIREMENTS)))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


# ----------------------------------------------------------------------------- data


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def input_facts(results: Path) -> dict:
    """What fixes the peer's inputs: fingerprints of the states, the vocab map, the target."""
    from draftline.stages.hidden.store import read_index

    hidden, target = results / "hidden", results / "target"
    index = read_index(hidden)
    return {
        "target": str(target),
        "target_config_sha256": sha256_of(target / "config.json"),
        "hidden_index_sha256": sha256_of(hidden / "index.json"),
        "vocab_map_sha256": sha256_of(results / "vocab" / "vocab_map.safetensors"),
        "layer_ids": [int(i) for i in index["layer_ids"]],
        "num_target_layers": int(index["num_layers"]),
        "hidden_size": int(index["hidden_size"]),
    }


def write_sample(path: Path, sample: dict) -> None:
    """One sample as vLLM's hidden-state connector stores it: ``token_ids``, and
    ``hidden_states [n, aux layers + 1, H]`` (aux layers in order, then the final state)."""
    import torch
    from safetensors.torch import save_file

    n, hidden = sample["final"].shape
    states = torch.cat([sample["aux"].reshape(n, -1, hidden), sample["final"].unsqueeze(1)], 1)
    save_file({"hidden_states": states.contiguous(),
               "token_ids": sample["input_ids"].to(torch.int64).contiguous()}, str(path))


def write_dataset(store, data_dir: Path) -> dict:
    """The train split then the eval split, in speculators' format; return their sizes."""
    import torch
    from datasets import Dataset

    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    counts, tokens = {}, {}
    (data_dir / "hidden_states").mkdir(parents=True)
    for split in ("train", "eval"):
        refs = store.samples.get(split, [])
        counts[split], tokens[split] = len(refs), sum(ref.length for ref in refs)
        for ref in refs:
            sample = store.read(ref)
            write_sample(data_dir / "hidden_states" / f"hs_{len(rows['seq_len'])}.safetensors",
                         sample)
            rows["input_ids"].append(sample["input_ids"].to(torch.int64).tolist())
            rows["loss_mask"].append(sample["loss_mask"].to(torch.int64).tolist())
            rows["seq_len"].append(ref.length)
    if not counts["train"] or not counts["eval"]:
        raise ValueError(f"{store.origin}: the peer needs train and eval samples, got {counts}")
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data_dir))
    return {"train_samples": counts["train"], "train_tokens": tokens["train"],
            "val_samples": counts["eval"], "val_tokens": tokens["eval"]}


def write_vocab(vocab_map: Path, data_dir: Path) -> dict:
    """draftline's map as the CLI's ``d2t-{D}.npy``/``t2d-{D}.npy`` (none for an identity)."""
    import numpy as np
    from safetensors.torch import load_file

    tensors = load_file(str(vocab_map))
    d2t, t2d = tensors["d2t"].to("cpu"), tensors["t2d"].to("cpu").bool()
    draft, target = int(d2t.shape[0]), int(t2d.shape[0])
    if draft < target:
        np.save(data_dir / f"d2t-{draft}.npy", d2t.numpy().astype(np.int64))
        np.save(data_dir / f"t2d-{draft}.npy", t2d.numpy())
    return {"draft_vocab_size": draft, "target_vocab_size": target}


def convert(results: Path, data_dir: Path, facts: dict) -> dict:
    """draftline's stored samples and vocab map as speculators' ``--data-path`` folder.

    Reused when its recorded input facts match.
    """
    from draftline.stages.hidden.store import HiddenStates

    marker = data_dir / "draftline-source.json"
    if marker.exists():
        recorded = json.loads(marker.read_text())
        if recorded["facts"] == facts:
            return recorded["data"]
    shutil.rmtree(data_dir, ignore_errors=True)
    store = HiddenStates(results / "hidden")
    try:
        data = write_dataset(store, data_dir)
    finally:
        store.close()
    data.update(write_vocab(results / "vocab" / "vocab_map.safetensors", data_dir))
    marker.write_text(json.dumps({"facts": facts, "data": data}, indent=1))
    return data


# ----------------------------------------------------------------------------- run


def train_data_ratio(data: dict) -> float:
    """The CLI's ``--train-data-ratio`` that splits exactly after the train samples."""
    total = data["train_samples"] + data["val_samples"]
    return (data["train_samples"] + 0.5) / total


def peer_argv(paths: dict, facts: dict, data: dict, run: dict) -> list[str]:
    """``speculators train`` arguments: the run's own, the CPU flags, the rest at defaults."""
    argv = ["--speculator-type", run.get("family", "eagle3"),
            "--verifier-name-or-path", paths["target"],
            "--data-path", paths["data"], "--save-path", paths["save"],
            "--log-dir", paths["logs"],
            "--train-data-ratio", repr(train_data_ratio(data)),
            "--target-layer-ids", *[str(i) for i in facts["layer_ids"]],
            "--seed", str(run["seed"]), "--lr", repr(run["lr"]),
            "--epochs", str(run["epochs"]), "--ttt-steps", str(run["ttt_steps"]),
            "--optimizer", run["optimizer"]]
    if run["total_seq_len"] is not None:
        argv += ["--total-seq-len", str(run["total_seq_len"])]
    for key in ("num_layers", "block_size", "num_depths", "mask_token_id"):
        if run.get(key) is not None:
            argv += ["--" + key.replace("_", "-"), str(run[key])]
    if data["draft_vocab_size"] < data["target_vocab_size"]:
        argv += ["--draft-vocab-size", str(data["draft_vocab_size"])]
    for flag, value in CPU_FLAGS.items():
        argv += [flag, value]
    return argv


def run_worker(job: dict, out_dir: Path) -> dict:
    """Train in a subprocess (speculators on its ``sys.path``); its log goes to train.log."""
    job_path, result_path = out_dir / "job.json", out_dir / "worker.json"
    result_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps({**job, "result": str(result_path)}, indent=1))
    log_path = out_dir / "train.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(PEER_SCRIPT), "--worker", str(job_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(out_dir))
    if proc.returncode != 0:
        tail = log_path.read_text()[-LOG_TAIL_CHARS:]
        raise RuntimeError(f"peer training failed (exit {proc.returncode}), log {log_path}:\n"
                           f"{tail}")
    return json.loads(result_path.read_text())


def cached_result(out_dir: Path, settings: dict) -> dict | None:
    """The recorded result of an identical earlier run whose checkpoint is still there."""
    record_path = out_dir / "peer.json"
    if not record_path.exists():
        return None
    record = json.loads(record_path.read_text())
    recorded = {k: v for k, v in record.get("settings", {}).items() if k != "resolved"}
    if recorded != settings or not Path(record["checkpoint"], "config.json").exists():
        return None
    return record


def train_peer(results: Path, out_dir: Path, *, seed: int, lr: float, epochs: int = 4,
               ttt_steps: int = 3, optimizer: str = "muon",
               peer_dir: Path | None = None, total_seq_len: int | None = None,
               family: str = "eagle3", num_layers: int | None = None,
               block_size: int | None = None, num_depths: int | None = None,
               mask_token_id: int | None = None) -> dict:
    """Train speculators' ``family`` draft (eagle3, peagle, dflash, dspark) on draftline's
    train split of ``results``.

    Returns ``{"checkpoint", "train_seconds", "steps", "settings"}`` (also ``out_dir/peer.json``);
    ``checkpoint`` is the speculators-format folder vLLM serves (its config's
    ``speculators_model_type`` names the family). ``total_seq_len``: tokens packed into one
    step (``--total-seq-len``); None keeps the CLI's default, 8192. ``num_layers``,
    ``block_size`` (DFlash, DSpark: the drafted block, anchor included), ``num_depths``
    (P-EAGLE: the parallel depths trained), ``mask_token_id`` (DFlash, DSpark: the token of
    the mask slots): None keeps the CLI's default.
    """
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer must be muon or adamw, got {optimizer!r}")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    shape = {"num_layers": num_layers, "block_size": block_size, "num_depths": num_depths,
             "mask_token_id": mask_token_id}
    foreign = [k for k, v in shape.items() if v is not None and k not in FAMILIES[family]]
    if foreign:
        raise ValueError(f"the peer's {family} takes {', '.join(FAMILIES[family])}, not "
                         f"{', '.join(foreign)}")
    results, out_dir = Path(results).resolve(), Path(out_dir).resolve()
    peer_dir = ensure_peer(peer_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = input_facts(results)
    data = convert(results, out_dir / "data", facts)
    paths = {"target": facts["target"], "data": str(out_dir / "data"),
             "save": str(out_dir / "checkpoints"), "logs": str(out_dir / "logs")}
    run = {"seed": seed, "lr": lr, "epochs": epochs, "ttt_steps": ttt_steps,
           "optimizer": optimizer, "total_seq_len": total_seq_len}
    if family != "eagle3":  # an EAGLE-3 run's settings (its stored results' key) as before
        run.update(family=family, **{k: v for k, v in shape.items() if v is not None})
    elif num_layers is not None:
        run["num_layers"] = num_layers
    argv = peer_argv(paths, facts, data, run)
    settings = {"peer": f"speculators {PEER_VERSION}", "peer_dir": str(peer_dir),
                "results": str(results), **facts, **data, **run, "argv": argv,
                "cpu_flags": CPU_FLAGS, "checkpoint_epoch": epochs - 1}
    cached = cached_result(out_dir, settings)
    if cached is not None:
        return cached
    shutil.rmtree(paths["save"], ignore_errors=True)  # the CLI would resume from it
    worker = run_worker({"peer_dir": str(peer_dir), "argv": argv}, out_dir)
    record = {"checkpoint": str(Path(paths["save"]) / str(epochs - 1)),
              "train_seconds": worker["train_seconds"], "steps": worker["steps"],
              "settings": {**settings, "resolved": worker["resolved"]}}
    (out_dir / "peer.json").write_text(json.dumps(record, indent=1, default=str))
    return record


# ----------------------------------------------------------------------------- worker


def timed_trainer_class(trainer_cls, cpu: bool):
    """speculators' Trainer, recording the training phase's time and steps; with ``cpu``, on
    the CPU (it puts the model and batches on the accelerator's local rank and autocasts for
    the accelerator)."""

    class TimedTrainer(trainer_cls):
        record: dict = {}

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if cpu:
                self.device_type = "cpu"

        def run_training(self):
            started = time.perf_counter()
            super().run_training()
            TimedTrainer.record = {"train_seconds": time.perf_counter() - started,
                                   "steps": self.global_step}

    return TimedTrainer


def worker_main(job_path: Path) -> None:
    """Subprocess side: ``speculators train`` (its ``cli.main``), on the CPU when there is no
    accelerator."""
    job = json.loads(Path(job_path).read_text())
    # the peer's own install folder, in this subprocess only: the one module path a benchmark
    # changes (tests/test_benchmark_imports.py)
    sys.path.append(job["peer_dir"])
    import torch
    from speculators.train import cli, trainer
    from speculators.train import utils as train_utils
    from speculators.train.config import TrainConfig

    # Its provenance record looks for the git repo around its own files: the install folder
    # lies in draftline's checkout, whose SHA and diff it would save as its own.
    train_utils.find_repo_root = lambda start: None
    cpu = torch.accelerator.current_accelerator() is None
    if cpu:
        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *args, **kwargs: None  # its step timer's
    cli.Trainer = timed_trainer_class(trainer.Trainer, cpu)
    cfg = TrainConfig.resolve(job["argv"])
    cli.main(cfg)
    record = {**cli.Trainer.record, "resolved": cfg.flatten(),
              "torch_threads": torch.get_num_threads()}
    Path(job["result"]).write_text(json.dumps(record, indent=1, default=str))

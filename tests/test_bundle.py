"""The artifact bundle: deterministic archive, verification, secrets, model card, publishing.

A small but realistic results tree (real safetensors and PNG files, the stage formats of
docs/formats.md) stands in for a full pipeline run, so these tests take seconds.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, default_config, requires_vllm, sha256_of, write_workflow_config
from safetensors.numpy import save_file

from draftline.cli import main as cli_main
from draftline.stages import bundle as B

PLANTED_KEY = "sk-planted-0123456789abcdef"  # an API key that must never reach a bundle
PLANTED_TOKEN = "hf_plantedtoken0123456789"


SERVING_IMAGE = "docker://example.org/serving@sha256:" + "ab" * 32
# what the stages record about the machines they ran on (draftline.core.machine)
GENERATION_MACHINE = {"server": "managed", "vllm_versions": ["0.32.0"],
                      "gpus": {"NVIDIA H200": 8}, "launcher": "process"}
BENCH_MACHINE = {"server": "managed", "vllm_versions": ["0.32.0"], "gpus": {"NVIDIA H200": 1},
                 "launcher": "docker", "image": "vllm/vllm-openai@sha256:" + "cd" * 32}

def tiny_png(width: int = 3, height: int = 2) -> bytes:
    """A valid RGB PNG, written by hand (no plotting library needed)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\xc0\x40\x10" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_results(root: Path, bench: bool = True) -> Path:
    """A results tree in the formats of docs/formats.md, with small real files."""
    rng = np.random.default_rng(0)
    hidden, draft_vocab, target_vocab = 16, 32, 64
    target = root / "target"
    write_json(target / "config.json", {"architectures": ["LlamaForCausalLM"],
                                        "hidden_size": hidden, "num_hidden_layers": 8,
                                        "vocab_size": target_vocab})
    write_json(target / "tokenizer_config.json", {"chat_template": "{{ messages }}"})
    write_json(target / "tokenizer.json", {"model": {"type": "BPE"}})
    write_json(target / "special_tokens_map.json", {"eos_token": "<|end|>"})
    write_json(target / "generation_config.json", {"eos_token_id": 3})
    save_file({"w": rng.standard_normal((4, 4)).astype(np.float32)},
              str(target / "model.safetensors"))

    ckpt = root / "draft" / "checkpoint"
    write_json(ckpt / "config.json", {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32, "vocab_size": target_vocab, "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}})
    d2t = np.arange(draft_vocab, dtype=np.int64)  # draft id i -> target id 2i
    t2d = np.zeros(target_vocab, dtype=bool)
    t2d[::2] = True
    save_file({"fc.weight": rng.standard_normal((hidden, 3 * hidden)).astype(np.float32),
               "lm_head.weight": rng.standard_normal((draft_vocab, hidden)).astype(np.float32),
               "norm.weight": np.ones(hidden, dtype=np.float32), "d2t": d2t, "t2d": t2d},
              str(ckpt / "model.safetensors"))
    (root / "vocab").mkdir(parents=True)
    save_file({"d2t": d2t, "t2d": t2d}, str(root / "vocab" / "vocab_map.safetensors"))
    write_json(root / "vocab" / "coverage.json", {"coverage": 0.9731, "draft_vocab_size": 32})
    (root / "draft" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 / s, "acc_0": 0.1 * s}) + "\n" for s in (1, 2, 3)))
    write_json(root / "draft" / "eval.json", {
        "simulated_acceptance_length": 2.4375, "accuracy": [0.71, 0.52, 0.38],
        "layer_ids": [2, 4, 5], "ttt_steps": 3,
        "machine": {"training": {"device": "cuda", "gpus": {"NVIDIA H200": 2}},
                    "hidden_states": {"backend": "hf", "device": "cuda",
                                      "gpus": {"NVIDIA H200": 8}}}})
    write_json(root / "prompts" / "summary.json", {
        "read": 250, "accepted": 240, "duplicates": 4, "rejected_total": 6, "written": 240,
        "num_shards": 2, "shard_sizes": [120, 120], "max_samples": 240, "seed": 0,
        "sources": [{"path": "bundled", "read": 250, "accepted": 240, "duplicates": 4,
                     "rejected": 6}]})
    # the generation stage's summary, with what served the answers (bundled)
    write_json(root / "responses" / "summary.json", {"shards": 2, "responses": 240,
                                                     "machines": [GENERATION_MACHINE]})
    (root / "responses" / "server_running.png").parent.mkdir(parents=True, exist_ok=True)
    (root / "responses" / "server_running.png").write_bytes(tiny_png())
    write_json(root / "profile" / "concurrency.json", {
        "chosen_concurrency": 16,
        "levels": [{"concurrency": c, "output_tok_s": 300.0 * c ** 0.7} for c in (1, 4, 16)]})
    (root / "profile" / "concurrency.png").write_bytes(tiny_png())
    if bench:
        write_json(root / "bench" / "results.json", {"baseline": {"output_tok_s": 900.0},
                                                     "eagle3": {"output_tok_s": 1500.0},
                                                     "vllm_versions": ["0.32.0"],
                                                     "machine": BENCH_MACHINE})
        (root / "bench" / "summary.md").write_text(
            "# Deployment benchmark\n\n| mode | tok/s |\n|---|---|\n| baseline | 900 |\n"
            "| eagle3 | 1500 |\n")
        (root / "bench" / "throughput.png").write_bytes(tiny_png(4, 4))
        (root / "bench" / "acceptance.png").write_bytes(tiny_png(3, 3))
    return root


@pytest.fixture
def results(tmp_path) -> Path:
    return make_results(tmp_path / "results")


def bundle_config(results: Path, **overrides) -> dict:
    return default_config(results=str(results), **overrides)


def build(results: Path, cfg: dict | None = None, **kwargs) -> dict:
    cfg = cfg or bundle_config(results)
    return B.build_bundle(B.BundleInputs.from_results(results), results / "bundle",
                          results / "bundle.tar", config=cfg, model=str(results / "target"),
                          **kwargs)


# --------------------------------------------------------------------------- determinism and layout


def test_bundle_twice_gives_identical_tar_bytes(results):
    build(results)
    first = (results / "bundle.tar").read_bytes()
    build(results)
    assert (results / "bundle.tar").read_bytes() == first

    with tarfile.open(results / "bundle.tar") as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names, key=lambda n: n.split("/"))
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" for m in members)
    assert {m.mode for m in members if m.isfile()} == {0o644}
    assert {m.mode for m in members if m.isdir()} == {0o755}
    assert names[0] == "bundle" and all(n.startswith("bundle/") for n in names[1:])


def _fake_other_host(monkeypatch) -> None:
    """Another machine, as far as the build can tell: host name, user, CPUs, architecture."""
    monkeypatch.setattr(socket, "gethostname", lambda: "elsewhere.example.org")
    monkeypatch.setattr(os, "cpu_count", lambda: 1234)
    monkeypatch.setattr(platform, "machine", lambda: "riscv128")
    for name in ("USER", "LOGNAME"):
        monkeypatch.setenv(name, "someone-else")


def test_same_results_give_the_same_bytes_whatever_the_command_line_or_host(results,
                                                                            monkeypatch):
    monkeypatch.setenv("DRAFTLINE_COMMAND_LINE", "snakemake --cores all")
    build(results)
    first = (results / "bundle.tar").read_bytes()
    first_manifest = (results / "bundle" / "manifest.json").read_bytes()

    monkeypatch.setenv("DRAFTLINE_COMMAND_LINE", "snakemake --cores 3 --forcerun bundle")
    _fake_other_host(monkeypatch)
    build(results)
    assert (results / "bundle" / "manifest.json").read_bytes() == first_manifest
    assert (results / "bundle.tar").read_bytes() == first

    # the facts about this one build are kept beside the tar, outside its bytes
    record = json.loads((results / "bundle.build.json").read_text())
    assert record["command_line"] == ["snakemake", "--cores", "3", "--forcerun", "bundle"]
    assert record["host"]["hostname"] == "elsewhere.example.org"
    assert record["host"]["user"] == "someone-else"
    assert record["host"]["logical_cpus"] == 1234 and record["host"]["machine"] == "riscv128"
    assert record["bundle_sha256"] == sha256_of(results / "bundle.tar")
    assert record["manifest_sha256"] == sha256_of(results / "bundle" / "manifest.json")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", record["built_at"])


def test_a_changed_input_file_changes_the_bytes(results):
    build(results)
    first = (results / "bundle.tar").read_bytes()
    write_json(results / "vocab" / "coverage.json", {"coverage": 0.9732, "draft_vocab_size": 32})
    build(results)
    assert (results / "bundle.tar").read_bytes() != first


def test_a_stage_run_on_other_gpus_changes_the_bytes_and_the_card_shows_it(results):
    build(results)
    first = (results / "bundle.tar").read_bytes()
    readme = (results / "bundle" / "README.md").read_text()
    assert "| generation | 8 x NVIDIA H200 | 0.32.0 | managed, process |" in readme
    assert "| hidden states | 8 x NVIDIA H200 | - | in process, cuda |" in readme
    assert "| training | 2 x NVIDIA H200 | - | in process, cuda |" in readme
    assert (f"| deployment benchmark | 1 x NVIDIA H200 | 0.32.0 | managed, docker, "
            f"{BENCH_MACHINE['image']} |") in readme

    other = dict(GENERATION_MACHINE, gpus={"NVIDIA B200": 8})  # the run really differed
    write_json(results / "responses" / "summary.json", {"shards": 2, "responses": 240,
                                                        "machines": [other]})
    build(results)
    assert (results / "bundle.tar").read_bytes() != first
    assert "| generation | 8 x NVIDIA B200 |" in (results / "bundle" / "README.md").read_text()


def test_bundle_layout_is_a_loadable_model_folder_with_all_evidence(results):
    manifest = build(results)
    root = results / "bundle"
    listed = {f["path"] for f in manifest["files"]}
    assert {"config.json", "model.safetensors", "README.md", "resolved_config.yaml",
            "vocab/vocab_map.safetensors", "vocab/coverage.json", "training/metrics.jsonl",
            "training/eval.json", "data/prompts_summary.json", "data/generation_summary.json",
            "profile/concurrency.json",
            "profile/concurrency.png", "bench/results.json", "bench/summary.md",
            "bench/throughput.png", "bench/acceptance.png"} == listed
    # binary artifacts are copied byte for byte, and the manifest hashes what is there
    for rel, src in [("model.safetensors", "draft/checkpoint/model.safetensors"),
                     ("bench/throughput.png", "bench/throughput.png")]:
        assert (root / rel).read_bytes() == (results / src).read_bytes()
    for entry in manifest["files"]:
        assert entry["sha256"] == sha256_of(root / entry["path"])
        assert entry["size"] == (root / entry["path"]).stat().st_size
    assert json.loads((root / "manifest.json").read_text()) == manifest


def test_bundle_without_benchmark_or_profile(tmp_path):
    results = make_results(tmp_path / "results", bench=False)
    shutil.rmtree(results / "profile")
    cfg = bundle_config(results, **{"generate.concurrency": 8})
    manifest = build(results, cfg)
    assert not any(f["path"].startswith(("bench/", "profile/")) for f in manifest["files"])
    readme = (results / "bundle" / "README.md").read_text()
    assert "This bundle holds no deployment benchmark." in readme
    assert "configured concurrency 8" in readme


def test_missing_input_is_named(results):
    (results / "draft" / "eval.json").unlink()
    with pytest.raises(B.BundleError, match="eval.json"):
        build(results)


# ----------------------------------------------------------------------------- provenance


def test_manifest_provenance(results, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_COMMAND_LINE", "/opt/venv/bin/snakemake --cores all")
    cfg = bundle_config(results, **{"containers.serving": SERVING_IMAGE})
    prov = build(results, cfg)["provenance"]

    target = prov["target"]
    assert target["source"] == "local" and target["model"] == str(results / "target")
    assert target["files"]["config.json"] == sha256_of(results / "target" / "config.json")
    assert set(target["files"]) == {"config.json", "tokenizer.json", "tokenizer_config.json",
                                    "special_tokens_map.json", "generation_config.json"}
    assert target["weight_files"] == {
        "model.safetensors": (results / "target" / "model.safetensors").stat().st_size}

    from draftline.stages.prompts import bundled_prompts_path

    (source,) = prov["prompt_sources"]
    assert source["path"] == "bundled"
    assert source["sha256"] == sha256_of(bundled_prompts_path())

    versions = prov["software"]["versions"]
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["draftline"] and versions["snakemake"] and versions["transformers"]
    git = prov["software"]["draftline_git"]
    if shutil.which("git") and (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        assert git["commit"] == head and isinstance(git["dirty"], bool)

    (image,) = prov["containers"]
    assert image == {"role": "serving", "image": SERVING_IMAGE,
                     "digest": SERVING_IMAGE.partition("@")[2]}
    assert not {"hardware", "command_line"} & set(prov)  # facts of one build: the record's

    record = json.loads((results / "bundle.build.json").read_text())
    (local,) = record["local_images"]
    assert local["role"] == "serving" and local["image"] == SERVING_IMAGE
    assert local["id"] is None and local["note"]  # not present locally, and says so
    assert record["host"]["logical_cpus"] == os.cpu_count()
    assert record["command_line"] == ["snakemake", "--cores", "all"]


def test_no_timestamps_in_hashed_content(results):
    build(results)
    stamp = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
    for name in ("manifest.json", "README.md", "resolved_config.yaml"):
        assert not stamp.search((results / "bundle" / name).read_text()), name


def test_resolved_config_is_the_config_without_publish_destination(results, tmp_path):
    cfg = bundle_config(results, **{"bundle.publish_to": str(tmp_path / "pub")})
    build(results, cfg)
    bundled = yaml.safe_load((results / "bundle" / "resolved_config.yaml").read_text())
    assert "publish_to" not in bundled["bundle"]
    assert bundled["train"] == cfg["train"] and bundled["generate"] == cfg["generate"]
    before = (results / "bundle.tar").read_bytes()
    cfg["bundle"]["publish_to"] = str(tmp_path / "elsewhere")
    build(results, cfg)
    assert (results / "bundle.tar").read_bytes() == before


# ----------------------------------------------------------------------------- secrets


def test_planted_secrets_never_reach_the_bundle(results, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_TEST_API_KEY", PLANTED_KEY)
    monkeypatch.setenv("DRAFTLINE_COMMAND_LINE",
                       f"snakemake --config server.env.HF_TOKEN={PLANTED_TOKEN} --api-key "
                       f"{PLANTED_TOKEN}")
    with open(results / "bench" / "summary.md", "a") as fh:  # a stage leaked the key into text
        fh.write(f"\nclient used key {PLANTED_KEY}\n")
    cfg = bundle_config(results, **{"server.external.api_key_env": "DRAFTLINE_TEST_API_KEY"})
    # literals the config check refuses, as a config that skipped it would hold them
    cfg["server"]["env"] = {"HF_TOKEN": PLANTED_TOKEN, "OMP_NUM_THREADS": "2"}
    cfg["server"]["extra_args"] = ["--api-key", PLANTED_TOKEN, f"--note={PLANTED_KEY}"]
    html = results / "report" / "model_card.html"
    build(results, cfg, card_html=html)

    blobs = [(results / "bundle.tar").read_bytes(), html.read_bytes(),
             (results / "bundle.build.json").read_bytes()]
    blobs += [p.read_bytes() for p in (results / "bundle").rglob("*") if p.is_file()]
    for blob in blobs:
        assert PLANTED_KEY.encode() not in blob and PLANTED_TOKEN.encode() not in blob
    bundled = yaml.safe_load((results / "bundle" / "resolved_config.yaml").read_text())
    assert bundled["server"]["external"]["api_key_env"] == "DRAFTLINE_TEST_API_KEY"  # the name
    assert bundled["server"]["env"] == {"HF_TOKEN": "[REDACTED]", "OMP_NUM_THREADS": "2"}
    assert bundled["server"]["extra_args"][:2] == ["--api-key", "[REDACTED]"]
    assert "[REDACTED:DRAFTLINE_TEST_API_KEY]" in (results / "bundle/bench/summary.md").read_text()
    assert B.verify_bundle(results / "bundle.tar")  # scrubbed files are what the manifest hashes


def test_secret_in_a_binary_file_is_refused(results, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_TEST_SECRET", PLANTED_KEY)
    weights = results / "draft" / "checkpoint" / "model.safetensors"
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(weights),
              metadata={"note": PLANTED_KEY})
    with pytest.raises(B.BundleError, match="model.safetensors.*DRAFTLINE_TEST_SECRET"):
        build(results)
    assert not (results / "bundle.tar").exists() and not (results / "bundle").exists()
    assert not (results / ".bundle.staging").exists()  # no partial copy left behind


def test_scrub_args():
    assert B.scrub_args(["serve", "--api-key", "abc", "--hf-token=xyz", "A_TOKEN=1", "--port",
                         "8000", "--api-key-env", "NAME"]) == [
        "serve", "--api-key", "[REDACTED]", "--hf-token=[REDACTED]", "A_TOKEN=[REDACTED]",
        "--port", "8000", "--api-key-env", "NAME"]


# ----------------------------------------------------------------------------- verification


def test_verify_ok_on_folder_and_archive(results, capsys):
    build(results)
    assert cli_main(["verify", str(results / "bundle")]) == 0
    assert cli_main(["verify", str(results / "bundle.tar")]) == 0
    assert "16 files match" in capsys.readouterr().out
    assert cli_main(["verify", str(results / "nothing-here")]) == 2


@pytest.mark.parametrize("change", ["modify", "delete", "add"])
def test_tampered_folder_fails_naming_the_file(results, change, capsys):
    build(results)
    root = results / "bundle"
    if change == "modify":
        data = bytearray((root / "training" / "eval.json").read_bytes())
        data[5] ^= 1  # same size, different content
        (root / "training" / "eval.json").write_bytes(bytes(data))
        expected = "training/eval.json: sha256"
    elif change == "delete":
        (root / "vocab" / "coverage.json").unlink()
        expected = "vocab/coverage.json: listed in the manifest but missing"
    else:
        (root / "bench" / "extra.png").write_bytes(tiny_png())
        expected = "bench/extra.png: not listed in the manifest"
    assert cli_main(["verify", str(root)]) == 1
    assert expected in capsys.readouterr().err


def test_tampered_archive_fails_naming_the_file(results, capsys):
    build(results)
    tar_path = results / "bundle.tar"
    with tarfile.open(tar_path) as tar:
        offset = tar.getmember("bundle/model.safetensors").offset_data
    data = bytearray(tar_path.read_bytes())
    data[offset + 200] ^= 0xFF  # one weight byte
    tar_path.write_bytes(bytes(data))
    assert cli_main(["verify", str(tar_path)]) == 1
    assert "model.safetensors: sha256" in capsys.readouterr().err


def test_rebuild_check_reports_equal_bytes(results, monkeypatch, capsys):
    build(results, card_html=results / "report" / "model_card.html")
    _fake_other_host(monkeypatch)  # checked elsewhere, with another command line
    result = B.rebuild_check(results, results / "bundle.tar")
    assert result.equal and result.rebuilt_sha256 == sha256_of(results / "bundle.tar")
    assert B.rebuild_check(results, results / "bundle").equal
    assert cli_main(["verify", "--rebuild", str(results), str(results / "bundle.tar")]) == 0
    assert f"equals its rebuild from {results}" in capsys.readouterr().out


@pytest.mark.parametrize("tamper, first", [
    (lambda r: _flip_last_byte(r / "draft" / "checkpoint" / "model.safetensors"),
     "model.safetensors"),
    (lambda r: write_json(r / "vocab" / "coverage.json", {"coverage": 0.5}),
     "vocab/coverage.json"),
])
def test_rebuild_check_names_the_member_a_tampered_results_folder_changes(results, tamper,
                                                                          first, capsys):
    build(results)
    tamper(results)
    result = B.rebuild_check(results, results / "bundle.tar")
    assert not result.equal and result.differing[0] == first
    assert "manifest.json" in result.differing  # it hashes the changed member
    assert cli_main(["verify", "--rebuild", str(results), str(results / "bundle.tar")]) == 1
    assert f"first differing member {first} " in capsys.readouterr().err


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_rebuild_check_runs_from_anywhere_for_a_workflow_with_relative_paths(tmp_path,
                                                                             monkeypatch):
    """The workflow spells paths relative to its directory ("results/target"); the check
    rebuilds from that directory whatever the current one."""
    work = tmp_path / "work"
    make_results(work / "results")
    monkeypatch.chdir(work)
    B.build_bundle(B.BundleInputs.from_results("results"), Path("results/bundle"),
                   Path("results/bundle.tar"), config=default_config(), model="results/target")
    monkeypatch.chdir(tmp_path)
    assert B.rebuild_check(work / "results", work / "results" / "bundle.tar").equal
    shutil.copytree(work / "results", tmp_path / "renamed")  # the names are in the bundle
    with pytest.raises(B.VerifyError, match="'results'.*renamed is not named so"):
        B.rebuild_check(tmp_path / "renamed", work / "results" / "bundle.tar")


def _evil_archive(good: Path, out: Path, member: tarfile.TarInfo, payload: bytes = b"") -> Path:
    """The good bundle archive plus one hostile member."""
    with tarfile.open(good) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        member.size = len(payload)
        dst.addfile(member, io.BytesIO(payload) if member.isfile() else None)
    return out


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("member, message", [
    (tarfile.TarInfo("/etc/evil.json"), "absolute path refused"),
    (tarfile.TarInfo("bundle/../../evil.json"), "escapes the bundle"),
    (tarfile.TarInfo("../evil.json"), "escapes the bundle"),
    (_link("bundle/passwd", "/etc/passwd", tarfile.SYMTYPE), "symbolic link to '/etc/passwd'"),
    (_link("bundle/up", "../../outside", tarfile.SYMTYPE), "(outside the bundle)"),
    (_link("bundle/hard", "/etc/passwd", tarfile.LNKTYPE), "hard link to '/etc/passwd'"),
    (_link("bundle/hard2", "../outside", tarfile.LNKTYPE), "(outside the bundle)"),
])
def test_verify_refuses_unsafe_archive_members(results, tmp_path, member, message):
    build(results)
    evil = _evil_archive(results / "bundle.tar", tmp_path / "evil.tar", member, b"{}")
    with pytest.raises(B.VerifyError) as err:
        B.verify_bundle(evil)
    assert message in str(err.value)
    assert not (tmp_path / "evil.json").exists() and not Path("/etc/evil.json").exists()


def test_verify_refuses_symlink_in_folder_and_unsafe_manifest_paths(results):
    build(results)
    root = results / "bundle"
    (root / "link").symlink_to("/etc/passwd")
    with pytest.raises(B.VerifyError, match="link: symbolic link"):
        B.verify_bundle(root)
    (root / "link").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][0]["path"] = "../../etc/passwd"
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(B.VerifyError, match="escapes the bundle"):
        B.verify_bundle(root)


# ----------------------------------------------------------------------------- model card


def test_model_card(results):
    build(results, draft_ref="org/eagle3-draft", card_html=results / "report" / "card.html")
    readme = (results / "bundle" / "README.md").read_text()
    front = yaml.safe_load(readme.split("---\n")[1])
    assert "eagle3" in front["tags"] and "base_model" not in front  # local target
    assert "| simulated_acceptance_length | 2.438 |" in readme
    assert "| 2 | 0.52 |" in readme  # per-step accuracy, step 2
    assert "### Deployment benchmark" in readme and "| eagle3 | 1500 |" in readme
    assert "![throughput](bench/throughput.png)" in readme
    assert "| Draft parameters (without the shared target embedding) | 1296 |" in readme
    spec = json.loads(re.search(r"--speculative-config '(.*)'", readme).group(1))
    assert spec == {"method": "eagle3", "model": "org/eagle3-draft", "num_speculative_tokens": 3}
    # SGLang serves a copy whose config lists the ids one lower (test_sglang_layer_ids...)
    vllm_ids = json.loads((results / "bundle" / "config.json").read_text())[
        "eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    sglang_ids = [k - 1 for k in vllm_ids]
    assert f"Serve a copy of the draft whose config lists {sglang_ids}" in readme
    assert f"['eagle_aux_hidden_state_layer_ids'] = {sglang_ids};" in readme
    assert "cp -r org/eagle3-draft sglang-draft" in readme
    assert "--speculative-draft-model-path sglang-draft" in readme
    assert "--speculative-algorithm EAGLE3" in readme  # the eagle3 family's SGLang algorithm
    assert "--speculative-num-steps 3" in readme and "--speculative-num-draft-tokens 4" in readme
    assert "served this draft with vLLM 0.32.0 (bench/results.json)" in readme
    html = (results / "report" / "card.html").read_text()
    assert "<table>" in html and "data:image/png;base64," in html
    # the report's card shows this build; the bundle's README, whose bytes are hashed, does not
    assert "Build record" in html and socket.gethostname() in html
    assert "Build record" not in readme and socket.gethostname() not in readme


def test_model_card_records_the_hidden_state_mode(results):
    build(results)
    assert "Hidden states: offline" in (results / "bundle" / "README.md").read_text()
    eval_path = results / "draft" / "eval.json"
    write_json(eval_path, {**json.loads(eval_path.read_text()), "hidden_mode": "online"})
    build(results, bundle_config(results, **{"hidden.mode": "online"}))
    readme = (results / "bundle" / "README.md").read_text()
    assert "Hidden states: online (the target produced its states while the draft trained" \
        in readme


def test_model_card_gives_no_sglang_command_for_norms_sglang_does_not_read(results):
    """SGLang's LlamaForCausalLMEagle3 builds no input_norm / fc_norm and reads none of the
    four norm flags: a draft that sets one gets no SGLang command, and says why."""
    config_path = results / "draft" / "checkpoint" / "config.json"
    write_json(config_path, {**json.loads(config_path.read_text()), "norm_before_fc": True,
                             "norm_output": False})
    build(results)
    readme = (results / "bundle" / "README.md").read_text()
    assert "--speculative-draft-model-path" not in readme
    assert "Not with SGLang: this draft sets norm_before_fc (config.json)" in readme
    assert "vllm serve" in readme


DFLASH_CONFIG = {  # as draftline.drafts.dflash.export.dflash_config_json writes it
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 16,
    "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
    "intermediate_size": 32, "vocab_size": 64, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "block_size": 8, "num_target_layers": 8,
    "dflash_config": {"target_layer_ids": [1, 3, 4], "mask_token_id": 5}}


def test_a_dflash_drafts_card_describes_dflash_not_eagle3(results):
    """The card's heading, first paragraph and tags are the draft's family's: a DFlash draft's
    card says DFlash (its layers, its block) and nowhere EAGLE-3, and SGLang is refused."""
    write_json(results / "draft" / "checkpoint" / "config.json", DFLASH_CONFIG)
    build(results)
    readme = (results / "bundle" / "README.md").read_text()
    front = yaml.safe_load(readme.split("---\n")[1])
    assert front["tags"] == ["speculative-decoding", "dflash", "draft-model", "draftline"]
    body = readme.split("---\n", 2)[2].lstrip("\n")
    assert body.startswith(f"# DFlash draft model for {results / 'target'}\n")
    assert ("A DFlash speculative-decoding draft (vLLM's DFlash): 3 Qwen3-style decoder layers "
            "that read the target's hidden states at 3 of its layers for every accepted "
            "position and fill a block of 7 masked tokens in one forward pass") in body
    assert "EAGLE-3" not in readme and "EAGLE3" not in readme
    assert '"method": "dflash"' in readme  # served as DFlash
    assert "Not with SGLang from this card: this is a DFlash draft" in readme
    ids = [i + 1 for i in DFLASH_CONFIG["dflash_config"]["target_layer_ids"]]  # vLLM's ids
    assert f"| Aux hidden-state layer ids (vLLM's) | {ids} |" in readme


def test_the_eagle3_card_keeps_its_heading_and_paragraph(results):
    build(results)
    readme = (results / "bundle" / "README.md").read_text()
    assert f"# EAGLE-3 draft model for {results / 'target'}\n" in readme
    assert ("An EAGLE-3 speculative-decoding draft: one Llama-style decoder layer that reads "
            "three hidden states of the target and proposes tokens which the target then "
            "verifies, so outputs are those of the target alone, produced faster. It was "
            "trained by draftline on responses generated by the target itself and cannot be "
            "used on its own.") in readme


def test_model_card_shows_how_the_learning_rate_was_chosen(results):
    eval_path = results / "draft" / "eval.json"
    choice = {"lr": 0.01, "probe_lr": 0.02, "horizon_scale": 0.5, "candidates": [0.01, 0.02],
              "probe_steps": 16, "of_steps": 64,
              "probes": [{"lr": 0.01, "simulated_acceptance_length": 2.41},
                         {"lr": 0.02, "simulated_acceptance_length": 2.73}]}
    write_json(eval_path, {**json.loads(eval_path.read_text()), "lr_choice": choice})
    build(results)
    readme = (results / "bundle" / "README.md").read_text()
    assert "Learning rate 0.01, measured (train.lr auto)" in readme
    assert "trained 16 of the run's 64 steps" in readme and "the best, 0.02, times" in readme
    assert "| 0.02 | 2.73 | yes |" in readme and "| 0.01 | 2.41 |  |" in readme


def test_model_card_leads_with_the_walked_acceptance_and_says_what_each_figure_is(results):
    eval_path = results / "draft" / "eval.json"
    choice = {"lr": 0.01, "probe_lr": 0.01, "horizon_scale": 0.5, "candidates": [0.01, 0.02],
              "probe_steps": 16, "of_steps": 64,
              "probes": [{"lr": 0.01, "walked_acceptance_length": 2.31,
                          "simulated_acceptance_length": 2.41},
                         {"lr": 0.02, "walked_acceptance_length": 2.22,
                          "simulated_acceptance_length": 2.73}]}
    write_json(eval_path, {**json.loads(eval_path.read_text()), "lr_choice": choice,
                           "walked_acceptance_length": 2.3125,
                           "walked_acceptance_length_by_num_drafts": [1.6, 2.1, 2.3125]})
    build(results)
    readme = (results / "bundle" / "README.md").read_text()
    assert "| walked_acceptance_length | 2.312 |" in readme
    assert "| simulated_acceptance_length | 2.438 |" in readme  # the per-position one beside
    assert "walked_acceptance_length is the tokens per round a server would get at T=0" in readme
    assert "averages a round started at every answer position" in readme
    # the probes are ranked by the walk: 0.01 wins on 2.31 though 0.02 has the higher 2.73
    assert "| 0.01 | 2.31 | yes |" in readme and "| 0.02 | 2.22 |  |" in readme


def _command(readme: str, first: str) -> list[str]:
    block = readme.split(first, 1)[1].split("```", 1)[0]
    return shlex.split(first + block.replace("\\\n", " "))


@requires_vllm
@pytest.mark.slow
def test_vllm_command_parses_with_vllm(results):
    """The card's vLLM command is accepted by vLLM's own argument parser (no server)."""
    cfg = bundle_config(results, **{"server.tensor_parallel_size": 2})
    build(results, cfg)
    args = _command((results / "bundle" / "README.md").read_text(), "vllm serve")
    code = ("import json, sys\n"
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
            "print(json.dumps([a.model_tag, a.speculative_config, a.tensor_parallel_size,"
            " a.reasoning_parser]))\n")
    out = subprocess.run([sys.executable, "-c", code, *args[2:]], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    model, spec, tp, parser = json.loads(out.stdout.strip().splitlines()[-1])
    assert model == str(results / "target") and tp == 2 and parser == "deepseek_r1"
    assert spec == {"method": "eagle3", "model": str(results / "bundle"),
                    "num_speculative_tokens": 3}


# ----------------------------------------------------------------------------- publishing


def test_cli_bundle_publishes_to_a_local_folder(tmp_path, capsys):
    results = make_results(tmp_path / "results")
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["results"] = str(results)
    cfg["bundle"] = {"publish_to": str(tmp_path / "published")}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["bundle", "--config", str(tmp_path / "config.yaml")]) == 0
    pub = tmp_path / "published"
    assert (pub / "bundle.tar").read_bytes() == (results / "bundle.tar").read_bytes()
    assert (pub / "bundle.tar.sha256").read_text() == (
        f"{sha256_of(pub / 'bundle.tar')}  bundle.tar\n")
    assert cli_main(["verify", str(pub / "bundle.tar")]) == 0


def test_publish_refuses_a_tampered_archive(results, tmp_path):
    build(results)
    data = bytearray((results / "bundle.tar").read_bytes())
    with tarfile.open(results / "bundle.tar") as tar:
        data[tar.getmember("bundle/config.json").offset_data] ^= 1
    (results / "bundle.tar").write_bytes(bytes(data))
    pub = tmp_path / "pub"
    with pytest.raises(B.VerifyError, match="config.json"):
        B.publish_files(results / "bundle.tar", results / "bundle" / "manifest.json",
                        pub / "bundle.tar", pub / "manifest.json", pub / "bundle.tar.sha256")
    assert not (pub / "bundle.tar").exists()


@pytest.mark.slow
def test_snakemake_bundles_publishes_locally_and_reports(tmp_path):
    """The real workflow: the bundle and publish rules on a prepared results tree (the other
    rules are not allowed to run, so their outputs count as given), then --report."""
    work = tmp_path / "work"
    make_results(work / "results")
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["bundle"] = {"publish_to": "published"}
    write_workflow_config(work, cfg)
    snakemake = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"),
                 "--directory", str(work), "--cores", "1", "--allowed-rules", "bundle",
                 "publish_bundle"]
    env = {k: v for k, v in os.environ.items() if k != "DRAFTLINE_COMMAND_LINE"}
    run = subprocess.run(snakemake + ["published/bundle.tar", "published/bundle.tar.sha256",
                                      "published/manifest.json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (work / "published" / "bundle.tar").read_bytes() == (
        work / "results" / "bundle.tar").read_bytes()
    B.verify_bundle(work / "published" / "bundle.tar")
    record = json.loads((work / "results" / "bundle.build.json").read_text())
    assert record["bundle_sha256"] == sha256_of(work / "results" / "bundle.tar")
    command = record["command_line"]
    assert "--allowed-rules" in command and "published/bundle.tar" in command
    # what the rule built, the rebuild check rebuilds byte for byte, from any directory
    assert cli_main(["verify", "--rebuild", str(work / "results"),
                     str(work / "published" / "bundle.tar")]) == 0

    report = subprocess.run(snakemake + ["--report", "report.html", "published/bundle.tar"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    html = (work / "report.html").read_text()
    assert "model_card.html" in html and "concurrency.png" in html


def test_hub_push_needs_a_token(results, monkeypatch):
    build(results)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(B.BundleError, match="HF_TOKEN"):
        B.push_to_hub(results / "bundle", "org/draft")


@pytest.mark.skipif(not (os.environ.get("HF_TOKEN") and os.environ.get("DRAFTLINE_TEST_HF_REPO")),
                    reason="pushing to the Hugging Face hub needs network access, HF_TOKEN and "
                           "DRAFTLINE_TEST_HF_REPO (not available offline)")
def test_hub_push(results):
    build(results)
    pushed = B.push_to_hub(results / "bundle", os.environ["DRAFTLINE_TEST_HF_REPO"])
    assert pushed["commit"] and pushed["manifest_sha256"] == sha256_of(
        results / "bundle" / "manifest.json")


def test_push_record_is_written_whole_in_the_bundle_json_style(tmp_path):
    out = tmp_path / "published" / "hub.json"
    pushed = {"repo": "org/draft", "commit": "abc", "manifest_sha256": "f" * 64}
    B.write_push_record(out, pushed)
    assert out.read_text() == json.dumps(pushed, indent=2, sort_keys=True) + "\n"
    assert [p.name for p in out.parent.iterdir()] == ["hub.json"]  # no temp left beside it

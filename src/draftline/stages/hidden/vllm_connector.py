"""A vLLM KV connector that writes the states of the ``extract_hidden_states`` method to disk.

vLLM's ``extract_hidden_states`` speculative method runs the target as usual and stores, for
every scheduled token, the residual stream at the aux layer ids (``[n_ids, H]`` per token) in
the KV cache of one cache-only attention layer. A KV connector then reads those cache blocks
when the request finishes. vLLM's example connector does this with a CUDA stream and a pinned
host buffer, which fails on the CPU build (``pin_memory=True``). This connector copies the
blocks synchronously to host memory (device-agnostic: a no-op copy on CPU, one D2H copy on a
GPU), frees the blocks, and lets a writer thread put the file on disk.

vLLM loads it from its module path::

    kv_transfer_config = {
        "kv_connector": "DraftlineHiddenStatesConnector",
        "kv_connector_module_path": "draftline.stages.hidden.vllm_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"spool_dir": "/path/on/the/same/disk"},
    }

Per request it writes ``{spool_dir}/{name}.safetensors`` with ``hidden_states`` ``[T, n_ids,
H]`` (ids in ascending order, as vLLM captures them) and ``token_ids`` ``[T]`` (the prompt),
atomically: the file exists only once complete. It is not fsynced: a spool file is read back
at once and the spool is wiped at start, so a crash may lose one but never shows it half
written. ``name`` comes from the request's ``kv_transfer_params["draftline_name"]`` (else the
request id). A failed write leaves ``{name}.error`` with the reason, so the reader fails fast
instead of waiting. A request that ends before its whole prompt was computed (aborted, or
failed) writes nothing: its blocks hold part of the states, and a retry under the same name
must not find them.

When the worker runs in the process that reads the states (the offline backend's in-process
engine at tensor-parallel size 1), files are not needed: the reader opens an ``Inbox`` for the
spool folder before it builds the engine, and the connector puts each request's tensors there
instead of serialising them (on a 2-core host the writer threads took 40% of the capture's
time). A worker in another process (a server, tensor-parallel workers) writes files.

Only tensor-parallel rank 0 writes (the states are replicated across ranks). ``read_states``,
below, is the one reader of what the connector hands over.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from draftline.core.atomic import atomic_path, write_text

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

NAME_KEY = "draftline_name"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")


@dataclass
class PendingWrite:
    req_id: str
    name: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    writes: list[PendingWrite] = field(default_factory=list)


def spool_file(spool_dir: str | Path, name: str) -> Path:
    return Path(spool_dir) / f"{name}.safetensors"


def error_file(spool_dir: str | Path, name: str) -> Path:
    return Path(spool_dir) / f"{name}.error"


class SpoolError(RuntimeError):
    """The connector failed for a request, or handed over states that do not fit it."""


class Inbox:
    """States handed over in process: the connector puts, the reader takes.

    An item is the request's states and prompt ids (``{"hidden_states": [T, n_ids, H] tensor,
    "token_ids": list}``), or the text of the error that replaced them.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked worker inherits the registry but not the reader
        self._items: dict[str, dict | str] = {}
        self._lock = threading.Lock()

    def put(self, name: str, item: dict | str) -> None:
        with self._lock:
            self._items[name] = item

    def take(self, name: str) -> dict | str | None:
        with self._lock:
            return self._items.pop(name, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


_INBOXES: dict[str, Inbox] = {}


def _inbox_key(spool_dir: str | Path) -> str:
    return str(Path(spool_dir).resolve())


def open_inbox(spool_dir: str | Path) -> Inbox:
    """Receive in this process the states a connector with this ``spool_dir`` would spool."""
    inbox = _INBOXES[_inbox_key(spool_dir)] = Inbox()
    return inbox


def close_inbox(spool_dir: str | Path) -> None:
    _INBOXES.pop(_inbox_key(spool_dir), None)


def inbox_in_this_process(spool_dir: str | Path) -> Inbox | None:
    inbox = _INBOXES.get(_inbox_key(spool_dir))
    return inbox if inbox is not None and inbox.pid == os.getpid() else None


def read_states(spool_dir: str | Path, name: str, token_ids: list[int], num_ids: int,
                inbox: Inbox | None = None):
    """The states ``[T, num_ids, H]`` handed over for request ``name``, checked against the
    prompt ``token_ids`` it was sent; None while they have not arrived.

    Looks in ``inbox`` first, then for the spool file (deleted once read). Raises
    ``SpoolError`` when the connector failed for the request or its states do not fit it.
    """
    item = inbox.take(name) if inbox is not None else None
    path = spool_file(spool_dir, name)
    source = f"request {name} (handed over in memory)"
    if isinstance(item, str):
        raise SpoolError(f"the hidden-state connector failed for request {name}: {item}")
    if item is None:
        if error_file(spool_dir, name).exists():
            reason = error_file(spool_dir, name).read_text().strip()
            raise SpoolError(f"the hidden-state connector failed for request {name}: {reason}")
        if not path.exists():
            return None
        try:
            item = load_file(str(path))
        except Exception as exc:
            raise SpoolError(f"spool file {path} is unreadable: {exc}") from exc
        finally:
            path.unlink(missing_ok=True)
        source = f"spool file {path}"
    states, got_ids = item["hidden_states"], item["token_ids"]  # [T, n, H], [T]
    if isinstance(got_ids, torch.Tensor):  # a file's; the inbox hands over the list itself
        got_ids = got_ids.tolist()
    sent = token_ids if isinstance(token_ids, list) else [int(t) for t in token_ids]
    if got_ids != sent:
        raise SpoolError(f"{source}: the states of other tokens than the sample sent "
                         f"({len(got_ids)} vs {len(sent)} tokens)")
    if states.dim() != 3 or tuple(states.shape[:2]) != (len(token_ids), num_ids):
        raise SpoolError(f"{source}: states of shape {tuple(states.shape)}, expected "
                         f"[{len(token_ids)}, {num_ids}, H]")
    return states


def prompt_states_complete(request: Request) -> bool:
    """Whether the request ended normally with every prompt token's states computed."""
    from vllm.v1.request import RequestStatus

    if request.prompt_token_ids is None:
        return False
    if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
        return False
    return request.num_computed_tokens >= len(request.prompt_token_ids)


def hidden_state_group_id(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group that holds the hidden states (the cache-only layer)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(f"cannot identify the hidden-state KV cache group among {len(groups)}")


def gather_token_states(cache: torch.Tensor, requests: list[tuple[list[int], int]],
                        block_size: int) -> list[torch.Tensor]:
    """The states of each request's first ``num_tokens`` slots of its ``block_ids`` (one
    ``(block_ids, num_tokens)`` pair a request), on the CPU: ``[num_tokens, n_ids, H]`` each.

    ``cache`` is the cache-only layer's view ``[num_blocks, n_ids, block_size, H]``. The used
    blocks of every request are copied at once, straight into token order (one index a block,
    not two a slot; one copy, not a copy and a transpose; one device-to-host copy a step), and
    each request gets its rows of the copy.
    """
    counts = [-(-num_tokens // block_size) for _, num_tokens in requests]  # blocks used
    used = torch.as_tensor([b for (ids, _), n in zip(requests, counts, strict=True)
                            for b in ids[:n]], dtype=torch.long)
    blocks = torch.index_select(cache.transpose(1, 2), 0, used.to(cache.device))
    # [sum(counts), block_size, n_ids, H] -> one row a slot
    rows = blocks.reshape(-1, cache.shape[1], cache.shape[3]).to("cpu")
    starts = [0, *itertools.accumulate(n * block_size for n in counts)]
    # contiguous, as safetensors wants (a no-op on rows of a contiguous copy)
    return [rows[start:start + num_tokens].contiguous()
            for start, (_, num_tokens) in zip(starts, requests, strict=False)]


class DraftlineHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: hidden states of finished prompts to safetensors files."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None:
            raise ValueError(f"{type(self).__name__} needs the extract_hidden_states method")
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("spool_dir"):
            raise ValueError("kv_connector_extra_config.spool_dir is required")
        self.spool_dir = Path(extra["spool_dir"])
        self.group_id = hidden_state_group_id(kv_cache_config)
        self.block_size = (
            kv_cache_config.kv_cache_groups[self.group_id].kv_cache_spec.block_size
            if kv_cache_config is not None else vllm_config.cache_config.block_size
        )
        # scheduler side
        self._pending: list[PendingWrite] = []
        # worker side
        self._cache: torch.Tensor | None = None
        self._is_writer = True
        self._copied: set[str] = set()
        self._finished: set[str] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._inbox: Inbox | None = None
        if role == KVConnectorRole.WORKER:
            self._inbox = inbox_in_this_process(self.spool_dir)
        if role == KVConnectorRole.WORKER and self._inbox is None:
            self._executor = ThreadPoolExecutor(
                max_workers=int(extra.get("writer_threads", 2)), thread_name_prefix="hs-write")

    # ----------------------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return 0, False  # never loads anything

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HiddenStatesMetadata(writes=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        """Keep the request's blocks until the worker has copied its states (returns True)."""
        if not block_ids or not prompt_states_complete(request):
            return False, None
        params = request.kv_transfer_params or {}
        name = str(params.get(NAME_KEY) or request.request_id)
        if not _SAFE_NAME.match(name):
            raise ValueError(f"request {request.request_id}: unsafe {NAME_KEY} {name!r}")
        self._pending.append(PendingWrite(request.request_id, name,
                                          list(request.prompt_token_ids), list(block_ids)))
        # spool_file's path as a string join: a Path a request cost as much as the rest here
        return True, {"hidden_states_path": f"{self.spool_dir}{os.sep}{name}.safetensors"}

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        if not 0 <= self.group_id < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group_id])

    # ----------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._is_writer = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(
            self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one cache-only layer, found {names}")
        cache = kv_caches[names[0]]  # [num_blocks, n_ids, block_size, H]
        if cache.dim() != 4 or cache.shape[2] != self.block_size:
            raise ValueError(f"hidden-state cache {names[0]} has shape {tuple(cache.shape)}; "
                             f"expected [blocks, n_ids, {self.block_size}, H]")
        self._cache = cache

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass  # the states are in the cache already; they are read in get_finished

    def wait_for_save(self) -> None:
        pass

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 reports; waiting for every rank would leak the blocks

    def get_finished(self, finished_req_ids: set[str]):
        """Copy the states of newly finished requests, queue their files, free their blocks."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, HiddenStatesMetadata) and self._is_writer and meta.writes:
            self._copy_and_queue(meta.writes)
        self._finished.update(finished_req_ids)
        done = self._copied & self._finished
        self._copied -= done
        self._finished -= done
        return (done or None), None

    def _copy_and_queue(self, writes: list[PendingWrite]) -> None:
        assert self._cache is not None
        try:
            states = gather_token_states(
                self._cache, [(w.block_ids, len(w.token_ids)) for w in writes], self.block_size)
        except Exception as exc:  # surface to the readers instead of hanging them
            logger.exception("hidden states of %d requests not copied", len(writes))
            states = [None] * len(writes)
            for write in writes:
                self._write_error(write.name, f"copy failed: {exc!r}")
        for write, request_states in zip(writes, states, strict=True):
            if request_states is not None:
                self._queue(write.name, request_states, write.token_ids)
            self._copied.add(write.req_id)

    def _queue(self, name: str, states: torch.Tensor, token_ids: list[int]) -> None:
        if self._inbox is not None:
            self._inbox.put(name, {"hidden_states": states, "token_ids": token_ids})
        else:
            assert self._executor is not None
            self._executor.submit(self._write_file, states, token_ids, name)

    def _write_file(self, states: torch.Tensor, token_ids: list[int], name: str) -> None:
        path = spool_file(self.spool_dir, name)
        try:
            tensors = {"hidden_states": states,  # [T, n_ids, H]
                       "token_ids": torch.tensor(token_ids, dtype=torch.long)}
            with atomic_path(path, durable=False) as tmp:
                save_file(tensors, str(tmp))
        except Exception as exc:
            logger.exception("hidden states file %s not written", path)
            self._write_error(name, f"write failed: {exc!r}")

    def _write_error(self, name: str, message: str) -> None:
        if self._inbox is not None:
            self._inbox.put(name, message)
            return
        # whole or not at all: the reader takes the file's existence as the error's arrival
        write_text(error_file(self.spool_dir, name), message + "\n")

    def shutdown(self):
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Same request as vLLM's reference connector (the layout the method is validated with
        # on GPUs: a token's states stay together); the CPU build overrides it with LBHNC.
        # Either way register_kv_caches receives the logical [blocks, n_ids, block_size, H] view.
        return "LBNHC"

"""Hidden states from the target served by vLLM (the production path for a 1T-parameter target).

The target runs in vLLM's offline engine (``vllm.LLM``). Each sample is one request: its token
ids as the prompt, ``max_tokens=1``. The prefill computes the states of every prompt token, and
one of two captures hands them over per request:

- the connector (``vllm_connector.py``): vLLM's ``extract_hidden_states`` speculative method
  with ``DraftlineHiddenStatesConnector``, in memory when the worker runs in this process, else
  as a spool file. Any layout: tensor parallelism, CUDA graphs, a separate engine process;
- the direct capture (``vllm_direct.py``): the model runner's own aux states, when the engine's
  one worker runs in this process in eager mode (tensor- and pipeline-parallel size 1). It
  skips the method's copies and bookkeeping (``benchmarks/hidden_states.py``).

Both give the same states (``tests/test_hidden.py``); this module checks the token ids and
hands the states to the part writer.

Why the offline engine and not the HTTP server: no port or process to manage, no tokenizer
(prompts are token ids, ``skip_tokenizer_init``), and the same engine, scheduler, kernels and
tensor parallelism as the server. By default the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set only when unset): after ``generate`` returns, the
spool files of the last requests are written during the next engine steps, which this module
then drives itself; with a separate engine-core process it simply waits for the files.

Prefix caching is disabled: a cache hit would skip the target's forward pass for the shared
prefix, and its hidden states would come from another request's blocks.

The layer ids requested from vLLM are the aux ids plus L (the final pre-norm state); vLLM
returns them in ascending order, whatever order the config lists them in.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from draftline.core.heap import HEAP_REUSE_ENV, reuse_freed_heap
from draftline.stages.hidden.vllm_connector import (
    NAME_KEY,
    SpoolError,
    close_inbox,
    open_inbox,
    read_states,
)

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "DraftlineHiddenStatesConnector"
CONNECTOR_MODULE = "draftline.stages.hidden.vllm_connector"


def speculative_config(capture_ids: Sequence[int]) -> dict:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture_ids)},
        },
    }


def kv_transfer_config(spool_dir: Path) -> dict:
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"spool_dir": str(spool_dir)},
    }


def why_not_direct(kwargs: dict) -> str | None:
    """Why the engine ``kwargs`` describe cannot use the direct capture; None if it can."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return "the engine core runs in a process of its own"
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if int(kwargs.get(key) or 1) != 1:
            return f"{key} {kwargs[key]}: the worker runs in a process of its own"
    if not kwargs.get("enforce_eager"):
        return "the model is compiled (server.enforce_eager false): traced without aux states"
    return None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(target_dir: Path, capture_ids: Sequence[int], spool_dir: Path,
                  max_len: int, hidden_cfg: dict, server_cfg: dict) -> dict:
    """Arguments of ``vllm.LLM`` from the ``hidden`` and ``server`` config sections."""
    server_cfg = server_cfg or {}
    kwargs = {
        "model": str(target_dir),
        "skip_tokenizer_init": True,
        "tensor_parallel_size": server_cfg.get("tensor_parallel_size", 1),
        # room for the longest sample plus the one sampled token
        "max_model_len": max(int(server_cfg.get("max_model_len") or 0), max_len + 1),
        "enforce_eager": bool(server_cfg.get("enforce_eager", False)),
        "enable_prefix_caching": False,
        # the step's token budget; vLLM wants room for one token of every running sequence
        "max_num_batched_tokens": max(int(hidden_cfg.get("batch_tokens", 8192)),
                                      int(server_cfg.get("max_num_seqs") or 256)),
        "speculative_config": speculative_config(capture_ids),
        "kv_transfer_config": kv_transfer_config(spool_dir),
        "seed": 0,
    }
    if server_cfg.get("max_num_seqs"):
        kwargs["max_num_seqs"] = server_cfg["max_num_seqs"]
    if server_cfg.get("dtype", "auto") != "auto":
        kwargs["dtype"] = server_cfg["dtype"]
    if server_cfg.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = server_cfg["gpu_memory_utilization"]
    if hidden_cfg.get("trust_remote_code"):
        kwargs["trust_remote_code"] = True
    overrides, _ = extra_engine_args(server_cfg.get("extra_args") or ())
    kwargs.update({k: v for k, v in overrides.items() if k not in kwargs})
    return kwargs


def extra_engine_args(extra_args: Sequence[str]) -> tuple[dict, list[str]]:
    """``server.extra_args`` as ``vllm.LLM`` keywords, read with vLLM's own engine parser.

    Every vLLM the run starts gets them (``--language-model-only`` for a multimodal target,
    ``--mm-encoder-tp-mode``, ...). Settings this backend needs keep its values (see
    ``engine_kwargs``); API-server options the engine does not know are returned apart.
    """
    if not extra_args:
        return {}, []
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    defaults = vars(parser.parse_args([]))
    parsed, server_only = parser.parse_known_args(list(extra_args))
    return {k: v for k, v in vars(parsed).items() if v != defaults[k]}, server_only


class VLLMBackend:
    """A vLLM engine that returns the states at ``capture_ids`` for lists of token ids."""

    name = "vllm"

    def __init__(self, target_dir: Path, capture_ids: Sequence[int], max_len: int,
                 spool_dir: Path, hidden_cfg: dict, server_cfg: dict | None,
                 wait_timeout_s: float = 600.0, capture: str = "auto"):
        # in-process engine core; vLLM reads the variable only while it builds the engine, and
        # it must not reach a vLLM server this process starts later (its API server would run
        # the engine in its own event loop: bursty streams, a running gauge stuck at 0)
        unset = "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # server.env applies to every vLLM of the run (e.g. NCCL settings for TP over PCIe)
        os.environ.update((server_cfg or {}).get("env") or {})
        # the states are freed a pass at a time: keep that memory here, and in the
        # tensor-parallel workers (fresh processes read the variables while the engine starts)
        reuse_freed_heap()
        heap_env = {k: v for k, v in HEAP_REUSE_ENV.items() if k not in os.environ}
        os.environ.update(heap_env)

        if sorted(set(capture_ids)) != list(capture_ids):
            raise ValueError(f"capture ids must be ascending and distinct, got {capture_ids}")
        self.capture_ids = list(capture_ids)
        self.spool_dir = Path(spool_dir)
        shutil.rmtree(self.spool_dir, ignore_errors=True)  # leftovers of a killed run
        self.spool_dir.mkdir(parents=True)
        self.inbox = open_inbox(self.spool_dir)  # used if the engine's worker runs here
        self.wait_timeout_s = wait_timeout_s
        kwargs = engine_kwargs(target_dir, capture_ids, self.spool_dir, max_len,
                               hidden_cfg, server_cfg or {})
        _, server_only = extra_engine_args((server_cfg or {}).get("extra_args") or ())
        if server_only:
            log.info("server.extra_args %s are API-server options: not for the hidden-state "
                     "engine", server_only)
        if _on_cpu():
            # On CPU the KV cache size comes from this variable; the flag is a host-memory share.
            space = (server_cfg or {}).get("cpu_kvcache_space_gib", 1)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(space))))
            kwargs.setdefault("gpu_memory_utilization", 0.3)
        import torch

        set_num_threads, self._torch_threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.direct = self._choose_capture(capture, kwargs)
            self.llm = self._start(kwargs, capture)
        except BaseException:
            close_inbox(self.spool_dir)
            raise
        finally:
            if unset:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            for name in heap_env:  # not for the processes this one starts later
                os.environ.pop(name, None)
            # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op once
            # it has bound its threads; whatever this process runs next (training, tests that
            # compare floats with one-thread subprocesses) must still set its own thread count
            torch.set_num_threads = set_num_threads
        self._inprocess = type(self.llm.llm_engine.engine_core).__name__ == "InprocClient"

    @property
    def capture(self) -> str:
        """How the states are taken: ``direct`` (the model runner's) or ``connector``."""
        return "direct" if self.direct else "connector"

    def _choose_capture(self, capture: str, kwargs: dict) -> bool:
        """Whether to capture directly (``capture``: auto, direct or connector)."""
        if capture not in ("auto", "direct", "connector"):
            raise ValueError(f"capture must be auto, direct or connector, not {capture!r}")
        reason = why_not_direct(kwargs)
        if capture == "direct" and reason:
            raise ValueError(f"the direct capture cannot run here: {reason}")
        if capture == "auto" and reason:
            log.info("hidden states through the connector: %s", reason)
        return capture != "connector" and reason is None

    def _start(self, kwargs: dict, capture: str):
        """The engine, with the direct capture installed or the connector configured."""
        from vllm import LLM

        if not self.direct:
            return LLM(**kwargs)
        from draftline.stages.hidden.vllm_direct import install

        llm = LLM(**{k: v for k, v in kwargs.items()
                     if k not in ("speculative_config", "kv_transfer_config")})
        try:
            llm.collective_rpc(install, args=(str(self.spool_dir), self.capture_ids))
            return llm
        except Exception as exc:
            llm.llm_engine.engine_core.shutdown()
            if capture == "direct":
                raise
            log.info("hidden states through the connector: %s", exc)
            self.direct = False
            return LLM(**kwargs)

    def states(self, samples: Sequence[Sequence[int]],
               on_batch: Callable[[int], None] | None = None) -> list:
        """States for each sample, in input order: ``[T_i, len(capture_ids), H]`` tensors."""
        from vllm import SamplingParams

        run = uuid.uuid4().hex[:8]
        names = [f"{run}-{i}" for i in range(len(samples))]
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in samples]
        # the one sampled token is dropped: greedy spares the step vLLM's random sampling
        params = [SamplingParams(max_tokens=1, temperature=0.0, extra_args=(
                      {NAME_KEY: n} if self.direct else {"kv_transfer_params": {NAME_KEY: n}}))
                  for n in names]
        self.llm.generate(prompts, params, use_tqdm=False)
        states = self._collect(dict(zip(names, samples, strict=True)))
        if on_batch:
            on_batch(sum(len(ids) for ids in samples))
        return [states[name] for name in names]

    def _collect(self, pending: dict[str, Sequence[int]]) -> dict:
        """The states of each named request, as the capture hands them over."""
        deadline = time.monotonic() + self.wait_timeout_s
        states = {}
        while True:
            for name, ids in list(pending.items()):
                try:
                    got = read_states(self.spool_dir, name, ids, len(self.capture_ids),
                                      self.inbox)
                except SpoolError as exc:
                    raise RuntimeError(f"vLLM backend: {exc}") from exc
                if got is not None:
                    states[name] = got
                    del pending[name]
            if not pending:
                return states
            if self.direct:  # its requests were handed over by the forwards generate ran
                raise RuntimeError(f"vLLM backend: the direct capture handed over no states "
                                   f"for {len(pending)} requests (e.g. {next(iter(pending))})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM handed over no hidden states for {len(pending)} "
                                   f"requests within {self.wait_timeout_s:.0f} s "
                                   f"(e.g. {next(iter(pending))})")
            if self._inprocess:  # the step runs the connector for the last finished requests
                self.llm.llm_engine.step()
                time.sleep(0.001)
            else:
                time.sleep(0.01)

    def close(self) -> None:
        if getattr(self, "llm", None) is None:
            return
        engine = self.llm.llm_engine
        if self._inprocess:
            for _ in range(4):  # let the connector report the last requests as done
                engine.step()
        engine.engine_core.shutdown()
        self.llm = None
        import torch

        torch.set_num_threads(self._torch_threads)  # the engine set it to the cores it bound
        close_inbox(self.spool_dir)
        shutil.rmtree(self.spool_dir, ignore_errors=True)

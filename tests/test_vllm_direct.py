"""The direct capture's bookkeeping: a forward's rows go to their requests by the runner's
batch order, placed by position; a prompt is handed over once whole.

The runner here is a stand-in holding only what ``DirectCapture.take`` reads (the batch's
request order, its row offsets, the requests' prompts and names); the real model runner is
exercised by tests/test_hidden.py, whose direct capture must equal the connector's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import requires_vllm

pytestmark = requires_vllm

N_IDS, H = 2, 3


def runner(prompts: dict[str, list[int]]):
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[], num_reqs=0),
        query_start_loc=SimpleNamespace(np=np.zeros(8, dtype=np.int32)),
        requests={rid: SimpleNamespace(prompt_token_ids=ids, sampling_params=SimpleNamespace(
            extra_args={"draftline_name": f"name-{rid}"})) for rid, ids in prompts.items()})


def state_rows(positions: list[int]) -> torch.Tensor:
    """A row's states encode its position: [tokens, N_IDS, H]."""
    return torch.tensor(positions, dtype=torch.float32)[:, None, None].expand(-1, N_IDS, H)


def step(capture, schedule: list[tuple[str, int, int]], padding: int = 0) -> None:
    """One forward: ``(request, first position, tokens)`` in batch order."""
    run = capture.runner
    run.input_batch.req_ids = [rid for rid, _, _ in schedule] + [None]  # stale tail
    run.input_batch.num_reqs = len(schedule)
    starts = np.cumsum([0] + [n for _, _, n in schedule])
    run.query_start_loc.np[:len(starts)] = starts
    positions = [p for _, first, n in schedule for p in range(first, first + n)] + [0] * padding
    ids = [run.requests[rid].prompt_token_ids[p] if p < len(run.requests[rid].prompt_token_ids)
           else 999 for rid, first, n in schedule for p in range(first, first + n)] + [0] * padding
    states = state_rows(positions)
    capture.take(torch.tensor(ids), torch.tensor(positions),
                 [states[:, i] for i in range(N_IDS)])


def capture_of(prompts):
    from draftline.stages.hidden.vllm_connector import Inbox
    from draftline.stages.hidden.vllm_direct import DirectCapture

    return DirectCapture(runner(prompts), Inbox())


def test_rows_go_to_their_requests_and_chunked_prompts_come_out_whole():
    prompts = {"a": [5, 6, 7, 8, 9], "b": [3, 4], "c": [1, 2, 3]}
    capture = capture_of(prompts)
    step(capture, [("a", 0, 3), ("b", 0, 2)], padding=2)  # a's first chunk; b whole
    assert sorted(capture.inbox._items) == ["name-b"]
    step(capture, [("c", 0, 3), ("a", 3, 2), ("b", 2, 1)])  # a's last chunk; b's decode row
    got = {name: capture.inbox.take(name) for name in ("name-a", "name-b", "name-c")}
    for rid, ids in prompts.items():
        item = got[f"name-{rid}"]
        assert item["token_ids"] == ids
        assert torch.equal(item["hidden_states"], state_rows(list(range(len(ids)))))
    assert capture.partial == {} and len(capture.inbox) == 0


def test_a_preempted_prompt_starts_over_and_a_gap_is_an_error():
    capture = capture_of({"a": [5, 6, 7, 8], "b": [1, 2, 3, 4]})
    step(capture, [("a", 0, 2), ("b", 0, 2)])
    step(capture, [("a", 0, 2)])  # a computed again from the start after a preemption
    step(capture, [("a", 2, 2), ("b", 3, 1)])  # b's position 2 never came
    item = capture.inbox.take("name-a")
    assert torch.equal(item["hidden_states"], state_rows([0, 1, 2, 3]))
    assert capture.inbox.take("name-b") == "request b: rows from position 3, expected 2"


def test_a_request_gone_before_its_prompt_was_computed_is_forgotten():
    capture = capture_of({"a": [5, 6, 7, 8], "b": [1, 2]})
    step(capture, [("a", 0, 2)])
    del capture.runner.requests["a"]  # aborted
    step(capture, [("b", 0, 2)])
    assert capture.partial == {} and sorted(capture.inbox._items) == ["name-b"]


@pytest.mark.parametrize("kwargs,multiprocessing,reason", [
    ({"tensor_parallel_size": 1, "enforce_eager": True}, "0", None),
    ({"tensor_parallel_size": 2, "enforce_eager": True}, "0", "tensor_parallel_size 2"),
    ({"pipeline_parallel_size": 2, "enforce_eager": True}, "0", "pipeline_parallel_size 2"),
    ({"tensor_parallel_size": 1, "enforce_eager": False}, "0", "compiled"),
    ({"tensor_parallel_size": 1, "enforce_eager": True}, "1", "process of its own"),
])
def test_the_direct_capture_needs_the_one_worker_here_in_eager_mode(
        monkeypatch, kwargs, multiprocessing, reason):
    from draftline.stages.hidden.vllm_backend import why_not_direct

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    got = why_not_direct(kwargs)
    assert got is None if reason is None else reason in got


def test_a_request_the_direct_capture_missed_fails_at_once(tmp_path):
    """Its states come with the forwards ``generate`` ran: none later is worth waiting for."""
    from draftline.stages.hidden.vllm_backend import VLLMBackend
    from draftline.stages.hidden.vllm_connector import Inbox

    backend = object.__new__(VLLMBackend)  # no engine: only what _collect reads
    backend.direct, backend.inbox, backend.spool_dir = True, Inbox(), tmp_path
    backend.capture_ids, backend.wait_timeout_s = [2, 4], 600.0
    backend.inbox.put("s-1", {"hidden_states": torch.zeros(2, 2, 3), "token_ids": [7, 8]})
    with pytest.raises(RuntimeError, match="no states for 1 requests \\(e.g. s-2\\)"):
        backend._collect({"s-1": [7, 8], "s-2": [9]})

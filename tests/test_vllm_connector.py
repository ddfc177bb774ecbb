"""The hidden-states connector: which finished requests are handed over (scheduler side), and
how (worker side: in memory to a reader in the same process, else a spool file)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the connector is a vLLM plugin")

from vllm.v1.request import RequestStatus  # noqa: E402

from draftline.stages.hidden.vllm_connector import (  # noqa: E402
    NAME_KEY,
    DraftlineHiddenStatesConnector,
    SpoolError,
    close_inbox,
    gather_token_states,
    inbox_in_this_process,
    open_inbox,
    read_states,
)


def scheduler_side(tmp_path):
    """The connector's scheduler half without an engine: only what request_finished reads."""
    connector = object.__new__(DraftlineHiddenStatesConnector)
    connector.spool_dir = tmp_path
    connector._pending = []
    return connector


def finished_request(status, computed: int, prompt_len: int = 6):
    return SimpleNamespace(request_id="r1", status=status, num_computed_tokens=computed,
                           prompt_token_ids=list(range(prompt_len)),
                           kv_transfer_params={NAME_KEY: "s-0001"})


def test_a_request_finished_after_its_prompt_is_written(tmp_path):
    connector = scheduler_side(tmp_path)
    keep, params = connector.request_finished(
        finished_request(RequestStatus.FINISHED_LENGTH_CAPPED, computed=6), [3, 4])
    assert keep is True
    assert params == {"hidden_states_path": str(tmp_path / "s-0001.safetensors")}
    assert [(w.name, w.block_ids) for w in connector._pending] == [("s-0001", [3, 4])]


@pytest.mark.parametrize("status,computed", [
    (RequestStatus.FINISHED_ABORTED, 6),        # client went away after the prefill
    (RequestStatus.FINISHED_ABORTED, 2),        # ... or in the middle of it
    (RequestStatus.FINISHED_ERROR, 6),
    (RequestStatus.FINISHED_LENGTH_CAPPED, 4),  # any end before the whole prompt was computed
])
def test_a_request_that_ended_early_writes_no_file(tmp_path, status, computed):
    connector = scheduler_side(tmp_path)
    keep, params = connector.request_finished(finished_request(status, computed), [3, 4])
    assert (keep, params) == (False, None)
    assert connector._pending == []


# ----------------------------------------------------------------------------- worker side


def worker_side(tmp_path, inbox=None):
    """The connector's worker half without an engine: only what the hand-over reads."""
    connector = object.__new__(DraftlineHiddenStatesConnector)
    connector.spool_dir = tmp_path
    connector._inbox = inbox
    return connector


def states_of(ids):
    return torch.arange(len(ids) * 2 * 3, dtype=torch.float32).view(-1, 2, 3)  # [T, 2 ids, 3]


def test_spool_files_are_renamed_into_place_without_fsync(tmp_path, monkeypatch):
    """A spool file is read back at once and the spool is wiped at start: it needs the rename's
    all-or-nothing, not durability, and the fsyncs cost a busy 2-core host 8% of the capture."""
    from draftline.core import atomic

    synced = []
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(fd))
    worker_side(tmp_path)._write_file(states_of([5, 6, 7]), [5, 6, 7], "s-0001")
    assert synced == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-0001.safetensors"]
    states = read_states(tmp_path, "s-0001", [5, 6, 7], num_ids=2)
    assert torch.equal(states, states_of([5, 6, 7]))
    assert list(tmp_path.iterdir()) == []  # a file read is a file gone
    worker_side(tmp_path)._write_file(states_of([5, 6, 9]), [5, 6, 9], "s-0002")
    with pytest.raises(SpoolError, match="spool file .*s-0002.* other tokens"):
        read_states(tmp_path, "s-0002", [5, 6, 7], num_ids=2)


def test_states_handed_over_in_process_are_checked_like_files(tmp_path):
    inbox = open_inbox(tmp_path)
    try:
        assert inbox_in_this_process(tmp_path) is inbox
        connector = worker_side(tmp_path, inbox)
        assert read_states(tmp_path, "s-0001", [5, 6, 7], 2, inbox) is None  # not yet
        connector._queue("s-0001", states_of([5, 6, 7]), [5, 6, 7])
        connector._queue("s-0002", states_of([5, 6, 9]), [5, 6, 9])
        connector._write_error("s-0003", "copy failed: boom")
        states = read_states(tmp_path, "s-0001", [5, 6, 7], 2, inbox)
        assert torch.equal(states, states_of([5, 6, 7]))
        with pytest.raises(SpoolError, match="request s-0002 .*in memory.*other tokens"):
            read_states(tmp_path, "s-0002", [5, 6, 7], 2, inbox)
        with pytest.raises(SpoolError, match="failed for request s-0003: copy failed: boom"):
            read_states(tmp_path, "s-0003", [5, 6, 7], 2, inbox)
        assert len(inbox) == 0 and list(tmp_path.iterdir()) == []  # nothing went to disk
    finally:
        close_inbox(tmp_path)
    assert inbox_in_this_process(tmp_path) is None


def test_a_forked_worker_writes_files_instead_of_its_copy_of_the_inbox(tmp_path):
    """A worker forked from the reader inherits the inbox registry, but what it puts there
    never reaches the reader: it must spool files."""
    import multiprocessing

    open_inbox(tmp_path)
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            in_child = pool.apply(inbox_is_used, (str(tmp_path),))
        assert (inbox_is_used(str(tmp_path)), in_child) == (True, False)
    finally:
        close_inbox(tmp_path)


def inbox_is_used(spool_dir: str) -> bool:
    return inbox_in_this_process(spool_dir) is not None


@pytest.mark.parametrize("requests", [[([7, 2, 5, 0], 10)], [([3], 3)],
                                      [([7, 2, 5, 0], 10), ([3], 3), ([1, 6], 8)]],
                         ids=["three blocks", "one block", "three requests"])
@pytest.mark.parametrize("layout", ["blocks, ids, slots, H", "blocks, slots, ids, H"])
def test_token_states_are_gathered_from_their_blocks_in_prompt_order(layout, requests, tmp_path):
    """Token t of a prompt sits in slot t % block_size of its (t // block_size)-th block, in
    either physical layout vLLM may allocate (the view is [blocks, ids, slots, H] in both);
    the requests that finish in one step are gathered together."""
    blocks, n_ids, block_size, hidden = 9, 2, 4, 3
    if layout == "blocks, ids, slots, H":
        cache = torch.randn(blocks, n_ids, block_size, hidden)
    else:
        cache = torch.randn(blocks, block_size, n_ids, hidden).transpose(1, 2)
    expected = [torch.stack([cache[block_ids[t // block_size], :, t % block_size]
                             for t in range(num_tokens)]) for block_ids, num_tokens in requests]
    got = gather_token_states(cache, requests, block_size)
    assert [g.shape for g in got] == [(n, n_ids, hidden) for _, n in requests]
    assert all(g.is_contiguous() for g in got)  # as safetensors wants
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    # a slice of the step's copy
    worker_side(tmp_path)._write_file(got[-1], list(range(requests[-1][1])), "s-1")
    assert torch.equal(read_states(tmp_path, "s-1", list(range(requests[-1][1])), n_ids),
                       expected[-1])
    cache.zero_()
    assert all(g.abs().sum() > 0 for g in got)  # copies, not views of the cache's blocks

"""The hidden-states connector's scheduler side: which finished requests get a spool file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the connector is a vLLM plugin")

from vllm.v1.request import RequestStatus  # noqa: E402

from draftline.stages.hidden.vllm_connector import (  # noqa: E402
    NAME_KEY,
    DraftlineHiddenStatesConnector,
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

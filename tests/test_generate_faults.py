"""Generation against a faulty endpoint of the tests' own making (``fake_endpoint``): malformed
answers, slow bodies, a proxy in front of a dead server, interrupted and concurrent runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from fake_endpoint import (
    OUTPUT_TOKEN_IDS,
    PROMPT_TOKEN_IDS,
    FakeEndpoint,
    Reply,
    good_completion,
    user_prompts,
)

from draftline.stages.generate import GenerateSettings, generate_shard

IDS = ["q0", "q1", "q2"]
FAST = dict(concurrency=2, max_retries=3, backoff_base_s=0.01, backoff_cap_s=0.05,
            request_timeout_s=5.0, endpoint_down_timeout_s=30.0)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tmp_path: Path, endpoint, settings: GenerateSettings, ids=IDS) -> tuple[Path, dict]:
    prompts = user_prompts(tmp_path / "shard-0.jsonl", ids)
    out = tmp_path / "out" / "shard-0.jsonl"
    summary = generate_shard(prompts, out, out.with_name("shard-0.errors.jsonl"),
                             out.with_name("shard-0.summary.json"), [endpoint], settings)
    return out, summary


# ----------------------------------------------------------------------------- malformed answers


def _without(path: tuple, completion: dict) -> dict:
    *parents, last = path
    node = completion
    for key in parents:
        node = node[key]
    del node[last]
    return completion


def _with(path: tuple, value, completion: dict) -> dict:
    *parents, last = path
    node = completion
    for key in parents:
        node = node[key]
    node[last] = value
    return completion


MALFORMED = {
    "no token_ids": lambda c: _without(("choices", 0, "token_ids"), c),
    "empty token_ids": lambda c: _with(("choices", 0, "token_ids"), [], c),
    "no prompt_token_ids": lambda c: _without(("prompt_token_ids",), c),
    "message null": lambda c: _with(("choices", 0, "message"), None, c),
    "completion_tokens null": lambda c: _with(("usage", "completion_tokens"), None, c),
    "ids disagree with usage": lambda c: _with(("usage", "completion_tokens"), 9, c),
    "prompt ids disagree with usage": lambda c: _with(("usage", "prompt_tokens"), 1, c),
    "no usage": lambda c: _without(("usage",), c),
}


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_a_malformed_answer_is_asked_again_and_the_good_answer_kept(tmp_path, fault):
    """q1's first answer is a complete 200 that lacks what an answer needs: it is not kept,
    the prompt is asked once more (one ``invalid`` retry) and the good answer is the record."""

    def reply(prompt_id: str, attempt: int) -> Reply:
        good = good_completion(prompt_id)
        if prompt_id == "q1" and attempt == 0:
            return Reply(MALFORMED[fault](copy.deepcopy(good)))
        return Reply(good)

    with FakeEndpoint(reply) as fake:
        out, summary = _run(tmp_path, fake.endpoint, GenerateSettings(**FAST))
    assert dict(fake.asked) == {"q0": 1, "q1": 2, "q2": 1}
    records = _lines(out)
    assert [r["id"] for r in records] == IDS
    q1 = records[1]
    assert q1["output_token_ids"] == OUTPUT_TOKEN_IDS
    assert q1["prompt_token_ids"] == PROMPT_TOKEN_IDS
    assert q1["messages"][-1]["content"] == "answer to q1"
    assert _lines(out.with_name("shard-0.errors.jsonl")) == []
    assert summary["retries_by_kind"] == {"invalid": 1}
    assert summary["output_tokens"] == 3 * len(OUTPUT_TOKEN_IDS)
    assert summary["prompt_tokens"] == 3 * len(PROMPT_TOKEN_IDS)


def test_an_endpoint_that_only_answers_malformed_files_a_retryable_invalid_error(tmp_path):
    def reply(prompt_id: str, attempt: int) -> Reply:
        good = good_completion(prompt_id)
        return Reply(MALFORMED["message null"](good) if prompt_id == "q2" else good)

    with FakeEndpoint(reply) as fake:
        out, summary = _run(tmp_path, fake.endpoint, GenerateSettings(**FAST))
    assert fake.asked["q2"] == 1 + FAST["max_retries"]
    [error] = _lines(out.with_name("shard-0.errors.jsonl"))
    assert (error["id"], error["kind"], error["retryable"]) == ("q2", "invalid", True)
    assert "message" in error["error"]
    assert [r["id"] for r in _lines(out)] == ["q0", "q1"]


def test_a_kept_answer_without_token_ids_is_asked_again_on_the_rerun(tmp_path):
    """Answers an earlier run kept with null or empty ids (before answers were checked) carry a
    valid fingerprint, yet cannot be trained on: the rerun discards and re-asks them."""
    from draftline.core.records import read_shard
    from draftline.stages.responses import partial_paths, prompt_fingerprints

    settings = GenerateSettings(**FAST)
    with FakeEndpoint(lambda pid, attempt: Reply(good_completion(pid))) as fake:
        prompts = user_prompts(tmp_path / "shard-0.jsonl", IDS)
        fingerprints = prompt_fingerprints(read_shard(prompts), settings, [fake.endpoint], {})
        partial = partial_paths(tmp_path / "out" / "shard-0.jsonl")[0]
        partial.parent.mkdir(parents=True)
        kept = {"q0": (PROMPT_TOKEN_IDS, OUTPUT_TOKEN_IDS), "q1": (PROMPT_TOKEN_IDS, None),
                "q2": (None, [])}
        partial.write_text("".join(json.dumps({
            "id": pid, "messages": [], "prompt_token_ids": prompt_ids,
            "output_token_ids": output_ids, "finish_reason": "stop", "usage": None,
            "fingerprint": fingerprints[pid]}) + "\n" for pid, (prompt_ids, output_ids)
            in kept.items()))
        out, summary = _run(tmp_path, fake.endpoint, settings)
    assert dict(fake.asked) == {"q1": 1, "q2": 1}
    assert [(r["id"], r["output_token_ids"]) for r in _lines(out)] == [
        (pid, OUTPUT_TOKEN_IDS) for pid in IDS]
    assert (summary["resumed"], summary["discarded_incomplete"]) == (1, 2)


# -------------------------------------------------------------------------- whole-request deadline


def test_request_timeout_bounds_the_whole_request_not_each_read(tmp_path):
    """q1's first answer comes one byte every 20 ms (about 12 s for the body): no single read
    waits past ``request_timeout_s`` = 1 s, but the request as a whole does, so it times out
    after about a second and the prompt is asked again."""
    import time

    def reply(prompt_id: str, attempt: int) -> Reply:
        slow = prompt_id == "q1" and attempt == 0
        return Reply(good_completion(prompt_id), trickle_s=0.02 if slow else None)

    settings = GenerateSettings(**{**FAST, "request_timeout_s": 1.0})
    t0 = time.monotonic()
    with FakeEndpoint(reply) as fake:
        out, summary = _run(tmp_path, fake.endpoint, settings)
        elapsed = time.monotonic() - t0
    assert elapsed < 5.0
    assert dict(fake.asked) == {"q0": 1, "q1": 2, "q2": 1}
    assert summary["retries_by_kind"] == {"timeout": 1}
    assert [r["output_token_ids"] for r in _lines(out)] == [OUTPUT_TOKEN_IDS] * 3


# ----------------------------------------------------------------------------- 5xx: endpoint down


@pytest.fixture
def quick_set_aside(monkeypatch):
    """An endpoint that answered only 5xx for 0.2 s is down, and rests 0.2 s (not 5 and 5)."""
    from draftline.serving.endpoint_clients import EndpointPool

    monkeypatch.setattr(EndpointPool, "DOWN_AFTER_SERVER_ERRORS_S", 0.2, raising=False)
    monkeypatch.setattr(EndpointPool, "COOLDOWN_S", 0.2)


# the retries' backoff spans more than the 0.2 s it takes to call an endpoint down (as the
# defaults' 1, 2, 4 s spans more than 5 s), yet only about half a second in all
SLOWER_BACKOFF = {**FAST, "backoff_base_s": 0.1, "backoff_cap_s": 0.4}


def test_an_endpoint_answering_502_is_set_aside_and_the_prompts_wait_for_it(tmp_path,
                                                                          quick_set_aside):
    """A proxy in front of a server that is restarting answers 502 for 1.5 s: the prompts do
    not spend their retries on it (they would be spent in well under a second) but wait while
    the endpoint rests, and every one is answered once the server is back."""
    import time

    back_at = time.monotonic() + 1.5

    def reply(prompt_id: str, attempt: int) -> Reply:
        if time.monotonic() < back_at:
            return Reply({"error": {"message": "Bad Gateway"}}, status=502)
        return Reply(good_completion(prompt_id))

    with FakeEndpoint(reply) as fake:
        out, summary = _run(tmp_path, fake.endpoint, GenerateSettings(**SLOWER_BACKOFF))
    assert [r["id"] for r in _lines(out)] == IDS
    assert _lines(out.with_name("shard-0.errors.jsonl")) == []
    assert summary["endpoint_set_asides"] >= 2
    assert summary["retries_by_kind"].get("status", 0) <= 2 * FAST["max_retries"]


def test_an_endpoint_that_only_answers_502_ends_the_run_as_down_with_no_prompt_failed(
        tmp_path, quick_set_aside):
    from draftline.stages.generate import EndpointsDown
    from draftline.stages.responses import partial_paths, read_attempts

    def reply(prompt_id: str, attempt: int) -> Reply:
        return Reply({"error": {"message": "Bad Gateway"}}, status=502)

    settings = GenerateSettings(**{**SLOWER_BACKOFF, "endpoint_down_timeout_s": 1.0})
    with FakeEndpoint(reply) as fake, pytest.raises(EndpointsDown, match="no endpoint answered"):
        _run(tmp_path, fake.endpoint, settings)
    errors = partial_paths(tmp_path / "out" / "shard-0.jsonl")[1]
    assert errors.read_text() == ""  # the endpoint failed, not the prompts: all asked again
    assert min(fake.asked.values()) >= 2
    [attempt] = read_attempts(tmp_path / "out" / "shard-0.jsonl")  # in the rerun's summary
    assert (attempt["outcome"], attempt["answered"], attempt["errors"]) == ("EndpointsDown", 0, 0)


def test_one_prompt_the_server_always_fails_spends_its_retries_and_the_run_ends(
        tmp_path, quick_set_aside):
    """A 5xx for one prompt only, every time (the server chokes on it): once the other
    prompts are answered it is the only one asking, but the endpoint is not down, it is the
    prompt. It ends in the errors file after its retries, the run ends normally."""
    def reply(prompt_id: str, attempt: int) -> Reply:
        if prompt_id == "q1":
            return Reply({"error": {"message": "Internal Server Error"}}, status=500)
        return Reply(good_completion(prompt_id))

    settings = GenerateSettings(**{**SLOWER_BACKOFF, "endpoint_down_timeout_s": 3.0})
    with FakeEndpoint(reply) as fake:
        out, summary = _run(tmp_path, fake.endpoint, settings)
    assert [r["id"] for r in _lines(out)] == ["q0", "q2"]
    assert [e["id"] for e in _lines(out.with_name("shard-0.errors.jsonl"))] == ["q1"]
    assert fake.asked["q1"] == SLOWER_BACKOFF["max_retries"] + 1
    assert summary["endpoint_set_asides"] == 0


# ----------------------------------------------------------------------------- one run at a time

GENERATE_IN_A_PROCESS = """
import sys
from pathlib import Path
from draftline.stages.generate import GenerateSettings, generate_shard
from draftline.serving.server import Endpoint

prompts, out, base_url = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
generate_shard(prompts, out, out.with_name("shard-0.errors.jsonl"),
               out.with_name("shard-0.summary.json"), [Endpoint(base_url, "fake")],
               GenerateSettings(concurrency=1, max_retries=1, request_timeout_s=30))
"""


def _slow(prompt_id: str, attempt: int) -> Reply:
    return Reply(good_completion(prompt_id), delay_s=0.3)


def _generation_process(tmp_path: Path, fake: FakeEndpoint, ids: list[str]):
    """``generate_shard`` in a process of its own, once its first answer is kept."""
    import os
    import subprocess
    import sys
    import time

    prompts = user_prompts(tmp_path / "shard-0.jsonl", ids)
    out = tmp_path / "out" / "shard-0.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", GENERATE_IN_A_PROCESS, str(prompts),
                             str(out), fake.endpoint.base_url], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = out.parent / ".partial" / "shard-0.jsonl"
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc, out


def test_a_second_run_on_the_same_results_refuses_naming_the_first_and_a_dead_ones_lock_is_taken(
        tmp_path):
    import signal

    from draftline.stages.generate import GenerationLocked

    ids = [f"q{i:02d}" for i in range(40)]
    with FakeEndpoint(_slow) as fake:
        first, out = _generation_process(tmp_path, fake, ids)
        try:
            with pytest.raises(GenerationLocked, match=f"pid {first.pid}\\b") as refused:
                _run(tmp_path, fake.endpoint, GenerateSettings(**FAST), ids)
            assert str(out.parent) in str(refused.value)
        finally:
            first.send_signal(signal.SIGKILL)
            first.communicate()
        asked_by_first = sum(fake.asked.values())
        # the first run died holding the lock: the next run takes it over and finishes
        _, summary = _run(tmp_path, fake.endpoint, GenerateSettings(**FAST), ids)
    assert 1 <= asked_by_first < len(ids)
    assert summary["responses"] == len(ids) and summary["resumed"] >= 1


# ----------------------------------------------------------------------------- unwritable output


@pytest.fixture
def read_only_responses(tmp_path):
    """``out/``, read only, with a writable ``out/.partial`` (as a folder left by an earlier
    run): a read-only tmpfs for root (root ignores permission bits), else mode 0555."""
    import os
    import subprocess

    out = tmp_path / "out"
    out.mkdir()
    mounts = []
    if os.geteuid() == 0:
        def mount(*args):
            proc = subprocess.run(["mount", *args], capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")

        mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out))
        mounts.append(out)
        (out / ".partial").mkdir()
        mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out / ".partial"))
        mounts.append(out / ".partial")
        mount("-o", "remount,ro", str(out))
    else:
        (out / ".partial").mkdir()
        out.chmod(0o555)
    yield out
    for path in reversed(mounts):
        subprocess.run(["umount", "-l", str(path)], check=False)
    if not mounts:
        out.chmod(0o755)


def test_an_unwritable_output_folder_stops_the_run_before_its_first_request(
        tmp_path, read_only_responses):
    from draftline.stages.generate import OutputNotWritable

    with FakeEndpoint(lambda pid, attempt: Reply(good_completion(pid))) as fake, \
            pytest.raises(OutputNotWritable) as refused:
        _run(tmp_path, fake.endpoint, GenerateSettings(**FAST))
    assert f"cannot write generation output in {read_only_responses}:" in str(refused.value)
    assert dict(fake.asked) == {}


# ----------------------------------------------------------------------------- Ctrl-C


def test_sigint_ends_the_run_with_one_line_and_keeps_what_was_answered(tmp_path):
    import signal

    from draftline.stages.responses import read_attempts, read_jsonl_ids

    ids = [f"q{i:02d}" for i in range(40)]
    with FakeEndpoint(_slow) as fake:
        proc, out = _generation_process(tmp_path, fake, ids)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    [message] = [line for line in stderr.splitlines() if "interrupted" in line]
    kept = read_jsonl_ids(out.parent / ".partial" / "shard-0.jsonl")
    assert 1 <= len(kept) < len(ids)
    assert f"{len(kept)} answers kept" in message and "rerun to resume" in message
    [attempt] = read_attempts(out)
    assert (attempt["outcome"], attempt["answered"]) == ("interrupted", len(kept))


# ----------------------------------------------------------------------------- summaries' history


def test_a_rerun_keeps_the_faulted_runs_retries_and_errors_in_the_summary(tmp_path):
    """The first run: q1 gets only 503s and ends as a (retryable) error after one retry. The
    rerun answers it. The rerun's summary reports its own figures under the keys as before, and
    every attempt's with the totals over both."""
    server_up = {"q1": False}

    def reply(prompt_id: str, attempt: int) -> Reply:
        if server_up.get(prompt_id, True):
            return Reply(good_completion(prompt_id))
        return Reply({"error": {"message": "overloaded"}}, status=503)

    settings = GenerateSettings(**{**FAST, "max_retries": 1})
    with FakeEndpoint(reply) as fake:
        _, first = _run(tmp_path, fake.endpoint, settings)
        server_up["q1"] = True
        out, second = _run(tmp_path, fake.endpoint, settings)
    assert (first["retries"], first["errors"], first["responses"]) == (1, 1, 2)
    assert (second["retries"], second["errors"], second["responses"]) == (0, 0, 3)
    assert [(a["outcome"], a["asked"], a["answered"], a["errors"], a["retries"],
             a["retries_by_kind"]) for a in second["attempts"]] == [
        ("complete", 3, 2, 1, 1, {"status": 1}), ("complete", 1, 1, 0, 0, {})]
    assert second["all_attempts"] == {"attempts": 2, "asked": 4, "answered": 3, "errors": 1,
                                      "retries": 1, "retries_by_kind": {"status": 1},
                                      "endpoint_set_asides": 0, "connection_resends": 0}
    on_disk = json.loads(out.with_name("shard-0.summary.json").read_text())
    assert on_disk["attempts"] == second["attempts"]


# ----------------------------------------------------------------------------- final errors


def test_a_rerun_asks_the_prompts_that_ended_in_final_errors_again_and_keeps_their_history(
        tmp_path):
    """The first run: q1 and q2 get a 404 (an error another try in that run would repeat): each
    is asked once and filed as a final error. The rerun asks both again; q1 is answered and
    kept, q2 fails again and is filed once. Neither earlier error is lost: the kept errors hold
    both runs' records and the rerun's summary counts the earlier ones."""
    from draftline.stages.responses import partial_paths

    first_run = {"value": True}

    def reply(prompt_id: str, attempt: int) -> Reply:
        if prompt_id == "q2" or (prompt_id == "q1" and first_run["value"]):
            return Reply({"error": {"message": "Not Found"}}, status=404)
        return Reply(good_completion(prompt_id))

    settings = GenerateSettings(**FAST)
    with FakeEndpoint(reply) as fake:
        out, first = _run(tmp_path, fake.endpoint, settings)
        assert dict(fake.asked) == {"q0": 1, "q1": 1, "q2": 1}  # final: once in a run
        assert [(e["id"], e["kind"]) for e in _lines(out.with_name("shard-0.errors.jsonl"))] \
            == [("q1", "final"), ("q2", "final")]
        first_run["value"] = False
        out, second = _run(tmp_path, fake.endpoint, settings)
    assert dict(fake.asked) == {"q0": 1, "q1": 2, "q2": 2}
    assert [r["id"] for r in _lines(out)] == ["q0", "q1"]
    assert _lines(out)[1]["messages"][-1]["content"] == "answer to q1"
    [q2] = _lines(out.with_name("shard-0.errors.jsonl"))  # one record per failed id
    assert (q2["id"], q2["status"], q2["kind"]) == ("q2", 404, "final")
    assert (first["errors"], first["earlier_errors"]) == (2, 0)
    assert (second["responses"], second["errors"], second["unanswered"]) == (2, 1, 0)
    assert (second["earlier_errors"], second["earlier_errors_answered"]) == (2, 1)
    assert [(a["asked"], a["answered"], a["errors"]) for a in second["attempts"]] == [
        (3, 1, 2), (2, 1, 1)]
    history = _lines(partial_paths(out)[1])  # every run's errors, in the order filed
    assert sorted((e["id"], e["status"]) for e in history[:2]) == [("q1", 404), ("q2", 404)]
    assert history[2]["id"] == "q2"
    assert history[0]["time"] <= second["attempts"][0]["end"] < second["timing"]["job_start"] \
        <= history[2]["time"]

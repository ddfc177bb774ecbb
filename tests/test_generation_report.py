"""The generation stage as the servers saw it: merging shard timelines (no server needed)."""

import json

import pytest

from draftline.core.records import RecordError
from draftline.stages.generation_report import (
    build_generation_summary,
    compact_timeline,
    counter_increase,
    cumulative,
    interpolate,
    load_summaries,
    render_mismatches,
    server_view,
    stage_summary,
    step_mean,
    truncation,
)


def test_step_mean_holds_each_sample_until_the_next():
    times, values = [0.0, 1.0, 3.0], [0.0, 4.0, 2.0]
    assert step_mean(times, values, 0.0, 4.0) == pytest.approx((0 + 4 * 2 + 2 * 1) / 4)
    assert step_mean(times, values, 2.0, 4.0) == pytest.approx((4 + 2) / 2)
    assert step_mean([5.0], [3.0], 0.0, 10.0) == pytest.approx(1.5)  # 0 before the first
    assert step_mean(times, values, 4.0, 4.0) is None


def test_counter_increase_spans_the_window_and_survives_a_restart():
    times, counts = [0.0, 1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 5.0, 15.0, 99.0]
    # from the sample at 0 (last before 0.5) to the one at 3 (first after 2.5); 20 -> 5 is a
    # restart: it counts 5
    assert counter_increase(times, counts, 0.5, 2.5) == 10 + 5 + 10
    # two jobs' samples interleaved: one scraped earlier but stamped later steps back a little
    assert counter_increase([0.0, 1.0, 1.1, 2.0], [10.0, 20.0, 19.0, 25.0], 0.0, 2.0) == 15


def test_compact_timeline_averages_gauges_and_keeps_counters():
    rows = [[float(i), float(i % 2) * 4, 0.0, 10.0 * i, 0.5 * i, 0.25, i] for i in range(10)]
    out = compact_timeline(rows, limit=5)
    assert len(out) == 5
    assert out[0] == [1.0, 2.0, 0.0, 10, 0.5, 0.25, 1]  # mean running of (0, 4), rest at the end
    assert out[-1][3:] == [90, 4.5, 0.25, 9]


def test_cumulative_and_interpolate():
    assert cumulative([10.0, 20.0, 19.0, 5.0, 15.0]) == [0.0, 10.0, 10.0, 15.0, 25.0]
    times, values = [0.0, 1.0, 3.0], [0.0, 4.0, 2.0]
    assert interpolate(times, values, -1.0) == 0.0 and interpolate(times, values, 9.0) == 2.0
    assert interpolate(times, values, 0.5) == 2.0 and interpolate(times, values, 2.0) == 3.0
    assert interpolate(times, values, 1.0) == 4.0


# ----------------------------------------------------------------------------- simulated runs


def closed_loop(first: float, slots: int, per_slot: int, run: int = 0) -> list[tuple]:
    """(run, slot, sent, done) of ``slots`` back-to-back request chains of uneven lengths."""
    lengths = [0.9, 1.3, 0.7, 1.1, 0.6, 1.4]
    requests = []
    for slot in range(slots):
        t = first + 0.01 * slot
        for k in range(per_slot):
            length = lengths[(slot + 2 * k) % len(lengths)]
            requests.append((run, slot, t, t + length))
            t += length + 0.02  # the client's turnaround between two answers
    return requests


def sampled(requests: list[tuple], run: int, times: list[float], shard_of, shards: int,
            gauge: float = 0.0) -> list[list[float]]:
    """Rows as ``ServerSampler`` writes them for one run: the server's counters see every
    run's finished requests, the open seconds and completed counts are this run's own. The
    running gauge reads ``gauge`` throughout, whatever runs."""
    rows = []
    for t in times:
        finished = [(r, sent, done) for r, *_, sent, done in requests if done <= t]
        busy = sum(done - sent for _, sent, done in finished)
        open_s = sum(t - sent for r, _, sent, done in requests if r == run and sent <= t < done)
        completed = [sum(1 for q in requests if q[0] == run and q[3] <= t and shard_of(q) == k)
                     for k in range(shards)]
        rows.append([t, gauge, 0.0, 10.0 * len(finished), busy, open_s, *completed])
    return rows


def true_running(requests: list[tuple], start: float, end: float) -> float:
    """Mean requests in flight over [start, end], from the intervals themselves."""
    return sum(max(0.0, min(done, end) - max(sent, start))
               for *_, sent, done in requests) / (end - start)


def summary_of(rows, shard: int, mine: list[tuple], job_start: float, capacity: int = 4) -> dict:
    """Shard ``shard``'s summary, its requests ``mine``, from its run's rows."""
    first = min(q[2] for q in mine)
    end = max(q[3] for q in mine)
    summary = shard_summary(job_start, first, end - 1.0, end, [], responses=len(mine),
                            capacity=capacity, tokens=10 * len(mine))
    summary["server"] = server_view([row[:6] + [row[6 + shard]] for row in rows], capacity,
                                    first, end)
    return summary


def shard_summary(job_start, first, queue_empty, end, rows, responses=10, resumed=0, p50=1.0,
                  capacity=4, tokens=100):
    summary = {"prompts": responses, "responses": responses, "errors": 0,
               "resumed": resumed, "discarded_stale": 0, "output_tokens": tokens,
               "concurrency": capacity, "capacity": capacity,
               "client_slot_utilization": 1.0, "latency_s": {"p50": p50},
               "timing": {"job_start": job_start, "first_request": first,
                          "queue_empty": queue_empty, "end": end,
                          "startup_s": first - job_start}}
    summary["server"] = server_view(rows, capacity, first, end)
    return summary


def test_running_comes_from_request_time_even_when_the_gauge_reads_zero(tmp_path):
    """One run, two shards (even and odd slots), the running gauge stuck at 0 as seen in CI:
    mean running over the run and over the fill phase still match the requests' own
    intervals; the gauges' means are reported beside them, for what they are."""
    requests = closed_loop(first=100.3, slots=4, per_slot=5)
    times = [100.0 + 0.25 * i for i in range(34)]  # to 108.25, past the last answer
    rows = sampled(requests, 0, times, lambda q: q[1] % 2, shards=2)
    a, b = (summary_of(rows, k, [q for q in requests if q[1] % 2 == k], 99.5) for k in (0, 1))
    end = max(q[3] for q in requests)
    stage = stage_summary([a, b])
    server = stage["server"]
    assert server["mean_running"] == pytest.approx(true_running(requests, 99.5, end), rel=0.01)
    assert server["utilization"] == pytest.approx(
        true_running(requests, 99.5, end) / 4, rel=0.01)
    # fill: until fewer than C=4 of the 20 were left (the first sample with 16 done)
    fill_end = next(t for t, row in zip(times, rows, strict=True) if sum(row[6:]) >= 16)
    assert stage["fill_s"] == pytest.approx(fill_end - 100.3, abs=1e-3)
    assert server["mean_running_fill"] == pytest.approx(
        true_running(requests, 100.3, fill_end), rel=0.01)
    assert server["mean_running_fill"] > 3.7  # the slots were busy but for the turnarounds
    # how much of that is the open requests' time at the fill's end, from their sending
    open_at_end = sum(fill_end - sent for *_, sent, done in requests if sent <= fill_end < done)
    assert server["open_share_fill"] == pytest.approx(
        open_at_end / (true_running(requests, 100.3, fill_end) * (fill_end - 100.3)), rel=0.02)
    assert server["gauges"]["mean_running"] == 0.0  # what the gauge said, kept as such
    assert server["output_tokens"] == 200
    # one shard's view: the server's running over that shard's requests
    # (between samples R is interpolated: at each edge of a shard's span the error is at most
    # a sample interval x the change in running requests there, a quarter of that on average)
    first_a, end_a = a["timing"]["first_request"], a["timing"]["end"]
    assert a["server"]["mean_running"] == pytest.approx(
        true_running(requests, first_a, end_a), abs=2 * 0.25 * 4 / 4 / (end_a - first_a))
    # the rule writes the JSON and the plot
    paths = []
    for i, s in enumerate((a, b)):
        paths.append(tmp_path / f"shard-{i}.summary.json")
        paths[-1].write_text(json.dumps(s))
    build_generation_summary(paths, tmp_path / "summary.json", tmp_path / "running.png")
    assert json.loads((tmp_path / "summary.json").read_text()) == stage
    assert (tmp_path / "running.png").stat().st_size > 10_000


def test_stage_summary_puts_every_shard_on_one_time_axis():
    """Two generate runs at once on one server (jobs at 100 and 101, sampling at their own
    moments): the stage's running counts both runs' requests, open and finished; its fill
    phase and tail come from both runs' completions."""
    requests = (closed_loop(first=102.0, slots=2, per_slot=5, run=0)
                + closed_loop(first=103.0, slots=2, per_slot=5, run=1))
    end = max(q[3] for q in requests)
    summaries = []
    for run, (job_start, offset) in enumerate([(100.0, 0.0), (101.0, 0.1)]):
        times = [job_start + 1.5 + offset + 0.25 * i for i in range(40)]
        rows = sampled(requests, run, times, lambda q: 0, shards=1, gauge=2.0)
        summaries.append(summary_of(rows, 0, [q for q in requests if q[0] == run], job_start))
    stage = stage_summary(summaries)
    wall = end - 100.0
    assert stage["wall_s"] == pytest.approx(wall, abs=1e-3)
    assert stage["startup_s"]["first_job_to_first_request"] == 2.0
    assert stage["startup_s"]["per_shard"] == [2.0, 2.0]
    assert stage["server"]["mean_running"] == pytest.approx(
        true_running(requests, 100.0, end), rel=0.01)
    assert stage["server"]["output_tokens"] == 200
    assert stage["server"]["output_tok_s"] == pytest.approx(200 / wall, abs=0.01)
    assert stage["client"]["output_tok_s"] == pytest.approx(200 / wall, abs=0.01)
    # the other run's open seconds are interpolated between its own samples, across the
    # moments its requests end: R at the fill's end is off by less than one request's age
    # (1.4 s at most here); one run (the pipeline's) has no such error
    fill_s = stage["fill_s"]
    assert stage["server"]["mean_running_fill"] == pytest.approx(
        true_running(requests, 102.0, 102.0 + fill_s), abs=1.4 / fill_s)
    assert stage["server"]["gauges"]["mean_running_fill"] == 2.0
    # the tail: from 19 of the 20 done (95%) to the last, at the resolution of the samples
    last_two = sorted(q[3] for q in requests)[-2:]
    assert stage["tail_s"] == pytest.approx(last_two[1] - last_two[0], abs=0.25)


def test_a_rerun_that_resumed_every_answer_sends_nothing_and_is_summarised(tmp_path):
    """A rerun (the generate job stale, every kept answer still valid) asks nothing: the
    shard summaries have no first request, no latency and no server samples."""
    summaries = []
    for _ in range(2):
        s = shard_summary(100.0, 100.5, 100.8, 100.8, [], responses=120, resumed=120, tokens=0)
        s["timing"].update(first_request=None, startup_s=None)
        s.update(latency_s=None, client_slot_utilization=None, finish_reasons={"stop": 120})
        summaries.append(s)
    stage = stage_summary(summaries)
    assert stage["new_requests"] == 0 and stage["resumed"] == 240
    assert stage["startup_s"]["first_job_to_first_request"] is None
    assert stage["fill_s"] is None and stage["latency_p50_s"] is None
    assert stage["server"]["samples"] == 0 and stage["server"]["output_tokens"] == 0
    assert stage["server"]["utilization_fill"] is None
    paths = []
    for i, s in enumerate(summaries):
        paths.append(tmp_path / f"shard-{i}.summary.json")
        paths[-1].write_text(json.dumps(s))
    build_generation_summary(paths, tmp_path / "summary.json", tmp_path / "running.png")
    assert json.loads((tmp_path / "summary.json").read_text()) == stage


def test_an_old_shard_summary_is_named(tmp_path):
    path = tmp_path / "shard-0.summary.json"
    path.write_text(json.dumps({"prompts": 1}))
    with pytest.raises(ValueError, match="shard-0.summary.json.*rerun the generate rule"):
        load_summaries([path])


def test_no_fill_phase_when_there_are_fewer_requests_than_slots():
    # three requests open from 0: 3 open seconds at 1.0; all done by 2.0 (6 running seconds)
    rows = [[0.0, 0, 0, 0, 0.0, 0.0, 0], [1.0, 3, 0, 30, 0.0, 3.0, 0],
            [2.0, 0, 0, 60, 6.0, 0.0, 3]]
    view = server_view(rows, capacity=8, first_request=0.0, end=2.0)
    assert view["fill_end"] is None and view["utilization_fill"] is None
    assert view["mean_running"] == 3.0 and view["output_tokens"] == 60
    assert view["gauges"]["mean_running"] == 1.5


def test_answers_cut_at_max_tokens_are_counted_per_shard_and_warned_about():
    shards = [{"finish_reasons": {"stop": 6, "length": 4}}, {"finish_reasons": {"stop": 10}},
              {"finish_reasons": {}}]
    report = truncation(shards, warn_share=0.1)
    assert report["per_shard"] == [0.4, 0.0, None]
    assert report["share"] == 0.2  # 4 of 20 answers, pooled
    assert "20% of the answers stopped at generate.max_tokens (shard 0: 40%)" in \
        report["warning"]
    assert truncation(shards, warn_share=0.25)["warning"] is None


def test_a_responses_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    shard = tmp_path / "shard-0.jsonl"
    shard.write_text('{"id": "a", "messages": []}\n{"id": "b", "messa\n')
    with pytest.raises(RecordError, match=r"shard-0\.jsonl:2: invalid JSON"):
        render_mismatches([shard], target_dir=str(tmp_path / "no-target"))

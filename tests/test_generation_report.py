"""The generation stage as the servers saw it: merging shard timelines (no server needed)."""

import json

import pytest

from draftline.generation_report import (
    build_generation_summary,
    compact_timeline,
    counter_increase,
    load_summaries,
    render_mismatches,
    server_view,
    stage_summary,
    step_mean,
    truncation,
)
from draftline.records import RecordError


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
    rows = [[float(i), float(i % 2) * 4, 0.0, 10.0 * i, i] for i in range(10)]
    out = compact_timeline(rows, limit=5)
    assert len(out) == 5
    assert out[0] == [1.0, 2.0, 0.0, 10, 1]  # mean running of (0, 4), counters at the end
    assert out[-1][3:] == [90, 9]


def shard(job_start, first, queue_empty, end, rows, responses=10, resumed=0, p50=1.0,
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


def test_stage_summary_puts_every_shard_on_one_time_axis(tmp_path):
    # shard A: job 100-110, requests from 102, queue empty at 106; shard B: job 101-111.
    # The server ran 4 from 102 to 108 and 2 from 108 to 110, then nothing.
    a = shard(100.0, 102.0, 106.0, 110.0, [
        [101.5, 0, 0, 0, 0], [102.0, 4, 3, 0, 0], [104.0, 4, 1, 40, 4], [106.0, 4, 0, 80, 8],
        [108.0, 2, 0, 120, 9], [110.0, 0, 0, 150, 10]])
    b = shard(101.0, 103.0, 107.0, 111.0, [
        [103.0, 4, 2, 10, 0], [107.0, 4, 0, 100, 9], [109.0, 2, 0, 140, 10],
        [111.0, 0, 0, 150, 10]])
    assert a["server"]["fill_end"] == 106.0  # 8 of A's 10 done: fewer than C=4 left
    assert a["server"]["utilization_fill"] == 1.0
    stage = stage_summary([a, b])
    # fill: from the first request until fewer than C=4 of the 20 were left (17 done at 107)
    assert stage["wall_s"] == 11.0 and stage["fill_s"] == 5.0  # 102 .. 107
    assert stage["startup_s"]["first_job_to_first_request"] == 2.0
    assert stage["startup_s"]["per_shard"] == [2.0, 2.0]
    # running: 0 for 100-102, 4 for 102-108, 2 for 108-110, 0 after: (24 + 4) / 11
    assert stage["server"]["mean_running"] == pytest.approx(28 / 11, abs=1e-3)
    assert stage["server"]["utilization"] == pytest.approx(28 / 11 / 4, abs=1e-4)
    assert stage["server"]["utilization_fill"] == 1.0
    assert stage["server"]["output_tokens"] == 150
    assert stage["server"]["output_tok_s"] == pytest.approx(150 / 11, abs=0.01)
    assert stage["client"]["output_tok_s"] == pytest.approx(200 / 11, abs=0.01)
    # completed: 17 at 107, 18 at 108, 19 (95%) at 109, all 20 at 110
    assert stage["tail_s"] == 1.0
    assert stage["tail_over_median_latency"] == 1.0
    # the rule writes the JSON and the plot
    paths = []
    for i, s in enumerate((a, b)):
        paths.append(tmp_path / f"shard-{i}.summary.json")
        paths[-1].write_text(json.dumps(s))
    build_generation_summary(paths, tmp_path / "summary.json", tmp_path / "running.png")
    assert json.loads((tmp_path / "summary.json").read_text()) == stage
    assert (tmp_path / "running.png").stat().st_size > 10_000


def test_a_rerun_that_resumed_every_answer_sends_nothing_and_is_summarised(tmp_path):
    """A rerun (the generate job stale, every kept answer still valid) asks nothing: the
    shard summaries have no first request, no latency and no server samples."""
    summaries = []
    for _ in range(2):
        s = shard(100.0, 100.5, 100.8, 100.8, [], responses=120, resumed=120, tokens=0)
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
    rows = [[0.0, 0, 0, 0, 0], [1.0, 3, 0, 30, 0], [2.0, 0, 0, 60, 3]]
    view = server_view(rows, capacity=8, first_request=0.0, end=2.0)
    assert view["fill_end"] is None and view["utilization_fill"] is None
    assert view["mean_running"] == 1.5 and view["output_tokens"] == 60


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

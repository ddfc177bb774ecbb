"""The deployment benchmark's load generator against ``vllm bench serve`` on one real server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_measurement_agrees_with_vllm_bench_serve(vllm_server, tmp_path):
    """Two levels, 3 interleaved runs of each tool (medians over the runs; draftline's over
    the windows the engine's own TPOT confirmed, see ``agreement``). 12 answers a slot take
    vllm bench about as long as draftline's 4 s window.

    On this shared 2-core host single runs of either tool vary by up to 2x (vLLM's own tool
    once reported a median TPOT of 0.01 ms at C=8 here), so the medians must agree within a
    factor of 2: a wrong definition (per chunk instead of per token, the wrong first token, a
    unit) is off by far more. The 10% agreement is benchmarks/latency_agreement.py's to show,
    on a quiet host."""
    from latency_agreement import METRICS, agreement, bench_spec

    report = agreement(vllm_server.endpoint, vllm_server.spec.model, levels=[1, 8], repeats=3,
                       spec=bench_spec(max_tokens=64, temperature=0.0), prompts_per_slot=12,
                       warmup_s=2.0, measure_s=4.0, workdir=tmp_path)
    for level, row in report.items():
        print(level, row["ratio"], "confirmed", row["confirmed"])
        # a definition that is wrong (per chunk, the wrong first token, a unit) disagrees with
        # the engine's TPOT in every window, so no window would be confirmed
        assert row["confirmed"] >= 1, row
        for metric in METRICS:
            assert 0.5 <= row["ratio"][metric] <= 2.0, (level, metric, row)
        assert row["medians"]["draftline"]["median_tpot_ms"] > 0.5  # a real decode step
        for run in row["runs"]["draftline"]:
            # every window was held against the engine's own TPOT, and one that did not agree
            # (a burst on this busy host) was measured again before it was kept and marked
            assert run["server_tpot_ms_mean"] > 0.5, run
            assert not run["stream_lagged"] or run["attempts"] == 3, run

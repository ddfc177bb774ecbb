"""Benchmark of hidden-state extraction.

Measures, on the same samples:

* tokens/s of the hf backend (token-budget batches with length bucketing) against a
  batch-size-1 loop (one forward pass per sample), and their ratio;
* the padding the batching adds (padded tokens / real tokens);
* bytes written per token by a full ``extract`` against the theoretical minimum
  (``4 * H * dtype_size`` of states; plus 9 bytes of token id and loss mask);
* optionally (``--vllm``) tokens/s of the vllm backend after the engine has started, for each
  of its captures (``--captures``: direct, from the model runner; connector, through the
  ``extract_hidden_states`` method), against the physical limit of the same engine: a plain
  prefill of the same prompts with the same engine arguments but no capture (no method, no
  connector, no aux states; ``max_tokens=1``), and their ratio: ``--repeats`` rounds, each
  timing both engines in fresh processes in alternating order, the median of the rounds'
  ratios;
* optionally (``--producer``) the same for the online vllm producer: a vLLM server with the
  capture, whose spool files training reads, against the same server less the capture.

Usage::

    python benchmarks/hidden_states.py                      # tiny random Llama, toy dimensions
    python benchmarks/hidden_states.py --target results/target --samples 128 --vllm

The target defaults to a random Llama with the toy's dimensions (hidden 128, 8 layers). Times
are the best of ``--repeats`` interleaved runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from draftline.stages.hidden import (
    capture_ids,
    extract_hidden_states,
    resolve_layer_ids,
    target_info,
)
from draftline.stages.hidden.hf_backend import HFBackend, token_budget_batches
from draftline.stages.hidden.store import state_bytes_per_token, stored_bytes_per_token


def random_target(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 32)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads,
                      head_dim=hidden // heads, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def random_samples(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(n)]


def save_dataset(path: Path, samples: list[list[int]]) -> Path:
    from datasets import Dataset, DatasetDict

    from draftline.stages.dataset import dataset_features

    rows = {"id": [f"s{i:05d}" for i in range(len(samples))], "input_ids": samples,
            "loss_mask": [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in samples]}
    data = Dataset.from_dict(rows, features=dataset_features())
    n_eval = max(1, len(samples) // 10)
    DatasetDict({"train": data.select(range(len(samples) - n_eval)),
                 "eval": data.select(range(len(samples) - n_eval, len(samples)))}
                ).save_to_disk(str(path))
    return path


def time_states(backend, samples: list[list[int]], batch_tokens: int) -> float:
    backend.batch_tokens = batch_tokens
    start = time.perf_counter()
    backend.states(samples)
    return time.perf_counter() - start


def bench_hf(target: Path, samples: list[list[int]], batch_tokens: int, repeats: int) -> dict:
    info = target_info(target)
    ids = capture_ids(resolve_layer_ids(None, info["num_layers"]), info["num_layers"])
    backend = HFBackend(target, ids, info["num_layers"], info["dtype"], batch_tokens)
    tokens = sum(map(len, samples))
    time_states(backend, samples[:4], batch_tokens)  # warm-up
    batched, single = [], []
    for _ in range(repeats):  # interleaved, so load changes hit both alike
        batched.append(time_states(backend, samples, batch_tokens))
        single.append(time_states(backend, samples, 1))
    backend.close()
    lengths = list(map(len, samples))
    padded = sum(len(b) * max(lengths[i] for i in b)
                 for b in token_budget_batches(lengths, batch_tokens))
    return {"tokens": tokens, "batched_s": min(batched), "single_s": min(single),
            "batched_tok_s": tokens / min(batched), "single_tok_s": tokens / min(single),
            "batched_median_s": statistics.median(batched),
            "single_median_s": statistics.median(single),
            "padding": padded / tokens - 1, "batch_tokens": batch_tokens}


VLLM_SERVER_CFG = {"enforce_eager": True, "dtype": "bfloat16"}


def bench_vllm(target: Path, samples: list[list[int]], batch_tokens: int, work: Path,
               rounds: int, capture: str, runs: int = 3) -> dict:
    """The vllm backend's ``capture`` (direct or connector) against a plain prefill by the
    same engine arguments.

    Each round times both engines, each in a fresh process, in alternating order, so that
    the shared host's load changes hit both alike; a round's ratio compares its two medians,
    and the figure is the median of the rounds' ratios.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")  # a fresh process: one vLLM engine each
    timed: dict[str, list[dict]] = {"capture": [], "plain": []}
    for round_ in range(rounds):
        for kind in ("plain", "capture") if round_ % 2 == 0 else ("capture", "plain"):
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                timed[kind].append(pool.submit(time_engine, kind, target, samples,
                                               batch_tokens, work / kind, runs,
                                               capture).result())
    tokens = sum(map(len, samples))

    def tok_s(kind: str) -> float:
        return tokens / statistics.median(s for t in timed[kind] for s in t["runs_s"])

    ratios = [statistics.median(p["runs_s"]) / statistics.median(c["runs_s"])
              for c, p in zip(timed["capture"], timed["plain"], strict=True)]
    return {"tok_s": tok_s("capture"), "plain_tok_s": tok_s("plain"),
            "ratio_to_plain_prefill": statistics.median(ratios), "round_ratios": ratios,
            "start_s": statistics.median(t["start_s"] for t in timed["capture"]),
            "runs": runs, "rounds": rounds, "timed": timed}


def time_engine(kind: str, target: Path, samples: list[list[int]], batch_tokens: int,
                work: Path, runs: int, capture: str = "auto") -> dict:
    """Seconds of ``runs`` passes over ``samples`` after a warm-up, by the vllm backend
    (``capture``) or by an engine with its arguments less the capture (``plain``: no
    speculative or KV-transfer config, ``max_tokens=1``), the most the capture can reach."""
    start = time.perf_counter()
    run = start_capture(target, samples, batch_tokens, work, capture) if kind == "capture" \
        else start_plain(target, samples, batch_tokens, work)
    started = time.perf_counter() - start
    run(samples[:4])  # warm-up
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        run(samples)
        seconds.append(time.perf_counter() - start)
    return {"start_s": started, "runs_s": seconds}


def start_capture(target: Path, samples: list[list[int]], batch_tokens: int, work: Path,
                  capture: str = "auto"):
    from draftline.stages.hidden.vllm_backend import VLLMBackend

    info = target_info(target)
    ids = capture_ids(resolve_layer_ids(None, info["num_layers"]), info["num_layers"])
    backend = VLLMBackend(target, ids, max(map(len, samples)), work / "spool",
                          {"batch_tokens": batch_tokens}, VLLM_SERVER_CFG, capture=capture)
    return backend.states


def start_plain(target: Path, samples: list[list[int]], batch_tokens: int, work: Path):
    import os

    from draftline.core.heap import reuse_freed_heap
    from draftline.stages.hidden.vllm_backend import engine_kwargs

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the backend runs it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    reuse_freed_heap()  # as the backend's process keeps its memory
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    info = target_info(target)
    ids = capture_ids(resolve_layer_ids(None, info["num_layers"]), info["num_layers"])
    kwargs = engine_kwargs(target, ids, work / "unused", max(map(len, samples)),
                           {"batch_tokens": batch_tokens}, VLLM_SERVER_CFG)
    del kwargs["speculative_config"], kwargs["kv_transfer_config"]
    if current_platform.is_cpu():
        kwargs.setdefault("gpu_memory_utilization", 0.3)  # as the backend sets it there
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0)  # as the backend samples

    def prefill(batch: list[list[int]]) -> None:
        llm.generate([{"prompt_token_ids": list(map(int, s))} for s in batch], params,
                     use_tqdm=False)

    return prefill


def bench_producer(target: Path, samples: list[list[int]], batch_tokens: int, work: Path,
                   rounds: int, runs: int = 3) -> dict:
    """The online vllm producer (a server filling the spool; training reads it) against the
    same server less the capture prefilling the same prompts, sent the same way: 16 at a time,
    ``max_tokens=1``. Rounds as in ``bench_vllm``."""
    timed: dict[str, list[dict]] = {"capture": [], "plain": []}
    for round_ in range(rounds):
        for kind in ("plain", "capture") if round_ % 2 == 0 else ("capture", "plain"):
            with served(kind, target, samples, batch_tokens, work / f"{kind}-{round_}") as run:
                run(samples[:4])  # warm-up
                seconds = []
                for _ in range(runs):
                    start = time.perf_counter()
                    run(samples)
                    seconds.append(time.perf_counter() - start)
            timed[kind].append({"runs_s": seconds})
    tokens = sum(map(len, samples))
    ratios = [statistics.median(p["runs_s"]) / statistics.median(c["runs_s"])
              for c, p in zip(timed["capture"], timed["plain"], strict=True)]
    return {"tok_s": tokens / statistics.median(s for t in timed["capture"] for s in t["runs_s"]),
            "plain_tok_s": tokens / statistics.median(s for t in timed["plain"]
                                                      for s in t["runs_s"]),
            "ratio_to_plain_prefill": statistics.median(ratios), "round_ratios": ratios,
            "runs": runs, "rounds": rounds, "timed": timed}


PRODUCER_SERVER_CFG = {"enforce_eager": True, "dtype": "bfloat16", "cpu_kvcache_space_gib": 1}


@contextlib.contextmanager
def served(kind: str, target: Path, samples: list[list[int]], batch_tokens: int, work: Path):
    """A function that gets ``samples`` through a producer (``capture``) or through the plain
    server of the same spec (``plain``), while the server runs."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from benchlib.serving import serve

    from draftline.stages.hidden.vllm_producer import VLLMProducer, producer_server_spec

    info = target_info(target)
    ids = capture_ids(resolve_layer_ids(None, info["num_layers"]), info["num_layers"])
    hidden_cfg, max_len = {"batch_tokens": batch_tokens}, max(map(len, samples))
    if kind == "capture":
        producer = VLLMProducer(target, ids, max_len, hidden_cfg, PRODUCER_SERVER_CFG, None)
        try:
            yield lambda batch: producer.read(producer.produce(batch))
        finally:
            producer.close()
        return
    spec = producer_server_spec(target, ids, work / "unused", max_len, hidden_cfg,
                                PRODUCER_SERVER_CFG)
    args = list(spec.extra_args)
    at = args.index("--kv-transfer-config")
    spec = replace(spec, speculative_config=None, extra_args=tuple(args[:at] + args[at + 2:]))
    with serve(spec, work / "server.log") as server, \
            httpx.Client(timeout=600.0, headers={
                "Authorization": f"Bearer {server.endpoint.api_key}"}) as client, \
            ThreadPoolExecutor(max_workers=16) as pool:  # as many as the producer sends
        url, model = server.endpoint.root_url, server.endpoint.model

        def prefill(ids: list[int]) -> None:
            reply = client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0})
            reply.raise_for_status()

        yield lambda batch: list(pool.map(prefill, batch))


def bench_bytes(target: Path, samples: list[list[int]], batch_tokens: int, work: Path) -> dict:
    dataset = save_dataset(work / "dataset", samples)
    index = extract_hidden_states(dataset, target, work / "hidden", {"batch_tokens": batch_tokens,
                                                       "samples_per_file": 64})
    info = target_info(target)
    minimum = state_bytes_per_token(info["hidden_size"], info["dtype"])
    with_ids = stored_bytes_per_token(info["hidden_size"], info["dtype"])
    written = index["bytes"] / index["num_tokens"]
    return {"hidden_size": info["hidden_size"], "files": len(index["files"]),
            "bytes_per_token": written, "state_minimum": minimum, "with_ids_minimum": with_ids,
            "ratio_to_states": written / minimum, "ratio_to_with_ids": written / with_ids}


def print_table(hf: dict, size: dict, vllm: dict[str, dict], producer: dict | None) -> None:
    rows = [
        ("hf, token-budget batches", f"{hf['batched_tok_s']:,.0f} tok/s",
         f"{hf['batched_s']:.2f} s for {hf['tokens']:,} tokens "
         f"(batch_tokens {hf['batch_tokens']}, padding {hf['padding']:.1%})"),
        ("hf, batch-size-1 loop", f"{hf['single_tok_s']:,.0f} tok/s", f"{hf['single_s']:.2f} s"),
        ("speed-up (ratio)", f"{hf['batched_tok_s'] / hf['single_tok_s']:.2f}x", "best of runs"),
    ]
    for capture, got in vllm.items():
        ratios = " / ".join(f"{r:.2f}" for r in got["round_ratios"])
        rows += [(f"vllm backend, {capture}", f"{got['tok_s']:,.0f} tok/s",
                  f"engine start {got['start_s']:.0f} s, not counted; median of "
                  f"{got['rounds']} x {got['runs']} runs"),
                 ("  plain prefill", f"{got['plain_tok_s']:,.0f} tok/s",
                  "same engine arguments, no capture, max_tokens=1; its own rounds"),
                 ("  capture / plain prefill", f"{got['ratio_to_plain_prefill']:.2f}x",
                  f"median of rounds {ratios}; 1.0 = capture costs nothing")]
    if producer:
        ratios = " / ".join(f"{r:.2f}" for r in producer["round_ratios"])
        rows += [("online producer (server)", f"{producer['tok_s']:,.0f} tok/s",
                  f"spool files read back; median of {producer['rounds']} x "
                  f"{producer['runs']} runs"),
                 ("server plain prefill", f"{producer['plain_tok_s']:,.0f} tok/s",
                  "same server less the capture, 16 requests at a time"),
                 ("producer / plain prefill", f"{producer['ratio_to_plain_prefill']:.2f}x",
                  f"median of rounds {ratios}")]
    rows += [
        ("bytes/token written", f"{size['bytes_per_token']:,.1f} B",
         f"{size['files']} part files, H = {size['hidden_size']}"),
        ("minimum: states", f"{size['state_minimum']:,} B",
         f"4 x H x 2; written/minimum = {size['ratio_to_states']:.4f}"),
        ("minimum: + ids, mask", f"{size['with_ids_minimum']:,} B",
         f"written/minimum = {size['ratio_to_with_ids']:.4f}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>14}  notes")
    print("-" * (width + 40))
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None, help="HF model dir (default: random)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="also time the vllm backend")
    parser.add_argument("--captures", nargs="+", choices=("direct", "connector"),
                        default=["direct", "connector"],
                        help="the vllm backend's captures to time (--vllm)")
    parser.add_argument("--producer", action="store_true",
                        help="also time the online vllm producer (starts vLLM servers)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-hidden-") as tmp:
        work = Path(tmp)
        target = args.target or random_target(work / "target", args.hidden, args.layers,
                                              args.vocab)
        vocab = target_info(target)["vocab_size"]
        samples = random_samples(args.samples, args.min_len, args.max_len, vocab, seed=0)
        hf = bench_hf(target, samples, args.batch_tokens, args.repeats)
        size = bench_bytes(target, samples, args.batch_tokens, work)
        vllm = {capture: bench_vllm(target, samples, args.batch_tokens, work, args.repeats,
                                    capture)
                for capture in (args.captures if args.vllm else ())}
        producer = (bench_producer(target, samples, args.batch_tokens, work, args.repeats)
                    if args.producer else None)
    print_table(hf, size, vllm, producer)
    if args.json:
        args.json.write_text(json.dumps({"hf": hf, "bytes": size, "vllm": vllm,
                                         "producer": producer}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

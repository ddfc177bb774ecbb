"""Draft training throughput and peak memory on CPU: TTT diagonal attention vs a dense mask.

One full training step (target head, K-step unroll, loss, backward, AdamW) at the toy
dimensions (hidden 128, 4 heads, vocab 2048, draft vocab 1024), fp32, on one sequence of
``--tokens`` tokens. Three attention implementations, measured in the same run:

* ``diagonal``       - what training uses (draftline.model.ttt_attention): the causal part on
  the fused flash kernel, the k diagonal scores joined through the log-sum-exp;
* ``diagonal-eager`` - draftline.model.ttt_attention_reference: [T, T] causal scores plus
  [T, k] diagonal scores, one softmax (materialises the [T, T] probabilities);
* ``dense``          - the baseline defined here: all steps' keys concatenated,
  [T, T*(k+1)] scores with a boolean mask (causal on step 0's block, diagonal elsewhere).

Each (implementation, K) runs in a fresh process so that its peak resident memory is its own;
the table shows tokens/s, the increase of peak RSS over the process before its first step, and
the ratios against the dense baseline.

    python benchmarks/train_step.py                 # K = 1, 3, 7; 2,048 tokens
    python benchmarks/train_step.py --steps-k 7 --tokens 4096 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

TOY = {"hidden_size": 128, "target_hidden_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 384,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 2048,
       "draft_vocab_size": 1024, "max_position_embeddings": 8192}


IMPLS = ("diagonal", "diagonal-eager", "dense")


def dense_masked_attention(q, k_ctx, v_ctx, k_diag, v_diag):
    """Baseline: keys of steps 0..k in one [T*(k+1)] block; row i may see step-0 keys j <= i
    and key i of every later step. Scores ``[B, nh, T, T*(k+1)]``."""
    import torch

    length, blocks = q.shape[-2], 1 + len(k_diag)
    keys = torch.cat([k_ctx, *k_diag], dim=-2)  # [B, nh, T*(k+1), hd]
    values = torch.cat([v_ctx, *v_diag], dim=-2)
    allowed = torch.zeros(length, length * blocks, dtype=torch.bool, device=q.device)
    allowed[:, :length] = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=q.device)
    for s in range(1, blocks):
        allowed[:, s * length:(s + 1) * length] = eye
    scores = torch.matmul(q, keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.matmul(probs, values)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(impl: str, steps_k: int, tokens: int, repeats: int) -> dict:
    """One configuration, in this process: tokens/s and peak RSS increase."""
    import torch

    import draftline.model as m

    # DraftAttention looks ttt_attention up at call time, so replacing it swaps the kernel.
    if impl == "dense":
        m.ttt_attention = dense_masked_attention
    elif impl == "diagonal-eager":
        m.ttt_attention = m.ttt_attention_reference
    torch.manual_seed(0)
    cfg = m.DraftConfig(**TOY)
    vocab, draft, hidden = cfg.vocab_size, cfg.draft_vocab_size, cfg.hidden_size
    model = m.Eagle3Draft(cfg, torch.randn(vocab, hidden))
    m.init_draft_weights(model, 0)
    d2t = torch.arange(0, 2 * draft, 2) - torch.arange(draft)  # every other target id
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[::2] = True
    head = m.TargetHead(torch.ones(hidden), torch.randn(vocab, hidden) * 0.05, 1e-6, d2t, t2d)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    aux = torch.randn(1, tokens, 3 * hidden)  # [B, T, 3H]
    final = torch.randn(1, tokens, hidden)  # [B, T, H]
    input_ids = torch.randint(0, vocab, (1, tokens))
    loss_mask = torch.ones(1, tokens, dtype=torch.bool)

    def step():
        target_logp, in_draft = head(final)
        loss, _ = m.ttt_loss(model(aux, input_ids, steps_k), target_logp, in_draft, loss_mask,
                             0.8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    before = rss_mib()
    step()  # warm-up (allocator, optimizer state)
    started = time.perf_counter()
    for _ in range(repeats):
        step()
    elapsed = (time.perf_counter() - started) / repeats
    return {"impl": impl, "K": steps_k, "tokens": tokens, "s_per_step": elapsed,
            "tokens_per_s": tokens / elapsed, "peak_rss_increase_mib": rss_mib() - before,
            "threads": torch.get_num_threads()}


def table(rows: list[dict]) -> str:
    by = {(r["impl"], r["K"]): r for r in rows}
    lines = ["| K | attention | tokens/s | peak RSS increase (MiB) | speed vs dense | "
             "memory vs dense |", "|---|---|---|---|---|---|"]
    for k in sorted({r["K"] for r in rows}):
        dense = by[("dense", k)]
        for impl in IMPLS:
            r = by[(impl, k)]
            lines.append(
                f"| {k} | {impl} | {r['tokens_per_s']:,.0f} | "
                f"{r['peak_rss_increase_mib']:,.0f} | "
                f"{r['tokens_per_s'] / dense['tokens_per_s']:.2f}x | "
                f"{r['peak_rss_increase_mib'] / max(dense['peak_rss_increase_mib'], 1e-9):.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-k", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: torch's; 1 is steadier on a "
                             "busy machine)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--one", nargs=2, metavar=("IMPL", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # child process: one configuration, JSON on stdout
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.tokens, args.repeats)))
        return 0
    rows = []
    for k in args.steps_k:
        for impl in IMPLS:
            threads = ["--threads", str(args.threads)] if args.threads else []
            out = subprocess.run([sys.executable, __file__, "--one", impl, str(k), "--tokens",
                                  str(args.tokens), "--repeats", str(args.repeats), *threads],
                                 check=True, capture_output=True, text=True, env=os.environ)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{impl:14s} K={k}: {rows[-1]['tokens_per_s']:,.0f} tok/s, "
                  f"+{rows[-1]['peak_rss_increase_mib']:,.0f} MiB", file=sys.stderr)
    print(f"draft train step, toy dims, fp32, CPU, {args.tokens} tokens, "
          f"{rows[0]['threads']} threads, load average {os.getloadavg()[0]:.1f}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

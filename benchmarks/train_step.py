"""One draft training step: throughput, MFU and peak memory; TTT diagonal attention vs a dense mask.

The step is training's own: ``draftline.stages.train.run_micro_batch`` (the frozen target head makes
the teacher distribution, the K-step unroll, the loss; on CUDA under bf16 autocast with bf16
inputs, embedding and target head and fp32 trainable weights, as ``build_draft`` makes them),
then backward, gradient clipping and the optimizer step, as ``draftline.stages.train``'s loop
builds them (``build_optimizer``): AdamW, the step the peer harness compares, or Muon,
training's default (``--optimizers``).
One micro-batch of ``--batch`` rows of ``--tokens`` tokens, already on the device (the
host-to-device copy of the hidden states is not timed). Attention implementations, measured
in the same run on the same weights:

* ``diagonal``       - what training uses (draftline.drafts.ttt.ttt_attention): the causal part on
  the fused flash kernel, the k diagonal scores joined through the log-sum-exp (falls back to
  the eager reference where the fused path fails its check: the table says which ran);
* ``diagonal-eager`` - draftline.drafts.ttt.ttt_attention_reference: [T, T] causal scores plus
  [T, k] diagonal scores, one softmax (materialises the [T, T] probabilities);
* ``dense``          - the baseline defined here: all steps' keys concatenated,
  [T, T*(k+1)] scores with a boolean mask (causal on step 0's block, diagonal elsewhere);
* ``dense-sdpa``     - the same mask through torch's scaled_dot_product_attention (on CUDA its
  memory-efficient kernel, which never holds the [T, T*(k+1)] probabilities).

Rows also say whether the draft's norms and MLPs ran eager or compiled (``--pointwise``,
``train.compile``) and which optimizer stepped (``--optimizers``). Columns: step time,
tokens/s, peak memory (CUDA: max allocated, everything included; CPU: the increase of peak RSS
over the process before its first step, each configuration in its own process), the analytic
peak estimate (``memory_model``), model FLOPs per token (``flops_per_token``: the same useful
work for every implementation) and MFU against the matrix-product peak measured at the start
of the run (bf16 on CUDA, fp32 on CPU: the dtype training computes in there; Muon's
Newton-Schulz products, ``optimizer_flops``, are printed beside, not counted). Before the
table: which attention path ran, and the largest differences of outputs and gradients between
the fused path and the eager reference, both against an fp32 truth, at the run's dimensions.

    python benchmarks/train_step.py                      # CPU, toy dims, K = 1, 3, 7, 2,048 tok
    python benchmarks/train_step.py --steps-k 7 --tokens 4096 --repeats 3 --threads 1
    python benchmarks/train_step.py --memory-only --dims kimi   # the analytic memory, no run
    python benchmarks/train_step.py --preset h200        # CUDA, Kimi-K2.5 draft dims (< 8 min)
    python benchmarks/train_step.py --teacher-heads full draft_rows --impls diagonal
    python benchmarks/train_step.py --preset h200 --dims kimi-p-eagle   # a family per --dims
    python benchmarks/train_step.py --impls diagonal --pointwise eager compiled  # train.compile
    python benchmarks/train_step.py --impls diagonal --optimizers adamw muon  # train.optimizer

Needs torch and draftline only (``PYTHONPATH=src`` from a checkout).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import resource
import subprocess
import sys
import time

import torch
from benchlib.training import (  # noqa: F401 (the peer harness imports these from here)
    DIMS,
    FAMILIES,
    KIMI,
    KIMI_MLA,
    TOY,
    TRAIN,
    Runtime,
    optim,
    run_micro_batch,
)

import draftline.drafts as m
import draftline.drafts.eagle3.model as eagle3_model

TEACHER_HEADS = ("full", "draft_rows")  # train.teacher_head
POINTWISE = ("eager", "compiled")  # train.compile false / true
OPTIMIZERS = ("adamw", "muon")  # train.optimizer
# The optimizer of ``Setup``'s step unless told otherwise: AdamW, as the peer harness's
# speculators step (its ``--optimizer adamw``; the peer's Muon is an extra row there).
COMPARED_OPTIMIZER = "adamw"
# torch.optim.Muon's Newton-Schulz iterations (its default, which training keeps).
NS_STEPS = inspect.signature(torch.optim.Muon).parameters["ns_steps"].default

IMPLS = ("diagonal", "diagonal-eager", "dense", "dense-sdpa")
PRESETS = {
    # One H200 (141 GB): every implementation at the Kimi draft's dims, T = 2,048 and 4,096,
    # K = 1, 3, 7: about 2 minutes of steps plus start-up (the dense mask runs out of memory at
    # the largest sizes, which the table shows).
    "h200": {"device": "cuda", "dims": "kimi", "tokens": [2048, 4096], "steps_k": [1, 3, 7],
             "repeats": 3},
}
GIB = 2**30
# Rows per chunk of the teacher head (TargetHead.forward's default, which training uses).
TEACHER_CHUNK_ROWS = inspect.signature(m.TargetHead.forward).parameters["chunk_rows"].default


# ----------------------------------------------------------------------------- baselines


def dense_mask(length: int, blocks: int, device) -> torch.Tensor:
    """``[T, T*blocks]`` bool: row i sees step-0 keys j <= i and key i of every later step."""
    allowed = torch.zeros(length, length * blocks, dtype=torch.bool, device=device)
    allowed[:, :length] = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    for s in range(1, blocks):
        allowed[:, s * length:(s + 1) * length] = eye
    return allowed


def dense_masked_attention(q, k_ctx, v_ctx, k_diag, v_diag):
    """Baseline: keys of steps 0..k in one [T*(k+1)] block, masked. Scores
    ``[B, nh, T, T*(k+1)]``."""
    keys = torch.cat([k_ctx, *k_diag], dim=-2)  # [B, nh, T*(k+1), hd]
    values = torch.cat([v_ctx, *v_diag], dim=-2)
    allowed = dense_mask(q.shape[-2], 1 + len(k_diag), q.device)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.matmul(probs, values)


def dense_sdpa_attention(q, k_ctx, v_ctx, k_diag, v_diag):
    """The same mask through scaled_dot_product_attention (a masked fused kernel)."""
    keys = torch.cat([k_ctx, *k_diag], dim=-2)
    values = torch.cat([v_ctx, *v_diag], dim=-2)
    allowed = dense_mask(q.shape[-2], 1 + len(k_diag), q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)


ATTENTION = {"diagonal": m.ttt_attention, "diagonal-eager": m.ttt_attention_reference,
             "dense": dense_masked_attention, "dense-sdpa": dense_sdpa_attention}


@contextlib.contextmanager
def attention_impl(impl: str):
    """DraftAttention looks ``ttt_attention`` up in its module at call time: replacing it
    there swaps the kernel."""
    original = eagle3_model.ttt_attention
    eagle3_model.ttt_attention = ATTENTION[impl]
    try:
        yield
    finally:
        eagle3_model.ttt_attention = original


# ----------------------------------------------------------------------------- FLOPs, memory


def muon_matrices(cfg: m.DraftConfig) -> dict[str, tuple[int, ...]]:
    """The trainable tensors Muon updates (``draftline.stages.train.optim.muon_matrix``)."""
    return {name: shape for name, shape in m.expected_shapes(cfg).items()
            if optim.muon_matrix(name, torch.empty(shape, device="meta"))}


def optimizer_flops(cfg: m.DraftConfig, optimizer: str) -> float:
    """Matrix-product FLOPs of one optimizer step (once per step, whatever its tokens).

    AdamW: none (elementwise). Muon: per matrix of m <= n (its short side first), NS_STEPS
    Newton-Schulz iterations of a Gram product (2 m^2 n), its square (2 m^3) and the update
    (2 m^2 n), in bf16 (torch.optim.Muon).
    """
    if optimizer == "adamw":
        return 0.0
    return float(sum(optim.newton_schulz_flops(shape, NS_STEPS)
                     for shape in muon_matrices(cfg).values()))


def flops_per_token(cfg: m.DraftConfig, tokens: int, steps_k: int,
                    teacher_head: str = TRAIN["teacher_head"]) -> dict[str, float]:
    """Model FLOPs of one training step per token (2 per multiply-add; recomputation in
    kernels, softmax, norms and other elementwise work not counted).

    Trainable matrix products cost 3x their forward (forward, input gradient, weight
    gradient); ``fc`` 2x (its input, the target's hidden states, needs no gradient); the
    frozen teacher head 1x (no gradient), over the whole vocab or, ``teacher_head``
    draft_rows, the draft vocabulary's rows only. Attention: at unroll step s a row i attends to the
    i+1 causal keys of step 0 and its own key of steps 1..s: QK^T and PV cost 4 * nh * hd per
    key, a row has (T+1)/2 causal keys on average, and the backward costs 2x the forward.
    """
    H, A, D, V = (cfg.hidden_size, cfg.num_aux_hidden_states * cfg.target_hidden_size,
                  cfg.draft_vocab_size, cfg.vocab_size)
    Q, KV, F = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                cfg.intermediate_size)
    projections = 2 * H * (Q + 2 * KV) + Q * H  # q, k, v of [embedding, state] (2H); o_proj
    per_key = 4 * Q  # QK^T and PV
    if cfg.arch == "deepseek_mla":  # low-rank q, one latent for k and v, per-head expansion
        N, QK, VD = (cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                     cfg.v_head_dim)
        projections = (2 * H * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                       + cfg.q_lora_rank * N * QK
                       + cfg.kv_lora_rank * N * (cfg.qk_nope_head_dim + VD) + N * VD * H)
        per_key = 2 * N * QK + 2 * N * VD
    layer = 2 * (projections + 3 * H * F)  # attention projections; gate, up, down
    keys = sum((tokens + 1) / 2 + s for s in range(steps_k))  # keys per row, all steps
    terms = {
        "fc": 2 * (2 * A * H),
        "draft_layer": 3 * steps_k * layer,
        "draft_head": 3 * steps_k * (2 * H * D),
        "attention": 3 * (per_key * keys),
        "teacher_head": 2 * cfg.target_hidden_size * (V if teacher_head == "full" else D),
    }
    terms["total"] = sum(terms.values())
    return terms


def trainable_params(cfg: m.DraftConfig) -> dict[str, int]:
    shapes = m.expected_shapes(cfg)
    count = {name: 1 for name in shapes}
    for name, shape in shapes.items():
        for n in shape:
            count[name] *= n
    return count


def memory_model(cfg: m.DraftConfig, batch: int, tokens: int, steps_k: int,
                 device_type: str, teacher_head: str = TRAIN["teacher_head"],
                 optimizer: str = COMPARED_OPTIMIZER) -> dict[str, float]:
    """Expected bytes at the step's peak (the end of the forward, when everything saved for
    the backward is alive), term by term, from what the code keeps (checked against the
    tensors autograd saves in tests/test_train_step_bench.py).

    CUDA (training's setup): fp32 trainable weights, their gradients and the optimizer's
    state (AdamW: two moments a weight; Muon: one momentum buffer a matrix it updates, AdamW's
    two moments for the rest);
    bf16 copies of the weights autocast makes (all but fc's, which the backward does not
    need); bf16 frozen embedding and target lm_head; activations under bf16 autocast, with
    fp32 norms (fp32 norm weights times bf16) and an fp32 loss. CPU: everything fp32.

    Per token and unroll step s (H hidden, Q = nh*hd, F intermediate, D draft vocab, W the
    activation width in bytes: 2 on CUDA, 4 on CPU), saved for the backward:
      norms      4 RMSNorms save the normalised x in the input dtype (4 * W*H) and x in fp32
                 (3 * 4H: the final norm's input is the next step's hidden_norm input)
      qkv        q, k and v each save their own bf16 cast of the fp32 [embedding, state]:
                 3 * W*2H on CUDA; one shared 4*2H on CPU
      mlp        gate and up save a cast of the normed state (2 * W*H on CUDA, 4H on CPU);
                 gate out, up out, silu out and the product: 4 * W*F
      lm_head    its input: W*H
      attention  step 0: q, k, v, out (4 * W*Q) and the fp32 log-sum-exp; step s >= 1: q, out
                 and the step's own k and v (4 * W*Q: later steps save the same k and v
                 again, draftline.drafts.ttt.FusedTTTAttention), the joint log-sum-exp and the
                 diagonal probabilities (4 * nh * (1 + s))
      loss       the step's logits (W*D; draftline.drafts.losses.DraftKL recomputes the softmax)
    Per token, once: aux (3H), final (H) and ids; the teacher's fp32 log-probs (4D) and
    probabilities (4D, a view of which every step's loss saves). The teacher head itself runs
    in chunks of TEACHER_CHUNK_ROWS rows before the unroll (a transient of rows * V at 2 B
    plus rows * D at 4 B, freed before the peak; ``teacher_head`` draft_rows: rows * D, and a
    copy of the draft vocabulary's lm_head rows kept beside the full head, which evaluation
    still uses). Not counted: the backward's own transients
    (one step's gradients at a time), which the gradients counted from the start cover.
    """
    cuda = device_type == "cuda"
    H, Q, F, D, V, nh = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                         cfg.intermediate_size, cfg.draft_vocab_size, cfg.vocab_size,
                         cfg.num_attention_heads)
    W = 2 if cuda else 4
    params = trainable_params(cfg)
    n_params = sum(params.values())
    draft_rows = teacher_head == "draft_rows"
    head_rows = V + (D if draft_rows else 0)  # the full head, and its draft rows' copy
    frozen = (V * H + head_rows * cfg.target_hidden_size) * W  # embedding + teacher lm_head
    weight_casts = (n_params - params["fc.weight"]) * 2 if cuda else 0
    norms = 4 * W * H + 3 * 4 * H + 4 * 4
    qkv = 3 * W * 2 * H if cuda else 4 * 2 * H
    if cfg.arch == "deepseek_mla":  # approximate (not checked against autograd): the two
        # projections of [embedding, state], the low-rank query and latent with their norms,
        # and attention tensors of the query/key width (values are padded to it)
        Q = nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        low_rank = cfg.q_lora_rank + cfg.kv_lora_rank
        qkv = ((2 * W * 2 * H if cuda else 4 * 2 * H) + 2 * W * low_rank + 4 * low_rank
               + 2 * W * cfg.qk_rope_head_dim)
    mlp = (2 * W * H if cuda else 4 * H) + 4 * W * F
    saved = [norms + qkv + mlp + W * H + W * D
             + (4 * W * Q + 4 * nh if s == 0 else 4 * W * Q + 4 * nh * (1 + s))
             for s in range(steps_k)]
    rows = batch * tokens
    chunk = min(TEACHER_CHUNK_ROWS, rows)
    muon = sum(params[name] for name in muon_matrices(cfg)) if optimizer == "muon" else 0
    terms = {
        "weights fp32 + grads": 2 * 4 * n_params,
        "optimizer state": 4 * (2 * n_params - muon),
        "autocast weight copies": weight_casts,
        "frozen embedding + target head": frozen,
        "activations saved": rows * sum(saved),
        "inputs": rows * (W * 4 * cfg.target_hidden_size + 8 + 1),
        "teacher log-probs + probs": rows * 2 * 4 * D,
    }
    terms["peak"] = sum(terms.values())
    terms["teacher head transient"] = chunk * (2 * (D if draft_rows else V) + 4 * D * 2)
    terms["activations per token"] = sum(saved)
    return terms


PER_TOKEN_TERMS = ("activations saved", "inputs", "teacher log-probs + probs")


def max_batch_tokens(cfg: m.DraftConfig, tokens: int, steps_k: int, memory_bytes: float,
                     device_type: str = "cuda") -> int:
    """The most tokens (whole rows of ``tokens``) a micro-batch can hold in ``memory_bytes``."""
    one = memory_model(cfg, 1, tokens, steps_k, device_type)
    per_row = sum(one[k] for k in PER_TOKEN_TERMS)
    fixed = one["peak"] - per_row
    return int((memory_bytes - fixed) // per_row) * tokens


def saved_activation_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn`` runs,
    parameters excluded (what ``memory_model``'s activation terms describe)."""
    seen: dict[int, int] = {}
    params = set()

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def mark_params(model):
        params.update(p.untyped_storage().data_ptr() for p in model.parameters())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(mark_params)
    return sum(seen.values())


# ----------------------------------------------------------------------------- the step


class Setup:
    """Draft, target head, optimizer and one micro-batch, as ``draftline.stages.train`` builds
    them."""

    def __init__(self, dims: dict, device: str, batch: int, tokens: int, seed: int = 0,
                 teacher_head: str = TRAIN["teacher_head"], compile: bool = TRAIN["compile"],
                 optimizer: str = COMPARED_OPTIMIZER):
        torch.manual_seed(seed)
        self.teacher_head = teacher_head
        self.device = torch.device(device)
        self.cfg = m.DraftConfig(**dims)
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32  # build_draft's rule
        cfg, dtype = self.cfg, self.dtype
        vocab, draft, hidden = cfg.vocab_size, cfg.draft_vocab_size, cfg.hidden_size
        with self.device:  # parameters made in place: no host copy of 2 B-parameter tensors
            embed = torch.randn(vocab, hidden, dtype=dtype)
            self.model = m.Eagle3Draft(cfg, embed)
            d2t = torch.arange(0, 2 * draft, 2) - torch.arange(draft)  # every other target id
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[::2] = True
            self.head = m.TargetHead(torch.ones(hidden, dtype=dtype),
                                     torch.randn(vocab, hidden, dtype=dtype) * 0.05,
                                     cfg.rms_norm_eps, d2t, t2d)
        with torch.no_grad():  # the target's lm_head rows of the draft tokens, as training
            self.model.lm_head.weight.copy_(self.head.lm_head[self.head.draft_ids].float())
        self.compiled = False
        if compile:
            self.compile()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.set_optimizer(optimizer)
        self.rt = Runtime(rank=0, world=1, local_rank=0, device=self.device, owns_group=False)
        self.set_batch(batch, tokens)

    def set_optimizer(self, name: str) -> None:
        """``train.optimizer``: a fresh optimizer of that kind (the old state freed first)."""
        self.optimizer = None
        self.optimizer_name = name
        self.optimizer = optim.build_optimizer(self.model, {**TRAIN, "optimizer": name})

    def compile(self) -> None:
        """``train.compile``: the norms and MLPs compiled, from the next step on (one way)."""
        m.compile_pointwise(self.model)
        self.compiled = True

    def set_batch(self, batch: int, tokens: int) -> None:
        self.batch = None  # free the old one first
        cfg, dev, dtype = self.cfg, self.device, self.dtype
        self.batch = {
            "aux": torch.randn(batch, tokens, 3 * cfg.target_hidden_size, device=dev,
                               dtype=dtype),  # [B, T, 3Ht]
            "final": torch.randn(batch, tokens, cfg.target_hidden_size, device=dev,
                                 dtype=dtype),  # [B, T, Ht]
            "input_ids": torch.randint(0, cfg.vocab_size, (batch, tokens), device=dev),
            "loss_mask": torch.ones(batch, tokens, dtype=torch.bool, device=dev),
        }

    def loss(self, steps_k: int):
        return run_micro_batch(self.model, self.head, self.batch,
                               {"ttt_steps": steps_k, "loss_decay": TRAIN["loss_decay"],
                                "loss": "kl", "teacher_head": self.teacher_head,
                                "teacher_temperature": TRAIN["teacher_temperature"]}, self.rt)

    def step(self, steps_k: int) -> float:
        """One optimizer step of one micro-batch (grad_accum 1), as draftline.stages.train's
        loop."""
        loss, _ = self.loss(steps_k)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, TRAIN["grad_clip"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def rss_mib() -> float:
    """Peak resident memory of this process image. Not ru_maxrss: Linux carries that over
    exec from the forked parent, so a child of a big parent would report the parent's peak."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(setup: Setup, impl: str, steps_k: int, repeats: int) -> dict:
    """One configuration: seconds per step, tokens/s, peak memory in MiB."""
    rows, tokens = setup.batch["input_ids"].shape
    cuda = setup.device.type == "cuda"
    row = {"impl": impl, "K": steps_k, "tokens": tokens, "batch": rows,
           "teacher": setup.teacher_head, "pointwise": POINTWISE[setup.compiled],
           "optimizer": setup.optimizer_name}
    try:
        with attention_impl(impl):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            before = rss_mib()
            setup.step(steps_k)  # warm-up (allocator, kernels, optimizer state)
            setup.sync()
            started = time.perf_counter()
            for _ in range(repeats):
                setup.step(steps_k)
            setup.sync()
            elapsed = (time.perf_counter() - started) / repeats
    except torch.cuda.OutOfMemoryError:
        setup.optimizer.zero_grad(set_to_none=True)
        return {**row, "oom": True, "s_per_step": None, "tokens_per_s": None,
                "peak_memory_mib": None}
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mib() - before)
    return {**row, "oom": False, "s_per_step": elapsed, "tokens_per_s": rows * tokens / elapsed,
            "peak_memory_mib": peak, "threads": torch.get_num_threads()}


def attention_path(setup: Setup, steps_k: int) -> str:
    """Which kernel training's ttt_attention takes for this step's queries (device, dtype)."""
    seen = []

    def recording(q, k_ctx, v_ctx, k_diag, v_diag):
        if k_diag:
            seen.append((q.device.type, q.dtype, m.fused_attention_ok(q)))
        return ATTENTION["diagonal"](q, k_ctx, v_ctx, k_diag, v_diag)

    original, eagle3_model.ttt_attention = eagle3_model.ttt_attention, recording
    try:
        with torch.no_grad():
            setup.loss(max(steps_k, 2))
    finally:
        eagle3_model.ttt_attention = original
    if not seen:
        return "causal only (K = 1)"
    device, dtype, fused = seen[0]
    kind = "fused (flash kernel + diagonal)" if fused else "eager reference (fused check failed)"
    return f"{kind}, {device} {str(dtype).removeprefix('torch.')}"


def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """Best FLOP/s of a large square matrix product, measured here."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + (3.0 if device.type == "cuda" else 0.5)
    reps = 20 if device.type == "cuda" else 2
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - started))
    return best


def fused_vs_eager(device: torch.device, dtype: torch.dtype, cfg: m.DraftConfig, tokens: int,
                   steps_k: int) -> dict:
    """Attention of unroll step K-1 at the run's head dims: the fused path and the eager
    reference in ``dtype``, each against the reference in fp32 from the same inputs. Returns
    per tensor (out, dq, dk_ctx, dv_ctx, dk_diag, dv_diag) the largest absolute difference
    fused - eager and each one's error relative to the largest true magnitude."""
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (1, cfg.num_attention_heads, tokens, cfg.head_dim)
    diag = max(steps_k - 1, 1)
    tensors = [torch.randn(shape, device=device, generator=gen, dtype=dtype).requires_grad_()
               for _ in range(3 + 2 * diag)]

    def run(ts, fused):
        q, k0, v0, *rest = ts
        ks, vs = rest[:diag], rest[diag:]
        with torch.autocast(device.type, enabled=False):
            if fused:
                out = m.FusedTTTAttention.apply(q, k0, v0, *ks, *vs)
            else:
                out = m.ttt_attention_reference(q, k0, v0, ks, vs)
            grads = torch.autograd.grad(out.float().square().sum(), ts)
        g = [t.detach().float() for t in grads]
        return {"out": out.detach().float(), "dq": g[0], "dk_ctx": g[1], "dv_ctx": g[2],
                "dk_diag": torch.stack(g[3:3 + diag]), "dv_diag": torch.stack(g[3 + diag:])}

    fused = run(tensors, True)
    eager = run(tensors, False)
    truth = run([t.detach().float().requires_grad_() for t in tensors], False)
    return {name: {"max_abs_fused_minus_eager": float((fused[name] - eager[name]).abs().max()),
                   "fused_error": m.fused_error(fused[name], truth[name]),
                   "eager_error": m.fused_error(eager[name], truth[name])}
            for name in fused}


def step_gradients_diff(setup: Setup, steps_k: int) -> dict:
    """Loss and parameter gradients of one micro-batch, fused diagonal vs eager reference."""
    results = {}
    for impl in ("diagonal", "diagonal-eager"):
        with attention_impl(impl):
            loss, _ = setup.loss(steps_k)
            loss.backward()
        results[impl] = (float(loss.detach()), [p.grad.detach().float().clone()
                                                for p in setup.params])
        setup.optimizer.zero_grad(set_to_none=True)
    (lf, gf), (le, ge) = results["diagonal"], results["diagonal-eager"]
    rel = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
              for a, b in zip(gf, ge, strict=True))
    return {"loss_fused": lf, "loss_eager": le, "max_grad_diff_rel": rel}


# ----------------------------------------------------------------------------- report


def table(rows: list[dict], cfg: m.DraftConfig, peak_flops: float, device_type: str) -> str:
    """One row per (T, K, teacher head, attention, norms and MLPs eager or compiled,
    optimizer); speeds against the dense mask with the full teacher, eager, and the same
    optimizer, measured in the same run (MFU on each row's own model FLOPs: the optimizer's
    are not a token's work)."""
    by = {(r.get("teacher", "full"), r["impl"], r.get("pointwise", "eager"),
           r.get("optimizer", COMPARED_OPTIMIZER), r["K"], r["tokens"]): r for r in rows}
    memory = "peak allocated (MiB)" if device_type == "cuda" else "peak RSS increase (MiB)"
    lines = [f"| T | K | teacher | attention | norms, MLP | optimizer | step (ms) | tokens/s | "
             f"{memory} | model estimate (MiB) | GFLOP/token | MFU | "
             "speed vs dense, full teacher, eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for tokens in sorted({r["tokens"] for r in rows}):
        for k in sorted({r["K"] for r in rows}):
            for teacher, impl, mode, opt in ((t, i, p, o) for t in TEACHER_HEADS for i in IMPLS
                                             for p in POINTWISE for o in OPTIMIZERS):
                r = by.get((teacher, impl, mode, opt, k, tokens))
                if r is None:
                    continue
                dense = by.get(("full", "dense", "eager", opt, k, tokens))
                flops = flops_per_token(cfg, tokens, k, teacher)["total"]
                estimate = memory_model(cfg, r["batch"], tokens, k, device_type,
                                        teacher, opt)["peak"] / 2**20
                if r["oom"]:
                    lines.append(f"| {tokens} | {k} | {teacher} | {impl} | {mode} | {opt} | "
                                 f"out of memory | | | {estimate:,.0f} | {flops / 1e9:.4g} | | |")
                    continue
                speed = (f"{r['tokens_per_s'] / dense['tokens_per_s']:.2f}x"
                         if dense and not dense["oom"] else "-")
                mfu = flops * r["tokens_per_s"] / peak_flops
                lines.append(
                    f"| {tokens} | {k} | {teacher} | {impl} | {mode} | {opt} | "
                    f"{r['s_per_step'] * 1e3:,.1f} | "
                    f"{r['tokens_per_s']:,.0f} | {r['peak_memory_mib']:,.0f} | "
                    f"{estimate:,.0f} | {flops / 1e9:.4g} | {100 * mfu:.1f}% | {speed} |")
    return "\n".join(lines)


def flops_table(cfg: m.DraftConfig, tokens: list[int], steps_k: list[int]) -> str:
    names = ("fc", "draft_layer", "draft_head", "attention", "teacher_head", "total")
    lines = ["| T | K | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for t in tokens:
        for k in steps_k:
            f = flops_per_token(cfg, t, k)
            lines.append(f"| {t} | {k} | " + " | ".join(f"{f[n] / 1e9:.4g}" for n in names)
                         + " |")
    muon = optimizer_flops(cfg, "muon")
    lines.append(f"Muon's Newton-Schulz (once an optimizer step, not in MFU): {muon / 1e9:,.4g} "
                 f"GFLOP, {muon / max(tokens) / 1e9:.4g} GFLOP a token at {max(tokens):,} "
                 "tokens a step")
    return "GFLOP per token, by term\n" + "\n".join(lines)


def memory_report(cfg: m.DraftConfig, batch: int, tokens: list[int], steps_k: list[int],
                  device_type: str) -> str:
    names = ("weights fp32 + grads", "optimizer state", "autocast weight copies",
             "frozen embedding + target head", *PER_TOKEN_TERMS, "peak",
             "teacher head transient")
    lines = [f"Analytic memory ({device_type}, {batch} row(s); GiB)",
             "| T | K | " + " | ".join(names) + " | MiB / token | tokens in 80 GB |",
             "|---|---|" + "---|" * (len(names) + 2)]
    for t in tokens:
        for k in steps_k:
            mm = memory_model(cfg, batch, t, k, device_type)
            fit = max_batch_tokens(cfg, t, k, 80e9, device_type)
            lines.append(f"| {t} | {k} | " + " | ".join(f"{mm[n] / GIB:.2f}" for n in names)
                         + f" | {mm['activations per token'] / 2**20:.2f} | {fit:,} |")
    t, k = max(tokens), max(steps_k)
    mm = memory_model(cfg, batch, t, k, device_type)
    activations = mm["activations saved"]
    teacher_is_peak = mm["teacher head transient"] > activations
    lines.append(
        f"At T = {t}, K = {k}: the teacher head's chunked transient "
        f"({mm['teacher head transient'] / GIB:.2f} GiB, before the unroll) is "
        f"{'' if teacher_is_peak else 'not '}the peak; the peak is the end of the forward, "
        f"{mm['peak'] / GIB:.1f} GiB, of which activations "
        f"{activations / GIB:.1f} GiB.")
    return "\n".join(lines)


def fused_report(diffs: dict, step_diff: dict | None, dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    lines = [f"Fused vs eager reference, {name} (error = max |x - fp32 truth| / max |truth|; "
             f"the fused check's tolerance {m.fused_tolerance(dtype):g})",
             "| tensor | max abs fused - eager | fused error | eager error |",
             "|---|---|---|---|"]
    if "error" in diffs:
        lines.append(f"| the fused path failed: {diffs['error']} | | | |")
        diffs = {}
    for tensor, d in diffs.items():
        lines.append(f"| {tensor} | {d['max_abs_fused_minus_eager']:.3g} | "
                     f"{d['fused_error']:.2e} | {d['eager_error']:.2e} |")
    if step_diff:
        lines.append(f"Whole step: loss fused {step_diff['loss_fused']:.6f}, eager "
                     f"{step_diff['loss_eager']:.6f}; parameter gradients differ by at most "
                     f"{step_diff['max_grad_diff_rel']:.2e} of their largest magnitude")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a prepared run (sets device, dims, tokens, K, repeats)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dims", choices=sorted(DIMS), default="toy")
    parser.add_argument("--steps-k", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--teacher-heads", nargs="+", choices=TEACHER_HEADS,
                        default=[TRAIN["teacher_head"]],
                        help="train.teacher_head values measured (each beside every attention)")
    parser.add_argument("--pointwise", nargs="+", choices=POINTWISE, default=["eager"],
                        help="norms and MLPs eager and/or compiled (train.compile); compiled "
                             "rows are measured after the eager ones")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS,
                        default=[COMPARED_OPTIMIZER],
                        help=f"train.optimizer values measured (training's default is "
                             f"{TRAIN['optimizer']}; {COMPARED_OPTIMIZER} is the peer's step)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; 1 is steadier on a busy CPU)")
    parser.add_argument("--in-process", action="store_true",
                        help="CPU: run every configuration in this process (peak RSS is then "
                             "not per configuration)")
    parser.add_argument("--memory-only", action="store_true",
                        help="print the FLOPs and the analytic memory, run nothing")
    parser.add_argument("--json", help="also write the rows and checks to this file")
    parser.add_argument("--one", nargs=6,
                        metavar=("IMPL", "K", "T", "TEACHER", "POINTWISE", "OPTIMIZER"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    if args.device == "cuda" and not args.memory_only and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    return args


def child_row(args, impl: str, k: int, tokens: int, teacher: str, mode: str,
              optimizer: str = COMPARED_OPTIMIZER) -> dict:
    """CPU: one configuration in a fresh process, so that its peak RSS is its own."""
    cmd = [sys.executable, __file__, "--one", impl, str(k), str(tokens), teacher, mode, optimizer,
           "--dims", args.dims,
           "--batch", str(args.batch), "--repeats", str(args.repeats)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = m.DraftConfig(**DIMS[args.dims])
    if args.one:  # child process: one configuration, JSON on stdout
        impl, k, tokens = args.one[0], int(args.one[1]), int(args.one[2])
        setup = Setup(DIMS[args.dims], "cpu", args.batch, tokens, teacher_head=args.one[3],
                      compile=args.one[4] == "compiled", optimizer=args.one[5])
        print(json.dumps(measure(setup, impl, k, args.repeats)))
        return 0
    print(flops_table(cfg, args.tokens, args.steps_k))
    print(memory_report(cfg, args.batch, args.tokens, args.steps_k, args.device))
    if args.memory_only:
        return 0
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak_flops = matmul_peak(device, dtype)
    print(f"\nmeasured matmul peak: {peak_flops / 1e9:,.1f} GFLOP/s "
          f"({str(dtype).removeprefix('torch.')})")
    setup = Setup(DIMS[args.dims], args.device, args.batch, min(args.tokens))
    path = attention_path(setup, max(args.steps_k))
    print(f"attention path of training's ttt_attention: {path}")
    try:  # a kernel that fails here must not cost the table
        diffs = fused_vs_eager(device, torch.bfloat16, cfg, max(args.tokens),
                               max(args.steps_k))
    except (RuntimeError, NotImplementedError) as e:
        diffs = {"error": f"{type(e).__name__}: {e}"}
    step_diff = step_gradients_diff(setup, max(args.steps_k))
    print(fused_report(diffs, step_diff, torch.bfloat16), flush=True)
    rows = []

    def write_json():  # after every row: a run cut short by a time limit keeps what it measured
        if not args.json:
            return
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "peak_flops": peak_flops, "attention_path": path,
                       "fused_vs_eager": diffs, "step_gradients": step_diff,
                       "flops_per_token": {f"{t},{k}": flops_per_token(cfg, t, k)
                                           for t in args.tokens for k in args.steps_k},
                       "optimizer_flops_per_step": {o: optimizer_flops(cfg, o)
                                                    for o in OPTIMIZERS},
                       "memory_model": {f"{t},{k}": memory_model(cfg, args.batch, t, k,
                                                                 device.type)
                                        for t in args.tokens for k in args.steps_k}},
                      f, indent=1)

    for mode in sorted(args.pointwise, key=POINTWISE.index):  # compiling is one way
        if mode == "compiled" and not setup.compiled:
            setup.compile()
        for tokens in args.tokens:
            setup.set_batch(args.batch, tokens)
            for k, opt, teacher, impl in ((k, o, t, i) for k in args.steps_k
                                          for o in args.optimizers
                                          for t in args.teacher_heads for i in args.impls):
                setup.teacher_head = teacher  # one model: the head is a setting of the step
                if device.type == "cpu" and not args.in_process:
                    row = child_row(args, impl, k, tokens, teacher, mode, opt)
                else:
                    if setup.optimizer_name != opt:
                        setup.set_optimizer(opt)
                    row = measure(setup, impl, k, args.repeats)
                rows.append(row)
                write_json()
                rate = "OOM" if row["oom"] else f"{row['tokens_per_s']:,.0f} tok/s"
                print(f"  {teacher:10s} {impl:14s} {mode:8s} {opt:5s} T={tokens} K={k}: {rate}",
                      file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\ndraft train step, {args.dims} dims, {name}, {args.batch} row(s), "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}, "
          f"{time.perf_counter() - started:.0f} s")
    print(table(rows, cfg, peak_flops, device.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/train_step.py: its FLOPs formula, its memory model and its CPU path at toy dims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import draftline.drafts as m

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_step as bench  # noqa: E402


def test_flops_per_token_equals_a_hand_count():
    """Toy dims (H 128, 4 heads of 32, intermediate 384, vocab 2048, draft vocab 1024),
    T = 64, K = 2, counted by hand."""
    cfg = m.DraftConfig(**bench.TOY)
    flops = bench.flops_per_token(cfg, tokens=64, steps_k=2)
    fc = 2 * 2 * 384 * 128  # forward + weight gradient of [T, 384] x [384, 128]
    layer_forward = (2 * 256 * 128 * 3  # q, k, v: [T, 256] x [256, 128] each
                     + 2 * 128 * 128  # o_proj
                     + 2 * 128 * 384 * 3)  # gate, up, down
    head_forward = 2 * 128 * 1024
    # keys per row: step 0 sees (64 + 1) / 2 causal keys on average, step 1 one more;
    # QK^T and PV: 2 * 2 * 128 FLOPs per key; backward twice the forward.
    attention = 3 * 2 * 2 * 128 * (32.5 + 33.5)
    teacher = 2 * 128 * 2048  # forward only
    assert flops["fc"] == fc == 196_608
    assert flops["draft_layer"] == 3 * 2 * layer_forward == 3_145_728
    assert flops["draft_head"] == 3 * 2 * head_forward == 1_572_864
    assert flops["attention"] == attention == 101_376
    assert flops["teacher_head"] == teacher == 524_288
    assert flops["total"] == 5_540_864


def test_kimi_dims_are_the_production_config():
    """KIMI_MLA is the draft config/kimi-k2.5.yaml trains (the target's MLA sizes filled in as
    training fills them); KIMI the Llama layer at the same sizes, which the peer can train."""
    from draftline.plan import KNOWN_TARGETS

    config = yaml.safe_load((ROOT / "config/kimi-k2.5.yaml").read_text())
    kimi = KNOWN_TARGETS["moonshotai/kimi-k2.5"]
    production = m.DraftConfig.from_target(
        {**kimi, "num_attention_heads": kimi["num_heads"], "rope_theta": 50000.0,
         "max_position_embeddings": 262144, "rms_norm_eps": 1e-6},
        config["vocab"]["draft_vocab_size"], config["train"]["draft"])
    benchmarked = m.DraftConfig(**bench.KIMI_MLA)
    for key in ("arch", "intermediate_size", "num_attention_heads", "rope_scaling",
                "rope_theta", "draft_vocab_size", "vocab_size", *m.DraftConfig.MLA_KEYS):
        assert getattr(benchmarked, key) == getattr(production, key), key
    assert bench.KIMI["draft_vocab_size"] == config["vocab"]["draft_vocab_size"]
    assert (bench.KIMI["hidden_size"], bench.KIMI["vocab_size"]) == (7168, 163840)
    assert config["train"]["ttt_steps"] == max(bench.PRESETS["h200"]["steps_k"])


def test_the_step_reads_trainings_defaults():
    """TRAIN is the schema's train defaults (a fixed rate stands for ``lr: auto``), so that the
    step measured is the one a run takes."""
    schema = yaml.safe_load((ROOT / "src/draftline/schemas/config.schema.yaml").read_text())
    defaults = {key: spec.get("default")
                for key, spec in schema["properties"]["train"]["properties"].items()}
    assert defaults["lr"] == "auto"
    for key, value in bench.TRAIN.items():
        if key != "lr":
            assert defaults[key] == value, key
    assert bench.COMPARED_OPTIMIZER in bench.OPTIMIZERS
    assert set(bench.OPTIMIZERS) == set(
        schema["properties"]["train"]["properties"]["optimizer"]["enum"])


TOY_MLA = {**bench.TOY, "arch": "deepseek_mla", "q_lora_rank": 48, "kv_lora_rank": 32,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("dims", ["toy", "toy-mla"])
def test_the_optimizers_work_and_state_are_what_the_model_counts(dims, optimizer):
    """The matrix products of one optimizer step, counted by torch's FlopCounterMode, equal
    optimizer_flops (Muon's Newton-Schulz; AdamW none), and the optimizer's state after it
    equals memory_model's term (Muon keeps one buffer a matrix, not AdamW's two)."""
    from torch.utils.flop_counter import FlopCounterMode

    setup = bench.Setup(bench.TOY if dims == "toy" else TOY_MLA, "cpu", 1, 32,
                        optimizer=optimizer)
    loss, _ = setup.loss(2)
    loss.backward()
    with FlopCounterMode(display=False) as counter:
        setup.optimizer.step()
    assert counter.get_total_flops() == bench.optimizer_flops(setup.cfg, optimizer)
    state = sum(t.numel() * t.element_size() for per_param in setup.optimizer.state.values()
                for t in per_param.values() if torch.is_tensor(t) and t.ndim > 0)
    expected = bench.memory_model(setup.cfg, 1, 32, 2, "cpu", optimizer=optimizer)
    assert state == expected["optimizer state"]
    if optimizer == "muon":
        assert counter.get_total_flops() > 0
        adamw = bench.memory_model(setup.cfg, 1, 32, 2, "cpu", optimizer="adamw")
        assert state < 0.7 * adamw["optimizer state"]


def test_muons_work_a_step_at_kimi_dims_is_a_model_steps_worth_at_4096_tokens():
    """Why the optimizer is a column: at the Llama layer's Kimi sizes Muon's Newton-Schulz is
    1.6e14 FLOPs a step, about 39 GFLOP a token of a 4,096-token step, against the model's
    42 at K = 7 (a hand count of fc's share checks the formula's shape)."""
    cfg = m.DraftConfig(**bench.KIMI)
    fc = 5 * (4 * 7168**2 * 21504 + 2 * 7168**3)  # [7168, 3 x 7168]: short side 7168
    assert bench.muon_matrices(cfg)["fc.weight"] == (7168, 21504)
    total = bench.optimizer_flops(cfg, "muon")
    assert fc < total and total == pytest.approx(1.61e14, rel=0.01)
    assert total / 4096 == pytest.approx(0.93 * bench.flops_per_token(cfg, 4096, 7)["total"],
                                         rel=0.02)


@pytest.mark.parametrize("family", sorted(bench.FAMILIES))
def test_each_family_has_a_kimi_row_and_its_step_trains_what_makes_it_that_family(family):
    """--dims kimi-{family} is Kimi's Llama draft with the family's flags only, and the step
    (at toy dims, the same flags) gives a gradient to the parameters only that family has."""
    dims = bench.DIMS[f"kimi-{family}"]
    assert {k: v for k, v in dims.items() if bench.KIMI.get(k) != v} == bench.FAMILIES[family]
    setup = bench.Setup({**bench.TOY, **bench.FAMILIES[family]}, "cpu", 1, 32)
    loss, _ = setup.loss(3)  # training's run_micro_batch
    loss.backward()
    grads = {name: p.grad for name, p in setup.model.named_parameters() if p.requires_grad}
    own = {"p-eagle": ["mask_hidden"], "eagle3.1": ["fc_norm"]}[family]
    for prefix in own:
        named = [g for name, g in grads.items() if name.startswith(prefix)]
        assert named and all(g is not None and g.abs().sum() > 0 for g in named), prefix


def saved_bytes(setup: bench.Setup, steps_k: int, emulate_cuda: bool) -> int:
    """What autograd saves in training's forward; ``emulate_cuda``: bf16 embedding, target
    head and inputs under bf16 autocast, as run_micro_batch does on CUDA."""
    if emulate_cuda:
        bf16 = torch.bfloat16
        setup.model.embed_tokens.weight.data = setup.model.embed_tokens.weight.data.to(bf16)
        setup.head.lm_head = setup.head.lm_head.to(bf16)
        setup.head.norm_weight = setup.head.norm_weight.to(bf16)
        for key in ("aux", "final"):
            setup.batch[key] = setup.batch[key].to(bf16)

    def forward(mark_params):
        mark_params(setup.model)
        if not emulate_cuda:
            return setup.loss(steps_k)  # training's own run_micro_batch
        b = setup.batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, in_draft, argmax = setup.head(b["final"], with_argmax=True)
            logits = setup.model(b["aux"], b["input_ids"], steps_k)
            return m.ttt_loss(logits, logp, in_draft, b["loss_mask"], 0.8,
                              greedy_path=m.on_greedy_path(b["input_ids"], argmax))

    return bench.saved_activation_bytes(forward)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("steps_k", [1, 3, 7])
def test_memory_model_matches_what_autograd_saves(device_type, steps_k):
    """The analytic activations (plus the autocast weight copies and the aux input, which
    autograd saves too) within 5% of the bytes autograd keeps for the backward, at toy dims;
    CUDA's dtypes emulated with CPU autocast."""
    tokens = 256
    setup = bench.Setup(bench.TOY, "cpu", 1, tokens)
    got = saved_bytes(setup, steps_k, emulate_cuda=device_type == "cuda")
    model = bench.memory_model(setup.cfg, 1, tokens, steps_k, device_type)
    width = 2 if device_type == "cuda" else 4
    expected = (model["activations saved"] + model["autocast weight copies"]
                + tokens * 3 * bench.TOY["target_hidden_size"] * width  # aux, saved by fc
                + tokens * 4 * bench.TOY["draft_vocab_size"])  # the target probs
    assert expected == pytest.approx(got, rel=0.05)


def test_teacher_head_is_not_the_peak_and_kimi_seq_4096_k7_fits_80gb_with_a_batch():
    cfg = m.DraftConfig(**bench.KIMI)
    one = bench.memory_model(cfg, 1, 4096, 7, "cuda")
    assert one["teacher head transient"] < 0.1 * one["activations saved"]
    assert one["peak"] < 60e9
    assert bench.max_batch_tokens(cfg, 4096, 7, 80e9) >= 2 * 4096  # two rows of 4,096
    assert bench.memory_model(cfg, 2, 4096, 7, "cuda")["peak"] < 80e9


def test_cpu_path_runs_at_toy_dims_and_reports_the_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--dims", "toy", "--tokens", "48", "--steps-k", "1",
                       "3", "--impls", "diagonal", "dense", "--repeats", "1", "--in-process",
                       "--teacher-heads", "full", "draft_rows", "--optimizers", "adamw",
                       "muon", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| T | K | teacher"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "T", "K", "teacher", "attention", "norms, MLP", "optimizer", "step (ms)", "tokens/s",
        "peak RSS increase (MiB)", "model estimate (MiB)", "GFLOP/token", "MFU",
        "speed vs dense, full teacher, eager"]
    report = json.loads(out.read_text())
    assert {(r["teacher"], r["impl"], r["K"], r["pointwise"], r["optimizer"])
            for r in report["rows"]} == {
        (t, impl, k, "eager", o) for t in ("full", "draft_rows") for impl in ("diagonal", "dense")
        for k in (1, 3) for o in ("adamw", "muon")}
    assert "| 48 | 3 | draft_rows | diagonal | eager | muon |" in printed
    assert report["optimizer_flops_per_step"]["adamw"] == 0
    assert report["optimizer_flops_per_step"]["muon"] > 0
    for row in report["rows"]:
        assert not row["oom"] and row["tokens_per_s"] > 0 and row["tokens"] == 48
        mfu = report["flops_per_token"][f"48,{row['K']}"]["total"] * row["tokens_per_s"] \
            / report["peak_flops"]
        assert 0 < mfu < 1
    assert report["attention_path"] == "fused (flash kernel + diagonal), cpu float32"
    assert "attention path of training's ttt_attention: fused" in printed
    for tensor, diff in report["fused_vs_eager"].items():  # bf16, against the fp32 truth
        assert diff["fused_error"] < m.fused_tolerance(torch.bfloat16), tensor
        assert diff["max_abs_fused_minus_eager"] > 0  # the two paths really differ in bf16
    step = report["step_gradients"]  # the whole fp32 step: fused and eager agree
    assert step["loss_fused"] == pytest.approx(step["loss_eager"], rel=1e-5)
    assert step["max_grad_diff_rel"] < 1e-4


def test_the_draft_rows_teacher_counts_its_own_work_and_memory():
    """train.teacher_head draft_rows: the teacher's FLOPs are D / V of the full head's, and the
    step holds a copy of the draft rows beside the full head (evaluation's)."""
    cfg = m.DraftConfig(**bench.KIMI)
    full = bench.flops_per_token(cfg, 4096, 7, "full")
    rows = bench.flops_per_token(cfg, 4096, 7, "draft_rows")
    assert full["teacher_head"] == 2 * 7168 * 163840 and rows["teacher_head"] == 2 * 7168 * 32000
    assert full["total"] - rows["total"] == 2 * 7168 * (163840 - 32000)
    memory = {t: bench.memory_model(cfg, 1, 4096, 7, "cuda", t) for t in ("full", "draft_rows")}
    assert (memory["draft_rows"]["frozen embedding + target head"]
            - memory["full"]["frozen embedding + target head"]) == 32000 * 7168 * 2


def test_cpu_child_reports_its_own_peak_memory_not_its_parents():
    """Each CPU configuration runs in a fresh process so that its peak memory is its own; the
    parent here holds 512 MiB (as the CPU path's parent does after its fused-vs-eager check)."""
    ballast = torch.ones(512 * 2**20 // 4)  # noqa: F841 - touched, so resident
    args = bench.parse_args(["--dims", "toy", "--repeats", "1", "--threads", "1"])
    row = bench.child_row(args, "diagonal", 2, 64, "full", "eager")
    assert 1 < row["peak_memory_mib"] < 256
    assert bench.child_row(args, "diagonal", 2, 64, "full", "compiled")["pointwise"] == \
        "compiled"  # train.compile reaches the child's step
    assert bench.child_row(args, "diagonal", 2, 64, "full", "eager", "muon")["optimizer"] == \
        "muon"  # and train.optimizer


def test_script_runs_where_only_torch_is_installed():
    """The accelerator machine has torch, transformers and safetensors: the modules
    draftline.stages.train imports for the pipeline (config validation, progress bars, the server
    client) may be missing there, and the script must still import training's step."""
    blocked = ["jsonschema", "httpx", "tqdm", "yaml", "snakemake", "rich", "click", "openai"]
    runner = (
        "import os, runpy, sys\n"
        f"BLOCKED = {blocked!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = sys.argv[1:]\n"
        # the script's folder first on the path, as `python SCRIPT` puts it (run_path does not)
        "sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    script = str(ROOT / "benchmarks/train_step.py")
    done = subprocess.run([sys.executable, "-c", runner, script, "--memory-only", "--dims",
                           "kimi", "--device", "cuda", "--tokens", "4096", "--steps-k", "7"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "stood in for at import" in done.stderr
    assert "| 4096 | 7 |" in done.stdout


# The GPU comparison with speculators (../shared/peer-bench/h200-step, copied into the
# git-ignored benchmarks/.peer/ to travel to a lent GPU) imports this script's names.
PEER_HARNESS = [ROOT / "benchmarks/.peer/h200-step", ROOT.parent / "shared/peer-bench/h200-step"]


def test_the_peer_harness_measures_this_checkouts_step(tmp_path):
    """The harness's draftline half, run as its run.sh runs it, at its tiny dims on the CPU: a
    renamed or re-meant name (Setup, .step, attention_path, flops_per_token, memory_model,
    matmul_peak, m) would cost a lent GPU's minutes instead of failing here."""
    harness = next((d for d in PEER_HARNESS if (d / "bench_draftline.py").is_file()), None)
    if harness is None:
        pytest.skip("the peer harness (../shared/peer-bench/h200-step) is not on this machine")
    out = tmp_path / "draftline.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'benchmarks'}"}
    done = subprocess.run([sys.executable, "bench_draftline.py", "--device", "cpu", "--dims",
                           "tiny", "--tokens", "128", "--steps-k", "2", "--warmup", "1",
                           "--repeats", "2", "--threads", "1", "--json", str(out)],
                          cwd=harness, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    payload = json.loads(out.read_text())
    (row,) = payload["rows"]
    cfg = m.DraftConfig(**payload["dims_values"])
    assert row["flops_per_token"] == bench.flops_per_token(cfg, 128, 2)["total"]
    assert row["status"] == "ok" and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert payload["attention_path"].startswith("fused")


def test_the_gpu_call_passes_every_part_arguments_the_script_accepts(tmp_path):
    """benchmarks/gpu_session.sh with MEMORY_ONLY: each part's train_step.py arguments parse
    and print Kimi's T 4,096, K 7 row, so a lent GPU's one call is not lost to a typo."""
    env = {**os.environ, "PEER": "", "MEMORY_ONLY": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    exits = (tmp_path / "summary.txt").read_text().splitlines()[1:5]
    assert exits == [f"{part}: exit 0" for part in (
        "step-kimi", "step-kimi-mla", "step-kimi-eagle3.1", "step-kimi-p-eagle")]
    assert "| 4096 | 7 |" in (tmp_path / "step-kimi-mla.log").read_text()


def test_the_optimizer_benchmark_times_each_step_and_checks_its_weights(capsys):
    """benchmarks/optimizer_step.py at toy dims, 2 processes: a row for each strategy and
    step; the shared steps' weights are one process's torch.optim.Muon's bit for bit (its exit
    status says so too), torch's own step on FSDP's DTensors is not."""
    import optimizer_step

    assert optimizer_step.main(["--dims", "toy", "--world", "2", "--repeats", "1"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|")[4].strip()
            for line in capsys.readouterr().out.splitlines() if line.startswith("| DDP")
            or line.startswith("| FSDP")}
    labels = optimizer_step.LABELS
    assert set(rows) == set(labels.values())
    for (strategy, step), label in labels.items():
        exact = rows[label] == "equal bit for bit"
        assert exact == (step == "shared" or strategy == "ddp"), (label, rows[label])

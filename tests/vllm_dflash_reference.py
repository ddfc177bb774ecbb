"""Serve an exported DFlash draft with vLLM's own engine, in process on the CPU, and record
what its ``DFlashQwen3ForCausalLM`` computed at every drafting step.

    python tests/vllm_dflash_reference.py TARGET CHECKPOINT K PROMPT_IDS OUTPUT

vLLM (``"method": "dflash"``, ``num_speculative_tokens`` K, fp32, one request) decodes the
prompt greedily. Two hooks record, per step of ``DFlashProposer.propose``: the target's
captured states it was given (``target_hidden_states``, the aux layers concatenated, one row per
newly computed token), their positions, the rows rejected at the last verification, the
anchor token (``next_token_ids``), and the logits the draft model computed for its mask slots
(``compute_logits``). Nothing is substituted: the paged KV cache, the CPU attention kernel and
the proposer's input kernel are vLLM's. Its own process: vLLM initialises a process-wide
distributed group.

OUTPUT (``torch.save``, plain tensors and lists): ``{"steps": [{"positions", "hidden",
"rejected", "anchor", "logits"}], "output_ids": [...]}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(target: str, checkpoint: str, k: int, prompt: list[int], output: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.v1.spec_decode.dflash import DFlashProposer

    steps: list[dict] = []
    propose, compute_logits = DFlashProposer.propose, DFlashQwen3ForCausalLM.compute_logits

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

    def recording_logits(self, hidden_states, *args, **kwargs):
        logits = compute_logits(self, hidden_states, *args, **kwargs)
        steps[-1]["logits"] = logits.detach().float().clone()
        return logits

    DFlashProposer.propose = recording_propose
    DFlashQwen3ForCausalLM.compute_logits = recording_logits
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

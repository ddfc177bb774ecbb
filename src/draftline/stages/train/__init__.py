"""Train the draft on stored target hidden states: one loop for CPU, DDP and FSDP.

Library::

    from draftline.stages.train import train_draft
    record = train_draft(hidden_dir, vocab_map, target_dir, out_dir, train_cfg)

``train_cfg`` is the ``train`` config section (missing keys take the schema defaults). With
``nproc_per_node > 1`` and no torchrun environment, ``train_draft`` launches itself under torchrun
(``--standalone``) and returns when all processes are done. Multi-node runs (``nnodes > 1``)
are launched by the user on every node::

    torchrun --nnodes N --nproc_per_node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m draftline.stages.train \\
        --hidden-dir results/hidden --vocab-map results/vocab/vocab_map.safetensors \\
        --target-dir results/target --out-dir results/draft --config-json '{"epochs": 2}'

(``--config-json`` takes JSON text or a path to a JSON file.)

Outputs in ``out_dir``: ``metrics.jsonl`` (one record per optimizer step and per evaluation),
``eval.json`` (the best evaluation: simulated acceptance length, per-step accuracies,
``layer_ids``, ``ttt_steps``), ``best/`` (weights of the best evaluation, for export),
``tb/`` (TensorBoard events), and ``state/``: the latest resumable checkpoint plus the live
best weights and metrics log, from which ``best/`` and ``eval.json`` are published at the end
(so a workflow manager may delete the outputs of a killed job without losing anything).

Batches: samples are grouped by length and packed into micro-batches of at most
``batch_tokens`` padded tokens (each sample its own row, see draftline.drafts). One optimizer
step consumes ``grad_accum`` micro-batches on each of the ``world_size`` processes, so one
process with ``grad_accum = 2`` and two processes with ``grad_accum = 1`` take the same steps.
The micro-batches that do not fill a last step of an epoch are dropped.

Resume: a checkpoint (weights, optimizer, scheduler, RNG, data position, best so far) is
written atomically every ``checkpoint_every`` steps and at the end. A rerun with the same
inputs and config continues from it (on CPU the final weights equal an uninterrupted run); a
rerun with anything changed starts afresh. SIGINT or SIGTERM stops the run after the current
optimizer step, with a checkpoint of that step (exit status 128 + signal).

Modules: ``loop`` (``train_draft``: the loop, top to bottom), ``data`` (micro-batches and the batch
source the loop reads), ``draft`` (the draft and its teacher from the target), ``optim`` (the
optimizer and the learning-rate schedule), ``distributed`` (processes, DDP/FSDP, torchrun),
``checkpoint`` (checkpoints, resume, outputs), ``signals`` (stop requests), ``metrics`` (the
metrics log). This file only re-exports.
"""

from draftline.stages.train.checkpoint import load_checkpoint
from draftline.stages.train.data import StoredBatches, plan_micro_batches
from draftline.stages.train.distributed import Runtime
from draftline.stages.train.draft import build_draft, load_target_tensors, save_untrained
from draftline.stages.train.loop import resolve_train_cfg, run_micro_batch, train_draft

__all__ = [
    "Runtime",
    "StoredBatches",
    "build_draft",
    "load_checkpoint",
    "load_target_tensors",
    "plan_micro_batches",
    "resolve_train_cfg",
    "run_micro_batch",
    "save_untrained",
    "train_draft",
]

"""Hidden states with HF transformers: forward pre-hooks on the decoder layers.

Layer ids (docs/formats.md): id k < L is the residual stream entering decoder layer k, id L
the pre-norm output of the last layer. Both are "the input of a module": layer k's input, and
the final norm's input for L. So pre-hooks capture exactly the requested states and nothing
else (``output_hidden_states=True`` would keep all L + 1 states, and its last entry is after
the final norm, which is the wrong state for id L).

Samples are batched by a token budget after sorting by length, so a batch holds samples of
similar length and padding stays small. Padding goes on the right and no attention mask is
passed: with causal attention a real token never sees the pads after it, and its positions
are 0..T-1 as in a batch-size-1 pass. The LM head is never run (only the decoder stack).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

PAD_TOKEN_ID = 0  # any valid id works: pads sit after every real token and are discarded
# A batch only takes samples at least this fraction of its longest one: bounds the padding
# of every row to 15 % even in the short tail of a part.
MIN_FILL = 0.85


def token_budget_batches(lengths: Sequence[int], batch_tokens: int,
                         min_fill: float = MIN_FILL) -> list[list[int]]:
    """Group sample indices into batches with ``rows * longest <= batch_tokens``.

    Longest samples first, so each batch has similar lengths (little padding) and the largest
    activations are allocated first. A sample longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            longest = lengths[batch[0]]  # sorted: the first member is the longest
            if (len(batch) + 1) * longest <= batch_tokens and lengths[i] >= min_fill * longest:
                batch.append(i)
                continue
        batches.append([i])
    return batches


# hf_batching "bucketed": every forward pads to a multiple of this many tokens.
PAD_MULTIPLE = 32


def padded_length(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def bucketed_batches(lengths: Sequence[int], batch_tokens: int,
                     multiple: int = PAD_MULTIPLE) -> list[list[int]]:
    """Batches whose samples all pad to the same length (a multiple of ``multiple``), with
    ``rows * padded <= batch_tokens`` (a longer sample goes alone).

    With bf16 kernels a sample's states depend on the padded length of its forward (another
    length rounds differently) and on whether the batch has one row or more, but not on the
    other rows: with the length fixed by the sample itself and at least two rows (``_forward``
    runs a lone sample with a copy of itself), its states do not depend on which samples share
    its forward. So states produced for any grouping of samples (online training's micro-
    batches, offline extraction's parts) are the same bits.
    """
    padded = [padded_length(n, multiple) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-padded[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            if padded[batch[0]] == padded[i] and (len(batch) + 1) * padded[i] <= batch_tokens:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def _decoder_parts(model, num_layers: int):
    """(decoder, layers, final_norm) of a causal LM, found without knowing its class."""
    import torch.nn as nn

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != num_layers or norm is None:
        raise ValueError(
            f"{type(model).__name__}: cannot find {num_layers} decoder layers and a final norm "
            "(expected model.get_decoder().layers and .norm)"
        )
    return decoder, layers, norm


def _pick_device_map():
    import torch

    if not torch.cuda.is_available():
        return None
    return "auto" if torch.cuda.device_count() > 1 else "cuda"


class HFBackend:
    """A loaded target that returns the states at ``capture_ids`` for lists of token ids."""

    name = "hf"

    def __init__(self, target_dir: Path, capture_ids: Sequence[int], num_layers: int,
                 dtype: str, batch_tokens: int, trust_remote_code: bool = False,
                 batching: str = "packed"):
        import torch
        from transformers import AutoModelForCausalLM

        if batching not in ("packed", "bucketed"):
            raise ValueError(f"hidden.hf_batching must be 'packed' or 'bucketed', got "
                             f"{batching!r}")
        self.capture_ids = list(capture_ids)
        self.batch_tokens = batch_tokens
        self.bucketed = batching == "bucketed"
        kwargs = {"dtype": getattr(torch, dtype)}
        if trust_remote_code:
            kwargs["trust_remote_code"] = True
        device_map = _pick_device_map()
        if device_map:
            kwargs["device_map"] = device_map  # spread over all visible GPUs
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), **kwargs).eval()
        self.decoder, layers, norm = _decoder_parts(self.model, num_layers)
        self.input_device = self.model.get_input_embeddings().weight.device
        self._captured: dict[int, object] = {}
        self._hooks = [
            (norm if k == num_layers else layers[k]).register_forward_pre_hook(
                self._capture_hook(k), with_kwargs=True)
            for k in self.capture_ids
        ]

    def _capture_hook(self, layer_id: int) -> Callable:
        def hook(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, H]
            self._captured[layer_id] = hidden.detach()

        return hook

    def _forward(self, batch: list[Sequence[int]]) -> list:
        """States of one batch: per sample a CPU tensor [T, len(capture_ids), H]."""
        import numpy as np
        import torch

        longest = max(len(ids) for ids in batch)
        rows = list(batch)
        if self.bucketed:
            longest = padded_length(longest)
            if len(rows) == 1:  # a one-row batch takes other kernels: run it as two
                rows.append(rows[0])
        padded = np.full((len(rows), longest), PAD_TOKEN_ID, dtype=np.int64)  # [B, T]
        for row, ids in enumerate(rows):
            padded[row, : len(ids)] = ids
        self._captured.clear()
        self.decoder(input_ids=torch.from_numpy(padded).to(self.input_device), use_cache=False)
        missing = [k for k in self.capture_ids if k not in self._captured]
        if missing:
            raise RuntimeError(f"forward pass did not reach layer ids {missing}")
        # [B, T, n, H], gathered on CPU (layers may live on different GPUs)
        stacked = torch.stack([self._captured[k].to("cpu") for k in self.capture_ids], dim=2)
        self._captured.clear()
        return [stacked[row, : len(ids)].clone() for row, ids in enumerate(batch)]

    def states(self, samples: Sequence[Sequence[int]],
               on_batch: Callable[[int], None] | None = None) -> list:
        """States for each sample, in input order: ``[T_i, len(capture_ids), H]`` tensors."""
        import torch

        out: list = [None] * len(samples)
        lengths = [len(ids) for ids in samples]
        with torch.inference_mode():
            plan = bucketed_batches if self.bucketed else token_budget_batches
            for batch in plan(lengths, self.batch_tokens):
                for i, states in zip(batch, self._forward([samples[i] for i in batch]),
                                     strict=True):
                    out[i] = states
                if on_batch:
                    on_batch(sum(lengths[i] for i in batch))
        return out

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.model = None

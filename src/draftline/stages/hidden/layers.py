"""Aux hidden-state layer ids: which target states feed the EAGLE-3 draft, as vLLM reads them.

Id k < L is the residual stream entering decoder layer k, id L the pre-norm output of the last
layer (docs/formats.md). Every stage that touches the ids (extraction, training, export) checks them
here, so that a draft is never trained on states vLLM will not give it:

* vLLM collects aux states by membership while it walks the layers, so the draft's ``fc``
  always receives them in ascending layer order. Ids listed in another order would train
  ``fc`` on a permutation of what it is served: refused, not silently reordered, so that the
  config, the hidden-state index and the exported draft all say the same thing.
* vLLM's DeepSeek-V2/V3 model (Kimi-K2.x, Mistral Large 3) adds ``hidden_states + residual``
  for an aux layer before the residual exists at layer 0: id 0 fails there at serving time.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftline.core.target import NUM_AUX_LAYERS

CONFIG_KEY = "hidden.layer_ids"

# Architectures vLLM 0.32 serves with DeepseekV2Model, whose aux capture at layer 0 reads a
# residual that is still None (model_executor/models/deepseek_v2.py).
RESIDUAL_FREE_AT_LAYER_0 = frozenset({
    "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "KimiVLForConditionalGeneration", "MistralLarge3ForCausalLM",
})
RESIDUAL_FREE_MODEL_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "kimi_vl",
})


class LayerIdError(ValueError):
    """Aux layer ids that vLLM would not serve as the draft was trained."""


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layer ids ``(2, L//2, L-3)``; refuses colliding ids.

    For small L they collide (L=4 gives 2, 2, 1; L=6 gives 2, 3, 3) and vLLM would silently
    feed the draft fewer than three states, so that is an error here.
    """
    ids = (2, num_layers // 2, num_layers - 3)
    if not 0 < ids[0] < ids[1] < ids[2]:
        raise LayerIdError(
            f"the default aux layer ids {ids} for a {num_layers}-layer target are not three "
            f"ascending distinct layers; set {CONFIG_KEY} explicitly"
        )
    return ids


def layer_0_unsupported(target_config: dict | None) -> bool:
    """True for targets whose vLLM model cannot capture an aux state at layer 0."""
    if not target_config:
        return False
    configs = [target_config, target_config.get("text_config") or {}]
    architectures = {a for c in configs for a in c.get("architectures") or []}
    model_types = {c.get("model_type") for c in configs}
    return bool(architectures & RESIDUAL_FREE_AT_LAYER_0
                or model_types & RESIDUAL_FREE_MODEL_TYPES)


def check_layer_ids(layer_ids: Sequence[int], num_layers: int,
                    target_config: dict | None = None, source: str = CONFIG_KEY) -> list[int]:
    """The ids as ints, or LayerIdError naming ``source`` (a config key or an index file).

    Three distinct ids in ascending order, each in ``0..num_layers``; no 0 for a target whose
    vLLM model has no residual at layer 0 (``target_config`` is its config.json).
    """
    ids = [int(k) for k in layer_ids]
    if len(ids) != NUM_AUX_LAYERS or len(set(ids)) != NUM_AUX_LAYERS:
        raise LayerIdError(f"{source} must be {NUM_AUX_LAYERS} distinct ids, got {ids}")
    if ids != sorted(ids):
        raise LayerIdError(
            f"{source} must be in ascending order, got {ids}: vLLM passes the aux states to "
            f"the draft in layer order, so write {sorted(ids)}")
    bad = [k for k in ids if not 0 <= k <= num_layers]
    if bad:
        raise LayerIdError(f"{source} {bad} outside 0..{num_layers} "
                           f"(the target has {num_layers} layers)")
    if ids[0] == 0 and layer_0_unsupported(target_config):
        arch = (target_config.get("architectures") or [target_config.get("model_type")])[0]
        raise LayerIdError(
            f"{source} {ids}: id 0 cannot be served for a {arch} target (vLLM's DeepSeek "
            "model path has no residual at layer 0); use ids >= 1")
    return ids


def resolve_layer_ids(layer_ids: Sequence[int] | None, num_layers: int,
                      target_config: dict | None = None) -> list[int]:
    """The aux layer ids to use: the config's (checked) or vLLM's default."""
    if layer_ids is None:
        layer_ids = default_layer_ids(num_layers)
    return check_layer_ids(layer_ids, num_layers, target_config)


def capture_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Ids to capture from the target: the aux ids and L, ascending, without repeats."""
    return sorted(set(layer_ids) | {num_layers})

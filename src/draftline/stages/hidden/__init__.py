"""Hidden states of the target: the aux states (EAGLE-3 input) and the final pre-norm state.

* ``extract.py``: ``extract_hidden_states`` runs the target over the tokenized dataset and
  writes the store;
* ``store.py``: the on-disk format (part files, index), its writer, reader and checks;
* ``layers.py``: which aux layer ids, checked as vLLM serves them;
* ``hf_backend.py``, ``vllm_backend.py`` (+ ``vllm_connector.py``): the two ways to run the
  target.

This file only re-exports the names other code uses.
"""

from draftline.stages.hidden.extract import (
    DEFAULTS,
    HiddenStateError,
    extract_hidden_states,
    target_info,
)
from draftline.stages.hidden.layers import (
    LayerIdError,
    capture_ids,
    check_layer_ids,
    default_layer_ids,
    resolve_layer_ids,
)
from draftline.stages.hidden.store import (
    load_part,
    read_index,
    state_bytes_per_token,
    stored_bytes_per_token,
    verify_index,
)

__all__ = [
    "DEFAULTS",
    "HiddenStateError",
    "LayerIdError",
    "capture_ids",
    "check_layer_ids",
    "default_layer_ids",
    "extract_hidden_states",
    "load_part",
    "read_index",
    "resolve_layer_ids",
    "state_bytes_per_token",
    "stored_bytes_per_token",
    "target_info",
    "verify_index",
]

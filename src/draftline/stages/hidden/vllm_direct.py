"""Hidden states taken straight from vLLM's model runner, when its one worker runs here.

The connector (``vllm_connector.py``) rides on vLLM's ``extract_hidden_states`` speculative
method: the target returns its aux states, the method's proposer stacks them, copies them into
a cache-only attention layer's blocks, the rejection sampler and the scheduler's speculative
bookkeeping run every step, and the connector copies the blocks out again when the request
ends. That works in any process layout, and it is the production path (tensor parallelism,
CUDA graphs, a server). When the engine's only worker runs in the extracting process
(the offline backend's in-process engine, tensor- and pipeline-parallel size 1) and in eager
mode, none of it is needed: the backend asks the target for the same aux states through
vLLM's EAGLE-3 interface (``set_aux_hidden_state_layers``: the residual stream entering layer
i, ``hidden_states + residual``, the tensors the method stores), and this module takes each
forward's rows, request by request, and puts a request's states in the reader's inbox
(``vllm_connector.Inbox``) once its whole prompt has been computed. On the toy target this
removed most of what the capture cost over a plain prefill (``benchmarks/hidden_states.py``).

Eager only: a compiled model was traced without the aux outputs. Each request's rows are
placed by their positions, so a prompt computed in chunks comes out whole, and one computed
again after a preemption starts over. The token ids the model saw travel with the states,
and ``read_states`` checks them against the sample sent.
"""

from __future__ import annotations

from typing import Any

import torch

from draftline.stages.hidden.vllm_connector import NAME_KEY, Inbox, inbox_in_this_process


def request_name(sampling_params: Any, req_id: str) -> str:
    """The name the backend gave the request (``extra_args[NAME_KEY]``), else its id."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return str(extra.get(NAME_KEY) or req_id)


class PromptRows:
    """One request's states so far: the chunks computed, in position order."""

    def __init__(self) -> None:
        self.start_over()

    def start_over(self) -> None:
        self.states: list[torch.Tensor] = []  # [n, n_ids, H] each
        self.token_ids: list[torch.Tensor] = []  # [n] each
        self.next_position = 0

    def add(self, first_position: int, states: torch.Tensor, token_ids: torch.Tensor) -> None:
        if first_position == 0:  # computed again from the start (a preempted request)
            self.start_over()
        if first_position != self.next_position:
            raise RuntimeError(f"rows from position {first_position}, expected "
                               f"{self.next_position}")
        self.states.append(states)
        self.token_ids.append(token_ids)
        self.next_position += len(states)

    def whole(self) -> dict:
        one = len(self.states) == 1  # the usual case: a view of the step's copy, no cat
        return {"hidden_states": self.states[0] if one else torch.cat(self.states),
                "token_ids": (self.token_ids[0] if one else torch.cat(self.token_ids)).tolist()}


class DirectCapture:
    """Reads each forward's aux states off the model runner and hands over whole prompts."""

    def __init__(self, runner: Any, inbox: Inbox):
        self.runner = runner
        self.inbox = inbox
        self.partial: dict[str, PromptRows] = {}  # by vLLM request id

    def take(self, input_ids: torch.Tensor, positions: torch.Tensor,
             aux: list[torch.Tensor]) -> None:
        """The rows of one forward: ``aux`` is one ``[tokens, H]`` tensor a captured id."""
        batch = self.runner.input_batch
        req_ids = batch.req_ids[:batch.num_reqs]
        starts = self.runner.query_start_loc.np[:len(req_ids) + 1].tolist()
        num_tokens = starts[-1]  # rows past it are padding
        # one copy a step, into token order; each request's rows are views of it
        states = torch.stack([a[:num_tokens] for a in aux], dim=1).to("cpu")
        # a copy even on a CPU: the runner refills its input buffer every step
        token_ids = input_ids[:num_tokens].to("cpu", copy=True)
        first_positions = positions[:num_tokens].to("cpu")[starts[:-1]].tolist() \
            if num_tokens else []
        for req_id, start, end, first in zip(req_ids, starts, starts[1:], first_positions,
                                             strict=False):
            if end > start:
                self._add(req_id, first, states[start:end], token_ids[start:end])
        for req_id in [r for r in self.partial if r not in self.runner.requests]:
            del self.partial[req_id]  # aborted before its prompt was computed

    def _add(self, req_id: str, first: int, states: torch.Tensor,
             token_ids: torch.Tensor) -> None:
        request = self.runner.requests[req_id]
        prompt_len = len(request.prompt_token_ids)
        if first >= prompt_len:
            return  # a generated token's row: not a prompt state
        keep = min(len(states), prompt_len - first)
        name = request_name(request.sampling_params, req_id)
        rows = self.partial.setdefault(req_id, PromptRows())
        try:
            rows.add(first, states[:keep], token_ids[:keep])
        except RuntimeError as exc:
            del self.partial[req_id]
            self.inbox.put(name, f"request {req_id}: {exc}")
            return
        if rows.next_position == prompt_len:
            del self.partial[req_id]
            self.inbox.put(name, rows.whole())


def install(worker: Any, spool_dir: str, capture_ids: list[int]) -> None:
    """Run in the worker (``LLM.collective_rpc``): the target returns the states at
    ``capture_ids`` with every forward, and they go to the inbox open for ``spool_dir``."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    runner = worker.model_runner
    model = runner.get_model()
    if not supports_eagle3(model):
        raise RuntimeError(f"{type(model).__name__} does not return aux hidden states "
                           "(vLLM's EAGLE-3 interface)")
    if getattr(runner, "supports_mm_inputs", False) or getattr(runner, "enable_prompt_embeds",
                                                              False):
        raise RuntimeError("the model may take embeddings instead of token ids: the rows "
                           "could not be checked against the samples")
    inbox = inbox_in_this_process(spool_dir)
    if inbox is None:
        raise RuntimeError("the direct capture needs the engine's worker in the reader's process")
    model.set_aux_hidden_state_layers(tuple(capture_ids))
    runner.use_aux_hidden_state_outputs = True  # execute_model unpacks (hidden, aux)
    capture = DirectCapture(runner, inbox)
    forward = runner._model_forward

    def forward_and_take(*args: Any, **kwargs: Any):
        output = forward(*args, **kwargs)
        _, aux = output
        capture.take(kwargs["input_ids"], kwargs["positions"], aux)
        return output

    runner._model_forward = forward_and_take

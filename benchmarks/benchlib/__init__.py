"""What the benchmarks share, in one importable place instead of a copy in each script.

A benchmark runs as ``python benchmarks/NAME.py`` from the repository root: Python then puts
``benchmarks/`` first on the module path, so ``import benchlib`` needs no path change. A
benchmark never imports another benchmark script; code that two of them need lives here, or
in the draftline library where it is of use beyond the benchmarks.

* ``benchlib.inputs``: the default config, the target (given, or the tests' cached toy), prompts.
* ``benchlib.serving``: a vLLM server of a target with or without a draft; the spec-decode
  counters.
* ``benchlib.vllm_bench``: ``vllm bench serve`` in a worker process of its own.
* ``benchlib.peer``: the peer trainer (speculators) on draftline's stored hidden states.
* ``benchlib.training``: the training step's imports and the draft dimensions of the step
  benchmarks.

Nothing is imported here: each module brings only what it needs (``benchlib.training`` runs
where the pipeline's other dependencies may be missing).
"""

"""The pipeline's stages, in the order they run: ``toy`` (the toy target), ``prompts``,
``profile`` (the concurrency profile), ``generate`` (with ``responses``, the kept answers, and
``generation_report``), ``dataset``, ``vocab``, ``hidden`` (target hidden states), ``train``,
``export``, ``bench`` (the deployment benchmark) and ``bundle`` (with ``modelcard``). Each
Snakemake rule's script calls one of them; each also runs as ``draftline <stage>``."""

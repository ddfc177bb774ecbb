"""The DSpark family (``drafting: dspark``): DFlash's block drafter (``draftline.drafts.dflash``,
read it first) plus a Markov logit bias and a confidence head, served by vLLM's
``Qwen3DSparkForCausalLM`` (``"method": "dspark"``).

Reading order: ``family`` (its facts for the registry, standard library only), ``config``
(``DSparkConfig``), ``model`` (the heads and the draft; its docstring holds the layout),
``train`` (the objective and the training hooks), ``export`` (vLLM's checkpoint), ``serving``
(vLLM's speculative config, and why vLLM's CPU build cannot serve it).
"""

"""draftline: a reproducible pipeline that trains EAGLE-3 draft models for a served target LLM.

The package's folders are its architecture, and imports run one way, down this list:
``cli`` and ``plan`` (entry points), ``stages`` (the pipeline's stages), ``model`` (the draft
model, read top to bottom), ``serving`` (vLLM servers and their clients), ``core``
(foundations). ``tests/test_imports.py`` holds the library free of import circles.
"""

__version__ = "0.1.0"

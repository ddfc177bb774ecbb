"""draftline: a reproducible pipeline that trains speculative-decoding draft models for a served
target LLM.

The package's folders are its architecture, and imports run one way, down this list:
``cli`` and ``plan`` (entry points), ``stages`` (the pipeline's stages), ``drafts`` (the draft
families and the registry every other module asks about them), ``serving`` (vLLM servers and
their clients), ``core`` (foundations). ``tests/test_imports.py`` holds the library free of
import circles.
"""

__version__ = "0.1.0"

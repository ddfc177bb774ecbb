"""draftline: a reproducible pipeline that trains EAGLE-3 draft models for a served target LLM."""

__version__ = "0.1.0"

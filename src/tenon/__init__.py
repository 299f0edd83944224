"""Tenon: serve many LLM agents' sandboxes on a memory-constrained host.

Layers (arrows point down only): cli -> replay -> runtime -> policy|predict -> host|sandbox.
"""

__version__ = "0.1.0"

"""Warnings from libraries that every run raises and that are not selfrl's to fix, silenced in one
place for every entry point (the ``selfrl`` command, the scripts)."""

from __future__ import annotations

import warnings


def silence_library_warnings() -> None:
    """Ignore transformers' ``is_gradient_checkpointing`` FutureWarning (a deprecation inside
    transformers, raised on every model load and update)."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

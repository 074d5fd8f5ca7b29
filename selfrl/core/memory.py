"""Giving freed heap memory back to the operating system after a learner update.

A learner update allocates and frees hundreds of megabytes of tensors (activations, gradients,
optimizer steps, a candidate's state, its validation's key/value caches). glibc's allocator keeps
much of what was freed in its arenas for reuse, fragmented, so a server that updates every few
minutes shows a resident size that climbs for hours though nothing is leaked.
``malloc_trim(0)`` returns the free pages at the top of each arena and the free whole pages
inside them (glibc >= 2.8); it takes milliseconds and changes no live object.

``benchmarks/bench_serve_memory.py`` measures what it saves, per update, beside the bound on
the LoRA states a server keeps (:class:`selfrl.serve.served_version.ServedVersion`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Return the allocator's free memory to the operating system (``malloc_trim(0)``).

    Returns:
        True when glibc released memory, False when it had none to give back or the C library
        has no ``malloc_trim`` (then nothing is done).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False

"""Sampling backends behind one interface (:mod:`selfrl.engines.base`), found by name.

>>> sorted(ENGINES)
['auto', 'reference', 'slots']
"""

from __future__ import annotations

from collections.abc import Callable

from selfrl.engines.base import EngineHealth, Generation, SamplingEngine
from selfrl.engines.slotdriver import DRIVERS  # which thread runs the decoding steps (``driver``)


def _check_driver(driver: str | None) -> None:
    if driver is not None and driver not in DRIVERS:
        raise ValueError(f"driver must be one of {', '.join(DRIVERS)} (or None: the backend's own), got {driver!r}")


def _reference(model, tokenizer, version: int = 0, driver: str | None = None, **cache) -> SamplingEngine:
    """The reference engine (``cache``: the slot engine's cache bounds; this engine keeps no cache
    between calls, so they hold as they are)."""
    from selfrl.engines.reference import Engine

    _check_driver(driver)
    if driver == "thread":  # it samples in the calling thread, always
        raise ValueError("the reference engine samples in the caller's thread; driver 'thread' is not possible")
    return Engine(model, tokenizer, version=version)


def _slots(model, tokenizer, version: int = 0, driver: str | None = None, **cache) -> SamplingEngine:
    from selfrl.engines.slots import SlotEngine

    return SlotEngine(model, tokenizer, version=version, driver="thread" if driver is None else driver, **cache)


def _auto(model, tokenizer, version: int = 0, driver: str | None = None, **cache) -> SamplingEngine:
    """``slots`` for a policy on the CPU (measured faster there, docs/results/benchmarks.md),
    ``reference`` on a GPU (the slot engine keeps its cache on the CPU) and for a model whose
    attention the slot engine's masks do not express (not SDPA or eager, or a sliding window:
    :func:`selfrl.engines.slotattention.slot_attention`)."""
    from selfrl.engines.slotattention import slot_attention

    on_cpu = next(model.parameters()).device.type == "cpu"
    try:
        slots_can = on_cpu and slot_attention(model)[1] is None
    except ValueError:
        slots_can = False
    return (_slots if slots_can else _reference)(model, tokenizer, version=version, driver=driver, **cache)


# name -> factory(model, tokenizer, version) for the in-process backends
ENGINES: dict[str, Callable[..., SamplingEngine]] = {"auto": _auto, "reference": _reference, "slots": _slots}
# selfrl run: auto, i.e. slots on the CPU and the reference on a GPU. On an idle machine
# (2026-12-02, docs/results/benchmarks.md), make demo's session
# took 217 s on slots against 340 s on the reference next to it (407 s for the reference before
# the packed update), the same held-out result, and the label-free preset learned on slots too
# (7 % -> 100 %; it had not in one earlier run, README). --engine reference gives the previous default.
DEFAULT_ENGINE = "auto"
# selfrl serve: auto, i.e. slots on the CPU and the reference on a GPU. Measured on an idle
# machine (benchmarks/bench_serve.py, 2026-12-01): median time to first token with 8 streaming
# clients 0.71 s on slots against 4.35 s on the reference, 1.95 s against 8.04 s with 32,
# tokens/s 1.53x and 0.96x; both honour constrained decoding, cancellation and top logprobs
# (the serve tests run on both). --engine reference gives the previous behaviour.
DEFAULT_SERVE_ENGINE = "auto"


def make_engine(name: str, model, tokenizer, version: int = 0, driver: str | None = None,
                idle_cache_bytes: int | None = None, continuation_bytes: int | None = None) -> SamplingEngine:
    """The in-process backend registered as ``name``, over ``model`` (a peft model shared
    with the learner) with ``version`` in its weights.

    ``driver`` says which thread runs the decoding steps: None, the backend's own choice (the
    slot engine's worker thread, so that a server streams while nobody waits); ``"caller"``,
    the threads that wait for results, so that a process that also trains runs all its torch
    work in one thread (:class:`selfrl.engines.slots.SlotEngine`, ``driver``); ``"thread"``,
    a worker thread (the slot engine only).

    ``idle_cache_bytes`` and ``continuation_bytes`` bound the key/value memory the slot engine keeps
    between requests (:class:`selfrl.engines.slots.SlotEngine`; None: its defaults,
    ``IDLE_CACHE_BYTES`` and ``CONTINUATION_BYTES``); the reference engine keeps none.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), or a ``driver`` the
            backend cannot honour.
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(sorted(ENGINES))}")
    cache = {k: v for k, v in (("idle_cache_bytes", idle_cache_bytes), ("continuation_bytes", continuation_bytes))
             if v is not None}
    return ENGINES[name](model, tokenizer, version=version, driver=driver, **cache)


__all__ = ["DEFAULT_ENGINE", "DEFAULT_SERVE_ENGINE", "ENGINES", "EngineHealth", "Generation", "SamplingEngine", "make_engine"]

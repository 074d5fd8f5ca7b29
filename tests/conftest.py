"""Shared fixtures: the tiny tokenizer and tiny models of :mod:`selfrl.testing`.

The builders live in the package (``selfrl.testing``) because the benchmarks and the
fault suite use them too; the names stay importable from here for the tests.
"""

from __future__ import annotations

import pytest

from selfrl.testing import (  # noqa: F401 (re-exported for the tests)
    _CORPUS,
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    add_lora,
    build_tiny_model,
    build_tiny_tokenizer,
    save_tiny_phi,
)
from serving import SERVE_ENGINES, running_server, serve_config
from smallfs import SmallFs, SmallFsUnavailable


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Session-wide tiny tokenizer (never mutate it; copy first)."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tiny_tokenizer):
    """``make(seed=0, eos_bias=None, lora=False, default_init=False)`` -> a fresh tiny model
    (a PeftModel when ``lora``; see :func:`add_lora` for ``default_init``)."""

    def make(seed: int = 0, eos_bias: float | None = None, lora: bool = False, default_init: bool = False):
        model = build_tiny_model(tiny_tokenizer, seed=seed, eos_bias=eos_bias)
        return add_lora(model, seed=seed + 1, default_init=default_init) if lora else model

    return make


@pytest.fixture
def tiny_model(tiny_model_factory):
    """A fresh plain tiny Llama per test (tests may change its weights)."""
    return tiny_model_factory()


@pytest.fixture
def tiny_peft_model(tiny_model_factory):
    """A fresh LoRA-wrapped tiny Llama per test."""
    return tiny_model_factory(lora=True)


@pytest.fixture(scope="module", params=SERVE_ENGINES)
def server(request, tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    """``(base_url, service)`` of a real server on loopback around a LoRA tiny model (EOS bias
    3.0), one per test module and serve engine. A module may override it (its own ``server``)."""
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    cfg = serve_config(tmp_path_factory.mktemp("serve"), request.param)
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        yield url, service


@pytest.fixture
def client(server):
    """The real ``openai`` client against the module's ``server`` (no API key, no retries)."""
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def short(traj, ctx):
    """Test reward: 1 for an immediate EOS, 0 at 24 completion tokens (the token limit of both
    turns of ``tests/test_loop.py``'s run: ``max_new_tokens`` 12, ``max_turns`` 2)."""
    return 1.0 - traj.num_completion_tokens / 24


@pytest.fixture(scope="module")
def short_reward():
    """:func:`short` registered as the reward ``"short"`` for the test module."""
    from selfrl.envs.rewards import REWARD_FUNCS

    mp = pytest.MonkeyPatch()
    mp.setitem(REWARD_FUNCS, "short", short)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny Phi saved to disk (:func:`save_tiny_phi`), one per test module, loaded as a user's model.
    A module may override it."""
    return save_tiny_phi(tmp_path_factory.mktemp("model"), tiny_tokenizer)


@pytest.fixture
def small_fs(tmp_path):
    """``make(size_kib) -> SmallFs``: a tmpfs of that size under ``tmp_path`` (``tests/smallfs.py``),
    unmounted after the test; the test is skipped, with the reason, where none can be mounted
    (not root, no ``mount``)."""
    made = []

    def make(size_kib: int) -> SmallFs:
        try:
            fs = SmallFs(tmp_path / f"smallfs{len(made)}", size_kib)
        except SmallFsUnavailable as e:
            pytest.skip(f"a small file system is needed to fill the disk: {e}")
        made.append(fs)
        return fs

    yield make
    for fs in made:
        fs.unmount()

"""The swap check (selfrl.safety.swap_check): the logic on hand-made numbers, then for real
over HTTP on loopback against ``selfrl sampler`` with an injected stale adapter and an
injected hang."""

import copy
import math
import threading
import time

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from selfrl.engines.reference import Engine
from selfrl.engines.remote import RemoteEngine
from selfrl.serve.sampler_app import create_sampler_app
from selfrl.safety.swap_check import (SwapCheckConfig, SwapChecker, SwapCheckError, check_swap, probe_ids,
                               tolerance_for)
from selfrl.rl.logprobs import sequence_logprobs
from tests.engine_backends import start_loopback


class Scorer:
    """A backend that answers the probe with fixed numbers (no HTTP)."""

    def __init__(self, logprobs, version, delay_s=0.0):
        self.logprobs, self.version, self.delay_s = logprobs, version, delay_s

    def prompt_logprobs(self, token_ids, timeout_s=None):
        time.sleep(self.delay_s)
        return self.logprobs, self.version


PROBE = [1, 2, 3, 4, 5]
NEW = [-1.0, -2.0, -3.0, -0.5]
OLD = [-1.2, -2.2, -2.8, -0.7]  # mean |NEW - OLD| = 0.2


def test_check_logic_on_hand_made_numbers():
    ok = check_swap(Scorer([x + 1e-4 for x in NEW], 3), NEW, PROBE, 3, 1e-3, 5.0, previous=OLD)
    assert ok.ok and ok.reason == "ok" and ok.mean_abs_diff == pytest.approx(1e-4)
    assert ok.diff_to_previous == pytest.approx((3 * 0.2001 + 0.1999) / 4)
    # 0.05 off on one token of four: mean 0.0125 > 1e-3
    off = check_swap(Scorer([-1.05, -2.0, -3.0, -0.5], 3), NEW, PROBE, 3, 1e-3, 5.0)
    assert not off.ok and off.reason == "mismatch"
    assert off.mean_abs_diff == pytest.approx(0.0125) and off.max_abs_diff == pytest.approx(0.05)
    # within a loose (bf16-like) tolerance of 0.3, yet exactly the old version: stale
    stale = check_swap(Scorer(OLD, 3), NEW, PROBE, 3, 0.3, 5.0, previous=OLD)
    assert not stale.ok and stale.reason == "stale" and stale.diff_to_previous == 0.0
    # versions the probe cannot tell apart (|NEW - OLD| <= tolerance) are not called stale
    assert check_swap(Scorer(NEW, 3), NEW, PROBE, 3, 0.3, 5.0, previous=NEW).ok
    wrong = check_swap(Scorer(NEW, 2), NEW, PROBE, 3, 1e-3, 5.0)
    assert not wrong.ok and wrong.reason == "wrong_version" and "reports version 2" in wrong.detail
    nan = check_swap(Scorer([math.nan] * 4, 3), NEW, PROBE, 3, 1e-3, 5.0)
    assert not nan.ok and nan.reason == "mismatch"
    short = check_swap(Scorer(NEW[:2], 3), NEW, PROBE, 3, 1e-3, 5.0)
    assert not short.ok and short.reason == "error"


def test_deadline_returns_on_time_for_a_backend_that_never_answers():
    t = time.monotonic()
    res = check_swap(Scorer(NEW, 3, delay_s=3), NEW, PROBE, 3, 1e-3, deadline_s=0.5)
    assert time.monotonic() - t < 2.0
    assert not res.ok and res.reason == "timeout" and "within 0.5 s" in res.detail


def test_tolerances_and_probe(tiny_tokenizer):
    assert tolerance_for("float32") < tolerance_for("bfloat16")
    with pytest.raises(ValueError, match="float16"):
        tolerance_for("float16")
    ids = probe_ids(tiny_tokenizer, 48)
    assert len(ids) == 48 and ids == probe_ids(tiny_tokenizer, 48) and len(set(ids)) > 10


def test_checker_from_config(tiny_tokenizer):
    c = SwapChecker.from_config(SwapCheckConfig(probe_tokens=20), tiny_tokenizer, "bfloat16")
    assert len(c.probe) == 20 and c.tolerance == tolerance_for("bfloat16") and c.deadline_s == 30.0
    assert SwapChecker.from_config(SwapCheckConfig(tolerance=0.5), tiny_tokenizer, "float32").tolerance == 0.5
    for bad, match in [(dict(deadline_s=0), "deadline_s"), (dict(tolerance=-1.0), "tolerance"),
                       (dict(probe_tokens=1), "probe_tokens")]:
        with pytest.raises(ValueError, match=match):
            SwapChecker.from_config(SwapCheckConfig(**bad), tiny_tokenizer, "float32")


# ------------------------------------------------------------------ over HTTP on loopback


class StaleEngine(Engine):
    """Injected fault: acknowledges a swap (and reports the new version) but keeps the old weights."""

    def swap(self, state_dict, version):
        self.version = version
        return 0.0


class HangingEngine(Engine):
    """Injected fault: acknowledges a swap, then hangs while 'loading' it (holds the lock) until released."""

    release = threading.Event()

    def swap(self, state_dict, version):
        seconds = super().swap(state_dict, version)
        held = threading.Event()

        def hang():
            with self.lock:
                held.set()
                self.release.wait(60)

        threading.Thread(target=hang, daemon=True).start()
        held.wait(10)
        return seconds


def random_state(model, seed):
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) * 0.3 for k, v in get_peft_model_state_dict(model).items()}


@pytest.fixture
def setup(tiny_tokenizer, tiny_model_factory):
    """``make(engine_cls) -> (learner_model, remote, checker, events)``: the learner's model, and a
    sampler on loopback serving its own copy through ``engine_cls``; version 0 checked already."""

    def make(engine_cls=Engine):
        model = tiny_model_factory(lora=True)
        url = start_loopback(create_sampler_app(engine_cls(copy.deepcopy(model), tiny_tokenizer)))
        remote = RemoteEngine(url, tiny_tokenizer, timeout_s=60)
        checker = SwapChecker(probe_ids(tiny_tokenizer), tolerance_for("float32"), deadline_s=5.0)
        events = []
        checker.require(remote, model, 0, lambda *e: events.append(e))
        assert [e[0] for e in events] == ["swap_check"]
        return model, remote, checker, events

    return make


def test_an_honest_swap_passes(setup):
    model, remote, checker, events = setup()
    v1 = random_state(model, 1)
    set_peft_model_state_dict(model, v1)  # the learner's new weights ...
    remote.swap(v1, 1)  # ... sent to the server
    res = checker.require(remote, model, 1, lambda *e: events.append(e))
    assert res.ok and res.mean_abs_diff < 1e-5 and res.diff_to_previous > 0.01
    assert events[-1][0] == "swap_check" and events[-1][2]["version"] == 1
    assert res.mean_abs_diff == pytest.approx(0.0, abs=1e-5)
    # the probe the learner scores is what the server scores
    assert remote.prompt_logprobs(checker.probe)[0] == pytest.approx(sequence_logprobs(model, checker.probe), abs=1e-5)


def test_an_injected_stale_adapter_stops_promotion(setup):
    model, remote, checker, events = setup(StaleEngine)
    v1 = random_state(model, 1)
    set_peft_model_state_dict(model, v1)
    remote.swap(v1, 1)
    assert remote.health().version == 1  # the server claims the new version: only the numbers tell
    with pytest.raises(SwapCheckError, match=r"swap check failed for version 1 \(mismatch\).*not promoted") as info:
        checker.require(remote, model, 1, lambda *e: events.append(e))
    assert info.value.result.mean_abs_diff > 100 * checker.tolerance
    kind, message, data = events[-1]
    assert kind == "swap_check_failed" and data["reason"] == "mismatch" and "version 1" in message
    # with a tolerance too loose to see the difference, the previous version's numbers still do
    loose = SwapChecker(checker.probe, tolerance=info.value.result.mean_abs_diff * 2, last=checker.last)
    with pytest.raises(SwapCheckError, match="stale"):
        loose.require(remote, model, 1)


def test_an_injected_hang_fails_at_the_deadline(setup):
    model, remote, checker, events = setup(HangingEngine)
    checker.deadline_s = 1.0
    v1 = random_state(model, 1)
    set_peft_model_state_dict(model, v1)
    remote.swap(v1, 1)
    t = time.monotonic()
    try:
        with pytest.raises(SwapCheckError, match="timeout.*within 1 s"):
            checker.require(remote, model, 1, lambda *e: events.append(e))
        assert time.monotonic() - t < 3.0
        assert events[-1][0] == "swap_check_failed" and events[-1][2]["reason"] == "timeout"
    finally:
        HangingEngine.release.set()


def test_an_unreachable_backend_fails_with_the_reason(setup, tiny_tokenizer):
    model, remote, checker, _ = setup()
    remote.base_url = "http://127.0.0.1:9"  # nothing listens there
    res = checker.check(remote, model, 0)
    assert not res.ok and res.reason == "error" and "RemoteBackendError" in res.detail
    assert not remote.health().ok

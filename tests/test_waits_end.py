"""Every wait ends: a failure reaches whoever waits on it, and the component serves the next.

The slot engine's own failures are in ``tests/test_engine_failures.py``. These tests inject a
failure into each other place where a caller waits on another thread, process or future (the
server's batcher, a stream, the pipelined rollout, the browser's driver thread, the sandbox's
child) and check that the waiter gets a clear error within a bound, that nothing is left
holding a slot, a row or a process, and that the next request is served in full. On the code
before these fixes each of them hung (the tests' own bounds turn that into a failure) or leaked.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from selfrl.engines.base import Generation
from selfrl.serve import batcher as batcher_mod
from selfrl.serve.batcher import Batcher, Job

BOUND_S = 10.0  # no waiter below waits longer than this on the fixed code


class ListEngine:
    """A stand-in batch engine: row ``i`` of a call samples ``[prompt[0] + 1, ..., + max_new_tokens]``.

    ``drop``: return one generation fewer than the rows it was given (a backend bug).
    ``die``: raise this (a ``BaseException``) from ``generate``.
    """

    version = 3
    eos_token_ids = [0]

    def __init__(self):
        self.drop, self.die, self.calls = False, None, 0

    def generate(self, prompts, max_new_tokens, temperature=1.0, greedy=False, top_p=1.0, on_step=None, stop=None):
        self.calls += 1
        if self.die is not None:
            raise self.die
        gens = [Generation([p[0] + k for k in range(1, max_new_tokens + 1)], [-0.5] * max_new_tokens, False,
                           self.version) for p in prompts]
        return gens[:-1] if self.drop else gens


def settle(fut: Future, timeout: float = BOUND_S):
    """``fut``'s result (or its exception, returned); fails the test when it never settles."""
    try:
        return fut.result(timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"the future did not settle within {timeout} s: its waiter would hang") from None
    except BaseException as e:
        return e


def test_a_batch_the_engine_answers_short_fails_its_jobs_and_the_next_batch_is_served():
    engine = ListEngine()
    b = Batcher(engine, lambda v, fn: fn(), window_s=0.2)
    engine.drop = True
    first = [b.submit(Job([10], 2, greedy=True)), b.submit(Job([20], 2, greedy=True))]
    errors = [settle(f) for f in first]
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert str(errors[1]) == "the engine returned 1 generation(s) for a batch of 2 rows"
    engine.drop = False
    g = settle(b.submit(Job([30], 3, greedy=True)))
    assert g.token_ids == [31, 32, 33] and g.logprobs == [-0.5] * 3 and g.adapter_version == 3
    assert b.pending == 0 and b.error is None and b.batches == 1 and b.rows == 1
    b.close()


def test_a_job_whose_bookkeeping_raises_fails_alone_and_the_worker_goes_on(monkeypatch):
    real = batcher_mod.cut

    def cut(gen, limit, eos):  # the batcher's own step after the engine call raises for one row
        if gen.token_ids[0] == 21:
            raise ValueError("row 20 cannot be cut")
        return real(gen, limit, eos)

    monkeypatch.setattr(batcher_mod, "cut", cut)
    b = Batcher(ListEngine(), lambda v, fn: fn(), window_s=0.2)
    bad, good = b.submit(Job([20], 2, greedy=True)), b.submit(Job([40], 2, greedy=True))
    e = settle(bad)
    assert isinstance(e, ValueError) and str(e) == "row 20 cannot be cut"
    assert settle(good).token_ids == [41, 42]
    assert settle(b.submit(Job([50], 1, greedy=True))).token_ids == [51]  # the worker is alive
    assert b._thread.is_alive() and b.error is None
    b.close()


class Stop(BaseException):
    """Something that ends a thread (as ``SystemExit`` would), not an ``Exception``."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_worker_that_dies_fails_what_it_held_and_what_was_queued_and_refuses_new_jobs():
    engine = ListEngine()
    gate = threading.Event()
    real = engine.generate

    def generate(*a, **k):
        gate.wait(BOUND_S)  # holds the worker while more jobs queue up behind this batch
        return real(*a, **k)

    engine.generate = generate
    engine.die = Stop("the engine pulled the plug")
    b = Batcher(engine, lambda v, fn: fn(), window_s=0.0)
    held = b.submit(Job([1], 2, greedy=True))
    time.sleep(0.2)
    queued = b.submit(Job([2], 2, temperature=0.7))
    gate.set()
    e = settle(held)  # a waiter is never handed what ends threads: a RuntimeError caused by it
    assert isinstance(e, RuntimeError) and isinstance(e.__cause__, Stop)
    assert str(e) == "the batcher's worker died: Stop: the engine pulled the plug"
    e = settle(queued)
    assert isinstance(e, RuntimeError)
    assert str(e) == "the batcher stopped before this request ran: its worker died: Stop: the engine pulled the plug"
    b._thread.join(BOUND_S)
    with pytest.raises(RuntimeError, match="the batcher takes no more requests: its worker died: Stop"):
        b.submit(Job([3], 1))
    assert b.pending == 0


def test_jobs_submitted_after_close_are_refused_not_queued_forever():
    b = Batcher(ListEngine(), lambda v, fn: fn())
    assert settle(b.submit(Job([5], 1, greedy=True))).token_ids == [6]
    b.close()
    with pytest.raises(RuntimeError, match="the batcher takes no more requests: it was closed"):
        b.submit(Job([6], 1))


# -- the server: a request whose generation fails gets the reason, and its other choices stop -------------

LIMIT = 900  # the tiny model never samples EOS (bias -30): a row runs to its limit unless stopped


@pytest.fixture(scope="module", params=["reference", "slots"])
def server(request, tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    from serving import running_server, serve_config

    model = tiny_model_factory(lora=True, eos_bias=-30.0)
    with running_server(model, tiny_tokenizer, serve_config(tmp_path_factory.mktemp("waits"), request.param),
                        api_key=None) as (url, service):
        yield url, service


def _fail_first_job(monkeypatch, service, after_tokens: int | None) -> list:
    """Make the first job of the next request fail (at once, or from its streaming callback once
    ``after_tokens`` tokens were streamed); returns the request's jobs once made."""
    made: list = []
    real_jobs = service.jobs

    def jobs(p, on_tokens=None):
        out = real_jobs(p, on_tokens)
        if not made:
            made.extend(out)
            if after_tokens is not None:
                inner = out[0].on_tokens

                def on_tokens0(ids, *rest):
                    if len(ids) >= after_tokens:
                        raise RuntimeError("injected engine failure")
                    return inner(ids, *rest)

                out[0].on_tokens = on_tokens0
        return out

    real_submit = service.batcher.submit

    def submit(job):
        if after_tokens is None and made and job is made[0]:
            job.future.set_exception(RuntimeError("injected engine failure"))
            return job.future
        return real_submit(job)

    monkeypatch.setattr(service, "jobs", jobs)
    monkeypatch.setattr(service.batcher, "submit", submit)
    return made


def _others_stopped(jobs: list) -> None:
    """The request's jobs are all settled; those that did not fail were cancelled early."""
    for j in jobs:
        out = settle(j.future, BOUND_S * 3)
        if not isinstance(out, BaseException):
            assert out.cancelled and len(out.token_ids) < LIMIT  # it stopped: nobody decodes for an answered request


def _next_request_is_served(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "again"}],
                                         max_tokens=5)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5


def test_a_failed_generation_is_a_500_with_the_reason_and_the_other_choice_stops(server, monkeypatch):
    import openai

    url, service = server
    made = _fail_first_job(monkeypatch, service, after_tokens=None)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "two please"}],
                                       max_tokens=LIMIT, n=2)
    assert info.value.status_code == 500
    assert info.value.body == {"message": "generation failed: RuntimeError: injected engine failure",
                               "type": "server_error", "param": None, "code": "generation_failed"}
    assert len(made) == 2
    _others_stopped(made)
    monkeypatch.undo()
    _next_request_is_served(url)


def test_a_stream_whose_generation_fails_ends_with_an_error_event_not_a_cut_connection(server, monkeypatch):
    import openai

    url, service = server
    made = _fail_first_job(monkeypatch, service, after_tokens=3)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "stream two"}],
                                            max_tokens=LIMIT, n=2, stream=True)
    chunks = []
    with pytest.raises(openai.APIError) as info:
        for c in stream:
            chunks.append(c)
    assert info.value.message == "generation failed: RuntimeError: injected engine failure"
    assert info.value.body["code"] == "generation_failed" and info.value.body["type"] == "server_error"
    assert chunks and chunks[0].choices[0].delta.role == "assistant"  # it failed mid-stream
    _others_stopped(made)
    monkeypatch.undo()
    _next_request_is_served(url)


# -- the pipelined rollout: a failed row stops its siblings and closes the environments ---------------------


class ClosingEnv:
    """An environment with no tools that records whether it was closed."""

    tools: list = []
    demonstration = None

    def __init__(self):
        self.closed = False

    def is_completed(self) -> bool:
        return False

    def state(self) -> dict:
        return {}

    def close(self) -> None:
        self.closed = True


def test_a_rollout_whose_row_fails_cancels_the_rows_still_decoding_and_closes_its_envs(tiny_tokenizer,
                                                                                      tiny_model_factory):
    from selfrl.config import RolloutConfig
    from selfrl.engines.slots import SlotEngine
    from selfrl.rollout.agent import rollout
    from selfrl.core.tasks import Task

    engine = SlotEngine(tiny_model_factory(eos_bias=-30.0), tiny_tokenizer)  # no EOS: rows run to their limit
    futures: list[Future] = []
    real = engine.submit

    def submit(*a, cancel=None, **k):
        if not futures:  # the first row fails at once (as a failed prefill would)
            f = Future()
            f.set_exception(RuntimeError("injected row failure"))
        else:
            f = real(*a, cancel=cancel, **k)
        futures.append(f)
        return f

    engine.submit = submit
    envs: list[ClosingEnv] = []

    def make_env(task):
        envs.append(ClosingEnv())
        return envs[-1]

    tasks = [Task.make("test", f"What is {k}+{k}?", str(2 * k)) for k in range(3)]
    with pytest.raises(RuntimeError, match="injected row failure"):
        rollout(engine, tasks, ["a", "b", "c"], [], RolloutConfig(max_new_tokens=LIMIT, max_turns=1),
                env_factory=make_env)
    assert len(futures) == 3 and [e.closed for e in envs] == [True, True, True]
    for f in futures[1:]:  # the others were cancelled, not left decoding to 900 tokens for nobody
        g = settle(f)
        assert g.cancelled and len(g.token_ids) < LIMIT
    deadline = time.monotonic() + BOUND_S
    while engine.lock.in_flight:  # their version-gate tickets are back
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.submit = real
    g = settle(engine.submit([1, 2, 3], 4, greedy=True))  # and the engine serves the next one in full
    assert len(g.token_ids) == 4 and not g.cancelled
    engine.close()


# -- the browser's driver thread: a call stuck in Chromium ends with a TimeoutError, and Chromium is killed ---


def _in_thread(fn, timeout: float = BOUND_S):
    """``fn()`` run in a thread: its result or exception; fails the test when it is still running after
    ``timeout`` s (on the old code the call waited forever)."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:
            box["out"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the call did not return within {timeout} s"
    return box["out"]


def test_a_stuck_driver_call_and_the_calls_behind_it_time_out_and_the_driver_then_serves(monkeypatch):
    from selfrl.envs import web_browser

    monkeypatch.setattr(web_browser, "CALL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(web_browser, "POLL_S", 0.05)
    killed: list[int] = []
    monkeypatch.setattr(web_browser, "_chromium_pids", lambda: killed.append(1) or [])
    driver = web_browser._Driver()
    release, ran = threading.Event(), []
    first = driver.submit(lambda: None)  # starts the thread
    first.result(BOUND_S)

    def stuck():  # a call that hangs (as page.evaluate in a hung Chromium)
        release.wait(60)
        return "late"

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("stuck", _in_thread(lambda: driver.run(stuck))), daemon=True)
    t.start()
    time.sleep(0.2)
    behind = _in_thread(lambda: driver.run(lambda: ran.append(1)))  # queued behind the stuck call
    assert isinstance(behind, TimeoutError)
    assert str(behind) == ("the browser did not answer: one call has run for over 1 s (an earlier one); "
                           "Chromium was killed")
    t.join(BOUND_S)
    assert isinstance(out["stuck"], TimeoutError) and "(this one)" in str(out["stuck"])
    assert killed == [1]  # once for the one stuck call, not once per waiter
    release.set()
    assert _in_thread(lambda: driver.run(lambda: 7)) == 7  # the thread is free again and serves the next call
    assert ran == []  # the call that timed out in the queue never ran later


def test_a_page_that_never_answers_costs_one_timeout_and_the_next_episode_gets_a_new_chromium(monkeypatch):
    from selfrl.envs import web_browser

    try:
        web_browser.check_available()
    except ValueError as e:
        pytest.skip(f"no real browser here: {e}")
    monkeypatch.setattr(web_browser, "CALL_TIMEOUT_S", 4.0)
    b = web_browser.PlaywrightBrowser()
    try:
        assert b.goto("/cart").startswith("page: /cart")
        before = set(web_browser._chromium_pids())
        assert before
        e = _in_thread(lambda: b._do("spin", lambda p: p.evaluate("while (true) {}")), timeout=60)
        assert isinstance(e, TimeoutError) and "(this one); Chromium was killed" in str(e)
        c = web_browser.PlaywrightBrowser()
        try:
            assert _in_thread(lambda: c.goto("/cart"), timeout=90).startswith("page: /cart")
            assert set(web_browser._chromium_pids()).isdisjoint(before)  # a new Chromium; the hung one is gone
        finally:
            c.close()
    finally:
        b.close()
    assert web_browser._DRIVER.open == 0


# -- the sandbox: a run whose collection fails on our side is killed, not left running ----------------------


@pytest.mark.parametrize("isolation", ["bwrap", "rlimit"])
def test_a_sandboxed_run_is_killed_when_collecting_its_output_fails(isolation, monkeypatch):
    import os
    import shutil

    from selfrl.envs.sandbox import Limits, Sandbox, bwrap_problem

    if isolation == "bwrap" and (shutil.which("bwrap") is None or bwrap_problem()):
        pytest.skip("no usable bubblewrap here")
    if isolation == "rlimit" and os.geteuid() != 0:
        pytest.skip("the rlimit fallback's fresh uid needs root")
    box = Sandbox(Limits(wall_seconds=60), isolation=isolation)
    pids: list[int] = []

    def communicate(self, proc, data, deadline):  # reading its output fails (as an interrupt would)
        pids.append(proc.pid)
        raise RuntimeError("the reader failed")

    monkeypatch.setattr(Sandbox, "_communicate", communicate)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the reader failed"):
        box.run(["sleep", "30"])
    assert time.monotonic() - t0 < BOUND_S
    [pid] = pids
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped: no sleep left running for 30 s
    monkeypatch.undo()
    out = box.run_python("print(6 * 7)")  # the sandbox runs the next one in full
    assert out.stdout == "42\n" and out.exit_code == 0 and not out.timed_out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_server_whose_batcher_died_answers_500_with_the_reason_streamed_or_not(tiny_tokenizer, tiny_model_factory,
                                                                                 tmp_path):
    import openai
    from serving import running_server, serve_config

    with running_server(tiny_model_factory(lora=True), tiny_tokenizer, serve_config(tmp_path, "slots"),
                        api_key=None) as (url, service):
        def die():
            raise Stop("out of the blue")

        service.batcher._hand_over = lambda job: die()  # the worker dies at the next request it takes
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        for stream in (False, True, False):
            with pytest.raises(openai.InternalServerError) as info:
                out = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, stream=stream)
                list(out) if stream else None
            assert info.value.body["code"] == "generation_failed"
            assert info.value.body["message"].startswith("generation failed: ")
            assert "Stop: out of the blue" in info.value.body["message"]
        assert service.engine.lock.in_flight == 0

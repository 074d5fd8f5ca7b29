"""Threads that run torch end before the interpreter finalises (selfrl.core.threads_at_exit): a daemon
thread still inside a torch operator at exit aborts the process with status -6."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from selfrl.core import threads_at_exit
from selfrl.engines import make_engine
from selfrl.engines.base import Generation

PROMPT = [5, 6, 7, 8]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _exit_of(tmp_path, source: str) -> subprocess.CompletedProcess:
    """Run ``source`` as a script in a process of its own, with this checkout's selfrl."""
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent(source))
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})


def test_a_slot_engines_worker_has_ended_when_the_exit_handlers_are_done(tmp_path):
    """The handler registered first runs last: it sees the worker the exit left behind."""
    out = _exit_of(tmp_path, """
        import atexit
        seen = {}
        atexit.register(lambda: print("worker alive at the end of exit:", seen["engine"]._worker.is_alive()))
        from selfrl.testing import build_tiny_tokenizer, build_tiny_model
        from selfrl.engines import make_engine
        tok = build_tiny_tokenizer()
        seen["engine"] = make_engine("slots", build_tiny_model(tok), tok)
        seen["engine"].generate([[5, 6, 7, 8]] * 4, max_new_tokens=4)
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "worker alive at the end of exit: False" in out.stdout


def test_a_batch_sampled_in_a_thread_ends_once_its_engine_closes(tiny_model, tiny_tokenizer):
    """A caller-driven engine (selfrl run's) stepped by a background thread: closing it at exit
    fails the thread's generation between steps, and the thread is joined."""
    engine = make_engine("slots", tiny_model, tiny_tokenizer, driver="caller")
    started, box = threading.Event(), {}

    def sample():
        try:
            engine.generate([PROMPT] * 2, max_new_tokens=10_000, on_step=lambda *a, **k: started.set())
        except RuntimeError as e:
            box["error"] = str(e)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    threads_at_exit.join_at_exit(thread)
    assert started.wait(60)
    threads_at_exit.stop_all(join_timeout_s=60)
    assert not thread.is_alive()
    assert box["error"] == "the slot engine is closed"


def test_the_served_learner_is_stopped_and_joined_at_exit(tiny_tokenizer, tiny_model_factory, tmp_path):
    """The served learner trains in a daemon thread until it is told to stop: one left running at
    exit (a graceful stop whose wait for the update ran out, a server never closed) was still
    inside an update's torch operators when the interpreter finalised."""
    import copy
    import time

    from selfrl.serve.service import Service, start_learning
    from serving import tiny_serve_config

    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run", poll_s=0.01),
                      learner_model=copy.deepcopy(model))
    try:
        learner, updating = service.learner, threading.Event()

        def tick():  # an update of 0.2 s, again and again: the learner never runs out of work
            updating.set()
            time.sleep(0.2)
            return True

        learner.tick = tick
        start_learning(service)
        assert updating.wait(120)
        threads_at_exit.stop_all(join_timeout_s=60)
        assert not learner.is_alive()
        assert learner.error is None  # it stopped as asked, not on a failure
    finally:
        service.close()


def _registered(name: str) -> list[threading.Thread]:
    """The live threads called ``name`` that the exit will join."""
    return [t for t in list(threads_at_exit._threads) if t.name == name and t.is_alive()]


def test_the_joins_at_exit_share_one_bound_and_name_the_threads_left():
    """Four threads that never end (a swap hung on its sampler): the exit waits once, not four times."""
    release = threading.Event()
    hung = [threading.Thread(target=release.wait, name=f"hung-{i}", daemon=True) for i in range(4)]
    for t in hung:
        threads_at_exit.join_at_exit(t)
        t.start()
    said: list[str] = []
    try:
        t0 = time.monotonic()
        threads_at_exit.stop_all(join_timeout_s=0.5, log=said.append)
        waited = time.monotonic() - t0
    finally:
        release.set()
    assert 0.45 <= waited < 1.5  # one bound of 0.5 s; each thread given its own was 2 s
    assert sorted(m for m in said if "hung-" in m) == [
        f"thread hung-{i} still running 0.5 s into the exit; left" for i in range(4)]


class SlowEngine:
    """A batch engine (no ``submit``) whose every call takes ``delay_s``."""

    version, eos_token_ids = 0, [2]

    def __init__(self, delay_s: float):
        self.delay_s, self.calls, self.started = delay_s, 0, threading.Event()

    def generate(self, prompts, max_new_tokens, temperature=1.0, **kwargs):
        self.calls += 1
        self.started.set()
        time.sleep(self.delay_s)  # the engine call: torch operators in a real engine
        return [Generation([9] * max_new_tokens, [-1.0] * max_new_tokens, False, 0) for _ in prompts]


def test_a_batchers_worker_ends_after_its_batch_and_the_queued_jobs_fail_at_exit():
    from selfrl.serve.batcher import Batcher, Job

    engine = SlowEngine(delay_s=0.5)
    batcher = Batcher(engine, run_on_version=None)
    running = batcher.submit(Job(PROMPT, 3))
    assert engine.started.wait(30)
    queued = batcher.submit(Job(PROMPT, 3, temperature=0.5))
    threads_at_exit.stop_all(join_timeout_s=30)
    assert not batcher._thread.is_alive()
    assert running.result(0).token_ids == [9, 9, 9]  # the batch in progress ran to its end
    assert engine.calls == 1  # and no other started
    with pytest.raises(RuntimeError, match="stopped before this request ran: the process is exiting"):
        queued.result(0)
    with pytest.raises(RuntimeError, match="takes no more requests: the process is exiting"):
        batcher.submit(Job(PROMPT, 3))


def test_a_batchers_batch_in_progress_ends_before_the_process_does(tmp_path):
    """At a real exit: the worker was left inside its engine call (torch) when the interpreter finalised."""
    out = _exit_of(tmp_path, """
        import atexit, threading, time
        seen = {}
        atexit.register(lambda: print("alive", seen["batcher"]._thread.is_alive(), "calls", seen["engine"].calls,
                                       "queued", seen["queued"].exception(0)))
        from selfrl.engines.base import Generation
        from selfrl.serve.batcher import Batcher, Job

        class Engine:
            version, eos_token_ids, calls, started = 0, [2], 0, threading.Event()
            def generate(self, prompts, max_new_tokens, temperature=1.0, **kwargs):
                self.calls += 1
                self.started.set()
                time.sleep(1.0)
                print("batch done", flush=True)
                return [Generation([9], [-1.0], False, 0) for _ in prompts]

        seen["engine"] = Engine()
        seen["batcher"] = Batcher(seen["engine"], run_on_version=None)
        seen["batcher"].submit(Job([5, 6], 1))
        seen["engine"].started.wait(30)
        seen["queued"] = seen["batcher"].submit(Job([5, 6], 1, temperature=0.5))
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "batch done", "alive False calls 1 queued the batcher stopped before this request ran: the process is exiting"]


class SlowSampler:
    """An in-process sampler whose swap and probe scoring take ``delay_s`` (past the check's deadline)."""

    def __init__(self, delay_s: float):
        self.delay_s, self.version = delay_s, 0

    def swap(self, adapter, version):
        time.sleep(self.delay_s)
        self.version = version

    def prompt_logprobs(self, token_ids, timeout_s=None):
        time.sleep(self.delay_s)
        return [-1.0] * (len(token_ids) - 1), self.version


def test_a_swap_and_a_swap_check_past_their_deadline_are_joined_at_exit():
    from selfrl.safety.swap_check import check_swap, swap_within

    sampler = SlowSampler(delay_s=0.8)
    assert swap_within(sampler, {}, 7, 0.05, 1e-3).reason == "timeout"
    check = check_swap(sampler, [-1.0] * 3, PROMPT, 7, 1e-3, deadline_s=0.05)
    assert check.reason == "timeout"
    [swap] = _registered("sampler-swap-v7")
    [probe] = _registered("swap-check-v7")
    threads_at_exit.stop_all(join_timeout_s=30)
    assert not swap.is_alive() and not probe.is_alive()
    assert sampler.version == 7  # the swap ran to its end before the exit went on


def test_a_hung_swap_delays_the_exit_by_the_bound_only(tmp_path):
    """A swap that ends late is waited for; one that never ends is left when the bound is up."""
    out = _exit_of(tmp_path, """
        import atexit, threading, time
        seen = {}
        atexit.register(lambda: print(f"exit took {time.monotonic() - seen['t']:.1f} s"))
        from selfrl.core import threads_at_exit
        from selfrl.safety.swap_check import swap_within

        class Sampler:
            version = 0
            def __init__(self, delay_s):
                self.delay_s = delay_s
            def swap(self, adapter, version):
                threading.Event().wait(self.delay_s)  # None: forever
                print("swapped", version, flush=True)

        threads_at_exit.JOIN_TIMEOUT_S = 3.0
        print(swap_within(Sampler(1.0), {}, 3, 0.05, 1e-3).reason, flush=True)
        print(swap_within(Sampler(None), {}, 4, 0.05, 1e-3).reason, flush=True)
        seen["t"] = time.monotonic()
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    timeout, timeout2, swapped, took = out.stdout.splitlines()
    assert (timeout, timeout2, swapped) == ("timeout", "timeout", "swapped 3")
    assert 2.9 <= float(took.split()[2]) < 6.0  # the bound of 3 s, once


def test_a_cut_off_turn_is_recorded_before_the_process_ends(monkeypatch):
    """The recording of a cut-off turn writes the store from a daemon thread of its own."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from selfrl.serve import disconnect

    done: list[str] = []

    def finish(prepared, gens, seconds):
        time.sleep(0.5)  # the store's writes
        done.append(f"finished {len(gens)}")

    monkeypatch.setattr(disconnect.records, "mark_cut_off",
                        lambda store, response_id, reason: done.append(f"marked {response_id}: {reason}"))
    service = SimpleNamespace(finish=finish, store=SimpleNamespace(lock=threading.Lock()),
                              event=lambda kind, message: done.append(kind))
    prepared = SimpleNamespace(req=SimpleNamespace(record=True), response_id="resp-1")
    job = SimpleNamespace(cancel=threading.Event(), future=Future())
    job.future.set_result(Generation([9, 9], [-1.0, -1.0], False, 0))
    disconnect.cut_off(service, prepared, [job], time.perf_counter())
    [thread] = _registered("selfrl-cut-off")
    threads_at_exit.stop_all(join_timeout_s=30)
    assert not thread.is_alive()
    assert done == ["finished 1", "marked resp-1: client disconnected", "disconnect"]

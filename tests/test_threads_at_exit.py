"""Threads that run torch end before the interpreter finalises (selfrl.core.threads_at_exit): a daemon
thread still inside a torch operator at exit aborts the process with status -6."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from selfrl.core import threads_at_exit
from selfrl.engines import make_engine

PROMPT = [5, 6, 7, 8]


def test_a_slot_engines_worker_has_ended_when_the_exit_handlers_are_done(tmp_path):
    """The handler registered first runs last: it sees the worker the exit left behind."""
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import atexit
        seen = {}
        atexit.register(lambda: print("worker alive at the end of exit:", seen["engine"]._worker.is_alive()))
        from selfrl.testing import build_tiny_tokenizer, build_tiny_model
        from selfrl.engines import make_engine
        tok = build_tiny_tokenizer()
        seen["engine"] = make_engine("slots", build_tiny_model(tok), tok)
        seen["engine"].generate([[5, 6, 7, 8]] * 4, max_new_tokens=4)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
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

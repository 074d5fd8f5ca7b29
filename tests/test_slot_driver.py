"""The slot engine's ``driver="caller"``: no worker thread, the waiting threads run the steps.

``selfrl run`` uses it so that all its torch work runs in one thread (one OpenMP team). The
conformance suite runs on it as the ``slots-caller`` backend (tests/engine_backends.py);
these tests cover what is particular to it: which thread steps, progress for every way of
waiting, several waiting threads, swap and close with rows nobody waits for.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ALL_COMPLETED

import pytest
import torch

from selfrl.engines import make_engine
from selfrl.engines.slots import SlotEngine
from tests.test_engine_conformance import assert_matches_model
from tests.test_slot_engine import prompts_with_system

QUESTIONS = ["Hi", "What is 17+25?", "Add 1, 2, 3 and 4."]


def slot_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "selfrl-slot-engine"]


def test_caller_driver_has_no_worker_and_steps_in_the_waiting_thread(tiny_tokenizer, tiny_model_factory):
    before = len(slot_threads())
    model = tiny_model_factory(eos_bias=2.5, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, max_slots=2, driver="caller")
    assert len(slot_threads()) == before  # no thread of its own
    stepped_in: set[int] = set()
    prompts = prompts_with_system(tiny_tokenizer, QUESTIONS) * 2
    torch.manual_seed(3)
    gens = engine.generate(prompts, max_new_tokens=8, temperature=0.8,
                           on_step=lambda ids: stepped_in.add(threading.get_ident()))
    assert stepped_in == {threading.get_ident()}
    assert_matches_model(gens, prompts, model, 0.8, tiny_tokenizer.eos_token_id, 8)
    assert engine.rows_done == 6 and engine.health().ok
    engine.close()


def test_caller_and_thread_drivers_sample_the_same_rows(tiny_tokenizer, tiny_model_factory):
    # each row samples from its own seeded generator: who steps does not change what is sampled
    prompts = prompts_with_system(tiny_tokenizer, QUESTIONS)
    out = {}
    for driver in ("thread", "caller"):
        engine = SlotEngine(tiny_model_factory(eos_bias=1.0, lora=True), tiny_tokenizer, driver=driver)
        futures = [engine.submit(p, 12, temperature=0.9, seed=100 + i) for i, p in enumerate(prompts)]
        out[driver] = [(g.token_ids, g.logprobs) for g in (f.result(timeout=60) for f in futures)]
        engine.close()
    assert out["caller"] == out["thread"]
    assert any(len(ids) > 1 for ids, _ in out["caller"])


def test_every_way_of_waiting_makes_progress(tiny_tokenizer, tiny_model_factory):
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver="caller")
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    a = engine.submit(prompt, 3, greedy=True)
    assert engine.steps == 0 and not a.done()  # nothing steps until someone waits
    assert len(a.result(timeout=60).token_ids) == 3  # result() steps
    b = engine.submit(prompt, 4, greedy=True)
    assert b.exception(timeout=60) is None and len(b.result().token_ids) == 4  # exception() steps
    c, d = engine.submit(prompt, 2, greedy=True), engine.submit(prompt, 6, greedy=True)
    done, not_done = engine.wait([c, d])  # FIRST_COMPLETED: returns when the 2-token row ends
    assert done == {c} and not_done == {d} and len(c.result().token_ids) == 2
    done, not_done = engine.wait([d], return_when=ALL_COMPLETED)
    assert done == {d} and not not_done and d.result().token_ids[:2] == c.result().token_ids
    e = engine.submit(prompt, 50, greedy=True)
    done, not_done = engine.wait([e], timeout=0)  # a timeout is honoured: nothing finished
    assert not done and not_done == {e} and not e.done()
    with pytest.raises(ValueError, match="return_when"):
        engine.wait([e], return_when="FIRST_EXCEPTION")
    assert len(e.result(timeout=60).token_ids) == 50
    engine.close()


def test_several_waiting_threads_share_the_steps(tiny_tokenizer, tiny_model_factory):
    # two threads generate at once: one steps for both (rows of both in the same batch), and the
    # other takes over when the first one's rows are done; each gets exactly what it asked for
    model = tiny_model_factory(eos_bias=-50.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    prompts = prompts_with_system(tiny_tokenizer, QUESTIONS)
    results, errors = {}, []

    def call(name: str, limit: int) -> None:
        try:
            results[name] = engine.generate(prompts, max_new_tokens=limit, greedy=True)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(n, k)) for n, k in (("short", 3), ("long", 40))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [len(g.token_ids) for g in results["short"]] == [3, 3, 3]
    assert [len(g.token_ids) for g in results["long"]] == [40, 40, 40]
    assert [g.token_ids for g in results["short"]] == [g.token_ids[:3] for g in results["long"]]  # greedy
    assert engine.steps < 40 + 3 + 5  # the short rows rode the long rows' steps
    engine.close()


def test_swap_finishes_rows_nobody_waits_for_then_swaps(tiny_tokenizer, tiny_model_factory):
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver="caller")
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    pending = engine.submit(prompt, 5, greedy=True)  # submitted, never waited on
    state = {k: v + 0.01 for k, v in engine.lora_parameters().items()}
    engine.swap(state, 7)  # would wait forever for the row's version ticket if it did not step
    assert pending.done() and pending.result().adapter_version == 0 and len(pending.result().token_ids) == 5
    assert engine.submit(prompt, 1, greedy=True).result(timeout=60).adapter_version == 7
    engine.close()


def test_close_fails_rows_nobody_waits_for(tiny_tokenizer, tiny_model_factory):
    engine = SlotEngine(tiny_model_factory(lora=True), tiny_tokenizer, driver="caller")
    pending = engine.submit(prompts_with_system(tiny_tokenizer, ["Hi"])[0], 5)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        pending.result(timeout=5)
    assert not engine.health().ok
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1, 2, 3], 2)


def test_an_interrupt_while_stepping_fails_the_rows_and_leaves_the_engine_usable(tiny_tokenizer, tiny_model_factory):
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver="caller")
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]

    def interrupt(ids):
        if ids.shape[1] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate([prompt, prompt], 10, greedy=True, on_step=interrupt)
    assert not engine._rows and not engine._queue  # every row in flight failed and left
    assert len(engine.generate([prompt], 4, greedy=True)[0].token_ids) == 4  # and it samples again
    engine.close()


def test_driver_choice_is_honoured_or_refused(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True)
    assert make_engine("slots", model, tiny_tokenizer, driver="caller").driver == "caller"
    assert make_engine("slots", model, tiny_tokenizer).driver == "thread"  # a server's default
    with pytest.raises(ValueError, match="caller's thread"):
        make_engine("reference", model, tiny_tokenizer, driver="thread")
    with pytest.raises(ValueError, match="driver must be one of thread, caller"):
        SlotEngine(model, tiny_tokenizer, driver="fiber")


# ---------------------------------------------------------------- found by a fresh user trying to break it


def test_an_interrupt_during_a_prefill_gives_every_ticket_back(tiny_tokenizer, tiny_model_factory):
    # the rows being admitted are neither queued nor active while prefilled; a Ctrl-C there left
    # their version tickets out, and selfrl run's finish() then waited in swap() forever
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver="caller")
    fired = []

    def interrupt_prefill(module, args, kwargs):
        if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] > 1 and not fired:
            fired.append(1)
            raise KeyboardInterrupt

    hook = engine.sampling_model.register_forward_pre_hook(interrupt_prefill, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts_with_system(tiny_tokenizer, QUESTIONS), 5, greedy=True)
    hook.remove()
    assert fired and engine.lock.in_flight == 0
    swapped = threading.Thread(target=engine.swap, args=(engine.lora_parameters(), 1), daemon=True)
    swapped.start()
    swapped.join(timeout=30)
    assert not swapped.is_alive() and engine.version == 1
    engine.close()


@pytest.mark.parametrize("driver", ["thread", "caller"])
def test_close_while_another_thread_generates_says_closed(tiny_tokenizer, tiny_model_factory, driver):
    for _ in range(5):  # the race was lost most of the time (an empty TimeoutError instead)
        engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver=driver)
        started, out = threading.Event(), {}

        def slow(ids):
            started.set()
            time.sleep(0.01)

        def call():
            try:
                engine.generate(prompts_with_system(tiny_tokenizer, QUESTIONS), 200, greedy=True, on_step=slow)
            except Exception as e:
                out["error"] = e

        t = threading.Thread(target=call)
        t.start()
        assert started.wait(30)
        engine.close()
        t.join(timeout=30)
        assert isinstance(out.get("error"), RuntimeError) and "closed" in str(out["error"])


@pytest.mark.parametrize("driver", ["thread", "caller"])
def test_a_swap_that_waits_finishes_rows_submitted_meanwhile(tiny_tokenizer, tiny_model_factory, monkeypatch, driver):
    # a row submitted while a swap is about to wait holds a ticket; its thread then submits again
    # (as the pipelined rollout does) and waits behind the swap: the swap must step that row itself
    from selfrl.engines.versiongate import VersionGate

    late = VersionGate.acquire_exclusive

    def acquire_late(self, *args):
        time.sleep(0.2)  # the window a preemption opens between deciding to swap and waiting
        return late(self, *args)

    monkeypatch.setattr(VersionGate, "acquire_exclusive", acquire_late)
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver=driver)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    out = {}

    def user():
        time.sleep(0.1)
        first = engine.submit(prompt, 3, greedy=True)
        time.sleep(0.3)  # the swap waits now, for first's ticket
        second = engine.submit(prompt, 3, greedy=True)  # waits behind the swap
        out["versions"] = sorted(f.result(timeout=30).adapter_version for f in (first, second))

    threads = [threading.Thread(target=user, daemon=True),
               threading.Thread(target=engine.swap, args=(engine.lora_parameters(), 1), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and out["versions"] == [0, 1]
    engine.close()


def test_a_future_cancelled_by_its_owner_does_not_break_close(tiny_tokenizer, tiny_model_factory):
    # Future.cancel() on a queued row made close() raise InvalidStateError, leaving the next row
    # unsettled and its ticket out (with a worker thread, the worker died of it)
    engine = SlotEngine(tiny_model_factory(lora=True), tiny_tokenizer, driver="caller", max_slots=1)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    a, b = engine.submit(prompt, 3, greedy=True), engine.submit(prompt, 3, greedy=True)
    assert a.cancel()  # queued: nobody steps a caller-driven engine until someone waits
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.result(timeout=5)
    assert engine.lock.in_flight == 0


def test_tickets_of_a_batch_are_taken_at_once():
    from selfrl.engines.versiongate import VersionGate

    gate = VersionGate()
    gate.acquire_shared(3)
    assert gate.in_flight == 3
    for _ in range(3):
        gate.release_shared()
    with gate:
        assert gate.in_flight == 0


@pytest.mark.parametrize("driver", ["thread", "caller"])
def test_a_callback_cannot_wait_for_its_own_engine(tiny_tokenizer, tiny_model_factory, driver):
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver=driver)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]

    def nested(ids):
        engine.generate([prompt], 2)  # would wait for the step it runs in

    with pytest.raises(RuntimeError, match="callback .* cannot wait for the same engine"):
        engine.submit(prompt, 4, on_tokens=nested).result(timeout=30)
    assert len(engine.generate([prompt], 3, greedy=True)[0].token_ids) == 3  # the engine goes on
    engine.close()


def test_wait_honours_its_timeout_for_futures_of_others(tiny_tokenizer, tiny_model_factory):
    from concurrent.futures import Future

    engine = SlotEngine(tiny_model_factory(lora=True), tiny_tokenizer, driver="caller")
    t = time.monotonic()
    done, not_done = engine.wait([Future()], timeout=0.3)
    assert not done and len(not_done) == 1 and time.monotonic() - t >= 0.3
    engine.close()


@pytest.mark.parametrize("bad", ["", 0, "fiber"])
def test_make_engine_refuses_a_driver_it_does_not_know(tiny_tokenizer, tiny_model_factory, bad):
    model = tiny_model_factory(lora=True)
    for name in ("slots", "reference"):
        with pytest.raises(ValueError, match="driver must be one of thread, caller"):
            make_engine(name, model, tiny_tokenizer, driver=bad)


@pytest.mark.parametrize("driver", ["thread", "caller"])
def test_a_callback_that_submits_while_a_swap_waits_does_not_hang(tiny_tokenizer, tiny_model_factory, driver):
    # a streaming callback submits a follow-up while a swap waits for the callback's own row: queued
    # behind the swap it waited for a swap that waited for it (a hang with no error); now the
    # follow-up runs on the version in place, then the swap goes through
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer, driver=driver)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    follow: list = []

    def on_tokens(ids):
        if len(ids) == 3 and not follow:
            deadline = time.monotonic() + 10
            while not engine.lock._waiting and time.monotonic() < deadline:  # the swap waits for this row
                time.sleep(0.01)
            follow.append(engine.submit(prompt, 4, greedy=True))

    first = engine.submit(prompt, 8, greedy=True, on_tokens=on_tokens)
    swapper = threading.Thread(target=engine.swap, args=(engine.lora_parameters(), 1), daemon=True)
    if driver == "caller":  # the swap steps the rows in flight itself
        swapper.start()
    else:
        while engine.steps < 1:
            time.sleep(0.01)
        swapper.start()
    swapper.join(timeout=30)
    assert not swapper.is_alive() and engine.version == 1
    assert first.result(timeout=10).adapter_version == 0 and len(first.result().token_ids) == 8
    assert follow and follow[0].result(timeout=10).adapter_version == 0  # it ran before the swap
    assert engine.submit(prompt, 2, greedy=True).result(timeout=30).adapter_version == 1
    engine.close()


def test_waiting_from_a_callback_raises_on_the_worker_too(tiny_tokenizer, tiny_model_factory):
    # a callback runs on the worker: waiting there for the engine waited for itself, for good
    engine = SlotEngine(tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    other = engine.submit(prompt, 30, greedy=True)
    seen: list = []

    def on_tokens(ids):
        if len(ids) == 2:
            for wait in (lambda: engine.wait([other], timeout=5), lambda: other.result(timeout=5),
                         lambda: other.exception(timeout=5)):
                try:
                    wait()
                except RuntimeError as e:
                    seen.append(str(e))

    first = engine.submit(prompt, 4, greedy=True, on_tokens=on_tokens)
    assert len(first.result(timeout=30).token_ids) == 4 and len(other.result(timeout=30).token_ids) == 30
    assert len(seen) == 3 and all("cannot wait for the same engine" in m for m in seen)
    engine.close()

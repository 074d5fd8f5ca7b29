"""A failure reaches the request it belongs to, at once, and nothing waits forever.

A request whose future is never settled hangs its caller, and, because it holds a ticket of
the version gate, every later swap of that engine too: the "weight sync hangs with no error"
that users of the field report. These tests inject each kind of failure into the slot engine
(a bad prompt, a failed prefill, a streaming callback or ``on_step`` hook that raises, a
worker thread that dies) and check that the failing requests raise, the others finish, no
ticket is left behind and a swap still goes through.
"""

from __future__ import annotations

import threading

import pytest
import torch

from selfrl.engines.reference import Engine
from selfrl.engines.slots import SlotEngine
from tests.held_row import HeldRow
from tests.test_slot_engine import prompts_with_system


def swap_finishes(engine, model, version: int, timeout_s: float = 60.0) -> bool:
    """Whether a swap to ``version`` (random LoRA weights) completes within ``timeout_s`` seconds."""
    from peft import get_peft_model_state_dict

    state = {k: torch.randn_like(v) for k, v in get_peft_model_state_dict(model).items()}
    t = threading.Thread(target=engine.swap, args=(state, version), daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive() and engine.version == version


@pytest.mark.parametrize("make", [Engine, SlotEngine], ids=["reference", "slots"])
@pytest.mark.parametrize("bad, shown", [(10**6, "1000000"), (-1, "-1"), (2.5, "2.5"), (True, "True"), ("7", "'7'")])
def test_a_prompt_id_outside_the_vocabulary_is_refused_in_the_callers_thread(make, bad, shown, tiny_tokenizer,
                                                                              tiny_model_factory):
    model = tiny_model_factory(lora=True)
    engine = make(model, tiny_tokenizer)
    vocab = model.get_input_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=rf"prompt 1 holds token id {shown} at position 2; ids must be integers in "
                                         rf"\[0, {vocab}\)"):
        engine.generate([[1, 2, 3], [1, 2, bad]], 2)
    if isinstance(engine, SlotEngine):
        with pytest.raises(ValueError, match="ids must be integers"):
            engine.submit([bad], 2)
    assert len(engine.generate([[1, 2, vocab - 1]], 2, greedy=True)[0].token_ids) >= 1  # still serves
    if isinstance(engine, SlotEngine):
        assert engine.lock.in_flight == 0
        engine.close()


@pytest.mark.parametrize("where", ["_prefill", "_run_packed"], ids=["prefill", "packed pass"])
def test_a_failed_prefill_fails_the_admitted_requests_and_the_running_row_goes_on(tiny_tokenizer,
                                                                                 tiny_model_factory, monkeypatch, where):
    # "_run_packed": the forward pass that carries the new rows' prefill and the running row's next id
    # fails; the running row then decodes in a pass of its own
    model = tiny_model_factory(eos_bias=-50.0, lora=True)  # no EOS: rows run to their limit
    engine = SlotEngine(model, tiny_tokenizer)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    held = HeldRow(at=3)  # one admission takes both late requests, while this row still decodes
    running = engine.submit(prompt, 40, greedy=True, on_tokens=held)
    assert held.wait()
    real = getattr(engine, where)

    def failing(*args):
        monkeypatch.setattr(engine, where, real)  # once
        raise MemoryError("no room for the new rows")

    monkeypatch.setattr(engine, where, failing)
    late = [engine.submit(prompt, 5, greedy=True), engine.submit(prompt[:-1], 5, greedy=True)]
    held.release()
    for f in late:
        with pytest.raises(MemoryError, match="no room"):
            f.result(timeout=60)
    got = running.result(timeout=120)
    assert len(got.token_ids) == 40  # the running row was not touched
    alone = SlotEngine(model, tiny_tokenizer, driver="caller").generate([prompt], 40, greedy=True)[0]
    assert got.token_ids == alone.token_ids  # nor were its ids (greedy: those of the row decoding alone)
    assert engine.lock.in_flight == 0
    assert swap_finishes(engine, model, 1)
    assert engine.submit(prompt, 3, greedy=True).result(timeout=60).adapter_version == 1
    engine.close()


def test_a_stream_callback_that_raises_fails_its_own_row_only(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=-50.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]

    def on_tokens(ids):
        if len(ids) == 3:
            raise ConnectionResetError("the client went away")

    broken = engine.submit(prompt, 12, greedy=True, on_tokens=on_tokens)
    fine = engine.submit(prompt, 12, greedy=True, on_tokens=lambda ids: None)
    with pytest.raises(ConnectionResetError, match="went away"):
        broken.result(timeout=60)
    assert len(fine.result(timeout=60).token_ids) == 12
    assert engine.lock.in_flight == 0 and engine.health().ok
    assert swap_finishes(engine, model, 1)
    engine.close()


def test_an_on_step_hook_that_raises_fails_its_own_call_only(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=-50.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, max_slots=2)  # the call's third row still waits in the queue
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    other = engine.submit(prompt, 30, greedy=True)

    def hook(ids):
        if ids.shape[1] == 2:
            raise RuntimeError("the observer broke")

    with pytest.raises(RuntimeError, match="observer broke"):
        engine.generate([prompt, prompt], 20, greedy=True, on_step=hook)
    assert len(other.result(timeout=120).token_ids) == 30
    assert engine.lock.in_flight == 0 and not engine._queue and not engine._rows
    assert swap_finishes(engine, model, 1)
    engine.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_fails_what_it_held_and_refuses_new_requests(tiny_tokenizer, tiny_model_factory,
                                                                        monkeypatch):
    class Fatal(BaseException):  # not an Exception: the step's own handler does not catch it
        pass

    model = tiny_model_factory(eos_bias=-50.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    real, calls = engine._step, []

    def dying():
        calls.append(1)
        if len(calls) == 3:
            raise Fatal("interpreter shutting down")
        real()

    monkeypatch.setattr(engine, "_step", dying)
    held = engine.submit(prompt, 50, greedy=True)
    with pytest.raises(RuntimeError, match="worker stopped: Fatal"):
        held.result(timeout=60)
    engine._worker.join(timeout=10)
    assert not engine.health().ok and "worker stopped" in engine.health().detail
    with pytest.raises(RuntimeError, match="worker stopped"):
        engine.generate([prompt], 2)
    assert engine.lock.in_flight == 0

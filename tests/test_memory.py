"""selfrl.core.memory: the heap trimmed after each learner update."""

import ctypes

import pytest

from selfrl.core import memory


def test_trim_heap_gives_freed_memory_back_on_glibc():
    if memory._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim")
    blocks = [ctypes.create_string_buffer(1 << 16) for _ in range(2000)]  # 128 MB in small blocks
    del blocks
    assert memory.trim_heap() is True


def test_trim_heap_does_nothing_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert memory.trim_heap() is False


def test_the_learner_trims_after_every_update(tiny_tokenizer, tiny_model_factory, tmp_path, monkeypatch):
    from selfrl.serve.service import Service
    from serving import tiny_serve_config

    import selfrl.serve.background as background

    calls = []
    monkeypatch.setattr(background, "trim_heap", lambda: calls.append(1) or True)
    import copy

    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run", min_batch=2),
                      learner_model=copy.deepcopy(model))
    try:
        learner = service.learner
        monkeypatch.setattr(learner, "update", lambda batch: {"result": "skipped"})
        monkeypatch.setattr(background.records, "ready", lambda *a, **k: [object(), object()])
        assert learner.tick() is True
        assert calls == [1]
    finally:
        service.close()

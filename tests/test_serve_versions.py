"""Issue 12 cases 1-3: admin operations under concurrency, a rollback while the learner
trains, and a stray adapter folder, all through the version ledger."""

import copy
import json
import random
import shutil
import threading

import pytest
import torch

from selfrl.record import adapters
from selfrl.record.adapters import lora_state
from selfrl.serve.errors import ApiError
from selfrl.serve.service import Service
from serving import add_version, rated_turns, tiny_serve_config


def new_state(model):
    return {k: torch.randn_like(v) for k, v in lora_state(model).items()}


def test_concurrent_pins_and_rollbacks_are_serialised_and_consistent(tiny_tokenizer, tiny_model_factory, tmp_path):
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run"))
    try:
        for v in (1, 2, 3):
            add_version(service, new_state(model), v, metrics={"val/success": 0.5})
        failures = []

        def admin(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(6):
                v = rng.choice([0, 1, 2, 3])
                try:
                    (service.pin if rng.random() < 0.5 else service.rollback)(v)
                except ApiError as e:  # a version rolled back by another call: refused, not broken
                    if e.status != 409:
                        failures.append(repr(e))
                except Exception as e:  # noqa: BLE001 - anything else is a server error
                    failures.append(repr(e))

        threads = [threading.Thread(target=admin, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        served = service.engine.version
        assert service.ledger.get(served).status in ("base", "promoted")  # never a rolled-back version
        pin = tmp_path / "run" / "pinned.json"
        if service.pinned is not None:
            assert served == service.pinned == json.loads(pin.read_text())["version"]
        else:
            assert not pin.exists() and served == service.ledger.latest_servable().version
        served_state = lora_state(service.engine.model)
        assert all(torch.equal(served_state[k], v) for k, v in service.state_of(served).items())
    finally:
        service.close()


def test_a_rollback_during_a_learner_update_sticks(tiny_tokenizer, tiny_model_factory, tmp_path, monkeypatch):
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.train.learning_rate = 1e-2
    setup = Service(model, tiny_tokenizer, cfg)
    v1 = new_state(model)
    add_version(setup, v1, 1, metrics={"val/success": 0.5})
    add_version(setup, new_state(model), 2, parent=1, metrics={"val/success": 0.5})
    setup.close()
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        assert service.engine.version == 2 and service.ledger.champion.version == 2
        learner = service.learner
        real = learner.validate

        def validate_while_admin_rolls_back(version):
            if version == 3:  # the in-flight candidate, trained from v2
                service.rollback(1)
            return real(version)

        monkeypatch.setattr(learner, "validate", validate_while_admin_rolls_back)
        info = learner.update(rated_turns(service))
        assert info["version"] == 3 and info["result"] == "rejected"
        statuses = {v.version: v.status.value for v in service.ledger.all()}
        assert statuses == {0: "base", 1: "promoted", 2: "rolled_back", 3: "rejected"}
        assert any(e["kind"] == "reject" and "parent version 2 was rolled back" in e["message"]
                   for e in service.store.events())
        assert service.engine.version == 1 and service.ledger.champion.version == 1
        trained = lora_state(learner.model)  # the learner continues from the restored version
        assert all(torch.equal(trained[k], v1[k]) for k in v1)
    finally:
        service.close()
    again = Service(tiny_model_factory(lora=True, eos_bias=2.0), tiny_tokenizer, cfg)
    try:
        assert again.engine.version == 1  # after a restart too
    finally:
        again.close()


def test_a_stray_adapter_folder_is_recovered_in_serve_as_in_run(tiny_tokenizer, tiny_model_factory, tmp_path):
    # what a kill between the folder rename and the database commit leaves: a folder with no row
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    Service(model, tiny_tokenizer, cfg).close()
    run_dir = tmp_path / "run"
    shutil.copytree(adapters.version_dir(run_dir, 0), adapters.version_dir(run_dir, 1))
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        events = [e for e in service.store.events() if e["kind"] == "recover"]
        assert len(events) == 1 and "v000001 was left by an interrupted save" in events[0]["message"]
        assert not adapters.version_dir(run_dir, 1).exists() and list((run_dir / "adapters" / ".recovered").iterdir())
        info = service.learner.update(rated_turns(service))  # the learner saves version 1 as usual
        assert info["version"] == 1 and adapters.verify_version(adapters.version_dir(run_dir, 1)) is None
    finally:
        service.close()


def test_a_second_server_on_the_same_run_dir_is_refused(tmp_path):
    """Two servers on one run dir would run two learners on one store and disagree on the pin."""
    import subprocess
    import sys

    from selfrl.record.runlock import RunDirLock, RunDirLocked

    first = RunDirLock(tmp_path)
    code = ("import sys; from selfrl.record.runlock import RunDirLock, RunDirLocked\n"
            f"try:\n    RunDirLock({str(tmp_path)!r})\nexcept RunDirLocked as e:\n    print('refused:', e); sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert other.returncode == 3 and "in use by another selfrl process" in other.stdout
    first.release()
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    with pytest.raises(RunDirLocked):  # a second lock in the same process is refused too
        RunDirLock(tmp_path), RunDirLock(tmp_path)


def test_the_kept_lora_states_are_bounded_and_an_evicted_version_is_read_again(tiny_tokenizer, tiny_model_factory,
                                                                               tmp_path):
    # a server promoting a version every few minutes kept every state it had served: memory grew
    # by one LoRA state a version (docs/results/soak.md)
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run"))
    try:
        states = {}
        for v in range(1, 9):
            states[v] = new_state(model)
            add_version(service, states[v], v, metrics={"val/success": 0.5})
            service.versions.publish(v, states[v], "promoted")
            assert service.engine.version == v
        kept = service.versions._states
        assert len(kept) == service.versions.STATES_KEPT == 4
        assert list(kept) == [5, 6, 7, 8]  # the least recently used went first
        service.rollback(2)  # long evicted: read from its folder again
        assert service.engine.version == 2
        assert all(torch.equal(states[2][k], v) for k, v in lora_state(service.engine.model).items())
        assert list(kept) == [6, 7, 8, 2]
    finally:
        service.close()


def test_the_swap_times_kept_are_bounded(tiny_tokenizer, tiny_model_factory, tmp_path):
    # one swap time a promoted version was kept for as long as the server ran (the status shows the last 10)
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run"))
    try:
        state = new_state(model)
        seen = []
        for v in range(1, 16):
            add_version(service, state, v, metrics={"val/success": 0.5})
            seen.append(service.versions.publish(v, state, "promoted"))
        assert len(seen) == 15 and all(s is not None for s in seen)
        assert service.versions.swap_seconds == seen[-10:]
        assert service.status()["swap_ms"] == [round(s * 1000, 2) for s in seen[-10:]]
    finally:
        service.close()

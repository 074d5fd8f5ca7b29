"""``gate.eval_every`` in ``selfrl serve`` (selfrl.serve.chain): the learner trains on from
unvalidated candidates, validates every k-th, serves only what the gate promoted; serve's default
validates every candidate."""

import copy
import sqlite3
import time

import pytest
import torch

from selfrl.config import ConfigError, RunConfig
from selfrl.config.serve import ServeConfig
from selfrl.record.adapters import lora_state
from selfrl.safety.gate import EvalResult
from selfrl.serve.health import health
from selfrl.serve.late_feedback import version_tree
from selfrl.serve.main import load_serve_config
from serving import rated_turns, tiny_serve_config


class Gate:
    """Stands in for ``selfrl.safety.gate.validate``: records the versions it validates; the first
    ``solved[version]`` of the 4 held-out tasks solved (all of them by default)."""

    def __init__(self, solved=None, during=None):
        self.calls, self.solved, self.during = [], solved or {}, during or {}

    def __call__(self, engine, tasks, *args, **kwargs):
        self.calls.append(engine.version)
        if engine.version in self.during:  # something that happens while this version is validated
            self.during[engine.version]()
        n = self.solved.get(engine.version, len(tasks))
        return EvalResult(engine.version, [(t.id, i < n, None) for i, t in enumerate(tasks)], 0.01, 0.0)


@pytest.fixture
def serve(tiny_tokenizer, tiny_model_factory, tmp_path, monkeypatch):
    """``make(eval_every, gate)`` -> (service, published versions); the learner thread is not started
    (its updates are called here), the champion (version 0) is validated before the gate is counted."""
    from selfrl.serve.service import Service

    services = []

    def make(eval_every: int | None, gate: Gate):
        monkeypatch.setattr("selfrl.serve.background.validate", gate)
        cfg = tiny_serve_config(tmp_path / f"run{len(services)}", min_batch=4, retry_s=0.05, retry_max_s=0.2)
        if eval_every is not None:
            cfg.gate.eval_every = eval_every
        cfg.train.learning_rate, cfg.train.beta, cfg.collapse.beta_min = 1e-2, 0.0, 0.0
        cfg.collapse.heldout_drop, cfg.collapse.max_kl, cfg.collapse.reward_rise = 0.5, 1e9, 1e9
        model = tiny_model_factory(lora=True, eos_bias=2.0)
        service = Service(model, tiny_tokenizer, cfg.validate(), learner_model=copy.deepcopy(model))
        services.append(service)
        service.storage.probe_every_s = 0.0
        learner, published = service.learner, []
        publish = learner.publish
        learner.publish = lambda v, state, reason: (published.append(v), publish(v, state, reason))[1]
        learner.ensure_champion_validated()
        gate.calls.clear()
        return service, published

    yield make
    for s in services:
        s.close()


def holds(learner, state) -> bool:
    """Whether the learner's model holds exactly ``state``'s LoRA tensors."""
    now = lora_state(learner.model)
    return now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in now)


def test_two_chained_updates_make_one_validation_and_only_the_second_is_served(serve):
    gate = Gate()
    service, published = serve(2, gate)
    learner, ledger = service.learner, service.ledger
    info = learner.update(rated_turns(service))
    assert (info["version"], info["result"]) == (1, "chained: 1 of 2 before the gate")
    assert gate.calls == [] and published == [] and service.engine.version == 0  # neither validated nor served
    assert ledger.get(1).status.value == "candidate" and ledger.champion.version == 0
    assert holds(learner, ledger.load_state(1)) and not holds(learner, ledger.champion.state)  # trained on from it
    assert learner.status()["chained"] == {"versions": [1], "eval_every": 2,
                                           "message": "chained: 1 of 2 before the gate"}
    assert learner.status()["last_update"]["result"] == "chained: 1 of 2 before the gate"
    assert health(service)[1]["chained"]["message"] == "chained: 1 of 2 before the gate"
    # the age rule counts the chain's weight change: a turn of the served version 0 is one behind
    assert version_tree(ledger) == ({0: None, 1: 0}, 1)
    assert service.ages.at_feedback(0, time.time())[0] == "queued"
    turns = [t for t, _ in rated_turns(service)]
    for t in turns:
        t.advantage = 1.0
    learner._logps_under(0, turns)  # version 0's weights loaded for one pass, then the chain's back
    assert holds(learner, ledger.load_state(1))

    info = learner.update(rated_turns(service))  # sampled by version 0, as every served turn
    assert (info["version"], info["result"]) == (2, "promoted")
    assert gate.calls == [2] and published == [2] and service.engine.version == 2
    assert ledger.get(2).parent == 1 and ledger.champion.version == 2
    assert ledger.get(1).status.value == "candidate"  # never validated, never servable
    m = {r["name"]: r["value"] for r in service.store.metrics() if r["step"] == 1}
    assert m["feedback/behind"] == 4.0 and m["sampled_version"] == 0.0
    assert learner.status()["chained"] is None and "chained" not in health(service)[1]
    assert ledger.chain_head is None and version_tree(ledger) == ({0: None, 1: 0, 2: 1}, 2)
    assert [v.version for v in ledger.all() if v.servable] == [0, 2]


def test_a_rejected_chain_goes_back_to_the_champion_and_serves_nothing_new(serve):
    gate = Gate(solved={2: 3})  # version 2: held-out 0.75 < 1.0 - 0.02
    service, published = serve(2, gate)
    learner, ledger = service.learner, service.ledger
    assert learner.update(rated_turns(service))["result"] == "chained: 1 of 2 before the gate"
    assert learner.update(rated_turns(service))["result"] == "rejected"
    assert gate.calls == [2] and published == [] and service.engine.version == 0
    assert ledger.champion.version == 0 and holds(learner, ledger.champion.state)
    assert ledger.get(2).status.value == "rejected"
    assert ledger.get(1).status.value == "rejected"
    assert ledger.get(1).metrics["unvalidated"] == "the chain's last version 2 was not promoted"
    rejects = [e for e in service.store.events() if e["kind"] == "reject"]
    assert [e["data"]["version"] for e in rejects] == [2, 1]
    assert rejects[1]["message"] == ("version 1 rejected unvalidated (gate.eval_every = 2): the chain's last "
                                     "version 2 was not promoted; serving version 0")
    assert learner.status()["chained"] is None and ledger.chain_head is None
    assert version_tree(ledger) == ({0: None, 1: 0, 2: 1}, 0)
    info = learner.update(rated_turns(service))  # a new chain, from the champion
    assert (info["version"], info["result"]) == (3, "chained: 1 of 2 before the gate")
    assert ledger.get(3).parent == 0 and gate.calls == [2]


def test_a_collapse_in_the_middle_of_a_chain_rolls_it_back(serve):
    gate = Gate()
    service, published = serve(3, gate)
    learner, ledger = service.learner, service.ledger
    assert learner.update(rated_turns(service))["result"] == "chained: 1 of 3 before the gate"
    learner.cfg.collapse.max_kl = 1e-9  # the next candidate's KL probe fires
    assert learner.update(rated_turns(service))["result"] == "rolled back (collapse)"
    assert [ledger.get(v).status.value for v in (1, 2)] == ["rolled_back", "rolled_back"]
    assert gate.calls == [] and published == [] and service.engine.version == 0
    assert holds(learner, ledger.champion.state) and learner.status()["chained"] is None
    assert not [e for e in service.store.events() if e["kind"] == "reject"]  # rolled back, not rejected


def test_an_admin_rollback_during_a_chain_rejects_it(serve):
    gate = Gate()
    service, published = serve(2, gate)
    learner, ledger = service.learner, service.ledger
    learner.update(rated_turns(service))
    assert learner.update(rated_turns(service))["result"] == "promoted" and published == [2]
    assert learner.update(rated_turns(service))["result"] == "chained: 1 of 2 before the gate"  # 3, from 2
    gate.during[4] = lambda: service.rollback(0)  # the admin rolls back while version 4 is validated
    info = learner.update(rated_turns(service))
    assert info["result"] == "rejected" and published == [2] and service.engine.version == 0
    four = [e for e in service.store.events() if e["kind"] == "reject" and e["data"]["version"] == 4]
    assert four[0]["message"] == ("version 4 rejected: version 2, which its chain was trained from, was rolled "
                                  "back; serving version 0")
    assert ledger.get(3).status.value == "rejected" and ledger.get(3).metrics["unvalidated"]
    assert holds(learner, ledger.champion.state) and ledger.champion.version == 0
    info = learner.update(rated_turns(service))  # between updates: the next chain starts at the champion
    assert ledger.get(info["version"]).parent == 0


def test_a_storage_fault_in_a_chain_ends_it_and_the_learner_trains_again_from_the_champion(serve, monkeypatch):
    from selfrl.record import served as records

    gate = Gate()
    service, published = serve(3, gate)
    learner, ledger = service.learner, service.ledger
    assert learner.update(rated_turns(service))["result"] == "chained: 1 of 3 before the gate"
    batch, mark, failed = rated_turns(service), records.mark, []

    def full_once(store, trajs, status, version):  # the disk fills up right after candidate 2 was saved
        if status == "trained" and not failed:
            failed.append(version)
            raise sqlite3.OperationalError("database or disk is full")
        return mark(store, trajs, status, version)

    monkeypatch.setattr(records, "mark", full_once)
    assert learner.until_done(lambda: learner.update(batch))  # pauses, undoes the failed update, trains again
    assert failed == [2] and learner.paused is None
    assert ledger.get(2).status.value == "rejected" and ledger.get(2).metrics["storage_fault"] == "disk_full"
    assert ledger.get(1).status.value == "rejected"
    assert ledger.get(1).metrics["unvalidated"] == "an update of its chain failed on a storage fault (disk_full)"
    assert ledger.get(3).parent == 0 and learner.last["result"] == "chained: 1 of 3 before the gate"
    assert learner.status()["chained"]["versions"] == [3] and gate.calls == [] and published == []


def test_serve_validates_every_candidate_by_default(serve):
    assert load_serve_config(None, {}).gate.eval_every == 1 and ServeConfig().gate.eval_every == 1
    assert RunConfig().gate.eval_every == 4  # run's own default is unchanged
    gate = Gate()
    service, published = serve(None, gate)
    results = [service.learner.update(rated_turns(service))["result"] for _ in range(2)]
    assert results == ["promoted", "promoted"] and gate.calls == [1, 2] and published == [1, 2]


def test_eval_every_is_read_from_the_config_file_and_refused_beyond_the_age_rule(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("[gate]\neval_every = 3\n")
    assert load_serve_config(str(path), {}).gate.eval_every == 3
    path.write_text("[gate]\neval_every = 6\n")
    with pytest.raises(ConfigError) as e:
        load_serve_config(str(path), {})
    assert ("gate.eval_every = 6 trains 5 unvalidated candidates before the gate, but "
            "learner.max_feedback_age_versions = 4") in str(e.value)
    assert "raise learner.max_feedback_age_versions to 5 or more, or lower gate.eval_every to 5 or less" in str(e.value)
    path.write_text("[gate]\neval_every = 6\n[learner]\nmax_feedback_age_versions = 5\n")
    assert load_serve_config(str(path), {}).gate.eval_every == 6

"""No forgetting in selfrl serve: a held-out set per family ([[families]]), the family of each
turn recorded from metadata.family, and a candidate that forgets a learned family not promoted."""

import copy
import re
import time

import pytest

from selfrl.config import ConfigError, FamilyConfig
from selfrl.core.trajectory import Trajectory
from selfrl.record import served as records
from selfrl.safety.gate import EvalResult
from serving import API_KEY, http, running_server, tiny_serve_config

# held-out tasks failed per version and family: version 1 forgets half of "long" while "long" was
# never trained on (not gated: promoted); version 2 forgets it again after a "long" turn was trained on
FORGOTTEN = {1: {"long": 2}, 2: {"long": 2}}


def scripted_validate(engine, tasks, *args, **kwargs) -> EvalResult:
    """Stands in for ``selfrl.safety.gate.validate``: every task solved, but ``FORGOTTEN`` says how many
    of a family's tasks the version fails (its first ones, in task order)."""
    results, failed = [], {}
    for t in tasks:
        family = t.id.partition("/")[0]
        failed[family] = failed.get(family, 0) + 1
        results.append((t.id, failed[family] > FORGOTTEN.get(engine.version, {}).get(family, 0), None))
    return EvalResult(engine.version, results, 0.01, 0.0)


def family_config(tmp_path):
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.families = [FamilyConfig("arith", "chain_sum", tolerance=0.1),
                    FamilyConfig("long", "chain_sum", {"min_terms": 3, "max_terms": 4}, tolerance=0.1, val_seed=7)]
    cfg.train.learning_rate, cfg.train.beta, cfg.collapse.beta_min = 1e-2, 0.0, 0.0
    cfg.train.micro_batch_size = 4
    cfg.gate.tolerance = 1.0  # the aggregate gate lets anything through: the families decide
    cfg.collapse.heldout_drop, cfg.collapse.reward_rise, cfg.collapse.max_kl = 1.0, 1e9, 1e9
    cfg.collapse.baseline_window = 100
    return cfg


def served_batch(service, family: str, k: int):
    """Four turns of ``family`` (rewards +-1), stored as the server stores them; the learner's batch."""
    batch = []
    for i, feedback in enumerate((1.0, -1.0, 1.0, -1.0)):
        t = Trajectory(f"{family}:{k}", f"{family}:{k}", service.engine.version, prompt_len=3,
                       token_ids=[5, 6, 7, 8 + i], completion_mask=[0, 0, 0, 1], logprobs=[0.0] * 4)
        turn = records.ServedTurn(t, t.id, 0, t.id, t.task_id, t.id, family=family)
        with service.store.lock:
            records.add_turns(service.store, service.run_id, [turn])
        batch.append((t, {"feedback": feedback, "created_at": time.time(), "group_key": t.task_id}))
    return batch


def test_a_candidate_that_forgets_a_learned_family_is_not_promoted(tiny_tokenizer, tiny_model_factory, tmp_path,
                                                                   monkeypatch):
    from selfrl.report.serve import write_serve_report
    from selfrl.serve.service import Service

    monkeypatch.setattr("selfrl.serve.background.validate", scripted_validate)
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, family_config(tmp_path), learner_model=copy.deepcopy(model))
    learner = service.learner
    try:
        val = [t.id for t in learner.val]
        assert len(val) == 8 and {v.partition("/")[0] for v in val} == {"arith", "long"}
        learner.ensure_champion_validated()
        # arith learned, long not: version 1 drops long by 0.5 but long is not gated
        info = learner.update(served_batch(service, "arith", 0))
        assert (info["version"], info["result"]) == (1, "promoted")
        assert learner.status()["families_learned"] == ["arith"]
        # a long turn trained on: version 2 drops long by 0.5 against its best (the base), beyond 0.1
        info = learner.update(served_batch(service, "long", 1))
        assert (info["version"], info["result"]) == (2, "rejected") and service.ledger.champion.version == 1
        assert learner.status()["families_learned"] == ["arith", "long"]
        [reject] = [e for e in service.store.events() if e["kind"] == "reject"]
        [drop] = reject["data"]["families"]
        assert (drop["family"], drop["drop"], drop["tolerance"], drop["reference_version"]) == ("long", 0.5, 0.1, 0)
        assert drop["lost_tasks"] == sorted(scripted_lost(learner.val, "long"))
        assert drop["paired_difference"] == -0.5 and drop["reference_interval"][1] == 1.0
        assert reject["message"].startswith("version 2 rejected: family long: held-out 0.500 < 1.000 of version 0")
        assert "arith" not in reject["message"] and all(t in reject["message"] for t in drop["lost_tasks"])
        assert reject["message"].endswith("; held-out 0.750 overall (best 1.000); serving version 1 again")
        metrics = {(m["step"], m["name"]): m["value"] for m in service.store.metrics() if m["name"].startswith("val/")}
        assert metrics[(1, "val/long")] == 0.5 and metrics[(1, "val/arith")] == 1.0
        report = write_serve_report(tmp_path / "report", service.store, "families").read_text()
        assert "| reject | version 2 rejected: family long: held-out 0.500" in report
    finally:
        service.close()


def scripted_lost(tasks, family):
    """The tasks ``scripted_validate`` fails for ``family``: its first two, in task order."""
    return [t.id for t in tasks if t.id.startswith(family + "/")][:2]


def test_metadata_family_is_recorded_and_an_unknown_one_refused(tiny_tokenizer, tiny_model_factory, tmp_path):
    cfg = family_config(tmp_path)
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        body = {"model": "selfrl", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2,
                "metadata": {"family": "long", "user": "long-3"}}
        status, out = http("POST", url + "/v1/chat/completions", body, key=API_KEY)
        assert status == 200
        with service.store.lock:
            row = records.find_response(service.store, out["id"])
        assert row["family"] == "long"
        body["metadata"]["family"] = "chess"
        status, out = http("POST", url + "/v1/chat/completions", body, key=API_KEY)
        assert status == 400 and out["error"]["code"] == "unknown_family"
        assert "'chess' is not a family of this server; valid: arith, long" in out["error"]["message"]


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.families[1], "name", "arith"), "family names must be unique"),
    (lambda c: setattr(c.families[0], "tolerance", 1.5), "families[0] (arith).tolerance must be >= 0 and <= 1, got 1.5"),
    (lambda c: setattr(c.families[0], "name", "a/b"), "without '/'"),
    (lambda c: setattr(c.task, "source", "arithmetic"), "task.source cannot be set with [[families]]"),
])
def test_families_are_validated(tmp_path, change, message):
    cfg = family_config(tmp_path)
    change(cfg)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.validate()


def test_an_unknown_family_source_is_refused_with_the_valid_names(tiny_tokenizer, tiny_model_factory, tmp_path):
    from selfrl.serve.service import Service

    cfg = family_config(tmp_path)
    cfg.families[1].source = "chess"
    with pytest.raises(ConfigError, match=r"families\[1\] \(long\).source: unknown environment 'chess'; valid names"):
        Service(tiny_model_factory(lora=True), tiny_tokenizer, cfg)


def test_the_learner_records_each_family_of_an_update_for_the_collapse_rules(tiny_tokenizer, tiny_model_factory,
                                                                             tmp_path, monkeypatch):
    # the batch as the server reads it (records.ready: each row with its family), two families mixed
    from selfrl.safety.collapse import FamilyStats, history_from_metrics
    from selfrl.serve.service import Service

    monkeypatch.setattr("selfrl.serve.background.validate", scripted_validate)
    cfg = family_config(tmp_path)
    cfg.collapse.family_min_turns = 3  # both families of the batch (3 and 4 turns) are groups of their own
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    learner = service.learner
    try:
        learner.ensure_champion_validated()
        stored = served_batch(service, "arith", 0)[:3] + served_batch(service, "long", 1)
        with service.store.lock:
            for t, row in stored:
                records.apply_feedback(service.store, t.id, 0, "explicit", row["feedback"])
            batch = records.ready(service.store, 1e9, 100)
        assert sorted(row["family"] for _, row in batch) == ["arith"] * 3 + ["long"] * 4
        info = learner.update(batch)
        assert info["version"] == 1
        metrics = {m["name"]: m["value"] for m in service.store.metrics() if m["step"] == 0}
        assert (metrics["family/arith/turns"], metrics["family/long/turns"]) == (3.0, 4.0)
        # served turns without an answer or a tool call are empty: every one degenerate; logprobs 0: entropy 0
        assert metrics["family/long/degenerate"] == 1.0 and metrics["family/long/entropy"] == 0.0
        [rec] = learner.cycle.guard.history
        assert rec.families == {"arith": FamilyStats(3, 1 / 3, 0.0, 1.0), "long": FamilyStats(4, 0.0, 0.0, 1.0)}
        # a restart rebuilds the same history (UpdateCycle.resume)
        assert history_from_metrics(service.store.metrics()) == [rec]
    finally:
        service.close()


def test_a_held_out_set_larger_than_the_environment_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """web's easy tier has under a thousand distinct tasks: drawing 100,000 of them took minutes of
    top-up rounds, after the model had loaded."""
    from selfrl.serve import main

    loaded = []
    monkeypatch.setattr("selfrl.model.load.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    toml = tmp_path / "serve.toml"
    for table, key in (('[[families]]\nname = "web"\nsource = "web"\noptions = { tier = "easy" }\n'
                        'val_size = 100000\n', "families[0] (web).val_size = 100000"),
                       ('[task]\nsource = "web"\noptions = { tier = "easy" }\n[gate]\nval_size = 100000\n',
                        "gate.val_size = 100000")):
        toml.write_text(table)
        t = time.monotonic()
        code = main.serve(str(toml), {"run_dir": str(tmp_path / "run")}, None)
        err = capsys.readouterr().err.strip()
        assert code == 2 and loaded == [] and time.monotonic() - t < 30
        assert err == (f"selfrl: error: {key}, but environment 'web' gives only 967 distinct tasks (sampled until "
                       "no new one came): lower it to at most 967")
    from selfrl.serve.families import check_family_sources
    from selfrl.serve.main import load_serve_config

    toml.write_text('[[families]]\nname = "web"\nsource = "web"\noptions = { tier = "easy" }\n[gate]\nval_size = 990\n')
    with pytest.raises(ConfigError) as err:
        check_family_sources(load_serve_config(str(toml), {}))
    assert str(err.value) == ("families[0] (web) takes gate.val_size = 990, but environment 'web' gives only 967 "
                              "distinct tasks (sampled until no new one came): lower it to at most 967")
    toml.write_text('[[families]]\nname = "web"\nsource = "web"\noptions = { tier = "easy" }\nval_size = 24\n')
    assert check_family_sources(load_serve_config(str(toml), {})) is None


def test_a_gate_default_every_family_overrides_is_refused_not_ignored(tmp_path):
    from selfrl.serve.main import load_serve_config

    toml = tmp_path / "f.toml"
    both = ('[[families]]\nname = "a"\nsource = "chain_sum"\nval_size = 8\nval_seed = 1\n'
            '[[families]]\nname = "b"\nsource = "chain_sum"\nval_size = 8\nval_seed = 2\n')
    toml.write_text(both)
    with pytest.raises(ConfigError) as err:
        load_serve_config(str(toml), {"gate.val_size": 5000})
    assert str(err.value) == ("gate.val_size (--val-size) has no effect: every [[families]] sets val_size; set it "
                              "there (or leave val_size out of a family to have it take this value)")
    toml.write_text(both + "[task]\nval_seed = 7\n")
    with pytest.raises(ConfigError) as err:
        load_serve_config(str(toml), {})
    assert str(err.value) == ("task.val_seed has no effect: every [[families]] sets val_seed; set it there (or "
                              "leave val_seed out of a family to have it take this value)")
    toml.write_text(both.replace("val_size = 8\nval_seed = 2\n", ""))  # family b takes both: they count
    assert load_serve_config(str(toml), {"gate.val_size": 12}).gate.val_size == 12

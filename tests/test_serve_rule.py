"""Which version a run serves when it ends, and the line and report text that say why.

The case this pins: version 4 scored 0.297 on 64 held-out tasks, version 8 scored 0.266,
within gate.tolerance = 0.05 of it, and was promoted; the run ended "base 0.266 -> final
0.266" and nothing said that a better version existed or why it was not served.
"""

import pytest

from selfrl.config import ConfigError, load_config
from selfrl.config.serve import ServeConfig
from selfrl.record.serve_rule import ServeRule, choose_served
from selfrl.record.store import Store
from selfrl.record.versions import VersionRecord, VersionStatus
from selfrl.report.run import rebuild_report, write_report

N = 64


def rec(version, status, success):
    return VersionRecord(version, None, None, VersionStatus(status), {} if success is None else {"val/success": success}, 0.0)


LEDGER = [rec(0, "base", 17 / N), rec(2, "promoted", 18 / N), rec(3, "rejected", 0.5), rec(4, "promoted", 19 / N),
          rec(6, "rolled_back", 0.6), rec(8, "promoted", 17 / N), rec(9, "candidate", None)]


def test_newest_serves_the_newest_promoted_and_names_the_best():
    c = choose_served(LEDGER, "newest", 0.05)
    assert (c.served, c.newest, c.best) == (8, 8, 4)  # rejected, rolled back and unvalidated never count
    assert c.line() == ("served: v8 (0.266), the newest promoted version, within 0.05 of the best, v4 (0.297); "
                        "--gate-rule best serves v4")


def test_best_serves_the_highest_held_out_and_names_the_newest():
    c = choose_served(LEDGER, ServeRule.BEST, 0.05)
    assert (c.served, c.newest, c.best) == (4, 8, 4)
    assert c.line() == ("served: v4 (0.297), the best held-out version (--gate-rule best); "
                        "--gate-rule newest serves v8 (0.266)")


def test_a_tie_goes_to_the_newer_and_one_version_is_both():
    c = choose_served([rec(0, "base", 0.3), rec(1, "promoted", 0.5), rec(2, "promoted", 0.5)], "best", 0.02)
    assert c.served == c.newest == c.best == 2
    assert c.line() == "served: v2 (0.500), the newest promoted version and the best held-out one"


def test_only_the_base_never_validated():
    c = choose_served([rec(0, "base", None)], "best", 0.02)
    assert c.served == 0 and c.line().startswith("served: v0 (not validated)")


def test_unknown_rule_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: newest, best"):
        choose_served(LEDGER, "latest", 0.02)


def test_config_checks_the_rule():
    assert load_config(None, {"gate.rule": "best"}).gate.rule == "best"
    with pytest.raises(ConfigError, match="rule must be one of 'newest', 'best', got 'max'"):
        load_config(None, {"gate.rule": "max"})


def test_serve_refuses_a_rule_it_does_not_apply():
    """selfrl serve serves its newest promoted version; gate.rule = "best" there would be ignored."""
    cfg = ServeConfig()
    cfg.gate.rule = "best"
    with pytest.raises(ConfigError, match="selfrl serve serves its newest promoted version"):
        cfg.validate()


def issue_store(path):
    """The issue's run: base 17/64, v4 19/64, v8 17/64 (promoted within 0.05 of v4)."""
    store = Store(path / "selfrl.db")
    run = store.start_run({"gate": {"rule": "newest", "tolerance": 0.05}})
    tasks = [f"t{i}" for i in range(N)]
    for v, status, solved in ((0, "base", range(17)), (4, "promoted", range(2, 21)), (8, "promoted", range(17))):
        store.add_version(v, None if v == 0 else 0, None, status, {"val/success": len(solved) / N})
        store.add_evaluation(v, [(t, i in solved, None) for i, t in enumerate(tasks)])
    return store, run


def test_report_states_the_served_version_the_best_and_the_rule(tmp_path):
    store, run = issue_store(tmp_path)
    with store:
        text = write_report(tmp_path, store, run, {"base_version": 0, "final_version": 8, "gate_rule": "newest",
                                                   "gate_tolerance": 0.05}).read_text()
    assert "| after (served) | 8 | 17/64 = 0.266" in text
    assert ("Served: v8 (0.266), the newest promoted version, within 0.05 of the best, v4 (0.297); "
            "--gate-rule best serves v4.") in text
    assert ("Rule (gate.rule = 'newest'): the newest promoted version serves; each promotion was within "
            "gate.tolerance = 0.05 of the best held-out success so far.") in text
    # v8 - v4: v4 solves t17..t20 that v8 does not, v8 solves t0, t1 that v4 does not: d = -2/64
    assert "Served version 8 - version 4 on 64 shared held-out tasks: -0.031" in text


def test_rebuilt_report_applies_the_runs_rule(tmp_path):
    """selfrl report RUN_DIR: the final version is the one the stored config's rule serves."""
    store, _ = issue_store(tmp_path)
    store.close()
    (tmp_path / "config.json").write_text('{"gate": {"rule": "best", "tolerance": 0.05}}')
    text = rebuild_report(tmp_path).read_text()
    assert "| after (served) | 4 | 19/64 = 0.297" in text
    assert "Served: v4 (0.297), the best held-out version (--gate-rule best); --gate-rule newest serves v8" in text


@pytest.mark.parametrize("rule, served", [("newest", 2), ("best", 1)])
def test_the_run_serves_by_its_rule_and_says_so(model_dir, tmp_path, monkeypatch, capsys, rule, served):
    """v1 scores 14/20, v2 13/20 (promoted: within 0.1 of 0.7). The run ends serving v2 (newest)
    or v1 (best, its stored weights swapped back in), and its last log line says which and why."""
    import torch

    from selfrl.config import RunConfig
    from selfrl.core.trajectory import Trajectory
    from selfrl.envs.rewards import REWARD_FUNCS
    from selfrl.record import adapters
    from selfrl.run.loop import Runner, iteration_tasks
    from selfrl.run.progress import PlainProgress
    from selfrl.run.setup import build_run
    from selfrl.safety.gate import EvalResult

    solved = {0: 10, 1: 14, 2: 13}

    def scripted_validate(engine, tasks, *args, **kwargs):
        return EvalResult(engine.version, [(f"t{i}", i < solved[engine.version], None) for i in range(20)], 0.01, 0.0)

    monkeypatch.setitem(REWARD_FUNCS, "short", lambda traj, ctx: 1.0 - traj.num_completion_tokens / 4)
    monkeypatch.setattr("selfrl.run.loop.validate", scripted_validate)
    cfg = RunConfig(run_dir=str(tmp_path / "run"), iterations=2, num_prompts=2, num_generations=2,
                    reward_weights={"short": 1.0})
    cfg.model.name, cfg.model.device, cfg.lora.r, cfg.task.num_train, cfg.gate.val_size = str(model_dir), "cpu", 4, 40, 6
    cfg.train.learning_rate, cfg.train.beta, cfg.collapse.beta_min = 1e-2, 0.0, 0.0
    cfg.collapse.enabled = False
    cfg.gate.tolerance, cfg.gate.rule, cfg.gate.eval_every = 0.1, rule, 1
    runner = Runner(build_run(cfg.validate()), PlainProgress())

    def rollouts(it, batch=None, quiet=False):
        out = []
        for j, task in enumerate(iteration_tasks(runner.s.train, it, cfg.num_prompts, cfg.task.train_seed)):
            for n in (1, 3):  # rewards differ within the group: an update happens
                out.append(Trajectory(task.id, f"{it}-{j}", runner.s.engine.version, prompt_len=3,
                                      token_ids=[5, 6, 7] + [8] * n, completion_mask=[0, 0, 0] + [1] * n,
                                      logprobs=[0.0] * (3 + n)))
        return out, 0.0

    runner.rollouts = rollouts
    result = runner.run()
    assert [v["status"] for v in Store(tmp_path / "run" / "selfrl.db").versions()] == ["base", "promoted", "promoted"]
    assert result.final_version == served and result.final_success == solved[served] / 20
    line = ("served: v2 (0.650), the newest promoted version, within 0.1 of the best, v1 (0.700); "
            "--gate-rule best serves v1" if rule == "newest" else
            "served: v1 (0.700), the best held-out version (--gate-rule best); --gate-rule newest serves v2 (0.650)")
    assert result.summary["served"] == line
    assert capsys.readouterr().out.rstrip().endswith(line)  # the run's last log line
    log = (tmp_path / "run" / "progress.log").read_text()  # and in the run directory's log file
    assert "base model: held-out success 0.500 on 6 tasks" in log and log.rstrip().endswith(line)
    stored = adapters.load_version_state(adapters.version_dir(tmp_path / "run", served))
    live = adapters.lora_state(runner.s.engine.model)
    assert runner.s.engine.version == served and all(torch.equal(live[k], stored[k]) for k in stored)


def test_compare_takes_the_version_each_run_serves(tmp_path):
    """selfrl compare and prompt_baseline --run-dir read the run's final version by its rule."""
    from selfrl.report.compare import load_outcome

    for rule, final in (("newest", 8), ("best", 4)):
        d = tmp_path / rule
        d.mkdir()
        issue_store(d)[0].close()
        (d / "config.json").write_text(f'{{"gate": {{"rule": "{rule}", "tolerance": 0.05}}}}')
        o = load_outcome(d, rule)
        assert o.final_version == final and sum(o.final.values()) == {8: 17, 4: 19}[final]
